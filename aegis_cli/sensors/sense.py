"""The GEMM sensor (docs/sensors.md §2): each launch of an instrumented GEMM first asks the
controller whether it is sampled. A sampled launch runs the device's checked GEMM (fused
fp32-accumulator checksums) and compares those checksums with fp64 references read from its
operands (``numerics.reference_checksums(lean=True)``), by the scan's own check (checks/gemm.py
``checksum_signal``), and pushes a suspicion when one is over τ; its result is the one it checked.
A launch that is not sampled runs torch's own GEMM of the same bf16 operands (cuBLAS on CUDA; on
the CPU path the very product the CPU checked GEMM forms, so there the bits do not depend on
sampling): it pays for nothing it does not use.

Forward and dgrad compare row checksums, wgrad rows and columns (the AEGIS paper's vTask packing:
a row check needs the flagged rows of A and all of B; wgrad's B, the activations, is the large
operand, and its column checks localise a fault to the flagged columns of dW).

Every launch runs the checked GEMM, sampled or not, where bits must not depend on the coin: under
a self-test's fault plan (the fault acts there, as a broken unit would on every launch) and inside
a fingerprinted checkpoint region (``SensorHandle.pinned``: its forward, its recompute and the
verifier's re-runs must compute the same bits).

On CUDA a checked launch is only enqueued (``CudaDevice.prepare`` and ``run``); a fault while a
kernel runs surfaces at the next synchronisation, at the latest the step boundary's
(SensorHandle.step). A sampled launch synchronises before its clock starts, so the cost it charges
is its own, and reads one number back. Self-tests run through ``Device.checked_gemm`` as a scan does.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from aegis_cli.backends.base import Device
from aegis_cli.backends.cuda import CudaDevice
from aegis_cli.checks import gemm as checks
from aegis_cli.faults.spec import FaultPlan
from aegis_cli.ops import numerics
from aegis_cli.ops.gemm import GemmOperands, GemmResult, Layout
from aegis_cli.sensors.queue import nbytes


@dataclass
class GemmContext:
    """What the verifier needs to judge a flagged launch: copies of its operands and of what it
    returned, where and how it ran, and the τ it was flagged at."""

    device: Device
    fault: FaultPlan | None
    operands: GemmOperands
    result: GemmResult
    layer: str
    tau: float
    floor: float  # the τ floor this operator's τ was raised from (adaptive thresholds)

    def tensors(self) -> list[torch.Tensor]:
        r = self.result
        return [self.operands.a, self.operands.b, r.c, r.row_sums, r.col_sums]


def op_id(layer: str, layout: Layout, m: int, n: int, k: int) -> str:
    """A launch's op id, also the case id of its vTasks: ``train/LAYER/LAYOUT/MxNxK``. An
    ``--inject`` fault's ``op=`` matches a part of it, and replay launches under it, so a seeded
    fault lands where it landed in training."""
    return f"train/{layer}/{layout.value}/{m}x{n}x{k}"


def compare(ops: GemmOperands, res: GemmResult, tau: float,
            noise: numerics.NoiseModel | None = None) -> tuple[list[checks.Signal], float, bool]:
    """The sensor's comparison: (signals over τ, the largest normalised difference, whether the
    inputs were finite). Differences are in units of the device's ``noise`` scale, as the scan's
    (ReferenceChecksums.noise). Non-finite inputs have no reference to compare with: nothing is flagged."""
    both = ops.layout is Layout.WGRAD
    ref = numerics.reference_checksums(ops, res.tile, noise, lean=True, cols=both)
    row_unit, col_unit = ref.noise()
    d_row = numerics.normalised_diff(res.row_sums, ref.row, row_unit, ref.floor)
    parts = [("gemm.row_checksum", d_row, res.row_sums, ref.row)]
    if both:
        d_col = numerics.normalised_diff(res.col_sums, ref.col, col_unit, ref.floor)
        parts.append(("gemm.col_checksum", d_col, res.col_sums, ref.col))
    scales = (ref.row_scale, ref.col_scale) if both else (ref.row_scale,)
    # one read-back per launch: the largest difference, and whether every input was finite
    *worst, finite = torch.stack([d.max() for _, d, _, _ in parts] + [torch.isfinite(torch.stack([s.sum() for s in scales])).all()
                                                                      .double()]).tolist()
    if not finite:
        return [], 0.0, False
    worst_f = max(worst)
    if not worst_f > tau:  # nearly every launch
        return [], worst_f, True
    found = [checks.checksum_signal(name, d, sums, r, tau) for name, d, sums, r in parts]
    return [s for s in found if s is not None], worst_f, True


def snapshot(ops: GemmOperands, res: GemmResult) -> tuple[GemmOperands, GemmResult]:
    """Copies of a flagged launch's tensors: the loop may update its weights or activations in place
    before the verifier runs."""
    ops2 = GemmOperands(ops.a.detach().clone(), ops.b.detach().clone(), ops.layout)
    return ops2, dataclasses.replace(res, c=res.c.detach().clone(), row_sums=res.row_sums.clone(), col_sums=res.col_sums.clone())


def sense(h, device: Device, layer: str, ops: GemmOperands, res: GemmResult, site: str, key: str) -> None:
    """Check one sampled launch; push a suspicion when a checksum is over this operator's τ.
    ``h``: the SensorHandle (its controller, queue and counters); the caller times it
    (``SensorHandle.sensing_time``)."""
    floor = h.config.thresholds.tau
    tau = h.controller.tau(key, floor)
    signals, worst, finite = compare(ops, res, tau, device.noise_model(ops.mnk[2]))
    h.stats.checked += 1
    h.step_max_ratio = max(h.step_max_ratio, worst / tau)
    if not finite:
        h.stats.skipped_nonfinite += 1
    elif not signals:
        h.stats.clean_max_ratio = max(h.stats.clean_max_ratio, worst / tau)
    else:
        h.suspect("gemm", layer, site, [s.check for s in signals], worst,
                  nbytes((ops.a, ops.b, res.c, res.row_sums, res.col_sums)),
                  lambda: GemmContext(device, h.fault_for(device), *snapshot(ops, res), layer, tau, floor))


def launch(device: Device, ops: GemmOperands, fault: FaultPlan | None, site: str) -> GemmResult:
    """The device's checked GEMM. On CUDA without a fault plan: enqueued on torch's current stream
    and returned at once (its outputs are ready in stream order, as any torch op's are)."""
    if fault is None and isinstance(device, CudaDevice) and ops.b.device == ops.a.device:
        with torch.cuda.device(device.torch_device):
            run = device.prepare(ops.a, ops.b, ops.layout)
            run.run()
        c, row_sums, col_sums, tile_sm = run.outputs
        return GemmResult(c=c, row_sums=row_sums, col_sums=col_sums, tile=device.tile, tile_sm=tile_sm,
                          kernel=f"gemm_{run.kernel}")
    return device.checked_gemm(ops, fault, op=site)


def plain_gemm(device: Device, ops: GemmOperands) -> torch.Tensor:
    """C of an unsampled launch, bf16: torch's GEMM of the bf16 operands (cuBLAS on CUDA, fp32
    accumulation); on the CPU path the product ``CpuDevice.checked_gemm`` forms, bit for bit."""
    if device.identity.backend == "cpu":
        return (ops.a_mk.float() @ ops.b_kn.float()).to(torch.bfloat16)
    return ops.a_mk @ ops.b_kn


def run_gemm(h, layer: str, layout: Layout, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """One instrumented GEMM of bf16 ``a`` and ``b`` (stored per ``layout``): the controller decides
    first; sampled, the device's checked GEMM and its comparison; else torch's GEMM (``plain_gemm``),
    unless the bits must not depend on sampling (a fault plan, a pinned region). Returns C (bf16)
    on ``a``'s device."""
    device = h.device_for(a)
    home = a.device
    ops = GemmOperands(a, b, layout)
    if device.identity.backend == "cpu" and home.type != "cpu":  # the reference path for tensors that live elsewhere
        ops = GemmOperands(a.cpu(), b.cpu(), layout)
    key = f"{layer}/{layout.value}"
    sampled = h.sensing and h.controller.want(key)
    fault = h.fault_for(device)
    h.stats.launches += 1
    with torch.autocast(home.type, enabled=False):  # the GEMM's own precision, never autocast's
        if not sampled and fault is None and not h.pinned:
            return plain_gemm(device, ops).to(home)
        m, n, k = ops.mnk
        site = op_id(layer, layout, m, n, k)
        res = launch(device, ops, fault, site)
        if sampled:
            with h.sensing_time(device, key):
                sense(h, device, layer, ops, res, site, key)
    return res.c.to(home)
