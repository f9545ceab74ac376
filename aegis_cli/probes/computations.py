"""What the bitwise probes share: the canonical computations, stored-tensor faults, and
turning a fingerprint mismatch into evidence (docs/probes.md).

A computation is a deterministic workload: seeded bf16 inputs drawn on the device, then
a function of them with named outputs. The determinism probe repeats each one, the golden
and cross-device probes compare their fingerprints across time and devices.

    checked_gemm   our checked GEMM (Device.checked_gemm): c, row_sums, col_sums
    matmul         torch.matmul, bf16 (cuBLAS on GPUs)
    sdpa_fwd       F.scaled_dot_product_attention, causal: o
    sdpa_bwd       its backward, as training runs it: dq, dk, dv
    sdpa_bwd_det   the same under torch.use_deterministic_algorithms(True)
    rmsnorm        F.rms_norm over the hidden dimension (with a weight)
    gelu, silu     elementwise activations
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from aegis_cli.backends import fingerprints
from aegis_cli.backends.base import Device
from aegis_cli.faults.spec import FaultPlan
from aegis_cli.faults.stored import stored_faults
from aegis_cli.ops.case import case_seed
from aegis_cli.ops.gemm import GemmOperands, Layout

LOCAL_BLOCK = 4096  # elements per localisation block (a whole number of words for every dtype)
MAX_SAMPLES = 8

# Computations whose repeated runs differ on a healthy device of this backend (measured:
# docs/probes.md). Their mismatches are reported in the stats, never as evidence; every
# other computation is assumed bitwise deterministic and a mismatch is corruption.
NONDETERMINISTIC: dict[str, set[str]] = {"cpu": set(), "cuda": {"sdpa_bwd", "sdpa_bwd_det"}}


@dataclass(frozen=True)
class Sizes:
    """Shapes of the canonical computations."""

    gemm: tuple[int, int, int]  # M, N, K
    attn: tuple[int, int, int, int]  # B, H, S, D
    rows: tuple[int, int]  # tokens, hidden (norms, activations)


CPU_SIZES = Sizes(gemm=(128, 192, 256), attn=(1, 2, 96, 32), rows=(64, 384))
GPU_SIZES = Sizes(gemm=(4096, 4096, 4096), attn=(2, 16, 2048, 128), rows=(8192, 8192))


def sizes_for(device: Device) -> Sizes:
    return CPU_SIZES if device.identity.backend == "cpu" else GPU_SIZES


@contextlib.contextmanager
def deterministic_algorithms():
    """torch.use_deterministic_algorithms(True) for the block, restored after."""
    was, warn = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.use_deterministic_algorithms(True, warn_only=True)
        try:
            yield
        finally:
            torch.use_deterministic_algorithms(was, warn_only=warn)


@dataclass
class Computation:
    name: str
    inputs: Callable[[Device, Sizes, int], dict[str, torch.Tensor]]
    run: Callable[..., dict[str, torch.Tensor]]  # run(device, inputs, fault, op) -> outputs
    shape: Callable[[Sizes], dict]
    names: tuple[tuple[str, ...], tuple[str, ...]]  # (its inputs, its outputs), as the probes key them
    vendor: bool = True  # runs a library kernel (torch/cuBLAS/cuDNN), not ours

    def held(self, device: Device, x: dict[str, torch.Tensor], fault: FaultPlan | None, op: str) -> dict[str, torch.Tensor]:
        """Run on inputs ``x`` and keep the outputs as a probe holds them before comparing:
        contiguous, with any ``target=mem`` fault applied (stored_faults)."""
        out = {k: v.contiguous() for k, v in self.run(device, x, fault, op).items()}
        stored_faults(fault, device.identity.id, op, out)
        return out


def _gemm_inputs(dev: Device, s: Sizes, seed: int) -> dict[str, torch.Tensor]:
    m, n, k = s.gemm
    return {"a": dev.generate((m, k), "normal", case_seed(seed, "gemm", "A")),
            "b": dev.generate((n, k), "normal", case_seed(seed, "gemm", "B"))}  # fwd layout: B stored (N, K)


def _checked_gemm(dev: Device, x: dict, fault: FaultPlan | None, op: str) -> dict[str, torch.Tensor]:
    ops = GemmOperands(x["a"], x["b"], Layout.FWD)
    med = None  # a perturb fault is sized by a clean run's checksum noise, as in the GEMM probe
    if fault is not None and fault.needs_clean_median():
        from aegis_cli.probes.gemm import clean_median

        med = clean_median(dev, ops, dev.reference_checksums(ops, dev.tile))
    res = dev.checked_gemm(ops, fault, op=op, clean_median=med)
    return {"c": res.c, "row_sums": res.row_sums, "col_sums": res.col_sums}


def _matmul(dev: Device, x: dict, fault: FaultPlan | None, op: str) -> dict[str, torch.Tensor]:
    return {"c": torch.matmul(x["a"], x["b"].t())}


def _attn_inputs(dev: Device, s: Sizes, seed: int) -> dict[str, torch.Tensor]:
    return {n: dev.generate(s.attn, "normal", case_seed(seed, "attn", n)) for n in ("q", "k", "v", "do")}


def _sdpa_fwd(dev: Device, x: dict, fault: FaultPlan | None, op: str) -> dict[str, torch.Tensor]:
    with torch.no_grad():
        return {"o": F.scaled_dot_product_attention(x["q"], x["k"], x["v"], is_causal=True)}


def _sdpa_bwd(dev: Device, x: dict, fault: FaultPlan | None, op: str) -> dict[str, torch.Tensor]:
    q, k, v = (x[n].detach().requires_grad_(True) for n in ("q", "k", "v"))
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    dq, dk, dv = torch.autograd.grad(o, (q, k, v), x["do"])
    return {"dq": dq, "dk": dk, "dv": dv}


def _sdpa_bwd_det(dev: Device, x: dict, fault: FaultPlan | None, op: str) -> dict[str, torch.Tensor]:
    with deterministic_algorithms():
        return _sdpa_bwd(dev, x, fault, op)


def _rows_inputs(dev: Device, s: Sizes, seed: int) -> dict[str, torch.Tensor]:
    t, h = s.rows
    return {"x": dev.generate((t, h), "heavy", case_seed(seed, "rows", "x")),
            "w": dev.generate((h,), "uniform", case_seed(seed, "rows", "w"))}


def _rmsnorm(dev: Device, x: dict, fault: FaultPlan | None, op: str) -> dict[str, torch.Tensor]:
    return {"y": F.rms_norm(x["x"], (x["x"].shape[-1],), x["w"], eps=1e-6)}


def _gelu(dev: Device, x: dict, fault: FaultPlan | None, op: str) -> dict[str, torch.Tensor]:
    return {"y": F.gelu(x["x"])}


def _silu(dev: Device, x: dict, fault: FaultPlan | None, op: str) -> dict[str, torch.Tensor]:
    return {"y": F.silu(x["x"])}


_gemm_shape = lambda s: dict(zip("mnk", s.gemm, strict=True))
_attn_shape = lambda s: dict(zip(("batch", "heads", "seq", "head_dim"), s.attn, strict=True))
_rows_shape = lambda s: {"tokens": s.rows[0], "hidden": s.rows[1]}

_GEMM_IN, _ATTN_IN, _ROWS_IN = ("a", "b"), ("q", "k", "v", "do"), ("x", "w")
COMPUTATIONS: dict[str, Computation] = {c.name: c for c in (
    Computation("checked_gemm", _gemm_inputs, _checked_gemm, _gemm_shape, (_GEMM_IN, ("c", "row_sums", "col_sums")),
                vendor=False),
    Computation("matmul", _gemm_inputs, _matmul, _gemm_shape, (_GEMM_IN, ("c",))),
    Computation("sdpa_fwd", _attn_inputs, _sdpa_fwd, _attn_shape, (_ATTN_IN, ("o",))),
    Computation("sdpa_bwd", _attn_inputs, _sdpa_bwd, _attn_shape, (_ATTN_IN, ("dq", "dk", "dv"))),
    Computation("sdpa_bwd_det", _attn_inputs, _sdpa_bwd_det, _attn_shape, (_ATTN_IN, ("dq", "dk", "dv"))),
    Computation("rmsnorm", _rows_inputs, _rmsnorm, _rows_shape, (_ROWS_IN, ("y",))),
    Computation("gelu", _rows_inputs, _gelu, _rows_shape, (_ROWS_IN, ("y",))),
    Computation("silu", _rows_inputs, _silu, _rows_shape, (_ROWS_IN, ("y",))),
)}


def computation_list(allow_empty: bool) -> Callable[[str], str]:
    """The type of the probes' ``only`` options: comma-separated COMPUTATIONS names, checked
    when the command line is read (not when the probe's turn comes, after the others ran)."""

    def parse(v: str) -> str:
        names = [n.strip() for n in v.split(",") if n.strip()]
        unknown = [n for n in names if n not in COMPUTATIONS]
        if unknown:
            raise ValueError(f"must name known computations (unknown: {', '.join(unknown)}; known: {', '.join(COMPUTATIONS)})")
        if not names and not allow_empty:  # would compare nothing and say HEALTHY
            raise ValueError(f"must name at least one computation (known: {', '.join(COMPUTATIONS)})")
        return v

    parse.__name__ = "str"
    return parse


def case_shape(shape: dict) -> str:
    """The shape part of a computation's case id: its sizes joined by "x" (128x192x256)."""
    return "x".join(str(v) for v in shape.values())


def assumed_deterministic(device: Device, name: str) -> bool:
    return name not in NONDETERMINISTIC.get(device.identity.backend, set())


# -- mismatch → evidence fields ------------------------------------------------------------
def unravel(index: int, shape: tuple[int, ...]) -> list[int]:
    out = []
    for d in reversed(shape):
        index, r = divmod(index, d) if d else (index, 0)
        out.append(r)
    return out[::-1]


def localise(expected: torch.Tensor, actual: torch.Tensor, *, tile: tuple[int, int] | None = None,
             limit: int = MAX_SAMPLES) -> dict:
    """Where ``actual`` differs from ``expected``: blocks (by block fingerprint), element
    count, samples with coordinates, bits and XOR mask, GEMM tiles for 2-D outputs."""
    blocks, count, records = fingerprints.diff_records(expected, actual, LOCAL_BLOCK, limit)
    shape = tuple(expected.shape)
    tiles = set()
    for r in records:
        r["coords"] = unravel(r["index"], shape)
        r["block"] = r["index"] // LOCAL_BLOCK
        if tile is not None and len(shape) == 2:
            r["tile"] = [r["coords"][0] // tile[0], r["coords"][1] // tile[1]]
            tiles.add(tuple(r["tile"]))
    return {"blocks": blocks, "elements": count, "samples": records, "tiles": [list(t) for t in sorted(tiles)],
            "localised": [r["coords"] for r in records]}


def majority(prints: list) -> tuple[object, list[int]]:
    """The most common value and the indices that differ from it (ties: the first seen)."""
    counts: dict = {}
    for p in prints:
        counts[p] = counts.get(p, 0) + 1
    best = max(counts, key=lambda p: (counts[p], -prints.index(p)))
    return best, [i for i, p in enumerate(prints) if p != best]


def bytes_of(outputs: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in outputs.values())

