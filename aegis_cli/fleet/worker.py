"""The per-device sweep worker: ``python -m aegis_cli.fleet.worker SPEC.json``.

One process per device, so a device that hangs or crashes its process costs only its own
result (the sweep kills the worker at its timeout and records ERROR). The spec names the
device, the scan options, the previously failing cases to run first, and where to write:
``OUT.partial.json`` after the priority cases, ``OUT`` (a device report, the JSON of
DeviceReport plus ``probes.fleet_fingerprint``) at the end. Log lines go to stderr.

Test hooks (never active unless asked for in ``inject``): ``hang:seconds=N`` sleeps before
scanning (``when=replay``: before replaying vTasks), ``crash:signal=S`` kills the worker
(aegis_cli.faults.spec.WORKER_MODELS).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import sys
import time
from dataclasses import replace

from aegis_cli import report as report_mod
from aegis_cli.backends.threads import apply_thread_policy
from aegis_cli.faults.spec import WORKER_MODELS, FaultPlan, parse_spec
from aegis_cli.fleet.compare import PROBE_KEY, fingerprint_class
from aegis_cli.fleet.logs import log_line
from aegis_cli.ops import files, provenance
from aegis_cli.ops.errors import AegisError, ConfigError
from aegis_cli.ops.verdict import worst


def log(event: str, **kv) -> None:
    print(log_line(event, **kv), file=sys.stderr, flush=True)  # to the worker's log file, as the sweep writes


def _die_with_parent() -> None:
    """Linux: SIGKILL this worker when the sweep that started it dies (even by SIGKILL). If it
    died before the signal was armed, the parent is no longer the sweep (whose pid the sweep
    passes: "parent is pid 1" would be wrong when the sweep itself is pid 1 in a container)."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    sweep = os.environ.get("AEGIS_SWEEP_PID", "")
    if sweep.isdecimal() and os.getppid() != int(sweep):
        os._exit(3)


def fleet_fingerprints(device, wl, seed: int, fault: FaultPlan | None, limit: int) -> dict[str, str]:
    """Output and accumulator-checksum fingerprints of the first ``limit`` seeded cases at
    scale (0, 0): the same bits on every identical device (compared by fleet/compare.py)."""
    from aegis_cli.probes.gemm_scan import plan_cases

    out = {}
    for case in plan_cases(wl, seed)[:limit]:
        cid = case.case_id(0, 0)
        res = device.checked_gemm(case.operands(device), fault, op=cid)
        out[cid] = f"{device.fingerprint(res.c):016x}{device.fingerprint(res.row_sums):016x}"
    return out


def run(spec: dict) -> dict:
    from aegis_cli.backends import resolve_devices
    from aegis_cli.probes import load_all, workload_for
    from aegis_cli.scan import ScanOptions, preflight, scan_device

    device_id = spec["device"]
    hooks, faults, slots = [], [], []
    if spec.get("inject"):
        for slot, f in enumerate(parse_spec(spec["inject"], worker=True)):
            if f.params.get("device") not in (None, device_id):
                continue
            if f.model in WORKER_MODELS:
                hooks.append(f)
            else:  # seeded by its place in the whole spec, as in a scan (FaultPlan.slots)
                faults.append(f)
                slots.append(slot)
    _fire_hooks(hooks, device_id, "scan")
    load_all()
    (device,) = resolve_devices(device_id)
    inject = ";".join(str(f) for f in faults) or None
    opts = ScanOptions(devices=device_id, workload=spec.get("workload"), seed=spec.get("seed", 0), reruns=spec.get("reruns", 3),
                       inject=inject, probes=tuple(spec.get("probes") or ("gemm",)), probe_options=dict(spec.get("probe_options") or {}),
                       command_line=spec.get("command_line", []), fail_fast=spec.get("fail_fast", False))
    preflight(opts, [device])  # a workload that cannot fit: one line, exit 3, before any work
    plan = FaultPlan(faults, slots=slots) if faults else None
    quiet = lambda *a, **k: None
    priority = {"cases": list(spec.get("priority_cases") or []), "verdicts": {}}
    t0 = time.time()
    pre = []
    seeds = spec.get("priority_seeds") or {}
    for cid in priority["cases"]:
        try:
            dr = scan_device(device, _as_judged(opts, cid, seeds.get(cid, opts.seed), device), plan and plan.for_device(device_id), quiet)
        except ConfigError as exc:  # a case from history this configuration no longer has
            priority["verdicts"][cid] = f"not run: {exc}"
            log("priority_case_skipped", device=device_id, case=cid, reason=str(exc))
            continue
        priority["verdicts"][cid] = dr.verdict.value
        pre.append(dr)
        log("priority_case", device=device_id, case=cid, verdict=dr.verdict.value)
    if pre:
        partial = pre[0].to_dict(opts.thresholds.tau)
        partial["evidence"] = [e for dr in pre for e in dr.to_dict(opts.thresholds.tau)["evidence"]]
        partial["verdict"] = worst(dr.verdict for dr in pre).value
        partial["probes"]["sweep"] = {"priority": priority, "full_scan": "not finished"}
        files.atomic_write(spec["output"] + ".partial.json", report_mod.render(partial, "json"))
    dr = scan_device(device, opts, plan and plan.for_device(device_id), quiet)
    _keep_priority_findings(dr, pre)
    if spec.get("soak") and dr.tally is not None and dr.tally.stopped:  # fail-fast: the device is FAULTY already
        dr.tally.skipped_probes.append("soak")
    elif spec.get("soak"):  # sweep.yaml soak: a checked burn-in after the probes (docs/soak.md)
        from aegis_cli.soak.record import parse_duration
        from aegis_cli.soak.run import SoakOptions, soak_after

        soak_after(dr, device, SoakOptions(seconds=parse_duration(spec["soak"], "soak:"), devices=device_id, workload=opts.workload,
                                           seed=opts.seed, reruns=opts.reruns, thresholds=opts.thresholds,
                                           command_line=opts.command_line), plan and plan.for_device(device_id))
    doc = dr.to_dict(opts.thresholds.tau)
    log("scanned", device=device_id, verdict=dr.verdict.value, seconds=round(time.time() - t0, 2))
    limit = int(spec.get("fingerprint_cases", 12))
    if limit > 0 and dr.verdict.value != "ERROR":
        wl = workload_for(opts.probe_config(), device)
        try:
            fps = fleet_fingerprints(device, wl, opts.seed, plan and plan.for_device(device_id), limit)
            doc["probes"][PROBE_KEY] = {"class": fingerprint_class(doc["device"], provenance.versions(), report_mod.kernel_hashes(),
                                                                   wl.name, opts.seed), "seed": opts.seed, "fingerprints": fps}
        except Exception as exc:  # the comparison is extra: a failure here is recorded, not fatal
            doc["probes"][PROBE_KEY] = {"error": f"{type(exc).__name__}: {exc}"}
    doc["probes"]["sweep"] = {"priority": priority, "full_scan": "completed", "worker_seconds": round(time.time() - t0, 3)}
    if spec.get("vtasks"):  # captured vTasks (a training job's sensors, a scan's --save-vtasks) replayed here
        from aegis_cli.fleet.vtasks import replay_directory

        # the scan is done: a bundle whose replay outlasts the device's timeout must not cost its verdict
        files.atomic_write(spec["output"] + ".scanned.json", report_mod.render(doc, "json"))
        _fire_hooks(hooks, device_id, "replay")
        doc["probes"]["vtasks"] = replay_directory(device, spec["vtasks"], log)
    return doc


def _fire_hooks(hooks: list, device_id: str, when: str) -> None:
    """The test hooks of phase ``when`` ("scan": before scanning, the default; "replay": before
    replaying vTasks, hang only)."""
    for f in hooks:
        if f.params.get("when", "scan") != when:
            continue
        log("test_hook", device=device_id, hook=str(f))
        if f.model == "hang":
            time.sleep(float(f.params["seconds"]))
        elif f.model == "crash":
            os.kill(os.getpid(), int(f.params.get("signal", "9")))


def _as_judged(opts, cid: str, seed: int, device):
    """The options that re-run ``cid`` as it failed before: with its sweep's seed (every sweep
    draws new inputs) and, for a GEMM case at a dithered scale, the gemm shift that gives it."""
    from aegis_cli.ops.case import CaseId
    from aegis_cli.probes import workload_for
    from aegis_cli.probes.gemm_scan import scales_for

    o = replace(opts, case=cid, seed=seed)
    scale = CaseId.parse(cid).scale
    if scale is None or scale == (0, 0):
        return o
    wl = workload_for(o.probe_config(), device)
    base = next(([a, b] for a, b in wl.scan.scales if (a, b) != (0, 0)), None)
    if base is None or list(scale) in scales_for(wl, o.probe_config()):
        return o
    return replace(o, probe_options={**o.probe_options, "gemm.shift": f"{scale[0] - base[0]},{scale[1] - base[1]}"})


def _keep_priority_findings(dr, pre: list) -> None:
    """Fold the priority re-runs into the full scan's report: an intermittent fault that a
    priority case caught again and the full scan happened to miss must not end as HEALTHY."""
    seen = {(e.check, e.case_id) for e in dr.evidence}
    for p in pre:
        dr.evidence += [e for e in p.evidence if (e.check, e.case_id) not in seen]
        seen |= {(e.check, e.case_id) for e in p.evidence}
        if p.error:
            dr.error = (dr.error + "; " if dr.error else "") + f"priority case: {p.error}"
    dr.verdict = worst([dr.verdict, *(p.verdict for p in pre)])


def main(argv: list[str]) -> int:
    _die_with_parent()
    if len(argv) != 1:
        print("usage: python -m aegis_cli.fleet.worker SPEC.json", file=sys.stderr)
        return 3
    with open(argv[0], encoding="utf-8") as fh:
        spec = json.load(fh)
    log("worker_start", device=spec["device"], pid=os.getpid())
    try:
        apply_thread_policy()  # its share of the cores (AEGIS_THREADS from the sweep)
        doc = run(spec)
    except AegisError as exc:
        print(f"Error: {exc}", file=sys.stderr, flush=True)
        return 3
    files.atomic_write(spec["output"], report_mod.render(doc, "json"))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
