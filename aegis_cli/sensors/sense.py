"""The GEMM sensor (docs/sensors.md §2): every instrumented launch runs the device's checked GEMM
(fused fp32-accumulator checksums); a sampled launch compares those checksums with fp64 references
read from its operands, by the scan's own check (checks/gemm.py ``checksum_signal``), and pushes a
suspicion when one is over τ.

Forward and dgrad compare row checksums, wgrad rows and columns (the AEGIS paper's vTask packing:
a row check needs the flagged rows of A and all of B; wgrad's B, the activations, is the large
operand, and its column checks localise a fault to the flagged columns of dW). The row reference
is taken with one row tile spanning all of M (``reference_checksums(ops, (M, tn))``): its column
part is then a single K×N product, a negligible cost beside the row part.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import torch

from aegis_cli.backends.base import Device
from aegis_cli.checks import gemm as checks
from aegis_cli.faults.spec import FaultPlan
from aegis_cli.ops import numerics
from aegis_cli.ops.gemm import GemmOperands, GemmResult, Layout, ReferenceChecksums
from aegis_cli.sensors.queue import Suspicion


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


def row_reference(device: Device, ops: GemmOperands, tile: tuple[int, int]) -> ReferenceChecksums:
    """fp64 references of the row checksums at the device's column tile; the column part spans
    all of M (one cheap K×N product), and the floor is that of a row checksum."""
    m, _, k = ops.mnk
    ref = device.reference_checksums(ops, (m, tile[1]))
    return dataclasses.replace(ref, floor=numerics.subnormal_slack(k, tile[1]))


def compare(device: Device, ops: GemmOperands, res: GemmResult, tau: float) -> tuple[list[checks.Signal], float, bool]:
    """The sensor's comparison: (signals over τ, the largest normalised difference, whether the
    inputs were finite). Non-finite inputs have no reference to compare with: nothing is flagged."""
    both = ops.layout is Layout.WGRAD
    ref = device.reference_checksums(ops, res.tile) if both else row_reference(device, ops, res.tile)
    d_row = numerics.normalised_diff(res.row_sums, ref.row, ref.row_scale, ref.floor)
    parts = [("gemm.row_checksum", d_row, res.row_sums, ref.row)]
    if both:
        d_col = numerics.normalised_diff(res.col_sums, ref.col, ref.col_scale, ref.floor)
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
    ``h``: the SensorHandle (its controller, queue and counters)."""
    t0 = time.perf_counter()
    floor = h.config.thresholds.tau_for(device, ops.mnk[2])
    tau = h.controller.tau(key, floor)
    signals, worst, finite = compare(device, ops, res, tau)
    h.stats.checked += 1
    h.step_max_ratio = max(h.step_max_ratio, worst / tau)
    if not finite:
        h.stats.skipped_nonfinite += 1
    elif not signals:
        h.stats.clean_max_ratio = max(h.stats.clean_max_ratio, worst / tau)
    elif not h.queue.fits(sum(t.numel() * t.element_size() for t in (ops.a, ops.b, res.c, res.row_sums, res.col_sums))):
        h.stats.raised += 1
        h.drop(h.step_index, layer, site, signals[0].check)  # no room: not even copied
    else:
        ops2, res2 = snapshot(ops, res)
        ctx = GemmContext(device, h.fault_for(device), ops2, res2, layer, tau, floor)
        h.raise_suspicion(Suspicion("gemm", layer, site, h.step_index, [s.check for s in signals], worst, ctx))
    dt = time.perf_counter() - t0
    h.controller.spent(key, dt)
    h.add_sense_time(dt)


def run_gemm(h, layer: str, layout: Layout, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """One instrumented GEMM: the device's checked GEMM of bf16 ``a`` and ``b`` (stored per
    ``layout``), sensed when sampled; returns C (bf16) on ``a``'s device."""
    device = h.device_for(a)
    home = a.device
    ops = GemmOperands(a, b, layout)
    if device.identity.backend == "cpu" and home.type != "cpu":  # the reference path for tensors that live elsewhere
        ops = GemmOperands(a.cpu(), b.cpu(), layout)
    m, n, k = ops.mnk
    site = op_id(layer, layout, m, n, k)
    with torch.autocast(home.type, enabled=False):  # the checked GEMM's own precision, never autocast's
        res = device.checked_gemm(ops, h.fault_for(device), op=site)
        h.stats.launches += 1
        key = f"{layer}/{layout.value}"
        if h.sensing and h.controller.want(key):
            sense(h, device, layer, ops, res, site, key)
    return res.c.to(home)
