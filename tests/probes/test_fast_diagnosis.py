"""A device that corrupts every launch is diagnosed as fast as a healthy one is cleared
(probes/confirmation.py): once the gemm probe has confirmed FAULTY, later cases are still
checked and counted, confirmed with one re-run per case group, and only the first N are
given in full. The bound is on counts of launches, not on time.

The bound, for the default CPU scan (36 case groups × 4 scales = 144 launches when healthy):
the first flagged case's full confirmation (``reruns`` re-runs), one re-run for each of the
next N−1 cases shown in full, and one per later case group, at most
144 + 5 + 3 + 35 = 187 ≤ 1.5 × 144 = 216. Before, every flagged case had 5 re-runs: 864."""

from __future__ import annotations

import json

import pytest

from aegis_cli.ops.verdict import Verdict
from aegis_cli.probes.confirmation import Tally
from aegis_cli.report import render
from aegis_cli.scan import ScanOptions, run_scan

EVERY_LAUNCH = ["bitflip:target=acc,bit=exp", "perturb:r=1e4", "bitflip:target=out,bit=14"]


def _scan(inject: str | None, probes=("gemm",), **kw):
    rep = run_scan(ScanOptions(devices="cpu", probes=probes, inject=inject, **kw))
    return rep, rep.to_dict()


@pytest.fixture(scope="module")
def healthy():
    rep, _ = _scan(None)
    return rep.devices[0]


@pytest.mark.parametrize("spec", EVERY_LAUNCH)
def test_a_fault_in_every_launch_costs_at_most_half_again_the_healthy_launches(healthy, spec):
    rep, doc = _scan(spec)
    dr, d = rep.devices[0], doc["devices"][0]
    assert dr.verdict is Verdict.FAULTY and healthy.verdict is Verdict.HEALTHY
    groups = healthy.stats.gemms // 4
    assert dr.stats.gemms <= healthy.stats.gemms + 5 + 3 + groups - 1 <= 1.5 * healthy.stats.gemms
    gemm = d["confirmation"]["probes"]["gemm"]
    assert gemm["launches"] == dr.stats.gemms and 0 < gemm["failed_launches"] <= gemm["launches"]
    # every case is counted, with its runs; the first 4 flagged cases in full, FAULTY among them
    counted = {c["case_id"] for c in gemm["cases"]}
    assert len(counted) == gemm["flagged_cases"] > 4
    assert all(1 <= c["failed"] <= c["runs"] <= 6 for c in gemm["cases"])
    shown = {e["case_id"] for e in d["evidence"]}
    assert len(shown) == gemm["evidence_in_full"] == 4 and shown <= counted
    assert any(e["severity"] == "FAULTY" for e in d["evidence"])
    for e in d["evidence"]:  # "failed k of n" in full says its own run count
        assert f"of {e['reruns'] + 1} runs" in e["summary"]


@pytest.mark.gpu
@pytest.mark.parametrize("spec", EVERY_LAUNCH[:2])
def test_gpu_a_fault_in_every_launch_costs_at_most_half_again_the_healthy_launches(spec):
    # the in-kernel injection build and a fault at random positions per launch, on cpu-quick shapes
    clean = run_scan(ScanOptions(devices="cuda:0", workload="cpu-quick", probes=("gemm",))).devices[0]
    bad = run_scan(ScanOptions(devices="cuda:0", workload="cpu-quick", probes=("gemm",), inject=spec)).devices[0]
    assert (clean.verdict, bad.verdict) == (Verdict.HEALTHY, Verdict.FAULTY)
    assert bad.stats.gemms <= 1.5 * clean.stats.gemms
    assert len({e.case_id for e in bad.evidence}) == 4


def test_the_default_scan_report_stays_small_with_a_fault_in_every_launch():
    rep, doc = _scan("bitflip:target=acc,bit=exp", probes=ScanOptions().probes)
    assert rep.devices[0].verdict is Verdict.FAULTY
    text = render(doc, "json")
    assert len(text.encode()) < 1_000_000
    c = doc["devices"][0]["confirmation"]
    assert c["launches"] == sum(p["launches"] for p in c["probes"].values())
    assert c["failed_launches"] == sum(p["failed_launches"] for p in c["probes"].values()) > 0
    assert {"gemm", "determinism", "pow2", "memory"} <= set(c["probes"])
    assert json.loads(text)["devices"][0]["confirmation"] == c


def test_more_cases_in_full_when_asked(healthy):
    rep, doc = _scan("bitflip:target=acc,bit=exp", evidence_in_full=10)
    assert len({e["case_id"] for e in doc["devices"][0]["evidence"]}) == 10
    assert rep.devices[0].stats.gemms <= 1.5 * healthy.stats.gemms


def test_a_healthy_scan_counts_its_launches_and_nothing_failed(healthy):
    c = healthy.tally.to_dict()
    assert c["launches"] == healthy.stats.gemms and c["failed_launches"] == 0
    assert c["probes"]["gemm"]["cases"] == [] and c["fail_fast"] is None


def test_the_verdict_always_rests_on_evidence_in_full():
    t = Tally(in_full=2)
    assert t.keep("gemm", "a", Verdict.SUSPECT) and t.keep("gemm", "b", Verdict.SUSPECT)
    assert not t.keep("gemm", "c", Verdict.SUSPECT)  # past N, no worse: counted only
    assert t.keep("gemm", "a", Verdict.SUSPECT)  # a case shown in full shows all its findings
    assert not t.cheap("gemm")  # nothing confirmed yet: full confirmation goes on
    assert t.keep("gemm", "d", Verdict.FAULTY)  # the first FAULTY is shown, however many came before
    assert t.cheap("gemm") and not t.keep("gemm", "e", Verdict.FAULTY)
    assert t.probe("gemm").in_full == 3
    unbounded = Tally(in_full=None)
    assert all(unbounded.keep("gemm", str(i), Verdict.FAULTY) for i in range(50)) and not unbounded.cheap("gemm")


def test_perturb_draws_distinct_positions_at_its_rate_on_a_70b_sized_output():
    # one launch of an 8192x8192 C: a binomial count of distinct positions (the old draw made
    # one random number per element, seconds of host time per launch on the GPU path)
    import numpy as np

    from aegis_cli.faults.spec import FaultPlan
    from aegis_cli.faults.tensor import perturb_draw

    plan = FaultPlan.parse("perturb:r=1e4")
    (f,), numel, rate = plan.faults, 8192 * 8192, 2e-4
    hit, signs = perturb_draw(plan, f, np.random.default_rng(1), numel)
    mean, sd = numel * rate, (numel * rate * (1 - rate)) ** 0.5
    assert abs(hit.size - mean) < 6 * sd and hit.size == signs.size
    assert np.all(np.diff(hit) > 0) and hit[0] >= 0 and hit[-1] < numel
    assert set(np.unique(signs)) == {-1.0, 1.0}
