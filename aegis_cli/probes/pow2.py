"""The power-of-two scale probe (docs/design.md §5): C(2ᵃA, 2ᵇB) = 2ᵃ⁺ᵇ·C(A, B), bit for bit.

Scaling a bf16 operand by a power of two changes only exponents, so every product, every
fp32 partial sum and the bf16 output scale exactly, as long as nothing overflows,
underflows or goes subnormal (numerics.pow2_exact_safe decides; pairs outside are skipped
and counted). The probe draws one pair of operands and sweeps a and b across the bf16
exponent range on a grid, for our checked GEMM (output and both fp32-accumulator checksum
vectors) and for torch.matmul (cuBLAS on GPUs):

  pow2.inexact   some (a, b) pairs inside the exact regime gave other bits than the scaled
                 base result. FAULTY. The evidence names the regime where the device
                 deviates (the ranges of a, b and a+b over deviating pairs, and how many
                 of the tested pairs) with samples: element, expected/actual bits, XOR mask.

The gemm probe checks a few scales of every training GEMM; this probe sweeps the range. The
grid spans every exponent that keeps each operand normal and finite (outside it no pair is
exact) and is anchored at ``offset`` (mod step): a sweep moves it every time (ops/dither.py),
so that within step² sweeps every exponent pair of the exact range has been checked.
"""

from __future__ import annotations

import time

import torch

from aegis_cli.backends.base import Device
from aegis_cli.faults.spec import recent_injections
from aegis_cli.ops import dither, numerics
from aegis_cli.ops.case import CaseId, case_seed
from aegis_cli.ops.errors import ConfigError
from aegis_cli.ops.fingerprint import int_view
from aegis_cli.ops.gemm import GemmOperands, Layout
from aegis_cli.ops.verdict import Evidence, Verdict
from aegis_cli.probes import ProbeContext, bounded, quick_or_full, register
from aegis_cli.probes.computations import COMPUTATIONS, MAX_SAMPLES, localise

EXP_RANGE = (-112, 112)  # operands that are all zeros (any scale is exact): inputs ~2^-14…2^2 reach −126 … 127 at the ends
CPU_SHAPE = (64, 96, 128)
GPU_SHAPE = (1024, 1024, 1024)
IMPLS = ("checked_gemm", "matmul")
MAX_STEP = 56  # the coarsest grid with pairs inside the exact range (−56 … 56 besides the ends)
# deviating outputs kept and localised for samples (2 each: MAX_SAMPLES); past them a device
# that deviates everywhere has its differing elements counted on the device, not copied and sorted
SHOWN_PAIRS = MAX_SAMPLES // 2

OPTIONS = {
    "mode": (quick_or_full, "quick", "quick: exponent step 16 (GPU) / 56 (CPU); full: step 4"),
    # a coarser grid leaves no pair of scales inside the exact range: HEALTHY would mean nothing was checked
    "step": (bounded(int, 1, MAX_STEP, auto=0), 0, f"exponent grid step, 1…{MAX_STEP} (0: by mode)"),
    "offset": (dither.parse_pair, (0, 0), "grid offset A,B (mod step): a sweep's scale dithering sets it (docs/fleet.md)"),
}


def _run(device: Device, impl: str, ops: GemmOperands, ctx: ProbeContext, op: str) -> dict[str, torch.Tensor]:
    return COMPUTATIONS[impl].held(device, {"a": ops.a, "b": ops.b}, ctx.fault, op)  # both take B stored (N, K)


def _regime(devs: list[dict]) -> dict:
    a = [d["a"] for d in devs]
    b = [d["b"] for d in devs]
    s = [d["a"] + d["b"] for d in devs]
    return {"a": [min(a), max(a)], "b": [min(b), max(b)], "a_plus_b": [min(s), max(s)]}


def shape_for(device: Device) -> tuple[int, int, int]:
    return CPU_SHAPE if device.identity.backend == "cpu" else GPU_SHAPE


def case_id(device: Device, impl: str) -> str:
    return str(CaseId("pow2", (impl, "x".join(map(str, shape_for(device))))))


def exponent_grids(mag: numerics.Magnitudes | None, step: int, off: tuple[int, int]) -> tuple[list[int], list[int]]:
    """The exponents of A and of B the grid visits: ≡ ``off`` (mod step), within each operand's
    exact range (dither.operand_range; EXP_RANGE for all-zero operands)."""
    ra = EXP_RANGE if mag is None else dither.operand_range(mag.amin, mag.amax)
    rb = EXP_RANGE if mag is None else dither.operand_range(mag.bmin, mag.bmax)
    return dither.grid(*ra, step, off[0]), dither.grid(*rb, step, off[1])


def sweep(device: Device, impl: str, step: int, ctx: ProbeContext, off: tuple[int, int] = (0, 0)) -> tuple[dict, Evidence | None]:
    t0 = time.perf_counter()
    m, n, k = shape_for(device)
    seed = ctx.config.seed
    a = device.generate((m, k), "normal", case_seed(seed, "pow2", "A"))
    b = device.generate((n, k), "normal", case_seed(seed, "pow2", "B"))
    base_ops = GemmOperands(a, b, Layout.FWD)
    case = case_id(device, impl)
    base = _run(device, impl, base_ops, ctx, f"{case}/a+0b+0")
    mag = numerics.magnitudes(base_ops)
    exps_a, exps_b = exponent_grids(mag, step, off)
    tested, skipped, deviating = 0, 0, []
    unshown = torch.zeros((), dtype=torch.int64, device=a.device)  # differing elements of pairs past SHOWN_PAIRS
    safe_sums: list[int] = []
    for ea in exps_a:
        a_scaled = numerics.pow2_scale(a, ea)
        for eb in exps_b:
            if (ea, eb) == (0, 0):
                continue
            if not numerics.pow2_exact_safe(mag, ea, eb):
                skipped += 1
                continue
            tested += 1
            safe_sums.append(ea + eb)
            op = f"{case}/a{ea:+d}b{eb:+d}"
            out = _run(device, impl, GemmOperands(a_scaled, numerics.pow2_scale(b, eb), Layout.FWD), ctx, op)
            for key, got in out.items():
                want = numerics.pow2_scale(base[key], ea + eb)
                if not torch.equal(int_view(got), int_view(want)):
                    d = {"a": ea, "b": eb, "output": key}
                    if len(deviating) < SHOWN_PAIRS:  # kept for samples; the rest only counted, where they lie
                        d.update(expected=want, actual=got)
                    else:
                        unshown += (int_view(got) != int_view(want)).sum()
                    deviating.append(d)
        ctx.progress("step", device=device.identity.id, case=f"{case}/a{ea:+d}")
    device.synchronize()
    if not tested:
        raise ConfigError(f"pow2: no pair of the exponent grid step {step} offset {off[0]},{off[1]} lies inside the exact range "
                          f"for {impl}: HEALTHY would mean nothing was checked")
    stats = {"shape": {"m": m, "n": n, "k": k}, "step": step, "offset": list(off), "tested": tested, "skipped_unsafe": skipped,
             "exact_regime_tested": {"a_plus_b": [min(safe_sums), max(safe_sums)]} if safe_sums else None,
             "deviating_pairs": len({(d["a"], d["b"]) for d in deviating}), "seconds": round(time.perf_counter() - t0, 4)}
    if not deviating:
        return stats, None
    regime = _regime(deviating)
    stats["deviating_regime"] = regime
    pairs = sorted({(d["a"], d["b"]) for d in deviating})
    stats["deviating"] = [list(p) for p in pairs[:64]]
    # confirm: the first deviating pair once more
    first = deviating[0]
    again = _run(device, impl, GemmOperands(numerics.pow2_scale(a, first["a"]), numerics.pow2_scale(b, first["b"]), Layout.FWD),
                 ctx, f"{case}/a{first['a']:+d}b{first['b']:+d}")
    reproduced = int(not torch.equal(int_view(again[first["output"]]), int_view(first["expected"])))
    samples, tiles, localised, count = [], set(), [], int(unshown)
    for d in deviating[:SHOWN_PAIRS]:
        loc = localise(d["expected"], d["actual"], tile=device.tile if d["output"] == "c" else None, limit=2)
        count += loc["elements"]
        tiles.update(tuple(t) for t in loc["tiles"])
        for s in loc["samples"]:
            if len(samples) < MAX_SAMPLES:
                samples.append({"a": d["a"], "b": d["b"], "output": d["output"], **s})
                localised.append(s["coords"])
    base_note = " (most pairs deviate: the base run C(A, B) itself may be the wrong one)" if len(pairs) > tested // 2 else ""
    ev = Evidence(
        check="pow2.inexact", severity=Verdict.FAULTY, case_id=case,
        summary=(f"pow2.inexact: {impl}: {len(pairs)} of {tested} (a, b) pairs inside the exact regime broke "
                 f"C(2^a·A, 2^b·B) = 2^(a+b)·C(A, B): a ∈ [{regime['a'][0]}, {regime['a'][1]}], "
                 f"b ∈ [{regime['b'][0]}, {regime['b'][1]}], a+b ∈ [{regime['a_plus_b'][0]}, {regime['a_plus_b'][1]}]"
                 f"{base_note}"),
        op=impl, layout="fwd", shape={"m": m, "n": n, "k": k}, dist="normal", scale=[first["a"], first["b"]], seed=seed,
        max_value=1.0, elements=count, samples=samples, tiles=[list(t) for t in sorted(tiles)][:16], localised=localised,
        reruns=1, reproduced=reproduced, kernel="aegis" if impl == "checked_gemm" else "torch",
        injected=recent_injections(ctx.fault),
    )
    return stats, ev


@register("pow2", OPTIONS)
def pow2_probe(device: Device, ctx: ProbeContext) -> list[Evidence]:
    """Sweep power-of-two input scales; outputs must scale exactly."""
    mode = ctx.option("pow2", "mode")
    step = ctx.option("pow2", "step") or (4 if mode == "full" else (56 if device.identity.backend == "cpu" else 16))
    off = tuple(o % step for o in ctx.option("pow2", "offset"))
    evidence, stats = [], {}
    chosen = ctx.case_choice("pow2", {case_id(device, impl): impl for impl in IMPLS}, device.identity.id)
    impls = IMPLS if chosen is None else (chosen,)  # --case pow2/IMPL/MxNxK
    tally = ctx.tally.probe("pow2")
    for impl in impls:
        st, ev = sweep(device, impl, step, ctx, off)
        stats[impl] = st
        bad = st["deviating_pairs"]
        tally.launches += 1 + st["tested"] + bool(bad)  # the base, the pairs, the confirming re-run
        tally.failed += bad + (ev.reproduced if ev is not None else 0)
        if ev is not None:
            tally.flagged(ev.case_id, ev.check, st["tested"], bad, shown=True)
            evidence.append(ev)
    ctx.stats["pow2"] = {"mode": mode, "step": step, "offset": list(off), "implementations": stats}
    return evidence
