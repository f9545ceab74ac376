"""``aegis scan`` as a library call: options in, a Report out. Never prints.

Devices are scanned one after another in this process (each GPU is independent; fleet
sweeps run one worker process per GPU instead, see fleet/sweep.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from aegis_cli import numerics, workloads
from aegis_cli.backends import resolve_devices
from aegis_cli.backends.base import Device
from aegis_cli.errors import AegisError, ConfigError
from aegis_cli.inject import FaultPlan
from aegis_cli.probes.gemm import GemmCase, GemmProbe
from aegis_cli.report import DeviceReport, Report, new_report
from aegis_cli.verdict import Evidence, Verdict, worst

DEFAULT_CPU_WORKLOAD = "cpu-quick"
DEFAULT_GPU_WORKLOAD = "llama3-70b"

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
    thresholds: numerics.Thresholds = field(default_factory=numerics.Thresholds)
    command_line: list[str] = field(default_factory=list)


def _workload_for(opts: ScanOptions, device: Device) -> workloads.Workload:
    if opts.workload:
        return workloads.load(opts.workload)
    return workloads.load(DEFAULT_CPU_WORKLOAD if device.identity.backend == "cpu" else DEFAULT_GPU_WORKLOAD)


def plan_cases(wl: workloads.Workload, seed: int, case: str | None = None) -> list[GemmCase]:
    cases = [GemmCase(wl.name, shape, dist, seed) for shape in wl.gemms() for dist in wl.scan.distributions]
    if case is not None:
        cases = [c for c in cases if case.startswith(c.group_id + "/")]
        if not cases:
            raise ConfigError(f"case {case!r} is not in workload {wl.name!r} (case ids look like "
                              f"{wl.name}/OP/LAYOUT/DIST/MxNxK/s+0+0)")
    return cases


def scan_device(device: Device, opts: ScanOptions, fault: FaultPlan | None, progress: Progress) -> DeviceReport:
    """Every case of the device's workload; any failure of the device → ERROR, never HEALTHY."""
    t0 = time.time()
    dr = DeviceReport(identity=device.identity, verdict=Verdict.ERROR)
    try:
        wl = _workload_for(opts, device)
        dr.workload = wl.name
        cases = plan_cases(wl, opts.seed, opts.case)
        scales = wl.scan.scales
        probe = GemmProbe(device, opts.thresholds, reruns=opts.reruns, fault=fault,
                          on_case=lambda cid: progress("case", device=device.identity.id, case=cid))
        evidence: list[Evidence] = []
        for case in cases:
            evidence += probe.run(case, scales, only=opts.case)
        dr.evidence = evidence
        dr.stats = probe.stats
        dr.verdict = worst([Verdict.HEALTHY, *(e.severity for e in evidence)])
    except AegisError as exc:
        if isinstance(exc, ConfigError):
            raise
        dr.error = str(exc)
    except Exception as exc:  # a driver or runtime failure during checks: the device is not trusted
        dr.error = f"{type(exc).__name__}: {exc}"
    dr.seconds = time.time() - t0
    progress("device_done", device=device.identity.id, verdict=dr.verdict.value)
    return dr


def count_cases(opts: ScanOptions, devices: list[Device]) -> int:
    total = 0
    for d in devices:
        wl = _workload_for(opts, d)
        n_scales = 1 if opts.case else len(wl.scan.scales)
        total += len(plan_cases(wl, opts.seed, opts.case)) * n_scales
    return total


def run_scan(opts: ScanOptions, progress: Progress | None = None) -> Report:
    progress = progress or (lambda *a, **k: None)
    plan = FaultPlan.parse(opts.inject) if opts.inject else None
    if opts.reruns < 1:
        raise ConfigError(f"--reruns must be ≥ 1, got {opts.reruns}")
    devices = resolve_devices(opts.devices)
    report = new_report(opts)
    progress("start", total=count_cases(opts, devices), devices=[d.identity.id for d in devices])
    for device in devices:
        fault = plan.for_device(device.identity.id) if plan else None
        report.devices.append(scan_device(device, opts, fault, progress))
    report.finish()
    return report
