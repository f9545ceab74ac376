"""What a sweep leaves behind: its report, the history transaction, the policy's verdict on
each device, the actions of devices whose quarantine changed, and the exports."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass

from aegis_cli import report as report_mod
from aegis_cli.fleet.actions import ActionRecord, prometheus_text, run_actions, transitions, write_quarantine_list
from aegis_cli.fleet.config import SweepConfig
from aegis_cli.fleet.history import History
from aegis_cli.fleet.logs import Log
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
