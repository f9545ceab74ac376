"""``aegis sweep``: a scheduled, non-interactive sweep of every local device.

    lock → open history (refuse a corrupt one before any work) → plan (order devices and
    cases by past failures) → one worker process per device, in parallel, each with a
    timeout inside the sweep's budget → one report → history (one transaction) → policy →
    actions and exports (quarantine list, Prometheus textfile, commands)

A device whose worker hangs past its timeout or dies gets ERROR; the others finish.
When the budget is short (a device's past full scans took longer than the time it has),
the cases that failed on it before run first, so the sweep's answer for the devices that
matter most comes even if the full scan cannot finish.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from aegis_cli import report as report_mod
from aegis_cli.backends.base import node_name
from aegis_cli.fleet import statefiles
from aegis_cli.fleet.actions import ActionRecord, ActionsConfig, prometheus_text, run_actions, transitions, write_quarantine_list
from aegis_cli.fleet.history import History, ResultRow
from aegis_cli.fleet.lock import SweepLock
from aegis_cli.fleet.policy import DAY, DeviceState, PolicyConfig, check_positive, drop_retired, evaluate_all
from aegis_cli.ops import config as config_mod
from aegis_cli.ops import files
from aegis_cli.ops.errors import AegisError, ConfigError
from aegis_cli.ops.verdict import Verdict, overall_exit

Log = Callable[..., None]  # log(event, level="info", **fields)
Stop = Callable[[], "str | None"]  # returns why the sweep must stop (e.g. "SIGTERM"), or None


def log_line(event: str, level: str = "info", fmt: str = "logfmt", **kv) -> str:
    """One structured log line (logfmt, or a JSON object with ``fmt="json"``), local time with offset."""
    ts = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    if fmt == "json":
        return json.dumps({"ts": ts, "level": level, "event": event, **kv}, default=str)
    parts = [f"ts={ts}", f"level={level}", f"event={event}"]
    for k, v in kv.items():
        v = "" if v is None else str(v)
        quote = not v or any(c in v for c in ' ="')
        parts.append(f"{k}={json.dumps(v, ensure_ascii=False) if quote else v}")
    return " ".join(parts)


class SweepInterrupted(AegisError):
    """The sweep was asked to stop (SIGTERM, SIGINT): workers killed, nothing recorded."""


@dataclass(kw_only=True)
class HistoryConfig:
    path: str = "/var/lib/aegis/history.sqlite"
    busy_timeout_seconds: float = 30.0

    def __post_init__(self) -> None:
        check_positive("history.busy_timeout_seconds", self.busy_timeout_seconds, zero_ok=True)


@dataclass(kw_only=True)
class ExportsConfig:
    report: str | None = None  # this sweep's JSON report
    quarantine_list: str | None = None  # TSV, or JSON when the name ends in .json
    prometheus_textfile: str | None = None  # e.g. /var/lib/node_exporter/textfile_collector/aegis.prom


@dataclass(kw_only=True)
class DistributedConfig:
    mode: str = "auto"  # auto: distributed when RANK/WORLD_SIZE/MASTER_ADDR are set; off: never
    backend: str = "auto"  # auto: nccl when CUDA is usable, else gloo
    timeout_seconds: float = 600.0
    fleet_report: str | None = None  # written by rank 0

    def __post_init__(self) -> None:
        if self.mode not in ("auto", "off"):
            raise ConfigError(f"distributed.mode must be auto or off, got {self.mode!r}")
        if self.backend not in ("auto", "nccl", "gloo"):
            raise ConfigError(f"distributed.backend must be auto, nccl or gloo, got {self.backend!r}")
        check_positive("distributed.timeout_seconds", self.timeout_seconds)


@dataclass(kw_only=True)
class SweepConfig:
    devices: str = "auto"
    workload: str | None = None
    probes: list[str] = field(default_factory=lambda: ["gemm"])
    seed: int = 0
    reruns: int = 3
    budget_seconds: float = 3600.0
    device_timeout_seconds: float = 1800.0
    max_parallel: int = 0  # 0: one worker per device, all at once
    prioritize: bool = True
    fingerprint_cases: int = 12
    lock_file: str = "/var/lib/aegis/sweep.lock"
    inject: str | None = None  # self-test only: faults (and worker test hooks) to inject
    history: HistoryConfig = field(default_factory=HistoryConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    exports: ExportsConfig = field(default_factory=ExportsConfig)
    actions: ActionsConfig = field(default_factory=ActionsConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    source: str = ""

    def __post_init__(self) -> None:
        check_positive("budget_seconds", self.budget_seconds)
        check_positive("device_timeout_seconds", self.device_timeout_seconds)
        from aegis_cli.ops.case import check_seed
        from aegis_cli.scan import check_reruns

        check_reruns(self.reruns, "reruns")

        check_seed(self.seed)
        self._check_probes()
        if self.max_parallel < 0 or self.fingerprint_cases < 0:
            raise ConfigError("max_parallel and fingerprint_cases must be ≥ 0")
        if self.inject:
            from aegis_cli.faults.spec import parse_spec

            parse_spec(self.inject, worker=True)

    def _check_probes(self) -> None:
        """Refuse, before any worker starts, probes a worker cannot run: otherwise every device
        would record ERROR (a typo) or HEALTHY with nothing checked (a node probe)."""
        from aegis_cli.probes import NODE_PROBES, PROBES, load_all

        load_all()
        runnable = sorted(p for p in PROBES if p != "golden")
        if not self.probes:
            raise ConfigError(f"probes is empty: no probes to run, so HEALTHY would mean nothing was checked "
                              f"(a sweep runs {', '.join(runnable)})")
        for p in self.probes:
            if p in NODE_PROBES:
                raise ConfigError(f"probes: {p} is a node probe, and each sweep worker scans one device; "
                                  f"a sweep compares devices through fingerprint_cases instead")
            if p == "golden":
                raise ConfigError("probes: golden compares against a golden file, which a sweep does not take "
                                  "(aegis scan --golden FILE)")
            if p not in PROBES:
                raise ConfigError(f"probes: unknown probe {p!r} (a sweep runs {', '.join(runnable)})")


def load_config(path: str | os.PathLike) -> SweepConfig:
    """sweep.yaml → SweepConfig; relative paths are taken relative to the file."""
    path = Path(path)
    data = config_mod.load_yaml(path)
    try:
        cfg = config_mod.from_dict(SweepConfig, data, str(path))
    except ConfigError as exc:
        msg = str(exc)
        raise ConfigError(msg if msg.startswith(str(path)) else f"{path}: {msg}") from None
    base = path.resolve().parent

    def rel(p: str | None) -> str | None:
        return None if p is None else str(base / os.path.expanduser(p))

    cfg.lock_file = rel(cfg.lock_file)
    cfg.history.path = rel(cfg.history.path)
    for key in ("report", "quarantine_list", "prometheus_textfile"):
        setattr(cfg.exports, key, rel(getattr(cfg.exports, key)))
    cfg.distributed.fleet_report = rel(cfg.distributed.fleet_report)
    if cfg.workload and (cfg.workload.endswith((".yaml", ".yml"))) and not os.path.isabs(cfg.workload):
        cfg.workload = str(base / cfg.workload)
    if cfg.workload:  # a typo here would otherwise be ERROR in the history of every device
        from aegis_cli.ops import workloads

        try:
            workloads.load(cfg.workload)
        except ConfigError as exc:
            raise ConfigError(f"{path}: workload: {exc}") from None
    cfg.source = str(path)
    return cfg


@dataclass
class SweepOutcome:
    doc: dict
    states: dict[str, DeviceState]
    actions: list[ActionRecord]
    exit_code: int
    fleet: dict | None = None  # distributed mode: the fleet report (rank 0) or None


# -- planning ------------------------------------------------------------------------------
@dataclass
class DevicePlan:
    device_id: str
    uuid: str
    priority_cases: list[str]
    probes: list[str]
    failures: int
    estimate: float | None


def plan_devices(cfg: SweepConfig, identities: list[dict], rows: list[ResultRow], now: float) -> list[DevicePlan]:
    """Order devices (most past failures first) and pick, per device, the cases that
    failed before within the policy window; they run first when the budget is short."""
    window = now - cfg.policy.window_days * DAY
    allowed = min(cfg.device_timeout_seconds, cfg.budget_seconds)
    plans = []
    for ident in identities:
        mine = [r for r in rows if r.uuid == ident["uuid"]]
        recent_bad = [r for r in mine if r.ts >= window and r.verdict in ("SUSPECT", "FAULTY")]
        cases: list[str] = []
        for r in reversed(recent_bad):
            cases += [c for c in r.cases if c not in cases]
        done = [r.seconds for r in mine if r.verdict != "ERROR" and r.seconds][-5:]
        estimate = statistics.median(done) if done else None
        # a device whose last scans ran out of time is short of it, whatever its earlier scans took
        timed_out = any(r.verdict == "ERROR" and "timed out" in (r.error or "") for r in mine[-3:])
        short = timed_out or (estimate is not None and estimate > allowed)
        failed_probes = {c.split(".")[0] for r in recent_bad for c in r.checks}
        probes = sorted(cfg.probes, key=lambda p: p not in failed_probes)
        plans.append(DevicePlan(ident["id"], ident["uuid"], cases[:16] if cfg.prioritize and short else [], probes,
                                len(recent_bad), estimate))
    if cfg.prioritize:
        plans.sort(key=lambda p: -p.failures)
    return plans


# -- workers -------------------------------------------------------------------------------
@dataclass
class _Worker:
    plan: DevicePlan
    identity: dict
    out: str
    errlog: str
    proc: subprocess.Popen | None = None
    started: float = 0.0
    deadline: float = 0.0


def _error_doc(identity: dict, message: str, seconds: float, partial: dict | None = None) -> dict:
    doc = {"device": identity, "verdict": "ERROR", "workload": "", "error": message, "evidence": [], "stats": None,
           "noise": None, "probes": {}, "timings": {"seconds": round(seconds, 3), "gemm_tflops": None}}
    if partial and partial.get("verdict") in ("SUSPECT", "FAULTY"):
        # the previously failing cases re-ran and failed again: that finding stands
        doc.update({k: partial[k] for k in ("workload", "evidence", "probes") if k in partial})
        doc["verdict"] = partial["verdict"]
    return doc


def _tail(path: str, n: int = 3) -> str:
    """The last lines a worker wrote to stderr, its own structured log lines left out when
    anything else is there (an error message, a traceback)."""
    try:
        lines = [ln for ln in Path(path).read_text(encoding="utf-8", errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    other = [ln for ln in lines if not ln.startswith("ts=")]
    return " | ".join((other or lines)[-n:])


def _kill(w: _Worker) -> None:
    if w.proc is not None and w.proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(w.proc.pid, signal.SIGKILL)
        w.proc.wait()


def run_workers(cfg: SweepConfig, plans: list[DevicePlan], identities: dict[str, dict], deadline: float, log: Log,
                env: dict[str, str] | None = None, stop: Stop | None = None) -> list[dict]:
    """One worker process per device (at most ``max_parallel`` at once); device reports in
    ``plans`` order. Workers are killed on timeout, on the sweep's deadline and on exit."""
    stop = stop or (lambda: None)
    # removed after (the reports are read by now; the workers' logs live on only in the sweep's
    # log), and by the next sweep when this one is killed
    with files.work_dir("aegis-sweep-") as tmp:
        return _run_workers(cfg, plans, identities, deadline, log, env, stop, tmp)


def _worker_env(extra: dict[str, str] | None) -> dict[str, str]:
    """The worker's environment: it must import the aegis this sweep runs. ``python -m`` puts
    the working directory first on sys.path, so workers start in their temp folder (an old
    checkout in the sweep's directory would otherwise shadow the installed package), with the
    running package's root and absolute PYTHONPATH entries in front."""
    env = {**os.environ, **(extra or {}), "AEGIS_SWEEP_PID": str(os.getpid())}
    root = str(Path(__file__).resolve().parents[2])
    paths = [os.path.abspath(p) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys([root, *paths]))
    return env


def _run_workers(cfg: SweepConfig, plans: list[DevicePlan], identities: dict[str, dict], deadline: float, log: Log,
                 env: dict[str, str] | None, stop: Stop, tmp: str) -> list[dict]:
    workers = [_Worker(p, identities[p.device_id], os.path.join(tmp, f"{i}.json"), os.path.join(tmp, f"{i}.log"))
               for i, p in enumerate(plans)]
    pending, running, results = list(workers), [], {}
    limit = cfg.max_parallel or len(workers)
    try:
        while pending or running:
            why = stop()
            if why:
                raise SweepInterrupted(f"sweep stopped by {why}: {len(running)} worker(s) killed, nothing of this sweep recorded")
            while pending and len(running) < limit:
                w = pending.pop(0)
                now = time.time()
                if now >= deadline:
                    results[w.plan.device_id] = _error_doc(w.identity, "not started: the sweep's time budget ran out", 0.0)
                    log("device_skipped", level="warning", device=w.plan.device_id, reason="budget")
                    continue
                spec = {"device": w.plan.device_id, "workload": cfg.workload, "seed": cfg.seed, "reruns": cfg.reruns,
                        "probes": w.plan.probes, "inject": cfg.inject, "priority_cases": w.plan.priority_cases,
                        "fingerprint_cases": cfg.fingerprint_cases, "output": w.out,
                        "command_line": ["aegis", "sweep", "--config", cfg.source]}
                spec_path = w.out + ".spec"
                Path(spec_path).write_text(json.dumps(spec), encoding="utf-8")
                with open(w.errlog, "wb") as errfh:
                    w.proc = subprocess.Popen([sys.executable, "-m", "aegis_cli.fleet.worker", spec_path], stdin=subprocess.DEVNULL,
                                              stdout=subprocess.DEVNULL, stderr=errfh, start_new_session=True, cwd=tmp,
                                              env=_worker_env(env))
                w.started = now
                w.deadline = min(now + cfg.device_timeout_seconds, deadline)
                running.append(w)
                log("device_start", device=w.plan.device_id, uuid=w.plan.uuid, pid=w.proc.pid,
                    timeout=round(w.deadline - now, 1), priority_cases=len(w.plan.priority_cases))
            time.sleep(0.05)
            for w in list(running):
                rc = w.proc.poll()
                now = time.time()
                if rc is None and now < w.deadline:
                    continue
                running.remove(w)
                took = now - w.started
                if rc is None:
                    _kill(w)
                    partial = _read(w.out + ".partial.json")
                    why = "device timeout" if w.deadline < deadline else "sweep budget"
                    doc = _error_doc(w.identity, f"worker timed out after {took:.0f} s ({why}); killed", took, partial)
                    log("device_timeout", level="error", device=w.plan.device_id, seconds=round(took, 1), verdict=doc["verdict"])
                else:
                    doc = _read(w.out) if rc == 0 else None
                    if doc is None:
                        how = f"killed by signal {-rc}" if rc < 0 else f"exit status {rc}"
                        tail = _tail(w.errlog)
                        doc = _error_doc(w.identity, f"worker failed ({how})" + (f": {tail}" if tail else ""), took,
                                         _read(w.out + ".partial.json"))
                        log("device_failed", level="error", device=w.plan.device_id, rc=rc)
                    else:
                        doc["device"] = {**w.identity, **doc["device"]}
                # every device ends with one device_done line; an ERROR says why there too:
                # operators tail logs, not reports
                why = {"error": str(doc["error"])[:300]} if doc.get("error") else {}
                log("device_done", device=w.plan.device_id, verdict=doc["verdict"], seconds=round(took, 2), **why)
                results[w.plan.device_id] = doc
    finally:
        for w in running:
            _kill(w)
    return [results[p.device_id] for p in plans]


def _read(path: str) -> dict | None:
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


# -- the sweep -----------------------------------------------------------------------------
def scan_options(cfg: SweepConfig):
    from aegis_cli.scan import ScanOptions

    return ScanOptions(devices=cfg.devices, workload=cfg.workload, seed=cfg.seed, reruns=cfg.reruns, inject=cfg.inject,
                       probes=tuple(cfg.probes), command_line=["aegis", "sweep", "--config", cfg.source])


def sweep_doc(cfg: SweepConfig, devices: list[dict], started: float, extra: dict | None = None) -> dict:
    rep = report_mod.new_report(scan_options(cfg), kind="sweep")
    doc = rep.to_dict()
    doc["devices"] = devices
    doc["duration_seconds"] = round(time.time() - started, 3)
    doc["finished"] = report_mod._now()
    doc["exit_code"] = int(overall_exit(Verdict(d["verdict"]) for d in devices))
    doc["sweep"] = {"config": cfg.source, "budget_seconds": cfg.budget_seconds, "device_timeout_seconds": cfg.device_timeout_seconds,
                    **(extra or {})}
    return doc


def apply_policy(cfg: SweepConfig, hist: History, doc: dict, log: Log, *, rank: int | None = None,
                 world_size: int | None = None, export: bool = True,
                 recorded: Callable[[], None] | None = None) -> tuple[dict[str, DeviceState], list[ActionRecord]]:
    """Record ``doc`` (one transaction), evaluate the policy, run the actions of devices
    whose state changed, and (``export``) write the exports. ``recorded`` runs once ``doc`` is
    recorded (a distributed sweep waits there for the node's other ranks)."""
    uuids = [d["device"]["uuid"] for d in doc["devices"]]
    # what was last announced (the actions table), not the old results re-read under today's
    # config: a changed policy that moves a device must still run its action. Never announced is
    # not quarantined: a sweep killed between recording its results and running its actions left
    # a quarantined device whose drain command then never ran
    announced = hist.last_events(uuids)
    was_q = {u: u in announced and announced[u][0] == "quarantine" for u in uuids}
    sweep_id = hist.record_sweep(doc, rank=rank, world_size=world_size)
    log("history_recorded", sweep_id=sweep_id, devices=len(doc["devices"]), path=cfg.history.path)
    if recorded:
        recorded()
    states = evaluate_all(hist.results(uuids), cfg.policy)
    by_uuid = {d["device"]["uuid"]: d["device"] for d in doc["devices"]}
    events = transitions(was_q, states)
    for uuid, ev in events.items():
        log(f"device_{ev}", level="warning", uuid=uuid, device=by_uuid[uuid].get("id"), state=states[uuid].state,
            reason=states[uuid].reason)

    node: dict[str, dict[str, DeviceState]] = {}

    def host_quarantined(u: str) -> int:  # other devices of u's node not (yet) back in service
        # from the history, not this doc: a distributed rank's doc holds its own device only, and a
        # quarantined GPU this sweep did not see still keeps the node drained
        host = by_uuid[u].get("host")
        if host not in node:
            mine = [d["uuid"] for d in hist.devices() if d["last_host"] == host]
            node[host] = drop_retired(evaluate_all(hist.results(mine), cfg.policy), hist.retired())
        return sum(1 for v, s in node[host].items() if v != u and s.quarantined)

    acts = run_actions(cfg.actions, [({**by_uuid[u], "host_quarantined": host_quarantined(u)}, states[u], ev)
                                     for u, ev in events.items()])
    for a in acts:
        hist.record_action(a.uuid, a.event, states[a.uuid].state, states[a.uuid].reason, a.argv, a.executed, a.returncode, a.output)
        failed = a.executed and a.returncode != 0  # the node stays undrained (or drained): say so loudly
        log("action", level="error" if failed else "info", action=a.event, uuid=a.uuid, executed=a.executed,
            returncode=a.returncode, argv=json.dumps(a.argv, ensure_ascii=False),
            **({"output": " ".join(a.output.split())[-300:]} if failed else {}))
    doc["policy"] = {u: s.to_dict(cfg.policy.probation_sweeps) for u, s in states.items()}
    doc["actions"] = [a.to_dict() for a in acts]
    if export:
        write_exports(cfg, hist, doc, log)
    return states, acts


def write_exports(cfg: SweepConfig, hist: History, doc: dict, log: Log) -> None:
    """Quarantine list (every quarantined device in the history), Prometheus textfile
    (``doc``'s devices) and the JSON report, each written atomically."""
    if cfg.exports.quarantine_list or cfg.exports.prometheus_textfile:  # the whole history, so only when needed
        states = drop_retired(evaluate_all(hist.results(), cfg.policy), hist.retired())
    if cfg.exports.quarantine_list:
        n = write_quarantine_list(cfg.exports.quarantine_list, states, {d["uuid"]: d for d in hist.devices()})
        log("quarantine_list", path=cfg.exports.quarantine_list, quarantined=n)
    if cfg.exports.prometheus_textfile:
        files.atomic_write(cfg.exports.prometheus_textfile, prometheus_text(doc, states))
        log("prometheus_textfile", path=cfg.exports.prometheus_textfile)
    if cfg.exports.report:
        files.atomic_write(cfg.exports.report, report_mod.render(doc, "json"))
        log("report", path=cfg.exports.report)


def run_sweep(cfg: SweepConfig, log: Log | None = None, *, environ: dict[str, str] | None = None,
              stop: Stop | None = None) -> SweepOutcome:
    """The whole sweep. Raises LockError, HistoryError, ConfigError, DeviceError, SweepInterrupted
    (when ``stop()`` says so; checked while workers run)."""
    log = log or (lambda *a, **k: None)
    environ = os.environ if environ is None else environ
    from aegis_cli.fleet import distributed

    statefiles.preflight(cfg.history.path, cfg.lock_file)  # a linked, FIFO, empty or read-only history; lock_file = history
    # an export path that cannot be written fails the sweep now, not after every device ran
    own = {os.path.realpath(cfg.history.path): "history.path", os.path.realpath(cfg.lock_file): "lock_file"}
    for key, path in (("exports.report", cfg.exports.report), ("exports.quarantine_list", cfg.exports.quarantine_list),
                      ("exports.prometheus_textfile", cfg.exports.prometheus_textfile),
                      ("distributed.fleet_report", cfg.distributed.fleet_report)):
        if path:
            real = os.path.realpath(path)
            # written over the history it would destroy it; over another export, a scheduler
            # would read a report or metrics as its quarantine list
            if real in own:
                raise ConfigError(f"{key}: {path} is also the sweep's {own[real]}")
            files.check_writable(path)
            own[real] = key

    if cfg.distributed.mode == "auto" and distributed.launched(environ):
        return distributed.run_distributed(cfg, log, environ, stop)
    started = time.time()
    deadline = started + cfg.budget_seconds
    with SweepLock(cfg.lock_file):
        log("sweep_start", host=node_name(), config=cfg.source, budget=cfg.budget_seconds)
        with History(cfg.history.path, busy_timeout=cfg.history.busy_timeout_seconds) as hist:
            from aegis_cli.backends import resolve_devices

            identities = {d.identity.id: d.identity.to_dict() for d in resolve_devices(cfg.devices)}
            uuids = [i["uuid"] for i in identities.values()]
            plans = plan_devices(cfg, list(identities.values()), hist.results(uuids), started)
            devices = run_workers(cfg, plans, identities, deadline, log, stop=stop)
            extra = {"plan": [{"device": p.device_id, "priority_cases": p.priority_cases, "probes": p.probes,
                               "past_failures": p.failures, "estimate_seconds": p.estimate} for p in plans]}
            doc = sweep_doc(cfg, devices, started, extra)
            states, acts = apply_policy(cfg, hist, doc, log)
    log("sweep_done", exit_code=doc["exit_code"], seconds=round(time.time() - started, 2),
        verdicts=",".join(f"{d['device']['id']}={d['verdict']}" for d in devices))
    return SweepOutcome(doc, states, acts, doc["exit_code"])
