"""The sensors' lean reference (``lean.lean_reference``: one read of each
operand, fp64 slices of the large one) against the scan's full fp64 reference: the checksums
within 0.05 σ of the CUDA kernels' noise model, σ and s (without ρ) within 3%, on random shapes up
to K = 8192 and the scan's three input distributions; with ρ, s is ``lean.stage_bound``, and σ
is what the exact s would give unless the cap binds."""

from __future__ import annotations

import pytest
import torch

from aegis_cli.backends.cuda import CUDA_NOISE
from aegis_cli.ops import lean, numerics
from aegis_cli.ops.gemm import GemmOperands, Layout

NOISE = CUDA_NOISE["wgmma"]  # the CUDA kernels' noise model (importable without a GPU)
SHAPES = [(64, 256, 8192), (200, 300, 517), (77, 1000, 128), (96, 130, 2048), (3, 5, 7), (130, 64, 4096)]


def _ops(layout: Layout, m: int, n: int, k: int, dist: str, seed: int) -> GemmOperands:
    a = numerics.generate_bf16(layout.a_stored_shape(m, k), dist, seed, "cpu")
    b = numerics.generate_bf16(layout.b_stored_shape(k, n), dist, seed + 1, "cpu")
    return GemmOperands(a, b, layout)


def _noise(k: int) -> numerics.NoiseModel:
    return NOISE.capped_at((k / 8 + 128) * 2.0**-24)  # as CudaDevice.noise_model


@pytest.mark.parametrize("dist", numerics.DISTRIBUTIONS)
def test_lean_reference_is_within_a_twentieth_of_sigma(dist):
    worst_sum = worst_scale = 0.0
    for layout in Layout:
        for i, (m, n, k) in enumerate(SHAPES):
            ops = _ops(layout, m, n, k, dist, 10 * i)
            noise = _noise(k)
            full = numerics.reference_checksums(ops, (64, 128), noise)
            sides = [(ops.a_mk, ops.b_kn, 128, lambda x: x), (ops.b_kn.t(), ops.a_mk.t(), 64, lambda x: x.t())]
            wants = [(full.row, full.row_scale, full.row_noise), (full.col, full.col_scale, full.col_noise)]
            for (left, right, t, out), (want, want_s, sigma) in zip(sides, wants, strict=True):
                sums, s, rho = (out(x) for x in lean.lean_side(left, right, t))
                exact = out(lean.lean_side(left, right, t, rho=False)[1])
                assert sums.dtype == s.dtype == rho.dtype == torch.float64 and sums.shape == want.shape
                assert torch.equal(s, out(lean.stage_bound(left, right, t))) and (s >= exact * (1 - 1e-12)).all()
                worst_sum = max(worst_sum, float(((sums - want).abs() / sigma).max()))
                worst_scale = max(worst_scale, float(((exact - want_s).abs() / want_s).max()),
                                  float(((noise.scale(rho, s, k) - sigma).abs() / sigma).max()))
    assert worst_sum <= 0.05, worst_sum
    assert worst_scale <= 0.03, worst_scale


def test_lean_reference_fields_and_rows_only():
    ops = _ops(Layout.WGRAD, 70, 300, 200, "normal", 3)
    full = numerics.reference_checksums(ops, (64, 128), _noise(200))
    both = lean.lean_reference(ops, (64, 128), _noise(200))
    rows = lean.lean_reference(ops, (64, 128), _noise(200), cols=False)
    assert both.floor == full.floor and both.col.shape == full.col.shape and both.col_noise.shape == full.col_noise.shape
    assert torch.equal(rows.row, both.row) and rows.col.shape == (0, 300) and rows.col_noise.shape == (0, 300)
    assert rows.floor == numerics.subnormal_slack(200, 128)
    plain = numerics.reference_checksums(ops, (64, 128), _noise(200), cols=False)  # the scan's path, rows only
    assert torch.equal(plain.row, full.row) and plain.col.numel() == 0 and plain.floor == rows.floor


def test_lean_reference_keeps_tiny_and_huge_rows_and_flags_nonfinite(monkeypatch):
    """Rows near the bottom or the top of the range keep their s and ρ (fp64); NaN/Inf make s
    non-finite (the sensors skip them); slices of the large operand give the same values."""
    monkeypatch.setattr(lean, "LEAN_SLICE", 400)  # 4 rows: 100 of K = 300 per slice
    ops = _ops(Layout.FWD, 4, 256, 300, "normal", 7)
    a = ops.a.float()
    a[0] *= 2.0**-100
    a[1] *= 2.0**100
    ops = GemmOperands(a.to(torch.bfloat16), ops.b, ops.layout)
    full = numerics.reference_checksums(ops, (64, 128), _noise(300))
    got = lean.lean_reference(ops, (64, 128), _noise(300), cols=False)
    bound = lean.stage_bound(ops.a_mk, ops.b_kn, 128)
    assert float(((got.row_scale - bound).abs() / bound).max()) < 1e-12 and (bound >= full.row_scale).all()
    assert float(((got.row_noise - full.row_noise).abs() / full.row_noise).max()) < 1e-3
    bad = ops.a.clone()
    bad[2, 5] = float("nan")
    bad[3, 7] = float("inf")
    got = lean.lean_reference(GemmOperands(bad, ops.b, ops.layout), (64, 128), _noise(300), cols=False)
    assert torch.isfinite(got.row_scale[:2]).all() and not torch.isfinite(got.row_scale[2:]).any()


def test_stage_bound_changes_sigma_only_where_the_cap_binds():
    """s's stage bound (``lean.stage_bound``) is never below s and gives the exact s's σ
    wherever ρ·u + Σ|c|·b stays under s·p. A row of one product over a tile of one column (ρ = s:
    at K = 2048, where u > p, the cap binds) gets σ looser by its stage's largest rta over its own
    (here the stage's other k have rta ≥ 2, its own 0.5), and never by more than (u + b)/p."""
    from aegis_cli.sensors import sense

    k, t = 2048, 128
    c = sense.Sigma.of(_noise(k), k)
    assert c.u > c.p
    left = numerics.generate_bf16((6, k), "normal", 3, "cpu").float()
    right = numerics.generate_bf16((k, t), "normal", 4, "cpu").float() * 0.02
    left[0] = 0.0
    left[0, 40] = 1000.0  # row 0: one product; its k = 40 is in stage 1 (k 32-63)
    right[40] = 0.0
    right[40, 0] = 0.5  # k 40: one column
    right[33:64:2, 1] = 2.0  # odd k of the stage: rta 2 or more
    left, right = left.to(torch.bfloat16), right.to(torch.bfloat16)
    _, bound, rho = lean.lean_side(left, right, t)
    exact = lean.lean_side(left, right, t, rho=False)[1]
    c_abs = numerics.abs_col_tiles((left.float() @ right.float()).to(torch.bfloat16), t)
    assert (bound >= exact * (1 - 1e-12)).all()
    got, want = sense.sigma_of(bound, rho, c_abs, c), sense.sigma_of(exact, rho, c_abs, c)
    binds = rho * c.u + c_abs * c.b > exact * c.p
    assert binds[0, 0] and not binds[1:].any()
    assert torch.equal(got[~binds], want[~binds])
    rta = right[32:64].double().abs().sum(-1)
    ratio = float(got[0, 0] / want[0, 0])
    spread = float(rta.max() / rta[8])
    assert spread >= 4 and ratio == pytest.approx(min(spread, (c.u + c.b) / c.p), rel=1e-12)
    assert 1.0 < ratio <= (c.u + c.b) / c.p


def _composed_sigma(ops, res, ref, noise, truncating):
    """The sensors' σ composed from the scan's lean reference (docs/sensors.md §2.1): on a
    truncating device the scan's plus BIAS·K·2⁻²⁴·Σ|c| (forward, dgrad), never above the
    accumulation bound's, and WGRAD_BOUND × that bound for wgrad; elsewhere the scan's. The oracle
    of ``sense.sigma_of``."""
    from aegis_cli.sensors import sense

    if not truncating:
        return ref.noise()
    per_s = noise.cap / numerics.DEFAULT_TAU
    if ops.layout is Layout.WGRAD:
        return ref.row_scale * (sense.WGRAD_BOUND * per_s), ref.col_scale * (sense.WGRAD_BOUND * per_s)
    c_abs = numerics.sum_col_tiles(res.c.double().abs(), res.tile[1])
    return torch.minimum(ref.row_noise + c_abs * (sense.BIAS * ops.mnk[2] * 2.0**-24), ref.row_scale * per_s), ref.col_noise


def test_sensor_sigma_adds_the_bias_term_and_bounds_wgrad():
    """sense.sigma_of over the sides the sensors compare (``_sides``) is the composed σ: the scan's
    plus the bias term on a truncating device (forward, dgrad), never above the accumulation
    bound's; WGRAD_BOUND × that bound for wgrad; the scan's elsewhere."""
    from aegis_cli.backends.cpu import CpuDevice
    from aegis_cli.sensors import sense

    k = 300
    noise = _noise(k)
    per_s = noise.cap / numerics.DEFAULT_TAU
    for layout in Layout:
        ops = _ops(layout, 70, 200, k, "uniform", 5)
        res = CpuDevice().checked_gemm(ops)
        res = type(res)(**{**res.__dict__, "tile": (64, 128)})
        for trunc in (False, True):  # wgrad on a truncating device: no ρ, so the exact s
            both = layout is Layout.WGRAD
            ref = lean.lean_reference(ops, (64, 128), None if both and trunc else noise, cols=both)
            got = [sense.sigma_of(s, r, c_abs, sense.Sigma.of(noise, k)) for _, _, _, s, r, c_abs, _ in sense._sides(ops, res, trunc, None)]
            want = _composed_sigma(ops, res, ref, noise, trunc)
            assert all(torch.allclose(g, w, rtol=1e-12, atol=0) for g, w in zip(got, want, strict=False))
        if layout is not Layout.WGRAD:
            assert (got[0] >= ref.row_noise * (1 - 1e-12)).all() and (got[0] <= ref.row_scale * per_s * (1 + 1e-12)).all()
            assert (got[0] > ref.row_noise * (1 + 1e-9)).any()  # the bias term is there


def test_enqueued_comparison_is_the_composed_one():
    """sense.enqueue's torch path (``_sides`` + ``sigma_of``, the fused kernel's twin) gives the bits
    of the composition it replaced: the lean reference_checksums, the composed σ, normalised_diff;
    and the finite flag falls with a non-finite input."""
    from aegis_cli.backends.cpu import CpuDevice
    from aegis_cli.sensors import sense

    k = 300
    noise = _noise(k)
    for layout in Layout:
        ops = _ops(layout, 70, 200, k, "normal", 9)
        res = CpuDevice().checked_gemm(ops)
        res = type(res)(**{**res.__dict__, "tile": (64, 128)})
        both = layout is Layout.WGRAD
        for trunc in (False, True):
            ref = lean.lean_reference(ops, (64, 128), None if both and trunc else noise, cols=both)
            row, col = _composed_sigma(ops, res, ref, noise, trunc)
            want = [numerics.normalised_diff(res.row_sums, ref.row, row, ref.floor)]
            if both:
                want.append(numerics.normalised_diff(res.col_sums, ref.col, col, ref.floor))
            parts, summary = sense.enqueue(ops, res, noise, trunc)
            assert [p[0] for p in parts] == ["gemm.row_checksum", "gemm.col_checksum"][:len(want)]
            assert all(torch.equal(p[1], w) for p, w in zip(parts, want, strict=True))
            assert summary.tolist() == [float(w.max()) for w in want] + [1.0]
    bad = ops.a.clone()
    bad[1, 2] = float("inf")
    res = CpuDevice().checked_gemm(GemmOperands(bad, ops.b, ops.layout))
    assert float(sense.enqueue(GemmOperands(bad, ops.b, ops.layout), res, noise, True)[1][-1]) == 0.0
