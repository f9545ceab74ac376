"""Data-parallel outlier warning: the robust leave-one-out rule, and 3 gloo ranks on CPU whose
statistics come from real checked GEMMs, one rank with an injected fault below τ
(tests/sensors/gloo_ranks.py runs them)."""

from __future__ import annotations

import math

from aegis_cli.sensors.outlier import OutlierWarning, outliers
from tests.sensors.gloo_ranks import FAULT_FROM, FAULTY, STEPS, WARMUP


def test_rule_flags_the_far_rank_only():
    assert outliers([3e-9, 2.5e-9, 2e-7])[0] == [2]
    assert outliers([3e-9, 2.5e-9, 4e-9, 3.1e-9])[0] == []
    assert outliers([3e-9, 2e-7])[0] == [1]  # two ranks: the margin is min_decades
    assert outliers([3e-9, 2e-8])[0] == []  # under one decade apart
    assert outliers([3e-9, math.nan, 2e-9, 1e-9])[0] == [1]  # a non-finite statistic always
    assert outliers([0.0, 0.0, 0.0])[0] == []  # nothing sampled anywhere
    assert outliers([5e-9])[0] == []  # a single rank has no peers


def test_single_process_stays_quiet():
    w = OutlierWarning(warmup=0)
    assert w.observe(1, 1.0) is None  # no process group: nothing to compare with


def test_three_gloo_ranks_warn_on_the_faulty_rank_only(gloo_ranks):
    got = [g["outlier"] for g in gloo_ranks]
    for r, g in enumerate(got):
        assert g["clean"][:WARMUP] == [None] * WARMUP  # quiet during warm-up
        assert all(f == [] for f in g["clean"][WARMUP:]), g["clean"]  # no rank flagged without a fault
        expected = [[] if s < FAULT_FROM else [FAULTY] for s in range(WARMUP + 1, STEPS + 1)]
        assert g["faulty"][WARMUP:] == expected  # every rank sees the same comparison
        assert g["warned"] == {"clean": 0, "faulty": STEPS - FAULT_FROM + 1 if r == FAULTY else 0}
    # the warning compares ranks, not a threshold: the faulty rank stands ≥ 10× above its peers
    peers = [v for r, g in enumerate(got) if r != FAULTY for v in g["values"]]
    assert min(got[FAULTY]["values"][FAULT_FROM - 1:]) > 10 * max(peers)
