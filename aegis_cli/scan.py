"""``aegis scan`` as a library call: options in, a Report out. Never prints.

Devices are scanned one after another in this process (each GPU is independent; fleet
sweeps run one worker process per GPU instead, see fleet/sweep.py).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from aegis_cli.backends import resolve_devices
from aegis_cli.backends.base import Device, memory_shortfall
from aegis_cli.faults.spec import FaultPlan
from aegis_cli.ops import numerics, workloads
from aegis_cli.ops.case import CaseId, check_seed, scale_token
from aegis_cli.ops.errors import AegisError, ConfigError, GoldenError
from aegis_cli.ops.verdict import Evidence, Verdict, worst
from aegis_cli.probes import DEFAULT_PROBES, NODE_PROBES, PROBES, ProbeContext, case_probe, load_all, parse_probe_options, register
from aegis_cli.probes.gemm import GemmCase, GemmProbe, case_bytes
from aegis_cli.report import DeviceReport, Report, new_report

DEFAULT_CPU_WORKLOAD = "cpu-quick"
DEFAULT_GPU_WORKLOAD = "llama3-70b"
MAX_RERUNS = 1000  # re-runs of one flagged case; a typo (--reruns 1000000) must not hang the scan

# progress(event, **info): "start" (total=cases), "case" (device, case), "device_done" (device, verdict)
Progress = Callable[..., None]


@dataclass
class ScanOptions:
    devices: str = "auto"
    workload: str | None = None  # None: cpu-quick on CPUs, llama3-70b on GPUs
    seed: int = 0
    reruns: int = 5
    inject: str | None = None
    case: str | None = None  # re-run exactly one case id from a report
    probes: tuple[str, ...] = DEFAULT_PROBES
    golden: str | None = None  # golden fingerprint file to compare against (probes that use it)
    probe_options: dict[str, str] = field(default_factory=dict)  # "probe.key" → value (--probe-option)
    thresholds: numerics.Thresholds = field(default_factory=numerics.Thresholds)
    command_line: list[str] = field(default_factory=list)
    # keep each flagged GEMM run as observed, for --save-vtasks (DeviceReport.captured); the scan
    # then also refuses up front what could not be saved (capture.check_savable)
    keep_flagged: bool = False

    def __post_init__(self) -> None:
        check_seed(self.seed)


def workload_for(opts: ScanOptions, device: Device) -> workloads.Workload:
    """The catalog a scan runs on ``device``: --workload, else the CPU or GPU default."""
    if opts.workload:
        wl = workloads.load(opts.workload)
    else:
        wl = workloads.load(DEFAULT_CPU_WORKLOAD if device.identity.backend == "cpu" else DEFAULT_GPU_WORKLOAD)
    load_all()
    if wl.name in PROBES or wl.name in NODE_PROBES:  # case ids start with the workload's name
        raise ConfigError(f"workload name {wl.name!r} is also a probe's: its case ids could not be re-run with --case")
    return wl


def plan_cases(wl: workloads.Workload, seed: int, case: str | None = None) -> list[GemmCase]:
    cases = [GemmCase(wl.name, shape, dist, seed) for shape in wl.gemms() for dist in wl.scan.distributions]
    if case is not None:
        cid = CaseId.parse(case)
        cases = [c for c in cases if cid.extends(c.group_id)]
        if not cases:
            raise ConfigError(f"case {case!r} is not in workload {wl.name!r} (case ids look like "
                              f"{wl.name}/OP/LAYOUT/DIST/MxNxK/s+0+0)")
        if cid not in [cases[0].group_id.with_scale(ea, eb) for ea, eb in wl.scan.scales]:
            # else the scan would run the base scale, ignore it and say HEALTHY
            raise ConfigError(f"case {case!r}: workload {wl.name!r} has no such scale (its scales: "
                              f"{', '.join(scale_token(ea, eb) for ea, eb in wl.scan.scales)})")
    return cases


@register("gemm")
def gemm_probe(device: Device, ctx: ProbeContext) -> list[Evidence]:
    """Checked training GEMMs across distributions and power-of-two scales."""
    opts = ctx.opts
    wl = workload_for(opts, device)
    ctx.stats["workload"] = wl.name
    probe = GemmProbe(device, opts.thresholds, reruns=opts.reruns, fault=ctx.fault, keep_flagged=opts.keep_flagged,
                      on_case=lambda cid: ctx.progress("case", device=device.identity.id, case=cid))
    evidence: list[Evidence] = []
    for case in plan_cases(wl, opts.seed, opts.case):
        evidence += probe.run(case, wl.scan.scales, only=opts.case)
    ctx.stats["gemm"] = probe.stats
    ctx.captured.update(probe.flagged_runs)
    return evidence


def scan_device(device: Device, opts: ScanOptions, fault: FaultPlan | None, progress: Progress) -> DeviceReport:
    """Every selected probe on one device; any failure of the device → ERROR, never HEALTHY
    (FAULTY when an earlier probe already confirmed corruption: its evidence is kept)."""
    t0 = time.time()
    dr = DeviceReport(identity=device.identity, verdict=Verdict.ERROR)
    ctx = ProbeContext(opts=opts, fault=fault, progress=progress)
    ran = Verdict.HEALTHY
    try:
        for name in opts.probes:
            if name in NODE_PROBES:
                continue  # node probes run once over all devices (run_node_probes)
            dr.evidence += PROBES[name](device, ctx)
    except AegisError as exc:
        if isinstance(exc, (ConfigError, GoldenError)):  # bad input, not the device: stop, exit 3
            raise
        dr.error, ran = str(exc), Verdict.ERROR
    except Exception as exc:  # a driver or runtime failure during checks: the device is not trusted
        dr.error, ran = f"{type(exc).__name__}: {exc}", Verdict.ERROR
    dr.verdict = worst([ran, *(e.severity for e in dr.evidence)])
    dr.workload = ctx.stats.pop("workload", "")
    dr.stats = ctx.stats.pop("gemm", None)
    dr.probe_stats = ctx.stats
    dr.captured = ctx.captured
    dr.seconds = time.time() - t0
    progress("device_done", device=device.identity.id, verdict=dr.verdict.value)
    return dr


def run_node_probes(devices: list[Device], reports: list[DeviceReport], opts: ScanOptions, plan: FaultPlan | None,
                    progress: Progress) -> None:
    """Node probes (e.g. crossdevice) over every scanned device; their evidence joins each
    device's report and can only worsen its verdict. A failure marks the devices ERROR (those
    already FAULTY stay FAULTY)."""
    by_id = {r.identity.id: r for r in reports}
    for name in (p for p in opts.probes if p in NODE_PROBES):
        ctx = ProbeContext(opts=opts, fault=plan, progress=progress)
        try:
            found = NODE_PROBES[name](devices, ctx)
        except ConfigError:
            raise
        except Exception as exc:  # a device failed during the node probe: none of them is trusted
            for r in reports:
                r.error = (r.error + "; " if r.error else "") + f"{name}: {type(exc).__name__}: {exc}"
                r.verdict = worst([r.verdict, Verdict.ERROR])
            continue
        for dev_id, evidence in found.items():
            r = by_id[dev_id]
            r.evidence += evidence
            r.verdict = worst([r.verdict, *(e.severity for e in evidence)])
            if name in ctx.stats:
                r.probe_stats[name] = ctx.stats[name]


def check_memory(opts: ScanOptions, devices: list[Device]) -> None:
    """Refuse, before any work, a GEMM case that could not fit in a device's memory: the OOM
    killer would end the scan with no report and no exit code of ours, and a CUDA out-of-memory
    error half-way would mark a sound GPU ERROR. Two cases, two remedies: the device is too
    small for the workload (lower its sizes), or other processes hold the memory now (retry
    when the device is idle). The memory probe's CPU buffer is checked against what is free too."""
    if "memory" in opts.probes:
        from aegis_cli.probes.memory import check_fits

        ctx = ProbeContext(opts=opts, fault=None, progress=lambda *a, **k: None)
        for d in devices:
            check_fits(d, ctx)
    if "gemm" not in opts.probes:
        return
    for d in devices:
        wl = workload_for(opts, d)
        big = max({c.shape for c in plan_cases(wl, opts.seed, opts.case)}, key=lambda s: case_bytes(s.m, s.n, s.k))
        need = case_bytes(big.m, big.n, big.k)
        short = memory_shortfall(d, need)
        if short is not None:
            remedy = "lower scan.max_tokens or the model's sizes" if short[0] == "small" else "run the scan when the device is idle"
            raise ConfigError(f"workload {wl.name!r}: its largest GEMM ({big.op} {big.layout.value} {big.m}x{big.n}x{big.k}) "
                              f"needs about {need / 2**30:.1f} GiB on {d.identity.id}, {short[1]}; {remedy}")


def check_savable(opts: ScanOptions, devices: list[Device]) -> None:
    """Refuse, before any work, GEMM cases whose vTasks no bundle could hold (capture.check_savable)."""
    from aegis_cli.vtask.capture import check_savable as savable
    from aegis_cli.vtask.model import GemmSpec

    for d in devices:
        wl = workload_for(opts, d)
        for case in plan_cases(wl, opts.seed, opts.case):
            s = case.shape
            savable(d.identity.id, GemmSpec(layout=s.layout, m=s.m, n=s.n, k=s.k, tile=tuple(d.tile)), s.op,
                    [case.case_id(ea, eb) for ea, eb in wl.scan.scales], tau=opts.thresholds.tau_for(d, s.k),
                    confirm_margin=opts.thresholds.confirm_margin, seed=case.seed, dist=case.dist)


def count_cases(opts: ScanOptions, devices: list[Device]) -> int:
    total = 0
    for d in devices:
        wl = workload_for(opts, d)
        if "gemm" in opts.probes:
            # a --case at a scale also runs the base scale it is checked against
            n_scales = (1 if CaseId.parse(opts.case).scale == (0, 0) else 2) if opts.case else len(wl.scan.scales)
            total += len(plan_cases(wl, opts.seed, opts.case)) * n_scales
    return total


def check_reruns(n: int, name: str = "--reruns") -> None:
    if not 1 <= n <= MAX_RERUNS:
        raise ConfigError(f"{name} must lie in 1…{MAX_RERUNS}, got {n}")


def run_scan(opts: ScanOptions, progress: Progress | None = None) -> Report:
    progress = progress or (lambda *a, **k: None)
    plan = FaultPlan.parse(opts.inject) if opts.inject else None
    check_reruns(opts.reruns)
    load_all()
    unknown = [p for p in opts.probes if p not in PROBES and p not in NODE_PROBES]
    if unknown:
        raise ConfigError(f"unknown probe(s) {', '.join(unknown)} (known: {', '.join(sorted([*PROBES, *NODE_PROBES]))})")
    parse_probe_options(opts.probe_options)
    probes = tuple(dict.fromkeys(opts.probes))  # each once: a repeat ran twice and doubled the evidence
    if not probes:
        raise ConfigError("no probes to run (--probes is empty): HEALTHY would mean nothing was checked")
    if opts.golden and "golden" not in probes:
        probes = (*probes, "golden")
    if "golden" in probes and not opts.golden:  # it would check nothing and add to a HEALTHY
        raise ConfigError("the golden probe compares against a golden file: give it with --golden FILE")
    if opts.case is not None:  # re-run one case: only the probe that owns it (ids start with its name)
        probes = (case_probe(opts.case),)
    opts = dataclasses.replace(opts, probes=probes)  # the caller's options stay as given
    devices = resolve_devices(opts.devices)
    if plan is not None:
        plan.check_devices([d.identity.id for d in devices])
    if set(probes) <= set(NODE_PROBES) and len(devices) < 2:
        raise ConfigError(f"{', '.join(probes)} compares devices with each other; with one device it checks nothing")
    check_memory(opts, devices)
    if "crossdevice" in probes:  # a case id it never gives, or nothing to compare: refuse before any work
        from aegis_cli.probes.crossdevice import selection

        selection(devices, ProbeContext(opts=opts, fault=None, progress=lambda *a, **k: None))
    if opts.keep_flagged:  # the caller saves the flagged cases as vTasks: refuse what it could not save
        check_savable(opts, devices)
    if opts.golden:
        from aegis_cli.probes import golden_file as golden

        golden.check_keys(golden.load(opts.golden), devices)  # refuse before any work
    report = new_report(opts)
    progress("start", total=count_cases(opts, devices), devices=[d.identity.id for d in devices])
    for device in devices:
        fault = plan.for_device(device.identity.id) if plan else None
        report.devices.append(scan_device(device, opts, fault, progress))
    run_node_probes(devices, report.devices, opts, plan, progress)
    if plan is not None:
        report.never_fired = plan.never_fired()
    report.finish()
    return report
