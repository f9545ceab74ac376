"""Fresh inputs over time: each sweep's seed and scale dithering, and what ``aegis history
--coverage`` shows (docs/fleet.md §3.1).

Seeds. Without ``seed:`` in the config, a sweep derives one from the UTC date and how many
sweeps this node recorded that day (the n-th sweep of a day has seed ``case_seed(0, "sweep",
DATE, n)``): every node's first sweep of a day shares its seed, so independent nodes' reports
still compare (``aegis report``), and two consecutive sweeps of one node never share one (a
seed equal to the node's previous one moves on to the next n). The seed is in the report, in
each device's entry and in the history, so a finding re-runs exactly: ``aegis scan --seed S
--case C`` (with the case's probe options, as the report's re-run commands print them).

Scale dithering. Sweep number i of a node (its recorded sweeps, counted from 0) checks the
pow2 grid at ``dither.offset(i, step)`` and the gemm probe's scales shifted by its centred
twin, step = ⌊√dither_sweeps⌋: within ``step²`` sweeps every exponent pair of the exact range
has been on the pow2 grid (ops/dither.py). A self-test records nothing, so it moves nothing on.
"""

from __future__ import annotations

import copy
import time

from aegis_cli.fleet.config import SweepConfig
from aegis_cli.fleet.history import History, ResultRow
from aegis_cli.ops import dither
from aegis_cli.ops.case import case_seed
from aegis_cli.probes.pow2 import MAX_STEP
from aegis_cli.report import launch_counts

DAY = 86400.0


def _day(ts: float) -> tuple[str, float]:
    """The UTC date of ``ts`` and the time its day began."""
    start = ts - ts % DAY
    return time.strftime("%Y-%m-%d", time.gmtime(start)), start


def derive_seed(date: str, n: int) -> int:
    """The seed of a node's ``n``-th derived sweep (from 0) on UTC ``date``."""
    return case_seed(0, "sweep", date, n)


def choose(cfg: SweepConfig, hist: History, host: str, now: float) -> dict:
    """This sweep's seed and dithering, from the config and the node's recorded sweeps."""
    mine = [s for s in hist.sweeps(host) if s["kind"] == "sweep"]
    index = 1 + max((s["dither"] for s in mine if s["dither"] is not None), default=-1)
    if cfg.seed is not None:
        return {"seed": cfg.seed, "seed_derived": False, "dither_index": index}
    date, start = _day(now)
    n = len({s["dither"] for s in mine if s["seed_derived"] and s["started"] >= start})
    last = mine[-1]["seed"] if mine else None
    seed = derive_seed(date, n)
    while seed == last:  # a hash collision with the previous sweep: fresh inputs all the same
        n += 1
        seed = derive_seed(date, n)
    return {"seed": seed, "seed_derived": True, "seed_rule": f"UTC date {date}, sweep {n} of the day", "dither_index": index}


def resolve(cfg: SweepConfig, chosen: dict) -> SweepConfig:
    """``cfg`` with this sweep's seed and its dithering as the probes' options."""
    out = copy.copy(cfg)
    out.seed = chosen["seed"]
    m = marks(cfg, chosen)
    opts: dict[str, str] = {}
    if m["step"]:
        off, shift = m["pow2_offset"], m["gemm_shift"]
        if "gemm" in cfg.probes and shift != [0, 0]:
            opts["gemm.shift"] = f"{shift[0]},{shift[1]}"
        if "pow2" in cfg.probes:
            opts.update({"pow2.step": str(m["step"]), "pow2.offset": f"{off[0]},{off[1]}"})
    out.probe_options = opts
    return out


def marks(cfg: SweepConfig, chosen: dict) -> dict:
    """What the report's ``sweep.coverage`` says about this sweep's seed and dithering."""
    step = dither.step_for(cfg.dither_sweeps, MAX_STEP)
    out = {**chosen, "dither_sweeps": step * step, "step": step}
    if step:
        off = dither.offset(chosen["dither_index"], step)
        out.update({"pow2_offset": list(off), "gemm_shift": list(dither.centred(off, step))})
    return out


def counts(d: dict) -> tuple[int | None, int | None]:
    """(launches checked, failing launches) of a device report: its probes' ``confirmation``
    counts and its burn-in's where the report carries them (report.launch_counts), else, for
    older reports, the GEMM launches of its stats and, for each finding, the runs that failed
    ("failed k of n": 1 + reproduced)."""
    carried = launch_counts(d)
    if carried is not None:
        return carried
    stats = d.get("stats") if isinstance(d.get("stats"), dict) else {}
    pow2 = ((d.get("probes") or {}).get("pow2") or {}).get("implementations") or {}
    launches = (stats.get("gemms") or 0) + sum(1 + (s.get("tested") or 0) for s in pow2.values() if isinstance(s, dict))
    failures = sum(1 + int(e.get("reproduced") or 0) for e in d.get("evidence") or [] if e.get("severity") in ("SUSPECT", "FAULTY"))
    return launches, failures


def device_coverage(d: dict, seed: int, marks_: dict) -> dict:
    """A device's ``coverage`` entry: the seed, the dithering it actually ran, launches, failures."""
    probes = d.get("probes") or {}
    ran = {"index": marks_.get("dither_index"), "step": marks_.get("step")}
    if isinstance(probes.get("pow2"), dict):
        ran["pow2_offset"], ran["pow2_step"] = probes["pow2"].get("offset"), probes["pow2"].get("step")
    if "gemm_shift" in marks_ and d.get("stats"):
        ran["gemm_shift"] = marks_["gemm_shift"]
    launches, failures = counts(d)
    return {"seed": seed, "dither": ran, "launches": launches, "failures": failures}


def summary(rows: list[ResultRow]) -> dict:
    """One device's coverage over ``rows``: seeds, the share of the pow2 grid's offsets (and the
    gemm shifts) visited at the latest step, and totals of sweeps, launches and failures."""
    seeds = [r.seed for r in rows if r.seed is not None]
    steps = [r.coverage.get("pow2_step") or r.coverage.get("step") for r in rows if r.coverage]
    step = next((s for s in reversed(steps) if s), 0)
    pow2 = {tuple(r.coverage["pow2_offset"]) for r in rows if r.coverage.get("pow2_offset") is not None
            and r.coverage.get("pow2_step") == step}
    gemm = {tuple(r.coverage["gemm_shift"]) for r in rows if r.coverage.get("gemm_shift") is not None and r.coverage.get("step") == step}
    launches = [r.launches for r in rows if r.launches is not None]
    failures = [r.failures for r in rows if r.failures is not None]
    return {"sweeps": len(rows), "seeds": len(set(seeds)), "last_seed": seeds[-1] if seeds else None,
            "step": step, "bands": step * step, "pow2_bands": len(pow2), "gemm_bands": len(gemm),
            "launches": sum(launches) if launches else None, "failures": sum(failures) if failures else (0 if launches else None),
            "recorded_with_counts": len(launches)}


def annotate(cfg: SweepConfig, chosen: dict, devices: list[dict]) -> dict:
    """Each device report's ``coverage`` entry; returns the report's ``sweep.coverage``."""
    m = marks(cfg, chosen)
    for d in devices:
        d["coverage"] = device_coverage(d, cfg.seed, m)
    return m
