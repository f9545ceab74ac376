"""Planning a sweep from the history: devices with past failures first and, when a device's
time is short, the cases that failed on it before run first, so their verdict survives even
if the full scan cannot finish."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from aegis_cli.fleet.config import SweepConfig
from aegis_cli.fleet.history import ResultRow
from aegis_cli.fleet.policy import DAY, by_device


@dataclass
class DevicePlan:
    device_id: str
    uuid: str
    priority_cases: list[str]
    probes: list[str]
    failures: int
    estimate: float | None
    priority_seeds: dict[str, int] = field(default_factory=dict)  # case → the seed it failed with (inputs change every sweep)


def plan_devices(cfg: SweepConfig, identities: list[dict], rows: list[ResultRow], now: float) -> list[DevicePlan]:
    """Order devices (most past failures first) and pick, per device, the cases that
    failed before within the policy window; they run first when the budget is short."""
    window = now - cfg.policy.window_days * DAY
    allowed = min(cfg.device_timeout_seconds, cfg.budget_seconds)
    plans, by = [], by_device(rows)
    for ident in identities:
        mine = by.get(ident["uuid"], [])
        recent_bad = [r for r in mine if r.ts >= window and r.verdict in ("SUSPECT", "FAULTY")]
        cases: list[str] = []
        seeds: dict[str, int] = {}
        for r in reversed(recent_bad):
            cases += [c for c in r.cases if c not in cases]
            seeds.update({c: r.seed for c in r.cases if c not in seeds and r.seed is not None})
        done = [r.seconds for r in mine if r.verdict != "ERROR" and r.seconds][-5:]
        estimate = statistics.median(done) if done else None
        # a device whose last scans ran out of time is short of it, whatever its earlier scans took
        timed_out = any(r.verdict == "ERROR" and "timed out" in (r.error or "") for r in mine[-3:])
        short = timed_out or (estimate is not None and estimate > allowed)
        failed_probes = {c.split(".")[0] for r in recent_bad for c in r.checks}
        probes = sorted(cfg.probes, key=lambda p: p not in failed_probes)
        chosen = cases[:16] if cfg.prioritize and short else []
        plans.append(DevicePlan(ident["id"], ident["uuid"], chosen, probes, len(recent_bad), estimate,
                                {c: seeds[c] for c in chosen if c in seeds}))
    if cfg.prioritize:
        plans.sort(key=lambda p: -p.failures)
    return plans
