"""The burn-in loop of ``aegis scan --soak DURATION`` (docs/soak.md). Never prints.

For the duration, each device runs its workload's training GEMMs back to back in our checked
kernels, input set after input set of the schedule (schedule.py). A set's fp64 reference
checksums are computed once, while the set before it runs: a scale's are the base's times
2^(ea+eb), exactly. Every launch is screened where it ran (checks/screen.py: fused checksums at
τ, a window's launches in one batch, read from the slab they wrote into; and on the launches
schedule.fingerprinted picks, its C's fingerprint against the base's C scaled exactly), and the
flags are read one window of launches behind, so the GPU never waits for the host. A flagged launch is checked in full
and confirmed by the scan's own GEMM checks and judgement (the first one; later ones are
counted), and every launch names the case id and seed that re-run it
(``aegis scan --seed S --case ID``).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from aegis_cli.backends import resolve_devices
from aegis_cli.backends.base import Device, memory_shortfall
from aegis_cli.backends.fingerprints import device_fingerprint_tensor
from aegis_cli.backends.nvml import Telemetry
from aegis_cli.backends.soak_cuda import Launcher, Slab
from aegis_cli.checks import screen
from aegis_cli.faults.spec import FaultPlan
from aegis_cli.ops import numerics
from aegis_cli.ops.case import check_seed
from aegis_cli.ops.errors import ConfigError, DeviceError
from aegis_cli.ops.gemm import GemmOperands, GemmResult, ReferenceChecksums
from aegis_cli.ops.verdict import Evidence, Verdict, worst
from aegis_cli.probes import DEFAULT_RERUNS, ProbeConfig, check_reruns, workload_for
from aegis_cli.probes.gemm import GemmProbe, ProbeStats, case_bytes, clean_median, scaled
from aegis_cli.report import DeviceReport, Report, device_failures, new_report
from aegis_cli.soak.record import SoakRecord
from aegis_cli.soak.schedule import FINGERPRINT_EVERY, REPEATS, SCALES, SET_FLOPS, SetPlan, fingerprinted, pow2, set_case, set_plan

Progress = Callable[..., None]  # as scan's: progress("start" | "soak" | "device_done", **info)

WINDOW = {"cuda": 64, "cpu": 4}  # launches screened per host read; on a GPU the host reads one window behind
CONFIRM = 1  # failing launches confirmed in full (re-runs, fp64 recomputation, judgement); later ones are counted


@dataclass
class SoakOptions:
    """What the burn-in is asked for. It also answers what a report records of a scan's options
    (report.RunOptions): the fields below ``command_line`` are a scan's that the burn-in refuses."""

    seconds: float
    devices: str = "auto"
    workload: str | None = None  # None: cpu-quick on CPUs, llama3-70b on GPUs, as the scan
    seed: int = 0
    reruns: int = DEFAULT_RERUNS  # re-runs confirming a failing launch
    inject: str | None = None
    thresholds: numerics.Thresholds = field(default_factory=numerics.Thresholds)
    command_line: list[str] = field(default_factory=list)
    case: str | None = None
    keep_flagged: bool = False
    golden: str | None = None
    probe_options: dict[str, str] = field(default_factory=dict)
    probes: tuple[str, ...] = ()
    fail_fast: bool = False

    def __post_init__(self) -> None:
        check_seed(self.seed)
        check_reruns(self.reruns)
        refused = {"--case": self.case, "--save-vtasks": self.keep_flagged, "--golden": self.golden,
                   "--probe-option": self.probe_options, "--probes": self.probes, "--fail-fast": self.fail_fast}
        given = [k for k, v in refused.items() if v]
        if given:
            raise ConfigError(f"--soak runs its own schedule of checked GEMMs and takes no {', '.join(given)} "
                              "(re-run a failing launch with aegis scan --seed S --case ID)")

    def probe_config(self) -> ProbeConfig:
        return ProbeConfig(seed=self.seed, reruns=self.reruns, thresholds=self.thresholds, workload=self.workload)


# ---------------------------------------------------------------------------- one device
@dataclass
class _Set:
    """An input set while its launches are in flight: operands, reference, the base run."""

    plan: SetPlan
    ops: GemmOperands
    ref: ReferenceChecksums
    tau: float
    median: float | None  # a perturb fault's unit (FaultPlan.needs_clean_median), else None
    base: GemmResult | None = None  # its first launch: the bits every scale must give, scaled
    matched: bool = False  # a launch after the base gave the expected bits: the base is right
    # the base run failed (its checks flagged it, or no launch after it gave its bits), counted
    # once: later launches that differ from it are not failures, and it is no expectation
    base_failed: bool = False


@dataclass
class _Launch:
    """One launch until its window is read: its result stays on the device for confirmation."""

    index: int  # of the burn-in's launches, from 0
    s: _Set
    scale: tuple[int, int]
    fp: torch.Tensor | None  # (1,) int64 on the device: its C's fingerprint (schedule.fingerprinted), else None
    expected: torch.Tensor  # (1,) int64: the fingerprint of the base's C at this scale
    lim: screen.Limits
    res: GemmResult | None = None  # its outputs, where the launcher gave it its own (off a GPU)
    slab: Slab | None = None  # else where they are: slot ``slot`` of a slab
    slot: int = 0
    kernel: str = ""
    injected: bool = False

    def result(self) -> GemmResult:
        return self.res if self.res is not None else self.slab.result(self.slot, self.kernel, self.injected)


@dataclass
class _Window:
    """Launches screened together, their flags on the way to the host."""

    launches: list[_Launch]
    host: torch.Tensor  # (2n + 2,) int64: flagged checksums, fingerprint mismatches, noise (fp64 bits)
    event: object | None  # recorded after the copy (CUDA)
    flops: int


def _start_copy(t: torch.Tensor, cuda: bool) -> tuple[torch.Tensor, object | None]:
    """Start copying ``t`` to the host without a sync: on a GPU into pinned memory, with an event
    recorded after the copy (synchronise on it before reading); elsewhere ``t`` itself, no event."""
    if not cuda:
        return t, None
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    event = torch.cuda.Event()
    event.record()
    return host, event


class _Soak:
    def __init__(self, device: Device, opts: SoakOptions, fault: FaultPlan | None, progress: Progress):
        self.device, self.opts, self.fault, self.progress = device, opts, fault, progress
        self.wl = workload_for(opts.probe_config(), device)
        self.th = opts.thresholds
        self.launcher = Launcher(device)
        backend = device.identity.backend
        self.window = WINDOW.get(backend, WINDOW["cpu"])
        self.stats = ProbeStats()
        self.rec = SoakRecord(opts.seconds, opts.seed, {
            "workload": self.wl.name, "window": self.window, "scales_per_set": SCALES, "repeats": list(REPEATS),
            "set_flops": SET_FLOPS.get(backend, SET_FLOPS["cpu"]), "fingerprint_every": FINGERPRINT_EVERY,
            "rule": "input set i: shape i mod #shapes, distribution (i div #shapes) mod #distributions, scan seed "
                    "case_seed(seed, 'soak', i); scales drawn from that seed over the exact range; each scale repeated; "
                    "repeat r of a scale fingerprinted when r mod fingerprint_every = fingerprint_every - 1 or it is the last"})
        self.evidence: list[Evidence] = []
        self.noise: list[torch.Tensor] = []  # (clean max, clean max ÷ τ) of each scale's first launch, on the device
        self.n = 0  # launches enqueued

    # -- input sets ------------------------------------------------------------------
    def _draw(self, index: int) -> tuple:
        """Enqueue input set ``index``'s operands, reference and magnitudes, and start copying the
        magnitudes back; it is drawn while the set before it runs, so starting it needs no sync."""
        case = set_case(self.wl, self.opts.seed, index)
        ops = case.operands(self.device)
        ref = self.device.reference_checksums(ops, self.device.tile)
        mags, event = _start_copy(screen.magnitudes(ops), self.launcher.cuda)
        return index, case, ops, ref, mags, event

    def _begin(self, drawn: tuple) -> _Set:
        index, case, ops, ref, mags, event = drawn
        t = time.monotonic()
        if event is not None:
            event.synchronize()
        self.rec.host_wait += time.monotonic() - t
        amin, amax, bmin, bmax = mags.tolist()
        mag = numerics.Magnitudes(amin, amax, bmin, bmax, case.shape.k) if amax > 0 and bmax > 0 else None
        plan = set_plan(self.wl, self.opts.seed, index, self.n, self.device.identity.backend, mag)
        med = clean_median(self.device, ops, ref) if self.fault is not None and self.fault.needs_clean_median() else None
        self.rec.visit(plan)
        return _Set(plan, ops, ref, self.th.tau, med)

    # -- the loop --------------------------------------------------------------------
    def run(self) -> None:
        telemetry = Telemetry(self.device.identity)
        try:
            self.rec.start(telemetry)
            self._loop(telemetry)
        finally:
            telemetry.close()

    def _loop(self, telemetry: Telemetry) -> None:
        t0 = time.monotonic()
        pending: list[_Launch] = []
        waiting: _Window | None = None
        drawn = self._draw(0)
        while time.monotonic() - t0 < self.opts.seconds:
            s = self._begin(drawn)
            drawn = self._draw(s.plan.index + 1)  # runs on the GPU ahead of this set's launches
            for scale in s.plan.scales:
                if time.monotonic() - t0 >= self.opts.seconds:
                    break
                for launch in self._scale_run(s, scale, t0):
                    pending.append(launch)
                    if len(pending) == self.window:
                        waiting = self._rotate(waiting, self._close(pending), telemetry)
                        pending = []
        window = self._close(pending) if pending else None
        waiting = self._rotate(waiting, window, telemetry)
        self._rotate(waiting, None, telemetry)
        self.rec.finish(telemetry)
        self.stats.seconds = self.rec.elapsed

    def _scale_run(self, s: _Set, scale: tuple[int, int], t0: float):
        """The launches of one scale of input set ``s`` (enqueued lazily, so the caller can stop)."""
        ea, eb = scale
        ops = GemmOperands(pow2(s.ops.a, ea), pow2(s.ops.b, eb), s.ops.layout)
        ref = s.ref.scaled(ea + eb)
        lim = screen.limits(ref, s.tau)
        prepared = self.launcher.prepare(ops)
        cid = s.plan.case.case_id(ea, eb)
        expected = slab = None
        repeats = s.plan.repeats
        for r in range(repeats):
            if r and time.monotonic() - t0 >= self.opts.seconds:
                return
            if self.launcher.cuda:  # into a slab: one per window's worth of launches
                if r % self.window == 0:
                    slab = self.launcher.slab(prepared, min(self.window, repeats - r))
                slot = r % self.window
                kernel, injected = self.launcher.run_into(prepared, slab, slot, self.fault, op=cid, clean_median=s.median)
                x = _Launch(self.n, s, scale, None, None, lim, slab=slab, slot=slot, kernel=kernel, injected=injected)
            else:
                x = _Launch(self.n, s, scale, None, None, lim, res=self.launcher.run(prepared, self.fault, op=cid, clean_median=s.median))
            if fingerprinted(r, repeats):
                x.fp = device_fingerprint_tensor(x.result().c)
            if expected is None:  # the first run of this scale
                res = x.result()
                if s.base is None:  # its own copy: the slab goes when its window has been read
                    s.base = res if x.slab is None else dataclasses.replace(
                        res, c=res.c.clone(), row_sums=res.row_sums.clone(), col_sums=res.col_sums.clone(), tile_sm=res.tile_sm.clone())
                # the base's C at this scale: exact (numerics.pow2_exact_safe)
                expected = device_fingerprint_tensor(pow2(s.base.c, ea + eb))
                clean = screen.clean_max(res, ref, s.tau)
                self.noise.append(torch.stack([clean, clean / s.tau]))
            x.expected = expected
            self.stats.checksums += lim.count  # the checksums the screen compares: every one of the launch's
            yield x
            self.n += 1

    def _close(self, launches: list[_Launch]) -> _Window:
        """Screen a window of launches on the device and start copying the flags to the host."""
        flags, start = [], 0
        for i in range(1, len(launches) + 1):  # consecutive launches of one slab (or scale) are screened together
            if i == len(launches) or launches[i].lim is not launches[start].lim or launches[i].slab is not launches[start].slab:
                run = launches[start:i]
                x, y = run[0], run[-1]
                if x.slab is not None:  # consecutive slots
                    rows, cols = x.slab.row_sums[x.slot:y.slot + 1], x.slab.col_sums[x.slot:y.slot + 1]
                else:
                    rows, cols = [u.res.row_sums for u in run], [u.res.col_sums for u in run]
                flags.append(screen.flagged(rows, cols, x.lim))
                start = i
        flags = torch.cat(flags)
        # a fingerprint against the expected one, where the launch has one (else the expected against itself)
        mismatch = (torch.cat([x.expected if x.fp is None else x.fp for x in launches])
                    != torch.cat([x.expected for x in launches])).long()
        clean = torch.stack(self.noise).amax(0) if self.noise else flags.new_zeros(2, dtype=torch.float64)
        self.noise = []
        # one copy back: flags, mismatches, and the noise's two fp64 values as their bits
        host, event = _start_copy(torch.cat([flags, mismatch, clean.view(torch.int64)]), self.launcher.cuda)
        return _Window(launches, host, event, sum(x.s.plan.case.shape.flops for x in launches))

    def _rotate(self, waiting: _Window | None, new: _Window | None, telemetry: Telemetry) -> _Window | None:
        """Read the window the GPU has (nearly) finished while ``new`` runs; returns ``new``."""
        if waiting is not None:
            if waiting.event is not None:
                t = time.monotonic()
                try:
                    waiting.event.synchronize()
                except Exception as exc:
                    raise DeviceError(f"{self.device.identity.id}: asynchronous failure during the burn-in: {exc}") from exc
                self.rec.host_wait += time.monotonic() - t
            self._read(waiting)
            self.rec.tick(telemetry, self.progress, self.device.identity.id)
        return new

    def _read(self, w: _Window) -> None:
        n = len(w.launches)
        flagged, mismatch = w.host[:n].tolist(), w.host[n:2 * n].tolist()
        clean_max, clean_ratio = w.host[2 * n:].view(torch.float64).tolist()
        self.stats.gemms += n
        self.stats.flops += w.flops
        self.rec.completed([x.s.plan.case.shape for x in w.launches], w.flops)
        self.rec.fingerprinted += sum(x.fp is not None for x in w.launches)
        self.stats.clean_max, self.stats.clean_ratio = max(self.stats.clean_max, clean_max), max(self.stats.clean_ratio, clean_ratio)
        for x, m in zip(w.launches, mismatch, strict=True):
            if not m and x.fp is not None and x.index != x.s.plan.first:
                x.s.matched = True
        for x, f, m in zip(w.launches, flagged, mismatch, strict=True):
            if f:
                self._fail(x, f, bool(m))
                if x.index == x.s.plan.first:
                    x.s.base_failed = True
            elif m:
                if x.s.matched:  # the base's bits are right: this launch is off
                    self._fail(x, 0, True)
                elif not x.s.base_failed:  # nothing after the base gave its bits: the base run is the odd one
                    x.s.base_failed = True
                    base = dataclasses.replace(x, index=x.s.plan.first, scale=(0, 0), res=x.s.base)
                    self._fail(base, 0, True, blamed=x)

    # -- failures --------------------------------------------------------------------
    def _fail(self, x: _Launch, flagged: int, mismatch: bool, blamed: _Launch | None = None) -> None:
        case = x.s.plan.case
        cid = case.case_id(*x.scale)
        k = self.rec.failure(x.index, cid, case.seed, flagged, mismatch, self.opts, self.device.identity.id)
        if k <= CONFIRM:
            self.evidence += self._confirm(x, blamed)

    def _confirm(self, x: _Launch, blamed: _Launch | None) -> list[Evidence]:
        """The scan's own checks and confirmation (probes/gemm.py, checks/judge.py) on the flagged
        launch's result: re-runs of its exact inputs, fingerprints, fp64 recomputation."""
        self.device.synchronize()
        s, (ea, eb) = x.s, x.scale
        probe = GemmProbe(self.device, self.th, reruns=self.opts.reruns, fault=self.fault)
        ops = scaled(s.ops, ea, eb) if x.scale != (0, 0) else s.ops
        ref = s.ref.scaled(ea + eb)
        if blamed is not None:  # the base against the bits later runs gave, scaled back (exact)
            expected = numerics.pow2_scale(blamed.result().c, -sum(blamed.scale))
        else:
            expected = None if s.base_failed else numerics.pow2_scale(s.base.c, ea + eb)
        cid = s.plan.case.case_id(ea, eb)
        rerun = lambda: self.device.checked_gemm(ops, self.fault, op=cid, clean_median=s.median)
        found = probe.confirm_run(s.plan.case, ea, eb, x.result(), ops, ref, expected, s.tau, rerun)
        self.stats.gemms += probe.stats.gemms
        self.stats.flops += probe.stats.flops
        if found:
            return found
        # the screen saw it, the full checks did not (a fingerprint against a base that was itself
        # off, with no run of the base's scale to compare): counted, never confirmed
        sh = s.plan.case.shape
        return [Evidence(check="soak.screen", severity=Verdict.SUSPECT, case_id=cid, op=sh.op, layout=sh.layout.value,
                         shape={"m": sh.m, "n": sh.n, "k": sh.k}, dist=s.plan.case.dist, scale=[ea, eb], seed=s.plan.case.seed,
                         kernel=x.result().kernel, summary="soak.screen: the burn-in's screen flagged this launch, and its full "
                         "checks found nothing to confirm")]


def soak_device(device: Device, opts: SoakOptions, fault: FaultPlan | None, progress: Progress) -> DeviceReport:
    """The burn-in on one device; any failure of the device → ERROR (FAULTY evidence kept)."""
    t0 = time.time()
    dr = DeviceReport(identity=device.identity, verdict=Verdict.ERROR)
    soak = None
    with device_failures(dr):
        soak = _Soak(device, opts, fault, progress)
        soak.run()
    if soak is not None:
        dr.evidence = soak.rec.annotate(soak.evidence)
        dr.workload, dr.stats, dr.soak = soak.wl.name, soak.stats, soak.rec.to_dict()
    dr.judge()
    dr.seconds = time.time() - t0
    progress("device_done", device=device.identity.id, verdict=dr.verdict.value)
    return dr


def soak_after(dr: DeviceReport, device: Device, opts: SoakOptions, fault: FaultPlan | None) -> DeviceReport:
    """A burn-in after a scan of the same device (a sweep's ``soak:``): its evidence and its
    section join the scan's report ``dr``, whose verdict it can only worsen."""
    sr = soak_device(device, opts, fault, lambda *_a, **_k: None)
    dr.evidence += sr.evidence
    dr.soak = sr.soak
    if sr.error:
        dr.error = (dr.error + "; " if dr.error else "") + f"soak: {sr.error}"
    dr.verdict = worst([dr.verdict, sr.verdict])
    dr.seconds += sr.seconds
    return dr


def preflight(opts: SoakOptions, devices: list[Device]) -> None:
    """Refuse, before any device runs, a workload that would not fit: a case's operands, scaled
    copies and reference, and two windows of results."""
    for d in devices:
        wl = workload_for(opts.probe_config(), d)
        # results of two windows, in slabs of a window's size that each may straddle two: C, 2 bytes an element
        held = 4 * WINDOW.get(d.identity.backend, WINDOW["cpu"])
        needs = {s: case_bytes(s.m, s.n, s.k) + held * s.m * s.n * 2 for s in wl.gemms()}
        big = max(needs, key=needs.get)
        need = needs[big]
        short = memory_shortfall(d, need)
        if short is not None:
            raise ConfigError(f"--soak: workload {wl.name!r}: its largest GEMM ({big.op} {big.layout.value} "
                              f"{big.m}x{big.n}x{big.k}) needs about {need / 2**30:.1f} GiB on {d.identity.id}, {short[1]}")


def run_soak(opts: SoakOptions, progress: Progress | None = None) -> Report:
    """``aegis scan --soak``: the burn-in on every device of ``opts.devices``, one after another."""
    progress = progress or (lambda *_a, **_k: None)
    plan = FaultPlan.parse(opts.inject) if opts.inject else None
    devices = resolve_devices(opts.devices)
    if plan is not None:
        plan.check_devices([d.identity.id for d in devices])
    preflight(opts, devices)
    report = new_report(opts)
    report.options["soak_seconds"] = opts.seconds
    progress("start", total=round(opts.seconds * len(devices)), devices=[d.identity.id for d in devices], soak=True)
    for device in devices:
        fault = plan.for_device(device.identity.id) if plan else None
        report.devices.append(soak_device(device, opts, fault, progress))
    if plan is not None:
        report.never_fired = plan.never_fired()
    report.finish()
    return report

