"""The one judgement of GEMM evidence: each row of its table."""

from __future__ import annotations

import math

import pytest

from aegis_cli.checks import judge
from aegis_cli.checks.recompute import Recompute
from aegis_cli.ops.verdict import Verdict


def refuse():
    raise AssertionError("the rounding doubt must not be asked here")


@pytest.mark.parametrize("check", sorted(judge.RIGOROUS))
def test_a_rigorous_check_is_faulty_however_it_reproduced(check):
    j = judge.judge([check], distinct_outputs=1, reproducible=False, margin=None, confirm_margin=10.0, rounding_doubt=refuse)
    assert j == judge.Judgement(Verdict.FAULTY, "an exact expectation was broken")


def test_distinct_outputs_are_faulty_before_anything_else():
    j = judge.judge(["gemm.row_checksum"], distinct_outputs=3, reproducible=False, margin=0.5, confirm_margin=10.0,
                    rounding_doubt=refuse)
    assert j.severity is Verdict.FAULTY and j.why == "runs of a deterministic kernel gave 3 different results"
    assert judge.judge([], distinct_outputs=2, reproducible=True, margin=None, confirm_margin=1.0).severity is Verdict.FAULTY


def test_reproducible_over_the_margin_is_faulty():
    j = judge.judge(["gemm.col_checksum"], distinct_outputs=1, reproducible=True, margin=250.0, confirm_margin=100.0)
    assert j.severity is Verdict.FAULTY and j.why == "250× over threshold, bit-identical every run"
    j = judge.judge(["gemm.col_checksum"], distinct_outputs=1, reproducible=True, margin=100.0, confirm_margin=100.0)
    assert j.severity is Verdict.FAULTY  # the margin itself confirms


def test_under_the_margin_is_suspect():
    j = judge.judge(["gemm.row_checksum"], distinct_outputs=1, reproducible=True, margin=4.5, confirm_margin=10.0)
    assert j == judge.Judgement(Verdict.SUSPECT, "only 4.5× over threshold (confirmation needs 10×)")


def test_over_the_margin_but_not_every_run_is_suspect():
    j = judge.judge(["gemm.row_checksum"], distinct_outputs=1, reproducible=False, margin=1e6, confirm_margin=1.0)
    assert j.severity is Verdict.SUSPECT and j.why.startswith("only 1e+06× over threshold")


def test_a_rounding_doubt_makes_a_checksum_flag_suspect():
    j = judge.judge(["gemm.row_checksum"], distinct_outputs=1, reproducible=True, margin=1e6, confirm_margin=1.0,
                    rounding_doubt=lambda: "within rounding")
    assert j == judge.Judgement(Verdict.SUSPECT, "within rounding", doubted=True)
    j = judge.judge(["gemm.row_checksum"], distinct_outputs=1, reproducible=True, margin=1e6, confirm_margin=1.0,
                    rounding_doubt=lambda: None)
    assert j.severity is Verdict.FAULTY and not j.doubted


def test_nothing_fired_is_healthy():
    j = judge.judge([], distinct_outputs=1, reproducible=True, margin=None, confirm_margin=1.0, rounding_doubt=refuse)
    assert j.severity is Verdict.HEALTHY


def test_margin_of_a_non_finite_difference_is_infinite():
    assert judge.margin(2e-3, 1e-6) == pytest.approx(2000.0)
    assert judge.margin(math.inf, 1e-6) == math.inf


# -- the fp64 recomputation of flagged checksums (checks/recompute.py) ------------------------------
WITHIN = Recompute(entries=64, elements=8192, beyond_bound=0, worst_ratio=0.9)
BEYOND = Recompute(entries=64, elements=8192, beyond_bound=3, worst_ratio=1e4)


def test_a_reproducible_flag_within_rounding_is_suspect_and_names_numerics():
    j = judge.judge(["gemm.row_checksum"], distinct_outputs=1, reproducible=True, margin=27.6, confirm_margin=1.0,
                    recompute=WITHIN)
    assert j.severity is Verdict.SUSPECT and j.doubted
    assert j.why.startswith("numerics: threshold too tight for this input? 27.6× over threshold") and "within" in j.why


def test_a_reproducible_flag_beyond_rounding_stays_faulty():
    j = judge.judge(["gemm.col_checksum"], distinct_outputs=1, reproducible=True, margin=27.6, confirm_margin=1.0,
                    recompute=BEYOND)
    assert j == judge.Judgement(Verdict.FAULTY, "27.6× over threshold, bit-identical every run")


def test_rigorous_checks_and_distinct_outputs_outrank_the_recomputation():
    for checks, distinct in ((["gemm.row_checksum", "gemm.pow2_exact"], 1), (["gemm.row_checksum"], 2)):
        j = judge.judge(checks, distinct_outputs=distinct, reproducible=True, margin=5.0, confirm_margin=1.0,
                        recompute=WITHIN)
        assert j.severity is Verdict.FAULTY
