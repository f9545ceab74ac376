"""Quarantine policy evaluated on a device's history (docs/design.md §1: faults come back).

A device is ACTIVE, QUARANTINED or on PROBATION (quarantined, with some clean sweeps
since its last bad one). Walking its results oldest first:

  ACTIVE      → QUARANTINED  when FAULTY results within ``window_days`` reach ``faulty_count``
                             or SUSPECT results within ``window_days`` reach ``suspect_count``
                             (FAULTY ones count there too: never less than a SUSPECT)
                             (ERROR counts as SUSPECT only with ``error_counts_as_suspect``)
  QUARANTINED → PROBATION    on a HEALTHY result; another SUSPECT/FAULTY restarts the count. Not
                             when the quarantine came from a FAULTY result and ``readmit_faulty``
                             is off (the default: a confirmed fault hides after a reboot, it is
                             not cured): such a device stays QUARANTINED, its clean streak counted
  PROBATION   → ACTIVE       after ``probation_sweeps`` consecutive HEALTHY results
ERROR results neither count as clean nor reset probation (the device was not checked).
Only results after a re-admission count towards the next quarantine.

Failure rates come with counts and a Wilson score upper bound, since "0 of 3" and
"0 of 300" are not the same evidence.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from aegis_cli.fleet.history import ResultRow
from aegis_cli.ops.errors import ConfigError

ACTIVE, QUARANTINED, PROBATION = "ACTIVE", "QUARANTINED", "PROBATION"
DAY = 86400.0


def check_positive(name: str, value: float, *, zero_ok: bool = False) -> None:
    """Refuse NaN, infinity and values ≤ 0 (< 0 with ``zero_ok``). A NaN passed every ``<= 0``
    check and then made every comparison false: window_days .nan never quarantined anything,
    device_timeout_seconds .nan timed every worker out at once."""
    if not math.isfinite(value) or value < 0 or (value == 0 and not zero_ok):
        raise ConfigError(f"{name} must be a finite number {'≥' if zero_ok else '>'} 0, got {value}")


@dataclass(kw_only=True)
class PolicyConfig:
    faulty_count: int = 1  # FAULTY results within the window that quarantine a device
    suspect_count: int = 3  # SUSPECT results within the window that quarantine a device
    window_days: float = 30.0
    probation_sweeps: int = 5  # consecutive HEALTHY sweeps before re-admission
    readmit_faulty: bool = False  # re-admit a device quarantined for a confirmed (FAULTY) result
    error_counts_as_suspect: bool = False

    def __post_init__(self) -> None:
        for name in ("faulty_count", "suspect_count", "probation_sweeps"):
            if getattr(self, name) < 1:
                raise ConfigError(f"policy.{name} must be ≥ 1, got {getattr(self, name)}")
        check_positive("policy.window_days", self.window_days)


@dataclass
class DeviceState:
    uuid: str
    state: str = ACTIVE
    reason: str = ""
    since: float | None = None  # when the current quarantine began
    clean_streak: int = 0  # HEALTHY results since the last bad one while quarantined
    permanent: bool = False  # quarantined for FAULTY and readmit_faulty is off
    sweeps: int = 0
    counts: dict[str, int] = field(default_factory=lambda: {"HEALTHY": 0, "SUSPECT": 0, "FAULTY": 0, "ERROR": 0})
    last: ResultRow | None = None

    @property
    def quarantined(self) -> bool:
        return self.state != ACTIVE

    @property
    def failures(self) -> int:
        return self.counts["SUSPECT"] + self.counts["FAULTY"]

    def to_dict(self, probation_sweeps: int) -> dict:
        lo, hi = wilson(self.failures, self.sweeps)
        return {"uuid": self.uuid, "state": self.state, "reason": self.reason, "since": self.since,
                "clean_streak": self.clean_streak, "probation_needed": None if self.permanent else probation_sweeps,
                "sweeps": self.sweeps, "counts": dict(self.counts), "failure_rate": self.failures / self.sweeps if self.sweeps else None,
                "failure_rate_95": [lo, hi], "summary": rate_text(self.failures, self.sweeps),
                "last_verdict": self.last.verdict if self.last else None, "last_ts": self.last.ts if self.last else None,
                "last_host": self.last.host if self.last else None, "last_device": self.last.device_id if self.last else None}


def wilson(k: int, n: int, z: float = 1.959964) -> tuple[float, float]:
    """Wilson score interval for k failures in n trials (95% by default)."""
    if n <= 0:
        return 0.0, 1.0
    p = k / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


def rate_text(k: int, n: int) -> str:
    if n == 0:
        return "no sweeps recorded"
    lo, hi = wilson(k, n)
    return f"failed {k} of {n} sweeps (95% CI {100 * lo:.1f}–{100 * hi:.1f}%)"


def evaluate(uuid: str, rows: list[ResultRow], cfg: PolicyConfig) -> DeviceState:
    """The device's state after its results, in the order they were recorded (History.results)."""
    st = DeviceState(uuid)
    window = cfg.window_days * DAY
    bad: list[ResultRow] = []  # SUSPECT/FAULTY(/ERROR) since the last re-admission
    for r in rows:
        st.sweeps += 1
        st.counts[r.verdict] = st.counts.get(r.verdict, 0) + 1
        st.last = r
        checks = f" ({', '.join(r.checks[:3])})" if r.checks else ""
        is_bad = r.verdict in ("SUSPECT", "FAULTY") or (r.verdict == "ERROR" and cfg.error_counts_as_suspect)
        if st.state == ACTIVE:
            if not is_bad:
                continue
            bad.append(r)
            recent = [b for b in bad if r.ts - b.ts <= window]
            faulty = sum(b.verdict == "FAULTY" for b in recent)
            suspect = len(recent) - faulty
            errors = sum(b.verdict == "ERROR" for b in recent)  # counted as SUSPECT (error_counts_as_suspect)
            when = f"within {cfg.window_days:g} days" if len(recent) > 1 else ""
            if faulty >= cfg.faulty_count:
                st.state, st.since, st.permanent = QUARANTINED, r.ts, not cfg.readmit_faulty
                st.reason = f"FAULTY {faulty}× {when}".strip() + checks
            elif len(recent) >= cfg.suspect_count:  # a FAULTY result counts at least as a SUSPECT one
                st.state, st.since = QUARANTINED, r.ts
                what = ", ".join(f"{v} {n}×" for v, n in (("SUSPECT", suspect - errors), ("FAULTY", faulty), ("ERROR", errors)) if n)
                st.reason = f"{what} {when}".strip() + checks
            st.clean_streak = 0
            continue
        # quarantined or on probation
        if r.verdict == "FAULTY" and not cfg.readmit_faulty and not st.permanent:
            # now for good: say so (the reason said SUSPECT, which reads as "will be readmitted")
            st.permanent, st.since = True, r.ts
            st.reason = "FAULTY while quarantined" + checks
        if is_bad:
            st.state, st.clean_streak = QUARANTINED, 0
        elif r.verdict == "HEALTHY":
            st.clean_streak += 1
            st.state = QUARANTINED if st.permanent else PROBATION
            if st.clean_streak >= cfg.probation_sweeps and not st.permanent:
                st.state, st.reason, st.since, st.clean_streak = ACTIVE, "", None, 0
                bad = []
    return st


def by_device(rows: list[ResultRow]) -> dict[str, list[ResultRow]]:
    """Results grouped per device, each group in the order given."""
    by: dict[str, list[ResultRow]] = {}
    for r in rows:
        by.setdefault(r.uuid, []).append(r)
    return by


def evaluate_all(rows: list[ResultRow], cfg: PolicyConfig) -> dict[str, DeviceState]:
    return {u: evaluate(u, rs, cfg) for u, rs in by_device(rows).items()}


def drop_retired(states: dict[str, DeviceState], retired: dict[str, float]) -> dict[str, DeviceState]:
    """States without the devices retired after their last result (History.retire)."""
    return {u: s for u, s in states.items() if not (u in retired and (s.last is None or s.last.ts <= retired[u]))}


def parse_since(text: str | None, now: float) -> float | None:
    """'30d', '12h', '90m', '45s' or an ISO date/time → a Unix time (None: no bound)."""
    if not text:
        return None
    units = {"d": DAY, "h": 3600.0, "m": 60.0, "s": 1.0, "w": 7 * DAY}
    t = text.strip()
    if t[-1:] in units and t[:-1].replace(".", "", 1).isdigit():
        return now - float(t[:-1]) * units[t[-1]]
    from datetime import datetime, timezone

    try:
        dt = datetime.fromisoformat(t)
    except ValueError:
        raise ConfigError(f"--since {text!r}: use a duration like 30d, 12h, 90m or an ISO date (2025-01-31)") from None
    return (dt if dt.tzinfo else dt.replace(tzinfo=timezone.utc)).timestamp()
