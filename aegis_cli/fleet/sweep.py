"""``aegis sweep``: a scheduled, non-interactive sweep of every local device.

    lock → open history (refuse a corrupt one before any work) → plan (order devices and
    cases by past failures) → one worker process per device, in parallel, each with a
    timeout inside the sweep's budget → one report → history (one transaction) → policy →
    actions and exports (quarantine list, Prometheus textfile, commands)

The pieces: config.py (sweep.yaml), plan.py, workers.py, record.py (history, policy,
actions, exports); distributed.py runs the same pieces on each rank of a torchrun launch.
"""

from __future__ import annotations

import os
import time

from aegis_cli.backends.base import node_name
from aegis_cli.fleet import coverage, distributed, vtasks
from aegis_cli.fleet.config import SweepConfig, check_outputs
from aegis_cli.fleet.history import History
from aegis_cli.fleet.lock import SweepLock
from aegis_cli.fleet.logs import Log, Stop
from aegis_cli.fleet.plan import plan_devices
from aegis_cli.fleet.record import SweepOutcome, apply_policy, sweep_doc
from aegis_cli.fleet.workers import run_workers


def run_sweep(cfg: SweepConfig, log: Log | None = None, *, environ: dict[str, str] | None = None,
              stop: Stop | None = None) -> SweepOutcome:
    """The whole sweep. Raises LockError, HistoryError, ConfigError, DeviceError, SweepInterrupted
    (when ``stop()`` says so; checked while workers run)."""
    log = log or (lambda *a, **k: None)
    environ = os.environ if environ is None else environ
    check_outputs(cfg)
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
            chosen = coverage.choose(cfg, hist, node_name(), started)
            cfg = coverage.resolve(cfg, chosen)
            log("sweep_seed", seed=cfg.seed, derived=chosen["seed_derived"], dither_index=chosen["dither_index"],
                **{k.replace(".", "_"): v for k, v in cfg.probe_options.items()})
            plans = plan_devices(cfg, list(identities.values()), hist.results(uuids), started)
            devices = run_workers(cfg, plans, identities, started + cfg.worker_budget(), log, stop=stop)
            extra = {"plan": [{"device": p.device_id, "priority_cases": p.priority_cases, "probes": p.probes,
                               "past_failures": p.failures, "estimate_seconds": p.estimate} for p in plans],
                     "coverage": coverage.annotate(cfg, chosen, devices), **vtasks.summarise(cfg, devices, log)}
            doc = sweep_doc(cfg, devices, started, extra)
            states, acts = apply_policy(cfg, hist, doc, log, deadline=deadline, stop=stop)
    log("sweep_done", exit_code=doc["exit_code"], seconds=round(time.time() - started, 2),
        verdicts=",".join(f"{d['device']['id']}={d['verdict']}" for d in devices))
    return SweepOutcome(doc, states, acts, doc["exit_code"])
