"""A replayed result against what was observed at capture."""

from __future__ import annotations

import torch

from aegis_cli.checks.observed import compare_with_capture, result_bits_equal, same_bits
from aegis_cli.ops import numerics
from aegis_cli.ops.gemm import GemmResult


def run(tile=(4, 4), seed=0) -> GemmResult:
    acc = torch.randn(8, 8, generator=torch.Generator().manual_seed(seed))
    return GemmResult(c=acc.to(torch.bfloat16), row_sums=numerics.sum_col_tiles(acc, tile[1]),
                      col_sums=numerics.sum_row_tiles(acc, tile[0]), tile=tile)


def observed(res: GemmResult) -> dict:
    return {"c": res.c.clone(), "row_sums": res.row_sums.clone(), "col_sums": res.col_sums.clone()}


def test_same_bits_tells_signed_zeros_apart():
    z = torch.zeros(3, dtype=torch.bfloat16)
    assert same_bits(z, z.clone()) and not same_bits(z, -z)
    assert result_bits_equal(run(), run()) and not result_bits_equal(run(), run(seed=1))


def test_identical_run_matches_bit_for_bit():
    res = run()
    out = compare_with_capture(res, observed(res), (4, 4), exact=True)
    assert out["matches"] is True and "output bit-identical to the capture" in out["detail"]


def test_a_changed_element_is_counted():
    res, cap = run(), observed(run())
    cap["c"].view(torch.int16)[0, 0] ^= 1
    out = compare_with_capture(res, cap, (4, 4), exact=True)
    assert out["matches"] is False and "1 of 64 output elements differ" in out["detail"]


def test_other_tiles_compare_totals_and_a_subset_skips_the_output_bits():
    res, cap = run(tile=(2, 2)), observed(run())
    out = compare_with_capture(res, cap, (4, 4), exact=True)
    assert out["matches"] is True and "row_sums totals agree with the capture (tiles [2, 2] vs [4, 4])" in out["detail"]
    out = compare_with_capture(run(), observed(run()), (4, 4), exact=False)
    assert out["detail"].startswith("output not compared bit for bit") and out["matches"] is True


def test_nothing_observed():
    assert compare_with_capture(run(), {}, (4, 4), exact=True) == {"matches": None,
                                                                     "detail": "nothing observed at capture to compare with"}
