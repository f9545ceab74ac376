"""What a sweep leaves behind: its report, the history transaction, the policy's verdict on
each device, the actions of devices whose quarantine changed, and the exports."""

from __future__ import annotations

import contextlib
import json
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from aegis_cli import report as report_mod
from aegis_cli.fleet.actions import ActionRecord, prometheus_text, run_actions, took_effect, transitions, write_quarantine_list
from aegis_cli.fleet.config import SweepConfig
from aegis_cli.fleet.history import History, ResultRow
from aegis_cli.fleet.logs import Log, Stop, SweepInterrupted
from aegis_cli.fleet.policy import DeviceState, drop_retired, evaluate_all
from aegis_cli.ops import files
from aegis_cli.ops.verdict import Verdict, overall_exit


@dataclass
class SweepOutcome:
    doc: dict
    states: dict[str, DeviceState]
    actions: list[ActionRecord]
    exit_code: int
    fleet: dict | None = None  # distributed mode: the fleet report (rank 0) or None



def scan_options(cfg: SweepConfig):
    from aegis_cli.scan import ScanOptions

    return ScanOptions(devices=cfg.devices, workload=cfg.workload, seed=cfg.seed, reruns=cfg.reruns, inject=cfg.inject,
                       probes=tuple(cfg.probes), probe_options=dict(cfg.probe_options), fail_fast=cfg.fail_fast,
                       command_line=["aegis", "sweep", "--config", cfg.source])


def sweep_doc(cfg: SweepConfig, devices: list[dict], started: float, extra: dict | None = None) -> dict:
    rep = report_mod.new_report(scan_options(cfg), kind="sweep")
    doc = rep.to_dict()
    doc["devices"] = devices
    doc["duration_seconds"] = round(time.time() - started, 3)
    doc["finished"] = report_mod._now()
    doc["exit_code"] = int(overall_exit(Verdict(d["verdict"]) for d in devices))
    doc["sweep"] = {"config": cfg.source, "budget_seconds": cfg.budget_seconds, "device_timeout_seconds": cfg.device_timeout_seconds,
                    "soak": cfg.soak, **(extra or {})}
    doc["sweep"]["rerun"] = _rerun_commands(doc)  # each flagged device's first case, exactly as it was judged
    return doc


def _rerun_commands(doc: dict) -> list[str]:
    """The scan commands that re-run each flagged device's first case (scan.rerun_commands),
    without the sweep workers' test hooks, which a scan refuses; none when a hook comes before a
    fault (faults are seeded by their place in the spec: the scan's would land elsewhere)."""
    from aegis_cli.faults.spec import WORKER_MODELS, parse_spec
    from aegis_cli.scan import rerun_commands  # imports torch: only once a sweep has run

    injected = []
    for spec in doc.get("injected") or []:
        parsed = parse_spec(spec, worker=True)
        models = [f.model in WORKER_MODELS for f in parsed]
        if any(hook and not all(models[i:]) for i, hook in enumerate(models)):
            return []
        kept = [str(f) for f, hook in zip(parsed, models, strict=True) if not hook]
        injected += [";".join(kept)] if kept else []
    out = []
    for d in doc["devices"]:  # one device at a time: a case run first from the history has the seed it failed with
        if d.get("evidence"):
            alone = [x if x is d else {**x, "evidence": []} for x in doc["devices"]]
            out += rerun_commands({**doc, "injected": injected, "seed": d["evidence"][0].get("seed", doc["seed"]), "devices": alone})
    return list(dict.fromkeys(out))


def apply_policy(cfg: SweepConfig, hist: History, doc: dict, log: Log, *, deadline: float | None = None, stop: Stop | None = None,
                 rank: int | None = None, world_size: int | None = None, export: bool = True, peers: list[dict] | None = None,
                 before_write: Callable[[], None] | None = None) -> tuple[dict[str, DeviceState], list[ActionRecord]]:
    """Evaluate the policy on the history plus ``doc``, run the commands of devices whose
    quarantine differs from what a command last did for them (within ``deadline``), then record
    ``doc`` (one transaction) and the actions, and (``export``) write the exports.

    Nothing is recorded before the commands ran: stopped meanwhile (``stop()``, or SIGTERM/SIGINT
    during the results' transaction, which then rolls back), it raises SweepInterrupted with
    nothing recorded; a command that already ran runs again at the next sweep. ``peers``: this
    sweep's devices on the node that ``doc`` does not hold (a distributed rank's), counted in
    {host_quarantined}; ``before_write`` runs after every read (a distributed sweep waits there
    for the node's other ranks). A self-test (``cfg.self_test``) records and runs nothing."""
    stop = stop or (lambda: None)
    by_uuid = {d["device"]["uuid"]: d["device"] for d in doc["devices"]}
    uuids = list(by_uuid)
    acts: list[ActionRecord] = []
    if cfg.self_test:
        states = evaluate_all(hist.results(uuids), cfg.policy)
        log("self_test", level="warning", recorded=False,
            note="faults injected on purpose: no history, actions, quarantine list or metrics (drill: true records them)")
        if before_write:
            before_write()
    else:
        now = time.time()
        pending = _rows(doc["devices"], now) + _rows(peers or [], now)
        states = evaluate_all(hist.results(uuids) + [r for r in pending if r.uuid in by_uuid], cfg.policy)
        events = transitions(_quarantine_done(hist, uuids), states)
        for uuid, ev in events.items():
            log(f"device_{ev}", level="warning", uuid=uuid, device=by_uuid[uuid].get("id"), state=states[uuid].state,
                reason=states[uuid].reason)
        node = _node_quarantine(cfg, hist, pending)
        changes = [({**by_uuid[u], "host_quarantined": sum(1 for v, s in node(by_uuid[u].get("host")).items() if v != u and s.quarantined)},
                    states[u], ev) for u, ev in events.items()]
        acts = run_actions(cfg.actions, changes, deadline=deadline, stop=stop)
        for a in acts:
            failed = a.executed and a.returncode != 0  # the node stays undrained (or drained): say so loudly
            log("action", level="error" if failed else "info", action=a.event, uuid=a.uuid, executed=a.executed,
                returncode=a.returncode, argv=json.dumps(a.argv, ensure_ascii=False),
                **({"output": " ".join(a.output.split())[-300:]} if failed or not a.done else {}))
        if before_write:
            before_write()
        _record(cfg, hist, doc, states, acts, log, stop, rank, world_size)
    doc["policy"] = {u: s.to_dict(cfg.policy.probation_sweeps) for u, s in states.items()}
    doc["actions"] = [a.to_dict() for a in acts]
    if export:
        write_exports(cfg, hist, doc, log)
    return states, acts


def _rows(devices: list[dict], now: float) -> list[ResultRow]:
    """This sweep's results as the history will hold them, for the policy before they are recorded."""
    rows = []
    for d in devices:
        flagged = [e for e in d.get("evidence") or [] if e.get("severity") in ("SUSPECT", "FAULTY")]
        dev = d["device"]
        rows.append(ResultRow(dev["uuid"], now, d["verdict"], host=dev.get("host") or "", device_id=dev.get("id") or "",
                              checks=sorted({e["check"] for e in flagged}), cases=sorted({e["case_id"] for e in flagged})))
    return rows


def _quarantine_done(hist: History, uuids: list[str]) -> dict[str, bool]:
    """uuid → whether the last event that took effect for it was a quarantine (took_effect):
    what a command did, not the old results re-read under today's config, so a changed policy
    that moves a device still runs its command; and a dry run or a failed command counts as not
    done, so it runs again at the next sweep."""
    out = {}
    for u in uuids:
        done = [a for a in hist.actions(u) if took_effect(a["argv"], a["executed"], a["returncode"])]
        out[u] = bool(done) and done[-1]["event"] == "quarantine"
    return out


def _node_quarantine(cfg: SweepConfig, hist: History, pending: list[ResultRow]) -> Callable[[str | None], dict[str, DeviceState]]:
    """host → the policy states of its devices, from the history and this sweep's results: a
    quarantined GPU this sweep did not see still keeps the node drained."""
    cache: dict[str | None, dict[str, DeviceState]] = {}
    fresh = {r.uuid for r in pending}

    def states(host: str | None) -> dict[str, DeviceState]:
        if host not in cache:
            here = {d["uuid"] for d in hist.devices() if d["last_host"] == host and d["uuid"] not in fresh}
            here |= {r.uuid for r in pending if r.host == host}
            rows = hist.results(sorted(here)) + [r for r in pending if r.uuid in here]
            cache[host] = drop_retired(evaluate_all(rows, cfg.policy), hist.retired())
        return cache[host]
    return states


def _record(cfg: SweepConfig, hist: History, doc: dict, states: dict[str, DeviceState], acts: list[ActionRecord], log: Log,
            stop: Stop, rank: int | None, world_size: int | None) -> None:
    """The results in one transaction that SIGTERM/SIGINT roll back, then the actions taken."""
    why = stop()
    if why:
        raise SweepInterrupted(f"sweep stopped by {why}: nothing of this sweep recorded")
    with _signals_roll_back():
        sweep_id = hist.record_sweep(doc, rank=rank, world_size=world_size)
    for a in acts:
        hist.record_action(a.uuid, a.event, states[a.uuid].state, states[a.uuid].reason, a.argv, a.executed, a.returncode, a.output)
    log("history_recorded", sweep_id=sweep_id, devices=len(doc["devices"]), actions=len(acts), path=cfg.history.path)
    why = stop()  # arrived while the actions were recorded: the results stand, the exports are not written
    if why:
        raise SweepInterrupted(f"sweep stopped by {why} after recording its results; exports not written")


@contextlib.contextmanager
def _signals_roll_back():
    """SIGTERM/SIGINT raise inside the transaction, which rolls back (History rolls back on any
    exception); outside it the CLI's handlers only set the flag that ``stop()`` reads."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum, frame):
        raise SweepInterrupted(f"sweep stopped by {signal.Signals(signum).name}: nothing of this sweep recorded")
    old = {s: signal.signal(s, interrupt) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)


def write_exports(cfg: SweepConfig, hist: History, doc: dict, log: Log) -> None:
    """Quarantine list (every quarantined device in the history), Prometheus textfile
    (``doc``'s devices) and the JSON report, each written atomically. A self-test writes only
    its report: the list and the metrics say what real sweeps found."""
    qlist, prom = (None, None) if cfg.self_test else (cfg.exports.quarantine_list, cfg.exports.prometheus_textfile)
    if qlist or prom:  # the whole history, so only when needed
        states = drop_retired(evaluate_all(hist.results(), cfg.policy), hist.retired())
    if qlist:
        n = write_quarantine_list(qlist, states, {d["uuid"]: d for d in hist.devices()})
        log("quarantine_list", path=qlist, quarantined=n)
    if prom:
        files.atomic_write(prom, prometheus_text(doc, states))
        log("prometheus_textfile", path=prom)
    if cfg.exports.report:
        files.atomic_write(cfg.exports.report, report_mod.render(doc, "json"))
        log("report", path=cfg.exports.report)
