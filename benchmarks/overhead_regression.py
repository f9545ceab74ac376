"""Whether a sampled training step pays for its checks' GPU time and nothing more.

    python3 benchmarks/overhead_regression.py OVERHEAD.json REFERENCE.json [--mode coverage]

OVERHEAD.json is a ``sensors_overhead.py`` run: step times and, step by step, the operators each step
checked. REFERENCE.json is a ``sensor_reference.py`` run: one check's GPU time per operator
(``enqueue_kernel_ms``). The script fits the mode's step times by least squares:

    step ms = slope · (the isolated check ms of that step's checks) + an intercept per round

It then prints the slope with its standard error, and each round's intercept minus the same round's
plain mean. A price per step beyond the checks' own time would show up in those differences (for
example a boundary waiting for a late check, or the allocator). A slope above 1 means that checks
cost more inside the step than alone. Writes nothing.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import numpy as np


def op_costs(reference: dict) -> dict[str, float]:
    """ms of one check per operator kind ("mlp.fc/wgrad", "head/fwd"), from sensor_reference.py."""
    return {row["op"]: row["enqueue_kernel_ms"] for row in reference["shapes"]}


def kind(op: str) -> str:
    """An instrumented operator's kind: "blocks.3.mlp.fc/wgrad" → "mlp.fc/wgrad"."""
    return re.sub(r"^blocks\.\d+\.", "", op)


def fit(overhead: dict, costs: dict[str, float], mode: str = "coverage") -> dict:
    runs = overhead["interleaved"]
    ours, plain = runs[mode], runs["plain"]
    rounds = len(ours["stats"])
    times = np.asarray(ours["times"]) * 1e3
    steps = len(times) // rounds
    missing = sorted({kind(op) for ops in ours["checked_ops"] for op in ops} - costs.keys())
    if missing:
        raise KeyError(f"no check time for {', '.join(missing)} in the reference run")
    x = np.array([sum(costs[kind(op)] for op in ops) for ops in ours["checked_ops"]])
    which = np.repeat(np.arange(rounds), steps)
    design = np.column_stack([x] + [(which == r).astype(float) for r in range(rounds)])
    coef, *_ = np.linalg.lstsq(design, times, rcond=None)
    resid = times - design @ coef
    var = resid @ resid / (len(times) - design.shape[1])
    se = np.sqrt(np.diag(var * np.linalg.inv(design.T @ design)))
    plain_means = (np.asarray(plain["times"]) * 1e3).reshape(rounds, -1).mean(axis=1)
    extra = coef[1:] - plain_means
    return {"slope": float(coef[0]), "slope_se": float(se[0]), "checks_ms_per_step": float(x.mean()),
            "extra_ms_per_round": [float(v) for v in extra], "extra_ms": float(extra.mean()),
            "extra_ms_se": float(extra.std(ddof=1) / np.sqrt(rounds)) if rounds > 1 else None,
            "plain_ms": float(plain_means.mean())}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("overhead", type=Path)
    p.add_argument("reference", type=Path)
    p.add_argument("--mode", default="coverage")
    args = p.parse_args(argv)
    try:
        overhead, reference = (json.loads(f.read_text(encoding="utf-8")) for f in (args.overhead, args.reference))
        got = fit(overhead, op_costs(reference), args.mode)
    except (OSError, ValueError, KeyError) as exc:
        sys.exit(f"overhead_regression: {exc}")
    se = f" ± {got['extra_ms_se']:.2f}" if got["extra_ms_se"] is not None else ""
    print(f"{args.mode}: slope {got['slope']:.2f} ± {got['slope_se']:.2f} over {got['checks_ms_per_step']:.3f} ms of "
          f"isolated checks a step; beyond them {got['extra_ms']:+.2f}{se} ms a step "
          f"(rounds {', '.join(f'{v:+.2f}' for v in got['extra_ms_per_round'])}) of a {got['plain_ms']:.1f} ms plain step")
    return got


if __name__ == "__main__":
    main()
