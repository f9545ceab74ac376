"""``aegis scan`` as a library call: options in, a Report out. Never prints.

Devices are scanned one after another in this process (each GPU is independent; fleet
sweeps run one worker process per GPU instead, see fleet/sweep.py).
"""

from __future__ import annotations

import dataclasses
import shlex
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from aegis_cli.backends import resolve_devices
from aegis_cli.backends.base import Device
from aegis_cli.backends.cpu import simulated_env
from aegis_cli.faults.spec import FaultPlan, parse_spec
from aegis_cli.ops import numerics
from aegis_cli.ops.case import check_seed
from aegis_cli.ops.errors import ConfigError
from aegis_cli.ops.verdict import Verdict, worst
from aegis_cli.probes import (
    CASE_COUNTS,
    DEFAULT_RERUNS,
    NODE_PROBES,
    PREFLIGHTS,
    PROBES,
    ProbeConfig,
    ProbeContext,
    case_probe,
    check_reruns,
    load_all,
    parse_probe_options,
    workload_for,
)
from aegis_cli.probes.gemm_scan import planned_runs
from aegis_cli.report import DeviceReport, Report, device_failures, new_report
from aegis_cli.vtask.capture import check_savable as savable
from aegis_cli.vtask.model import GemmSpec

MAX_IN_FULL = 1000  # evidence in full per probe: beyond it, a report of a device failing every launch grows without use

# progress(event, **info): "start" (total=cases), "case" (device, case), "device_done" (device, verdict)
Progress = Callable[..., None]


@dataclass(frozen=True)
class ScanOptions(ProbeConfig):
    """A scan's options: the ProbeConfig its probes read (seed, re-runs, ``--case``, probes and
    their options, thresholds, golden file, workload, fail-fast, evidence in full, keep_flagged)
    and what the scan alone reads: devices, faults to inject, command line. With ``keep_flagged``
    (--save-vtasks) the scan also refuses up front what could not be saved (check_savable)."""

    devices: str = "auto"
    inject: str | None = None
    command_line: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        check_seed(self.seed)
        if self.evidence_in_full is None or not 1 <= self.evidence_in_full <= MAX_IN_FULL:
            raise ConfigError(f"evidence in full must lie in 1…{MAX_IN_FULL} cases per probe, got {self.evidence_in_full}")

    def probe_config(self) -> ProbeConfig:
        """What the probes read of these options, and nothing else (no devices, no faults)."""
        given = {f.name: getattr(self, f.name) for f in dataclasses.fields(ProbeConfig)}
        return ProbeConfig(**{**given, "probes": tuple(self.probes), "probe_options": dict(self.probe_options)})


def _quiet(*_args, **_info) -> None:
    """A progress callback that shows nothing."""


def scan_device(device: Device, opts: ScanOptions, fault: FaultPlan | None, progress: Progress) -> DeviceReport:
    """Every selected probe on one device; any failure of the device → ERROR, never HEALTHY
    (FAULTY when an earlier probe already confirmed corruption: its evidence is kept)."""
    t0 = time.time()
    dr = DeviceReport(identity=device.identity, verdict=Verdict.ERROR)
    total, counted = count_cases(opts, [device]), 0  # progress("case") events due from this device, and sent

    def count(event: str, **info) -> None:
        nonlocal counted
        counted += event == "case"
        progress(event, **info)

    ctx = ProbeContext(config=opts.probe_config(), fault=fault, progress=count)
    tally = ctx.tally
    with device_failures(dr):
        for i, name in enumerate(opts.probes):
            if name in NODE_PROBES:
                continue  # node probes run once over all devices (run_node_probes)
            found = PROBES[name](device, ctx)
            dr.evidence += found
            first = next((e for e in found if e.severity is Verdict.FAULTY), None)
            if first is not None and tally.stop(first.case_id):  # fail-fast: the later probes are skipped
                tally.skipped_probes += list(opts.probes[i + 1:])
                break
    dr.judge()
    dr.workload = ctx.stats.pop("workload", "")
    dr.stats = ctx.stats.pop("gemm", None)
    dr.probe_stats = ctx.stats
    dr.captured = ctx.captured
    dr.tally = tally
    dr.seconds = time.time() - t0
    for _ in range(total - counted):  # the cases fail-fast skipped or a failure left unrun: the total adds up
        progress("case", device=device.identity.id, case="skipped")
    progress("device_done", device=device.identity.id, verdict=dr.verdict.value)
    return dr


def run_node_probes(devices: list[Device], reports: list[DeviceReport], opts: ScanOptions, plan: FaultPlan | None,
                    progress: Progress) -> None:
    """Node probes (e.g. crossdevice) over every scanned device; their evidence joins each
    device's report and can only worsen its verdict. A failure marks the devices ERROR (those
    already FAULTY stay FAULTY)."""
    by_id = {r.identity.id: r for r in reports}
    config = opts.probe_config()
    stopped = {r.identity.id for r in reports if r.tally is not None and r.tally.stopped}  # fail-fast
    devices = [d for d in devices if d.identity.id not in stopped]
    reports = [r for r in reports if r.identity.id not in stopped]
    for name in (p for p in opts.probes if p in NODE_PROBES):
        if stopped and len(devices) < 2:  # fail-fast left nothing to compare with: named as skipped
            for r in reports:
                r.tally.skipped_probes.append(name)
            continue
        ctx = ProbeContext(config=config, fault=plan, progress=progress)
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


def preflight(opts: ScanOptions, devices: list[Device]) -> None:
    """Refuse, before any work, what a selected probe could not do on ``devices``: each probe's
    own preflight (probes.PREFLIGHTS: memory that would not fit, a case it never gives, a golden
    file without these devices, nothing to compare), in the order of ``opts.probes``."""
    ctx = ProbeContext(config=opts.probe_config(), fault=None, progress=_quiet)
    for name in opts.probes:
        if name in PREFLIGHTS:
            PREFLIGHTS[name](devices, ctx)



def check_savable(opts: ScanOptions, devices: list[Device]) -> None:
    """Refuse, before any work, GEMM cases whose vTasks no bundle could hold (capture.check_savable):
    those the gemm probe will run, at the scales it runs them (``gemm.shift``, ``--case``)."""
    config = opts.probe_config()
    if "gemm" not in opts.probes:  # attention cases are saved whatever their shape (vtask/attention.py)
        return
    for d in devices:
        for case, ids in planned_runs(workload_for(config, d), config):
            s = case.shape
            savable(d.identity.id, GemmSpec(layout=s.layout, m=s.m, n=s.n, k=s.k, tile=tuple(d.tile)), s.op, ids,
                    tau=opts.thresholds.tau, confirm_margin=opts.thresholds.confirm_margin, seed=case.seed, dist=case.dist)


def count_cases(opts: ScanOptions, devices: list[Device]) -> int:
    """The progress total: the cases the selected probes will count with progress("case")."""
    config = opts.probe_config()
    return sum(CASE_COUNTS[name](devices, config) for name in opts.probes if name in CASE_COUNTS)


def scan_thresholds(tau: float | None, margin: float | None) -> numerics.Thresholds:
    """The default thresholds with the given ``--threshold`` / ``--confirm-margin`` (None: default)."""
    given = {"tau": tau, "confirm_margin": margin}
    return dataclasses.replace(numerics.Thresholds(), **{k: v for k, v in given.items() if v is not None})


def run_scan(opts: ScanOptions, progress: Progress | None = None) -> Report:
    progress = progress or _quiet
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
    preflight(opts, devices)
    if opts.keep_flagged:  # the caller saves the flagged cases as vTasks: refuse what it could not save
        check_savable(opts, devices)
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


def rerun_commands(doc: dict) -> list[str]:
    """For each device with evidence, the scan command that re-runs its first case exactly as it
    was judged: seed, device(s), workload, golden file, the case's probe options, thresholds
    (repr: ``:g`` rounded them), re-runs and injected faults; defaults left out. No --probes:
    --case runs the probe that owns the case and nothing else (run_scan)."""
    load_all()
    o, th, q = doc.get("options") or {}, numerics.Thresholds(), shlex.quote
    scanned = [d["device"]["id"] for d in doc["devices"]]
    faults = [f for spec in doc.get("injected") or [] for f in parse_spec(spec)]
    commands = []
    for d in doc["devices"]:
        if not d["evidence"]:
            continue
        case = d["evidence"][0]["case_id"]
        probe = case_probe(case)
        devices = [d["device"]["id"]]
        # a node probe compares them all; and faults aimed at other devices keep their places in
        # the --inject spec (the seeds of their positions) only when those devices are scanned too
        if probe in NODE_PROBES or any(f.params.get("device") not in (None, *devices) for f in faults):
            devices = scanned
        parts = [f"{simulated_env(devices)}aegis scan", f"--seed {doc['seed']}", f"--device {q(','.join(devices))}"]
        if o.get("workload"):
            parts.append(f"--workload {q(str(o['workload']))}")
        if o.get("golden"):
            parts.append(f"--golden {q(str(o['golden']))}")
        for key, value in (o.get("probe_options") or {}).items():
            if key.split(".", 1)[0] == probe:
                parts.append(f"--probe-option {q(f'{key}={value}')}")
        if o.get("threshold") not in (None, th.tau):
            parts.append(f"--threshold {o['threshold']!r}")
        if o.get("confirm_margin") not in (None, th.confirm_margin):
            parts.append(f"--confirm-margin {o['confirm_margin']!r}")
        if o.get("reruns") not in (None, DEFAULT_RERUNS):
            parts.append(f"--reruns {o['reruns']}")
        parts += [f"--inject {q(spec)}" for spec in doc.get("injected") or []]
        parts.append(f"--case {q(case)}")
        commands.append(" ".join(parts))
    return list(dict.fromkeys(commands))  # devices that share a case and device list share its command
