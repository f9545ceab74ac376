"""The GEMM sensor (docs/sensors.md §2): each launch of an instrumented GEMM first asks the
controller whether it is sampled. A sampled launch runs the device's checked GEMM (fused
fp32-accumulator checksums) and compares those checksums with fp64 references read from its
operands (``Device.lean_side``: the tile sums of one operand multiplied by the other, ``_sides``),
in units of the sensors' σ (``sigma_of``), flagged by the scan's own check (checks/gemm.py
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

On CUDA a checked launch is only enqueued (``CudaDevice.prepare`` and ``run``), and so is its
comparison (``sense``: the reference kernel, one comparison kernel, a copy of its few summary
numbers to pinned host memory), timed by CUDA events: ``resolve`` reads every comparison of the
step at the step boundary, waiting for each check's end event, not for the whole device (a fault
while a kernel runs surfaces there too).
Self-tests run through ``Device.checked_gemm`` as a scan does.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import torch

from aegis_cli.backends import cuda_compare
from aegis_cli.backends.base import Device
from aegis_cli.backends.cuda import CudaDevice
from aegis_cli.checks import gemm as checks
from aegis_cli.faults.spec import FaultPlan
from aegis_cli.ops import lean, numerics
from aegis_cli.ops.gemm import GemmOperands, GemmResult, Layout
from aegis_cli.sensors.queue import nbytes

PENDING_BYTES = 4 << 30  # the tensors enqueued comparisons may hold until the step boundary (they are read earlier beyond it)


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
        return _held(self.operands, self.result)


def _held(ops: GemmOperands, res: GemmResult) -> list[torch.Tensor]:
    """The tensors a queued launch holds (its context copies them): sized before they are copied."""
    return [*_watched(ops, res), res.row_sums, res.col_sums]


def op_id(layer: str, layout: Layout, m: int, n: int, k: int) -> str:
    """A launch's op id, also the case id of its vTasks: ``train/LAYER/LAYOUT/MxNxK``. An
    ``--inject`` fault's ``op=`` matches a part of it, and replay launches under it, so a seeded
    fault lands where it landed in training."""
    return f"train/{layer}/{layout.value}/{m}x{n}x{k}"


def op_key(layer: str, layout: Layout) -> str:
    """An operator's key in the controller (sampling, cost, τ): ``LAYER/LAYOUT``."""
    return f"{layer}/{layout.value}"


# The sensors' noise scale (docs/sensors.md §2.1). The scan's σ (NoiseModel: unit·K·ρ, fitted on
# zero-mean random inputs) underestimates a truncating accumulator on training tensors, whose
# products share signs (post-GELU activations, a feature's mean over tokens): the chopped bits
# follow the partial sums, not ρ. Measured on the H200 over real steps of the example's 1.18B GPT
# (benchmarks/RESULTS.md, session 11): forward and dgrad reach |Δ| = 0.023·K·2⁻²⁴·Σ|c| (Σ|c| over
# the checksum's outputs), so BIAS = 1/32 puts the largest clean value at 0.57 σ; wgrad sums over
# tokens, whose partial sums grow and cancel (Σ|c| says nothing of them), and reaches 0.88 of the
# device's accumulation bound (Device.accumulation_bound·s, one chopped ulp per 16-deep step): its σ
# is WGRAD_BOUND × that bound ÷ τ, the strict worst case of two ulps per step, so τ·σ is that bound.
BIAS = 1 / 32
WGRAD_BOUND = 2.0


@dataclass(frozen=True)
class Sigma:
    """The coefficients of the sensors' σ of one check (``sigma_of``), from the device's noise model at K."""

    u: float  # σ per ρ: the scan's unit·K^power
    p: float  # σ per s at the device's accumulation bound (cap ÷ τ)
    b: float  # the bias term per Σ|c|: BIAS·K·2⁻²⁴
    w: float  # wgrad's σ per s: WGRAD_BOUND·p

    @classmethod
    def of(cls, noise: numerics.NoiseModel, k: int) -> Sigma:
        per_s = noise.cap / numerics.DEFAULT_TAU
        return cls(noise.unit * noise.depth(k), per_s, BIAS * k * 2.0**-24, WGRAD_BOUND * per_s)


def sigma_of(s: torch.Tensor, rho: torch.Tensor | None, c_abs: torch.Tensor | None, c: Sigma) -> torch.Tensor:
    """σ of sums with magnitudes ``s``: s·w without ρ (wgrad on a truncating device); else the
    scan's min(ρ·u, s·p), plus the bias term Σ|c|·b given ``c_abs``, never above s·p. The torch
    twin of kernels/sensor_compare.cu (the same operations in the same order)."""
    if rho is None:
        return s * c.w
    base = torch.minimum(rho * c.u, s * c.p)  # NoiseModel.scale
    return base if c_abs is None else torch.minimum(base + c_abs * c.b, s * c.p)


class CheckTimer:
    """The device time of one check (a sampled GEMM's comparison, an attention call's checks). On
    CUDA: events on the device's current stream around the check's work, so neither the work queued
    before it nor the host counts, read at the step boundary by waiting for the end event alone
    (``wait``: never the whole device; ``resolve``); on the CPU: its wall time, known at ``stop``."""

    def __init__(self, device: Device):
        self.device, self.events, self.elapsed = device, None, 0.0
        if isinstance(device, CudaDevice):
            self.stream = torch.cuda.current_stream(device.torch_device)
            self.events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            self.events[0].record(self.stream)
        else:
            self.t0 = time.perf_counter()

    @property
    def on_device(self) -> bool:
        return self.events is not None

    def stop(self) -> None:
        if self.events is None:
            self.elapsed = time.perf_counter() - self.t0
        else:
            self.events[1].record(self.stream)

    def wait(self) -> None:
        """Until the check's work is done (its CUDA end event; nothing on the CPU)."""
        if self.events is not None:
            self.device.wait(self.events[1])

    def seconds(self) -> float:
        if self.events is None:
            return self.elapsed
        start, end = self.events
        return start.elapsed_time(end) / 1e3


@dataclass
class Pending:
    """A sampled launch whose comparison is enqueued on the device and read at the step boundary
    (``resolve``): the tensors it read are held (not copied) until then, with their versions, so
    a flagged launch is copied for the verifier only if nothing changed them in place."""

    layer: str
    site: str
    key: str
    device: Device
    ops: GemmOperands
    res: GemmResult
    tau: float
    floor: float
    parts: list[tuple[str, torch.Tensor, torch.Tensor, torch.Tensor]]  # (check, normalised diff, sums, reference)
    summary: torch.Tensor  # the largest diff of each part, then 1.0 if every input was finite: on the host (pinned on CUDA)
    versions: tuple[int, ...]
    timer: CheckTimer  # on CUDA its end event follows the summary's copy to the host
    nbytes: int

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return _watched(self.ops, self.res)

    def changed(self) -> bool:
        """Whether its tensors were changed in place since it was enqueued (their versions moved)."""
        return _versions(self.tensors()) != self.versions


def _watched(ops: GemmOperands, res: GemmResult) -> tuple[torch.Tensor, ...]:
    """The tensors a Pending holds until the step boundary (A, B, C), watched for in-place changes."""
    return ops.a, ops.b, res.c


def _versions(tensors) -> tuple[int, ...]:
    return tuple(t._version for t in tensors)


Side = tuple  # (check, sums, reference, s, ρ or None, Σ|c| or None, floor)


def _sides(ops: GemmOperands, res: GemmResult, truncating: bool, device: Device | None) -> list[Side]:
    """What a check compares: the row sums (wgrad also the column sums) with the lean references
    (``Device.lean_side``: a kernel on CUDA; torch's without a device) and, for forward and dgrad on
    a truncating device, Σ|c| (``tile_abs_sums``). wgrad's σ on a truncating device follows s alone:
    no ρ computed there."""
    tn = res.tile[1]
    k = ops.mnk[2]
    both = ops.layout is Layout.WGRAD
    refs = lean.lean_sides(ops, res.tile, not (both and truncating), both, lean.lean_side if device is None else device.lean_side)
    if not both:
        c_abs = None
        if truncating:
            c_abs = numerics.abs_col_tiles(res.c, tn) if device is None else device.tile_abs_sums(res.c, tn)
        return [("gemm.row_checksum", res.row_sums, *refs[0], c_abs, numerics.checksum_floor(k, res.tile, cols=False))]
    floor = numerics.checksum_floor(k, res.tile)
    return [("gemm.row_checksum", res.row_sums, *refs[0], None, floor), ("gemm.col_checksum", res.col_sums, *refs[1], None, floor)]


def compare_torch(sides: list[Side], c: Sigma) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The comparison by torch's operations (the CPU path, and the reference of the fused CUDA
    kernel): each side's normalised differences, and the summary (each side's largest, then 1.0
    if every s is finite)."""
    ds = [numerics.normalised_diff(sums, ref, sigma_of(s, r, c_abs, c), floor) for _, sums, ref, s, r, c_abs, floor in sides]
    finite = torch.stack([torch.isfinite(x[3]).all() for x in sides]).all().double()
    return ds, torch.stack([d.max() for d in ds] + [finite])


def enqueue(ops: GemmOperands, res: GemmResult, noise: numerics.NoiseModel, truncating: bool,
            device: Device | None = None):
    """The comparison, left on the device: (parts, summary). Differences are in units of the
    sensors' σ (``sigma_of``); non-finite inputs have no reference and are not flagged. The
    reference and Σ|c| are ``device``'s (``Device.lean_side``, ``tile_abs_sums``: kernels on
    CUDA), torch's without one; on CUDA the σ, differences, maxima and finite flag are one kernel
    (backends/cuda_compare.py), the bits of the torch path here."""
    sides = _sides(ops, res, truncating, device)
    c = Sigma.of(noise, ops.mnk[2])
    args = [x[1:] for x in sides]
    if isinstance(device, CudaDevice) and cuda_compare.applies(args):
        summary = cuda_compare.new_summary(len(sides), res.row_sums.device)
        ds = cuda_compare.compare(args, c.u, c.p, c.b, c.w, summary)
    else:
        ds, summary = compare_torch(sides, c)
    return [(name, d, sums, ref) for (name, sums, ref, *_), d in zip(sides, ds, strict=True)], summary


def judge_parts(parts, worst: list[float], finite: float, tau: float) -> tuple[list[checks.Signal], float, bool]:
    """(signals over τ, the largest normalised difference, whether the inputs were finite) of an
    enqueued comparison whose ``worst`` values and ``finite`` flag were read back."""
    if not finite:
        return [], 0.0, False
    worst_f = max(worst)
    if not worst_f > tau:  # nearly every launch
        return [], worst_f, True
    found = [checks.checksum_signal(name, d, sums, r, tau) for name, d, sums, r in parts]
    return [x for x in found if x is not None], worst_f, True


def snapshot(ops: GemmOperands, res: GemmResult) -> tuple[GemmOperands, GemmResult]:
    """Copies of a flagged launch's tensors: the loop may update its weights or activations in place
    before the verifier runs."""
    ops2 = GemmOperands(ops.a.detach().clone(), ops.b.detach().clone(), ops.layout)
    return ops2, dataclasses.replace(res, c=res.c.detach().clone(), row_sums=res.row_sums.clone(), col_sums=res.col_sums.clone())


def sense(h, device: Device, layer: str, ops: GemmOperands, res: GemmResult, site: str, key: str) -> None:
    """Enqueue the comparison of one sampled launch at this operator's τ, timed on the device (CUDA
    events) without a host synchronisation, and the copy of its summary (a few numbers) to pinned
    host memory; ``resolve`` reads it at the step boundary, or here when the launches waiting hold
    more than PENDING_BYTES (on the CPU: at once)."""
    floor = h.config.thresholds.tau
    tau = h.controller.tau(key, floor)
    timer = CheckTimer(device)
    k = ops.mnk[2]
    parts, summary = enqueue(ops, res, device.noise_model(k), device.accumulation_bound(k) > 0, device)
    if summary.is_cuda:  # read back at the boundary by waiting for this check's end event alone
        summary = torch.empty(summary.shape, dtype=summary.dtype, pin_memory=True).copy_(summary, non_blocking=True)
    timer.stop()
    watched = _watched(ops, res)
    pend = Pending(layer, site, key, device, ops, res, tau, floor, parts, summary, _versions(watched), timer, nbytes(watched))
    h.unread.append(pend)
    h.unread_bytes += pend.nbytes
    if not timer.on_device or h.unread_bytes > PENDING_BYTES:  # on the CPU the work is done already: read it now
        resolve(h)


def resolve(h) -> None:
    """Read every enqueued comparison, charge each its device time, and raise a suspicion for each
    flag. The host waits for each check's own end event (its summary is then in host memory), never
    for the whole device: the work queued after the step's last check (the rest of backward) keeps
    the GPU busy while the host reads, copies what was flagged and issues the optimizer step. A
    flagged launch is copied here, before anything the host issues later can change its tensors;
    one whose tensors were changed in place since is not copied (the copy would not be what was
    checked): it is counted unverified. The attention checks done on CUDA since (``h.timed``, judged
    when they ran) are charged their device time here too, after waiting for their end events."""
    pend, h.unread, h.unread_bytes = h.unread, [], 0
    timed, h.timed = h.timed, []
    for timer in [p.timer for p in pend] + [t for _, t in timed]:
        timer.wait()
    for key, timer in timed:
        h.charge(key, timer.seconds())
    for p in pend:
        n = len(p.parts)
        values = p.summary.tolist()
        worst, finite = values[:n], values[n]
        h.charge(p.key, p.timer.seconds())
        signals, worst_f, ok = judge_parts(p.parts, worst, finite, p.tau)
        h.count_check(p.key, worst_f / p.tau, ok and not signals)
        if not ok:
            h.stats.skipped_nonfinite += 1
        elif signals and p.changed():
            h.unverifiable(p.layer, p.site, signals[0].check, "its operands or output were changed in place before the step "
                           "boundary, so what was checked can no longer be copied for the verifier")
        elif signals:
            h.suspect("gemm", p.layer, p.site, [x.check for x in signals], worst_f, nbytes(_held(p.ops, p.res)),
                      lambda p=p: GemmContext(p.device, h.fault_for(p.device), *snapshot(p.ops, p.res), p.layer, p.tau, p.floor))


def settle_pinned(h, devices: list[Device], drain: bool = False) -> None:
    """Surface failures of the unsampled checked kernels that pinned regions only enqueued, at a step
    boundary but without draining the device: wait for the events recorded at the previous boundary
    (that step's kernels: in a running loop, a step behind the GPU's work) and record this step's,
    so a fault while one of them ran surfaces one boundary later, as a DeviceError naming the
    device. ``drain``: wait for this step's at once (``flush``, ``close``)."""
    for dev, event in h.pinned_marks:
        dev.wait(event)
    h.pinned_marks = []
    if not h.enqueued:
        return
    h.enqueued = False
    for dev in devices:
        if not isinstance(dev, CudaDevice):  # the CPU's launches ran already
            continue
        if drain:
            dev.synchronize()
        else:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(dev.torch_device))
            h.pinned_marks.append((dev, event))


def _enqueues(device: Device, ops: GemmOperands, fault: FaultPlan | None) -> bool:
    """Whether ``launch`` enqueues the kernel itself (CUDA, no fault plan, both operands on one
    device): the one path that takes a bias."""
    return fault is None and isinstance(device, CudaDevice) and ops.b.device == ops.a.device


def launch(device: Device, ops: GemmOperands, fault: FaultPlan | None, site: str, bias: torch.Tensor | None = None) -> GemmResult:
    """The device's checked GEMM. On CUDA without a fault plan: enqueued on torch's current stream
    and returned at once (its outputs are ready in stream order, as any torch op's are). ``bias``
    (only there, ``_enqueues``): added to C in the kernel's epilogue, the checksums still A·B's; only
    for a launch nothing compares or verifies (``run_gemm``), whose C is then not A·B."""
    if _enqueues(device, ops, fault):
        with torch.cuda.device(device.torch_device):
            run = device.prepare(ops.a, ops.b, ops.layout, bias=bias)
            run.run()
        c, row_sums, col_sums, tile_sm = run.outputs
        return GemmResult(c=c, row_sums=row_sums, col_sums=col_sums, tile=device.tile, tile_sm=tile_sm,
                          kernel=f"gemm_{run.kernel}")
    return device.checked_gemm(ops, fault, op=site)


def run_gemm(h, layer: str, layout: Layout, a: torch.Tensor, b: torch.Tensor, sampled: bool | None = None,
             bias: torch.Tensor | None = None) -> torch.Tensor:
    """One instrumented GEMM of bf16 ``a`` and ``b`` (stored per ``layout``): the controller decides
    first (``sampled``: already decided and counted by the caller); sampled, the device's checked
    GEMM and its comparison; else torch's GEMM (``Device.plain_gemm``), unless the bits must not depend
    on sampling (a fault plan, a pinned region). Returns C (bf16) on ``a``'s device, plus ``bias``
    (bf16, on that device) when given: in the checked kernel's epilogue where nothing reads C itself
    (an unsampled pinned launch on CUDA without a fault plan: no comparison, no verifier), else
    by torch's add after it; the same bits either way (kernels/common.cuh ``bias_add``)."""
    device = h.device_for(a)
    home = a.device
    ops = GemmOperands(a, b, layout)
    if device.identity.backend == "cpu" and home.type != "cpu":  # the reference path for tensors that live elsewhere
        ops = GemmOperands(a.cpu(), b.cpu(), layout)
    key = op_key(layer, layout)
    if sampled is None:
        sampled = h.sensing and h.controller.want(key)
        h.stats.launches += 1
    fault = h.fault_for(device)
    with torch.autocast(home.type, enabled=False):  # the GEMM's own precision, never autocast's
        if not sampled and fault is None and not h.pinned:
            return _plus(device.plain_gemm(ops).to(home), bias)
        m, n, k = ops.mnk
        site = op_id(layer, layout, m, n, k)
        fused = bias is not None and not sampled and _enqueues(device, ops, fault) and bias.device == ops.a.device
        res = launch(device, ops, fault, site, bias if fused else None)
        if sampled:  # its failures surface when resolve waits for its comparison
            sense(h, device, layer, ops, res, site, key)
        else:  # pinned: its failures surface at a step boundary (settle_pinned)
            h.enqueued = True
    return res.c.to(home) if fused else _plus(res.c.to(home), bias)


def _plus(c: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return c if bias is None else c + bias
