"""The sensors' reference kernel (kernels/sensor_reference.cu, ``CudaDevice.lean_side``) against its
torch reference (``lean.lean_side``, fp64) on the same CUDA tensors (tier 2, ``gpu``): random
and ragged shapes (not multiples of the MMA tiles, the CTA tiles or the 32-deep stages), every load
mode of the left operand (16-byte k vectors, 16- and 8-byte row vectors, scalar loads into either layout,
ragged views whose vectors end mid-way), every stored layout of the right one, rows near the ends
of the range, NaN/Inf, bit-identical repeats, and the sensors' comparison."""

from __future__ import annotations

import pytest
import torch

from aegis_cli.ops import lean, numerics
from aegis_cli.ops.gemm import GemmOperands, Layout

pytestmark = pytest.mark.gpu
CUDA = "cuda:0"
# (R, K, N, t): ragged R, K and N, a single row, K below and across one stage, many splits, tiles
# across two CTA tile blocks (nt 17, 20, 40), R across CTA row blocks
SHAPES = [(77, 517, 300, 128), (3, 5, 7, 64), (1, 2048, 256, 128), (600, 64, 1000, 64), (1030, 4099, 520, 128),
          (256, 8192, 384, 64), (129, 33, 17 * 128, 128), (130, 1000, 1221, 64), (300, 3000, 2560, 64)]


def _bound(k: int) -> float:
    """Relative error allowed between two fp64 sums of k non-negative terms in different orders
    (each within (k+1)·2⁻⁵³ of the exact one), and of |Δ sums| ÷ s."""
    return 2 * (k + 2) * 2.0**-53


# s with ρ (the stage bound) against its fp64 twin: the kernel adds a row's |L| of a stage in fp32
# (8 exact terms a lane, then 4 lanes: 9 roundings of non-negative sums)
S_BOUND = 2.0**-20


@pytest.fixture(scope="module")
def dev():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from aegis_cli.backends.cuda import CudaDevice

    return CudaDevice(0)


def _bf16(shape, seed: int, transposed: bool, scale: float = 1.0) -> torch.Tensor:
    """A seeded bf16 tensor of ``shape`` (never zeros), stored row-major or as the transpose of a row-major one."""
    g = torch.Generator(device=CUDA).manual_seed(seed)
    if transposed:
        return (torch.randn(shape[::-1], generator=g, device=CUDA) * scale).to(torch.bfloat16).t()
    return (torch.randn(shape, generator=g, device=CUDA) * scale).to(torch.bfloat16)


def _compare(got, want) -> tuple[float, float, float]:
    """(worst |Δ sums| ÷ s, worst relative Δ s, worst relative Δ ρ or 0 without ρ)."""
    (sums, s, rho), (w_sums, w_s, w_rho) = got, want
    assert sums.shape == w_sums.shape and sums.dtype == s.dtype == torch.float64 and (rho is None) == (w_rho is None)
    d_rho = 0.0 if rho is None else float(((rho - w_rho).abs() / w_rho).max())
    return float(((sums - w_sums).abs() / w_s).max()), float(((s - w_s).abs() / w_s).max()), d_rho


def _check(got, want, k: int) -> None:
    """The sums and ρ within _bound(k); s within S_BOUND with ρ (the stage bound), else within _bound(k)."""
    sums, s, rho = _compare(got, want)
    assert max(sums, rho) <= _bound(k) and s <= (_bound(k) if want[2] is None else S_BOUND), (sums, s, rho, k)


def _mode(left: torch.Tensor) -> str:
    """The kernel's load mode for ``left`` and, for scalar loads, the stage layout they fill."""
    from aegis_cli.backends import cuda_reference as cr

    mode = cr._mode(left)
    sr, sk = left.stride()
    return {cr.VEC_K: "vec-k", cr.VEC_R: "vec-r", cr.VEC_R16: "vec-r16"}.get(mode, "scalar-kmajor" if sr < sk else "scalar-rows")


@pytest.mark.parametrize("left_t", [False, True], ids=["left-rows", "left-cols"])
@pytest.mark.parametrize("right_t", [False, True], ids=["right-rows", "right-cols"])
def test_kernel_matches_the_torch_reference(dev, left_t, right_t):
    """sums within 2(K+2)·2⁻⁵³ of s, ρ within 2(K+2)·2⁻⁵³ relative (fp64 products and sums both,
    other orders), s (the stage bound) within S_BOUND; the same bits again; without ρ, the same sums
    and the exact s within 2(K+2)·2⁻⁵³, never above the bound; the shapes reach both load modes of
    their layout (vectors and scalar loads)."""
    modes = set()
    for i, (r, k, n, t) in enumerate(SHAPES):
        left = _bf16((r, k), 10 * i, left_t)
        right = _bf16((k, n), 10 * i + 1, right_t, 0.02)
        modes.add(_mode(left))
        got = dev.lean_side(left, right, t)
        _check(got, lean.lean_side(left, right, t), k)
        again = dev.lean_side(left, right, t)
        assert all(torch.equal(a, b) for a, b in zip(got, again, strict=True)), (r, k, n, t)
        exact = dev.lean_side(left, right, t, rho=False)  # the build without ρ: the same sums, the exact s
        assert exact[2] is None and torch.equal(exact[0], got[0]), (r, k, n, t)
        _check(exact, lean.lean_side(left, right, t, rho=False), k)
        assert (exact[1] <= got[1] * (1 + S_BOUND)).all(), (r, k, n, t)
    assert modes >= ({"vec-r16", "vec-r", "scalar-kmajor"} if left_t else {"vec-k", "scalar-rows"}), modes


def test_views_whose_vectors_end_mid_way(dev):
    """Vector loads of views narrower than their stride: a k vector ending inside the last 8 k (K
    1027 of rows 1032 apart), row vectors ending inside the last 4 or 8 rows (R 1030 of 1036 or of
    1040): the elements beyond the view (nonzero in the storage) stay out."""
    left_k = _bf16((300, 1032), 11, False)[:, :1027]
    left_r = _bf16((1036, 700), 12, True)[:1030]
    left_r16 = _bf16((1040, 700), 13, True)[:1030]
    assert _mode(left_k) == "vec-k" and _mode(left_r) == "vec-r" and _mode(left_r16) == "vec-r16"
    for left in (left_k, left_r, left_r16):
        k = left.shape[1]
        right = _bf16((k, 900), k, False, 0.02)
        _check(dev.lean_side(left, right, 128), lean.lean_side(left, right, 128), k)


def test_misaligned_operands_take_the_scalar_loads(dev):
    base = _bf16((300, 1031), 3, False)
    left = base[:, 1:1025]  # rows 1031 apart, one element off: no 16-byte vectors
    assert _mode(left) == "scalar-rows" and _mode(left.t()) == "scalar-kmajor"
    right = _bf16((1024, 260), 4, True)[:, 1:]
    _check(dev.lean_side(left, right, 128), lean.lean_side(left, right, 128), 1024)
    right_t = _bf16((300, 200), 5, False, 0.02)
    _check(dev.lean_side(left.t(), right_t, 64), lean.lean_side(left.t(), right_t, 64), 300)


def test_extreme_rows_keep_fp64_values_and_nonfinite_rows_stay_nonfinite(dev):
    """Rows scaled by 2¹⁰⁰ and 2⁻¹⁰⁰ (their squares 2^±200: fp64, nothing special) keep their sums,
    s and ρ; NaN and Inf make s non-finite in their rows only, as in the torch reference (the
    sensors skip them)."""
    left = _bf16((8, 700), 5, False).float()
    left[0] *= 2.0**100
    left[1] *= 2.0**-100
    left[2, :5] *= 2.0**120
    right = _bf16((700, 256), 6, False)
    left = left.to(torch.bfloat16)
    got, want = dev.lean_side(left, right, 128), lean.lean_side(left, right, 128)
    assert torch.isfinite(got[1]).all() and torch.isfinite(got[2]).all()
    _check(got, want, 700)
    left[3, 9] = float("nan")
    left[4, 600] = float("inf")
    bad = dev.lean_side(left, right, 128)
    assert not torch.isfinite(bad[1][3:5]).any()
    rest = [0, 1, 2, 5, 6, 7]  # the other rows of the same MMA tiles: the same bits as before
    assert all(torch.equal(b[rest], g[rest]) for b, g in zip(bad, got, strict=True))


@pytest.mark.parametrize("layout", list(Layout), ids=[x.value for x in Layout])
def test_sensor_comparison_with_the_kernel_is_the_torch_one(dev, layout):
    """sense.enqueue with the device's reference and Σ|c|: the same normalised differences as with
    torch's, within 10⁻⁴ σ, and the same finite flag."""
    from aegis_cli.sensors import sense

    m, n, k = 300, 520, 1000
    a = _bf16(layout.a_stored_shape(m, k), 7, False)
    b = _bf16(layout.b_stored_shape(k, n), 8, False, 0.02)
    ops = GemmOperands(a, b, layout)
    res = sense.launch(dev, ops, None, "train/x")
    noise = dev.noise_model(k)
    parts_t, sum_t = sense.enqueue(ops, res, noise, True)
    parts_k, sum_k = sense.enqueue(ops, res, noise, True, dev)
    assert [p[0] for p in parts_t] == [p[0] for p in parts_k]
    for (_, dt, _, _), (_, dk, _, _) in zip(parts_t, parts_k, strict=True):
        assert float((dt - dk).abs().max()) <= 1e-4
    assert float(sum_t[-1]) == float(sum_k[-1]) == 1.0


def test_tile_abs_sums_match_torch(dev):
    """Σ|c| over column tiles (the sensors' bias term): exact sums of bf16 values, so equal to torch's;
    a warp per (row, tile) on row-major tensors and views (ragged, misaligned), a thread per (row,
    tile) on a transpose."""
    views = [_bf16((m, n), m + n, False) for m, n in ((300, 1000), (5, 7), (8192 // 16, 2048))]
    views += [_bf16((300, 1004), 9, False)[:, :1001], _bf16((300, 1004), 9, False)[:, 1:], _bf16((700, 260), 10, True)]
    for x in views:
        for t in (64, 128):
            got, want = dev.tile_abs_sums(x, t), numerics.abs_col_tiles(x, t)
            assert got.shape == want.shape and float(((got - want).abs() / want).max()) <= 1e-15


def _stat_cases() -> list[tuple[str, torch.Tensor, int]]:
    """(mode, bf16 (K, N) tensor, t): every mode of the statistics, ragged ends and the lane counts of t."""
    rows = _bf16((300, 1008), 20, False)
    wt = _bf16((1032, 520), 21, True)  # the transpose of a (520, 1032) row-major tensor: k contiguous
    return [("vec-cols", rows[:, :1000], 128), ("vec-cols", rows[:, :1001], 64), ("vec-cols", rows[:, :1003], 96),
            ("vec-cols", rows[:, :1001], 8), ("vec-cols", _bf16((70, 2056), 22, False)[:, :2049], 1024),
            ("vec-cols", _bf16((5, 8), 23, False)[:, :7], 64), ("vec-cols", _bf16((3000, 520), 24, False, 0.02), 128),
            ("vec-k", wt, 128), ("vec-k", wt[:1027], 64), ("vec-k", wt[:5, :300], 128), ("vec-k", wt[:100, :7], 8),
            ("vec-k", _bf16((2048, 1000), 25, True, 0.02), 128),
            ("cols", rows[:, 1:1000], 128), ("cols", rows[:, ::2], 64), ("cols", rows[:, :1000], 100),
            ("k", _bf16((1031, 300), 26, True), 128), ("k", wt[1:], 64),
            ("k", rows.t()[1:, ::3], 64), ("cols", _bf16((1031, 300), 26, True)[::2], 64)]


def test_tile_statistics_in_every_mode_are_torch_sums(dev):
    """Σ and Σ|·| of each (row, tile) equal torch's fp64 sums bit for bit (sums of bf16 values,
    exact in fp64 in any order on such data), Σ·² within 2(t+2)·2⁻⁵³ relative (non-negative
    terms, other orders); Σ|·| alone (tile_abs_sums) the statistics' bits; repeats bit-identical."""
    from aegis_cli.backends import cuda_reference as cr

    names = {cr.ST_VEC_COLS: "vec-cols", cr.ST_VEC_K: "vec-k", cr.ST_COLS: "cols", cr.ST_K: "k"}
    for mode, x, t in _stat_cases():
        assert names[cr.stats_mode(x, t)[0]] == mode, (mode, x.shape, x.stride(), t)
        k, n = x.shape
        nt = -(-n // t)
        x3 = torch.nn.functional.pad(x, (0, nt * t - n)).reshape(k, nt, t).double()
        got = cr.tile_stats(x, t)
        assert got.shape == (3, k, nt) and got.dtype == torch.float64
        assert torch.equal(got[0], x3.sum(-1)) and torch.equal(got[1], x3.abs().sum(-1)), (mode, x.shape, t)
        want_sq = x3.square().sum(-1)
        assert float(((got[2] - want_sq).abs() / want_sq).max()) <= 2 * (t + 2) * 2.0**-53, (mode, x.shape, t)
        assert torch.equal(cr.tile_stats(x, t), got), (mode, x.shape, t)
        abs_only = cr.tile_abs_sums(x, t)
        assert torch.equal(abs_only, got[1]) and torch.equal(abs_only, numerics.abs_col_tiles(x, t)), (mode, x.shape, t)


def test_packed_kmajor_stage_keeps_the_bits(dev):
    """The k-major stage by 16-byte copies and packed reads (SR_KM_PACK) moves rows to other MMA
    rows, never k to other slots: the same bits as the 8-byte copies and 2-byte reads."""
    from aegis_cli.backends import cuda_reference as cr

    left = _bf16((1040, 700), 14, True)[:1030]
    right = _bf16((700, 520), 15, False, 0.02)
    assert _mode(left) == "vec-r16"
    got = cr.lean_side(left, right, 64)
    try:
        cr.DEFINES["SR_KM_PACK"] = 0
        old = cr.lean_side(left, right, 64)
    finally:
        cr.DEFINES.pop("SR_KM_PACK", None)
    assert all(torch.equal(a, b) for a, b in zip(got, old, strict=True))


@pytest.mark.parametrize("left_t", [False, True], ids=["left-rows", "left-cols"])
def test_whole_stages_keep_the_bits(dev, left_t):
    """Whole stages by load_whole (SR_WHOLE) copy the same values to the same places as load_stage:
    the same bits with and without ρ, on a grid whose last row block, tile block and stage are
    partial (those take load_stage) beside whole ones, and against the torch reference."""
    from aegis_cli.backends import cuda_reference as cr

    # R 1030: 8 whole row blocks and a partial one; K 700: 21 whole stages and a partial one;
    # 40 tiles of 64: two whole tile blocks of 16 and a partial one
    left = _bf16((1040, 700), 16, True)[:1030] if left_t else _bf16((1030, 704), 16, False)[:, :700]
    right = _bf16((700, 2560), 17, False, 0.02)
    assert _mode(left) == ("vec-r16" if left_t else "vec-k")
    for rho in (True, False):
        got = cr.lean_side(left, right, 64, rho)
        try:
            cr.DEFINES["SR_WHOLE"] = 0
            old = cr.lean_side(left, right, 64, rho)
        finally:
            cr.DEFINES.pop("SR_WHOLE", None)
        assert all(torch.equal(a, b) for a, b in zip(got[:2], old[:2], strict=True)), rho
        assert (got[2] is None) == (old[2] is None) == (not rho) and (not rho or torch.equal(got[2], old[2]))
    _check(cr.lean_side(left, right, 64), lean.lean_side(left, right, 64), 700)


@pytest.mark.parametrize("left_t", [False, True], ids=["left-rows", "left-cols"])
def test_eight_warp_ctas_keep_the_bits(dev, left_t):
    """CTAs of 8 warps (SR_WARPS=8: 256 rows, one an SM) stack the same 32-row warps: where the
    split count is the same (whole pairs of 128-row blocks), the same bits as 4 warps, with and
    without ρ; on a ragged grid, within the bound of the torch reference."""
    from aegis_cli.backends import cuda_reference as cr

    left = _bf16((1024, 1000), 18, True) if left_t else _bf16((1024, 1000), 18, False)
    right = _bf16((1000, 2560), 19, False, 0.02)
    for rho in (True, False):
        got = cr.lean_side(left, right, 64, rho)
        try:
            cr.DEFINES["SR_WARPS"] = 8
            splits = cr.splits_for(1024, 1000, 40, 3 if rho else 2)
            eight = cr.lean_side(left, right, 64, rho)
            ragged = cr.lean_side(left[:1000], right[:, :2500], 64, rho)
        finally:
            cr.DEFINES.pop("SR_WARPS", None)
        assert splits == cr.splits_for(1024, 1000, 40, 3 if rho else 2)  # what equal bits need
        assert all(torch.equal(a, b) for a, b in zip(got[:2], eight[:2], strict=True)), rho
        assert not rho or torch.equal(got[2], eight[2])
        if rho:
            _check(ragged, lean.lean_side(left[:1000], right[:, :2500], 64), 1000)
