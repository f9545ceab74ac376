"""The power-of-two vote (checks/vote.py): bit patterns per scale in, the odd runs out."""

from __future__ import annotations

import pytest

from aegis_cli.checks.vote import failures, majority, vote

GOOD, BAD, OTHER = 0x1111, 0xBAD, 0x0DD


def test_unanimous_runs_have_no_odd_one():
    v = vote([[GOOD] * 6, [GOOD], [GOOD], [GOOD]])
    assert v.decided and v.majority == GOOD and v.votes == v.scales == 4 and v.odd == ()


def test_a_base_run_hit_once_is_the_odd_one():
    """The bug the vote fixes: the base run's first result was wrong, so every scaled run broke
    the expectation built from it; its re-runs and the scaled runs agree on the true bits."""
    v = vote([[BAD] + [GOOD] * 5, [GOOD], [GOOD], [GOOD]])
    assert v.majority == GOOD and v.odd == ((0, 0),)
    assert failures([BAD] + [GOOD] * 5, v.majority) == 1


def test_a_scaled_run_hit_once_is_the_odd_one():
    v = vote([[GOOD] * 6, [GOOD], [BAD], [GOOD]])
    assert v.majority == GOOD and v.votes == 3 and v.odd == ((2, 0),)


def test_scales_vote_not_runs():
    """A base wrong in every run (a fault that sits still) does not outvote three scaled runs
    by being re-run: each scale has one vote."""
    v = vote([[BAD] * 6, [GOOD], [GOOD], [GOOD]])
    assert v.majority == GOOD and v.odd == tuple((0, j) for j in range(6))


def test_a_scale_whose_own_runs_disagree_abstains():
    v = vote([[GOOD, BAD, OTHER, BAD, GOOD, OTHER], [GOOD], [GOOD]])
    assert majority([GOOD, BAD, OTHER, BAD, GOOD, OTHER]) is None
    assert v.majority == GOOD and v.votes == 2 and v.scales == 3
    assert v.odd == ((0, 1), (0, 2), (0, 3), (0, 5))


@pytest.mark.parametrize("scales", [
    [[GOOD] * 3, [BAD]],                   # two scales that disagree: either could be wrong
    [[GOOD] * 6, [BAD], [OTHER], [GOOD]],  # two of four is not more than half
    [[GOOD, BAD], [OTHER]],                # no scale has a majority of its own runs
    [],
])
def test_without_a_strict_majority_of_scales_the_vote_is_undecided(scales):
    v = vote(scales)
    assert not v.decided and v.majority is None and v.odd == ()


def test_failures_count_the_runs_off_the_reference():
    assert failures([GOOD, BAD, BAD, GOOD], GOOD) == 2
    assert failures([BAD] * 3, GOOD) == 3 and failures([], GOOD) == 0
