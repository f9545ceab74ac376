"""Tier 1: how the sensors' reference kernel splits K (backends/cuda_reference.py ``splits_for``),
which decides its grid and the order of its fp64 sums: from the shape alone, covering K exactly
once, and at the counts its cost model gives for the benchmark model's GEMMs."""

from __future__ import annotations

import pytest

from aegis_cli.backends import cuda_reference as cr


@pytest.mark.parametrize("r", [1, 77, 128, 1030, 8192, 32768])
@pytest.mark.parametrize("k", [1, 5, 255, 256, 517, 2048, 4099, 32768])
@pytest.mark.parametrize("nt", [1, 17, 64, 256])
def test_splits_cover_k_once_in_whole_stages(r, k, nt):
    for planes in (2, 3):
        splits, k_split = cr.splits_for(r, k, nt, planes)
        assert k_split % cr.BK == 0 and k_split >= cr.MIN_SPLIT
        assert (splits - 1) * k_split < k <= splits * k_split  # every split has k, together all of K


# (R, K, nt, planes) of the 1.18B GPT's checks (benchmarks/sensor_reference.py) → splits
@pytest.mark.parametrize(("shape", "splits"), [
    ((8192, 2048, 64, 3), 1),    # mlp.fc forward: 256 CTAs, one wave; more splits only add partials
    ((8192, 2048, 48, 3), 4),    # attn.qkv forward: 192 blocks; 4 splits fill 3 waves nearly whole
    ((6144, 8192, 16, 2), 11),   # attn.qkv wgrad rows: 48 blocks; 11 splits make 2 whole waves
    ((8192, 32768, 16, 3), 4),   # head dgrad: one wave of 256 CTAs, not ten waves of partials
    ((32768, 8192, 16, 2), 1),   # head wgrad rows: 256 blocks
])
def test_benchmark_shapes_split_as_the_cost_model_says(shape, splits):
    assert cr.splits_for(*shape)[0] == splits


def test_the_split_count_follows_the_build_geometry():
    """256-row CTAs, one an SM (SR_WARPS=8): a wave is half the CTAs, each twice the rows, so the
    same whole-wave counts where the row blocks pair up."""
    try:
        cr.DEFINES["SR_WARPS"] = 8
        assert cr.geometry() == (256, 256, 3 * (32 * 272 * 2 + 3 * 512 * 8), 1)
        eight = cr.splits_for(8192, 2048, 64, 3)
    finally:
        cr.DEFINES.pop("SR_WARPS", None)
    assert cr.geometry() == (128, 128, 3 * (32 * 144 * 2 + 3 * 512 * 8), 2)
    assert eight == cr.splits_for(8192, 2048, 64, 3)
