"""What ``aegis history`` shows: each device's policy state over its whole history, its failure
rate with counts and a Wilson bound over a window, its coverage there (seeds, scale bands,
launches and failing runs: fleet/coverage.py) and, for one device, every result and the
actions taken; as a document (JSON) or CSV rows."""

from __future__ import annotations

import csv
import io
import time

from aegis_cli.fleet import coverage
from aegis_cli.fleet.history import History
from aegis_cli.fleet.policy import DeviceState, PolicyConfig, by_device, drop_retired, evaluate, parse_since, rate_text, wilson
from aegis_cli.ops.errors import ConfigError, HistoryError

RESULT_COLUMNS = ("ts", "uuid", "host", "device", "verdict", "workload", "seed", "launches", "failures", "evidence", "checks", "error")
DEVICE_COLUMNS = ("uuid", "serial", "name", "last_host", "last_id", "state", "sweeps", "failures", "summary", "last_verdict")
COVERAGE_COLUMNS = ("uuid", "last_host", "last_id", "sweeps", "seeds", "last_seed", "bands", "pow2_bands", "gemm_bands",
                    "launches", "failed_runs")


def show_history(db: str | None, config_path: str | None = None, ident: str | None = None, since: str | None = None,
                 retire: str | None = None) -> tuple[dict, str | None]:
    """The history summary of ``db`` (or ``history.path`` of the sweep config, whose policy it
    applies), after retiring the one device ``ident`` names when ``retire`` is given (""
    retires with a default reason). Returns (summary, the retired UUID or None)."""
    policy = PolicyConfig()
    if config_path:
        from aegis_cli.fleet.config import load_config

        cfg = load_config(config_path)
        db, policy = db or cfg.history.path, cfg.policy
    if not db:
        raise ConfigError("give --db PATH or --config SWEEP.YAML")
    retired = None
    with History(db, create=False) as hist:
        if retire is not None:
            uuids = hist.resolve(ident) if ident else []
            if len(uuids) != 1:
                raise ConfigError(f"--retire needs --device naming exactly one device (it names {len(uuids)})")
            retired = uuids[0]
            hist.retire(retired, retire or "retired by hand")
        return history_summary(hist, policy, ident, parse_since(since, time.time())), retired


def history_csv(doc: dict, coverage: bool = False) -> str:
    """A history summary as CSV: one row per result for one device (``--device``), else one per
    device; with ``coverage``, one per device with its coverage (seeds, bands, launches)."""
    if coverage:
        cols, rows = COVERAGE_COLUMNS, [{**d, **d["coverage"], "failed_runs": d["coverage"]["failures"]} for d in doc["devices"]]
    elif any("results" in d for d in doc["devices"]):
        cols, rows = RESULT_COLUMNS, [r for d in doc["devices"] for r in d.get("results", [])]
    else:
        cols, rows = DEVICE_COLUMNS, doc["devices"]
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=cols, extrasaction="ignore", lineterminator="\n")
    w.writeheader()
    for r in rows:
        w.writerow({k: (" ".join(map(str, v)) if isinstance(v, list) else v) for k, v in r.items()})
    return buf.getvalue()


def history_summary(hist, cfg: PolicyConfig, ident: str | None = None, since: float | None = None) -> dict:
    """What ``aegis history`` shows: per device, its policy state (over the whole history),
    its failure rate with counts and a Wilson bound over the ``since`` window, and — for one
    device — every result in the window and the actions taken."""
    devices = {d["uuid"]: d for d in hist.devices()}
    uuids = list(devices)
    if ident:
        uuids = hist.resolve(ident)
        if not uuids:
            raise HistoryError(f"no device matching {ident!r} in {hist.path} (give a UUID, a serial, a UUID prefix or an id like cuda:0)")
    by = by_device(hist.results(uuids if ident else None))  # one pass: fleets have thousands of devices
    states = {u: evaluate(u, rs, cfg) for u, rs in by.items()}
    live = drop_retired(states, hist.retired())
    out = []
    for u in uuids:
        rows = [r for r in by.get(u, ()) if since is None or r.ts >= since]
        k = sum(r.verdict in ("SUSPECT", "FAULTY") for r in rows)
        lo, hi = wilson(k, len(rows))
        st = states.get(u, DeviceState(u))
        state = st.state if u in live or u not in states else "RETIRED"
        entry = {**devices.get(u, {"uuid": u}), "state": state, "reason": st.reason, "clean_streak": st.clean_streak,
                 "sweeps": len(rows), "failures": k, "counts": {v: sum(r.verdict == v for r in rows) for v in st.counts},
                 "failure_rate_95": [lo, hi], "summary": rate_text(k, len(rows)),
                 "last_verdict": rows[-1].verdict if rows else None, "last_ts": rows[-1].ts if rows else None,
                 "coverage": coverage.summary(rows)}
        if ident:
            entry["results"] = [r.to_dict() for r in rows]
            entry["actions"] = hist.actions(u)
        out.append(entry)
    return {"database": str(hist.path), "since": since, "devices": out}
