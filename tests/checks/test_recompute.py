"""Recomputing flagged checksums in fp64 (checks/recompute.py): bits beyond any rounding are told
from rounding a too-tight threshold sees, on hand-built results."""

from __future__ import annotations

import math
import random

import pytest
import torch

from aegis_cli.checks import recompute as recheck
from aegis_cli.checks.gemm import checksum_signal
from aegis_cli.ops import numerics
from aegis_cli.ops.gemm import GemmOperands, GemmResult, Layout

TILE = (16, 32)
M, N, K = 48, 96, 512


def _run(seed: int, layout: Layout = Layout.FWD, dist: str = "normal") -> tuple[GemmOperands, GemmResult]:
    """A healthy checked GEMM as the CPU backend computes it: fp32 accumulator, sums from it."""
    a = numerics.generate_bf16(layout.a_stored_shape(M, K), dist, seed, "cpu")
    b = numerics.generate_bf16(layout.b_stored_shape(K, N), dist, seed + 1, "cpu")
    ops = GemmOperands(a, b, layout)
    acc = ops.a_mk.float() @ ops.b_kn.float()
    tm, tn = TILE
    return ops, GemmResult(c=acc.bfloat16(), row_sums=numerics.sum_col_tiles(acc.double(), tn).float(),
                           col_sums=numerics.sum_row_tiles(acc.double(), tm).float(), tile=TILE)


def _all(axes: str) -> torch.Tensor:
    """Every checksum position of one axis."""
    shape = (M, N // TILE[1]) if axes == "row" else (M // TILE[0], N)
    return torch.ones(shape, dtype=torch.bool).nonzero()


def _bound(ops: GemmOperands, axes: str, r: int, c: int) -> float:
    """The rigorous bound of one checksum entry: γ of K + span operations times its Σ|a||b|."""
    ref = numerics.reference_checksums(ops, TILE)
    scale, span = (ref.row_scale, TILE[1]) if axes == "row" else (ref.col_scale, TILE[0])
    return numerics.accumulation_ceiling(K, span) * float(scale[r, c])


@pytest.mark.parametrize("axes", ["row", "col"])
@pytest.mark.parametrize("dist", ["normal", "heavy"])
def test_a_healthy_result_is_within_rounding_everywhere(axes, dist):
    ops, res = _run(random.randrange(2**31), random.choice(list(Layout)), dist)
    rc = recheck.recompute(ops, res, axes, _all(axes))
    span = TILE[1] if axes == "row" else TILE[0]
    assert rc is not None and not rc.wrong and 0 < rc.worst_ratio <= 1
    assert rc.entries == _all(axes).shape[0] and rc.elements == rc.entries * span


def _one_entry(axes: str):
    """A healthy run, every position of one axis, one of them drawn, and that axis's sums."""
    ops, res = _run(random.randrange(2**31))
    where = _all(axes)
    r, c = where[random.randrange(where.shape[0])].tolist()
    return ops, res, where, (r, c), res.row_sums if axes == "row" else res.col_sums


@pytest.mark.parametrize("axes", ["row", "col"])
def test_a_corrupted_accumulator_sum_is_beyond_the_bound(axes):
    ops, res, where, (r, c), sums = _one_entry(axes)
    sums[r, c] += 3 * _bound(ops, axes, r, c)  # C untouched: only the fused sum is wrong
    rc = recheck.recompute(ops, res, axes, where)
    assert rc.wrong and rc.beyond_bound == 1 and 2.5 < rc.worst_ratio < 3.5


@pytest.mark.parametrize("axes", ["row", "col"])
def test_a_rounding_sized_difference_is_within(axes):
    ops, res, where, (r, c), sums = _one_entry(axes)
    x = sums[r, c : c + 1]
    for _ in range(4):  # four fp32 ulps: far more than τ = 1e-10 allows, far less than rounding can reach
        x.copy_(torch.nextafter(x, torch.tensor([math.inf])))
    rc = recheck.recompute(ops, res, axes, where)
    assert not rc.wrong and rc.beyond_bound == 0


def test_a_wrong_output_element_is_beyond_the_bound_and_nan_infinitely():
    ops, res = _run(random.randrange(2**31))
    i, j = random.randrange(M), random.randrange(N)
    res.c[i, j] = res.c[i, j] * 4 + 1  # C and sums disagree: a store-side error, or one the sums missed
    rc = recheck.recompute(ops, res, "row", torch.tensor([[i, j // TILE[1]]]))
    assert rc.wrong and rc.beyond_bound == 1 and rc.entries == 1 and rc.elements == TILE[1]
    res.row_sums[i, j // TILE[1]] = math.nan
    rc = recheck.recompute(ops, res, "row", torch.tensor([[i, j // TILE[1]]]))
    assert rc.beyond_bound == 2 and rc.worst_ratio == math.inf
    assert rc.to_dict() == {"entries": 1, "elements": TILE[1], "beyond_bound": 2, "worst_ratio": math.inf}


def test_the_worst_entries_are_recomputed_and_no_more():
    ops, res = _run(random.randrange(2**31))
    ref = numerics.reference_checksums(ops, TILE)
    d_row, _ = numerics.checksum_diffs(res, ref)
    sig = checksum_signal("gemm.row_checksum", d_row, res.row_sums, ref.row, 0.0)
    worst = recheck.worst_positions(sig, limit=5)
    top = torch.topk(d_row.reshape(-1), 5).values
    assert worst.shape == (5, 2) and sorted(d_row[worst[:, 0], worst[:, 1]].tolist()) == sorted(top.tolist())
    assert recheck.worst_positions(sig, limit=10**6).shape[0] == sig.elements


def test_no_finite_bound_at_k_too_deep_returns_none():
    k = 1 << 22  # K·2⁻²³ = ½: γ_K has no finite value
    ops = GemmOperands(torch.ones(1, k, dtype=torch.bfloat16), torch.ones(1, k, dtype=torch.bfloat16), Layout.FWD)
    res = GemmResult(torch.zeros(1, 1, dtype=torch.bfloat16), torch.zeros(1, 1), torch.zeros(1, 1), (1, 1))
    assert recheck.recompute(ops, res, "row", torch.tensor([[0, 0]])) is None


def test_merge_adds_counts_and_keeps_the_worst():
    a, b = recheck.Recompute(2, 64, 0, 0.5), recheck.Recompute(1, 32, 1, 7.0)
    assert a.merge(b) == recheck.Recompute(3, 96, 1, 7.0) and a.merge(None) is a
    assert "1 beyond any rounding" in b.describe() and "within what fp32 rounding can reach" in a.describe()
