"""The comparison helpers the scan and the replay share (numerics.checksum_diffs,
output_rowsum_excess, bf16_mismatches): each flags exactly what was changed, nothing on a
clean result."""

from __future__ import annotations

import dataclasses

import torch

from aegis_cli.backends.cpu import CpuDevice
from aegis_cli.ops import numerics
from aegis_cli.ops.gemm import GemmOperands, Layout


def _clean(m: int = 150, n: int = 300, k: int = 96, seed: int = 11):
    dev = CpuDevice()
    ops = GemmOperands(dev.generate((m, k), "normal", seed), dev.generate((k, n), "normal", seed + 1), Layout.DGRAD)
    return dev.checked_gemm(ops), dev.reference_checksums(ops, dev.tile)


def test_checksum_diffs_flag_only_the_changed_sums():
    res, ref = _clean()
    tau = numerics.Thresholds().tau
    d_row, d_col = numerics.checksum_diffs(res, ref)
    assert d_row.shape == res.row_sums.shape and d_col.shape == res.col_sums.shape
    assert float(d_row.max()) < tau and float(d_col.max()) < tau
    rows, cols = res.row_sums.clone(), res.col_sums.clone()
    rows[7, 1] += 1.0  # about 1e-4 of its magnitude scale s: far above τ
    cols[1, 200] = float("nan")
    d_row, d_col = numerics.checksum_diffs(dataclasses.replace(res, row_sums=rows, col_sums=cols), ref)
    assert (d_row > tau).nonzero().tolist() == [[7, 1]]
    assert (d_col > tau).nonzero().tolist() == [[1, 200]] and float(d_col[1, 200]) == float("inf")


def test_output_rowsum_excess_finds_a_changed_output_element():
    res, _ = _clean()
    tn = res.tile[1]
    over, ratio, bound = numerics.output_rowsum_excess(res, tn)
    assert not bool(over.any()) and float(ratio.max()) <= 1.0
    assert torch.equal(bound, numerics.output_rowsum_diff(res, tn)[1])
    c = res.c.clone()
    c[40, 130] = c[40, 130] * 4 + 1  # well past its rounding: row 40, column tile 1
    over, ratio, _ = numerics.output_rowsum_excess(dataclasses.replace(res, c=c), tn)
    assert over.nonzero().tolist() == [[40, 130 // tn]] and float(ratio[40, 130 // tn]) > 1.0


def test_bf16_mismatches_compares_raw_bits():
    res, _ = _clean(64, 64, 32)
    assert numerics.bf16_mismatches(res.c, res.c.clone()).shape == (0, 2)
    a, b = res.c.clone(), res.c.clone()
    b.view(torch.int16)[3, 5] ^= 1  # the lowest mantissa bit
    a[2, 2], b[2, 2] = 0.0, -0.0  # equal as numbers, not as bits
    assert sorted(map(tuple, numerics.bf16_mismatches(a, b).tolist())) == [(2, 2), (3, 5)]


def test_overflow_bound_covers_every_output_and_its_checksums():
    dev = CpuDevice()
    ops = GemmOperands(dev.generate((40, 24), "heavy", 3), dev.generate((24, 56), "heavy", 4), Layout.DGRAD)
    a, b = ops.a_mk.double().abs(), ops.b_kn.double().abs()
    exact = float((a @ b).max())  # the true largest Σ_k |A_ik|·|B_kj|
    bound = numerics.overflow_bound(ops) / numerics.CHECKSUM_SPAN
    assert exact <= bound <= min(float((a @ b.amax(1)).max()), float((a.amax(0) @ b).max())) * (1 + 1e-12)
    assert numerics.overflow_bound(ops, chunk=50) == numerics.overflow_bound(ops)  # slicing changes nothing
    from aegis_cli.backends.cuda import CHECK_TILE  # a constant: importing it touches no GPU

    assert max(*CpuDevice().tile, *CHECK_TILE) <= numerics.CHECKSUM_SPAN


def test_pow2_exact_safe_leaves_room_for_the_checksum_sums():
    mag = numerics.Magnitudes(amin=1.0, amax=2.0, bmin=1.0, bmax=2.0, k=1024)
    # 4·1024·2^e must stay below BF16_MAX/4 even when CHECKSUM_SPAN outputs are added up
    limit = numerics.BF16_MAX / 4 / (4 * 1024 * numerics.CHECKSUM_SPAN)
    e = int(torch.tensor(limit).log2().floor())
    assert mag.exact_safe(e, 0) and not mag.exact_safe(e + 1, 0)


def test_flushed_subnormal_results_are_not_flagged():
    """What an FTZ device returns for products below fp32's normal range: zeros. The reference
    still holds the tiny exact values; the difference is under ReferenceChecksums.floor."""
    dev = CpuDevice()
    ops = GemmOperands(numerics.pow2_scale(dev.generate((64, 96), "normal", 5), -66),
                       numerics.pow2_scale(dev.generate((96, 128), "normal", 6), -66), Layout.DGRAD)
    res, ref = dev.checked_gemm(ops), dev.reference_checksums(ops, dev.tile)
    assert float(ref.row.abs().max()) > 0  # the exact sums are tiny, not zero
    flushed = dataclasses.replace(res, c=torch.zeros_like(res.c), row_sums=torch.zeros_like(res.row_sums),
                                  col_sums=torch.zeros_like(res.col_sums))
    tau = numerics.Thresholds().tau
    for r in (res, flushed):
        assert all(float(d.max()) <= tau for d in numerics.checksum_diffs(r, ref))
        assert not bool(numerics.output_rowsum_excess(r, dev.tile[1])[0].any())
    # the floor is far below anything that matters for data in the normal range
    normal = dev.reference_checksums(GemmOperands(dev.generate((64, 96), "normal", 5), dev.generate((96, 128), "normal", 6),
                                                  Layout.DGRAD), dev.tile)
    assert normal.floor < 1e-30 * float(normal.row_scale.min())


def test_pow2_scale_reaches_2_to_the_128():
    # replay --scales 64,64 scales the base C by 2^128, which is not an fp32: one factor made
    # every expected value inf and a healthy device FAULTY
    t = torch.tensor([1.0, -1.5, 2.0**-30, 0.0], dtype=torch.bfloat16)
    assert torch.equal(numerics.pow2_scale(t * 2.0**-64, 128), (t.double() * 2.0**64).to(torch.bfloat16))
    assert torch.equal(numerics.pow2_scale(t * 2.0**100, -160), (t.double() * 2.0**-60).to(torch.bfloat16))
    assert torch.isinf(numerics.pow2_scale(t[:1], 128)).all()  # an output that truly overflows still does


def test_faulty_outranks_error():
    from aegis_cli.ops.verdict import Verdict, worst

    # corruption confirmed before a later check failed stays the finding (as in the node exit code)
    assert worst([Verdict.FAULTY, Verdict.ERROR]) is Verdict.FAULTY
    assert worst([Verdict.SUSPECT, Verdict.ERROR]) is Verdict.ERROR and worst([]) is Verdict.ERROR


def test_pow2_exact_needs_finite_operands_and_an_exact_base():
    # 2^64·A with 2^-64·B keeps the products in range but A itself overflows bf16
    mag = numerics.Magnitudes(2.0**60, 2.0**65, 2.0**-62, 2.0**-60, 4)
    assert mag.exact_safe(0, 0) and not mag.exact_safe(64, -64) and not numerics.pow2_exact_safe(mag, 64, -64)
    # products of 2^-140 round away in the base run: no scaled run can be compared with it
    tiny = numerics.Magnitudes(2.0**-70, 2.0**-70, 2.0**-70, 2.0**-70, 8)
    assert tiny.exact_safe(20, 20) and not numerics.pow2_exact_safe(tiny, 20, 20)


def test_accumulation_ceiling_covers_round_to_nearest_worst_case():
    # one dominant product per row, then K-1 products below half an ulp of it: round to nearest
    # drops every one of them, |Δ|/s grows with K past the calibrated τ but stays under the ceiling
    dev = CpuDevice(0)
    for k in (64, 1024):
        a = torch.full((128, k), 1.5 * 2.0**-25, dtype=torch.bfloat16)
        a[:, 0] = 1.0
        ops = GemmOperands(a, torch.ones((k, 128), dtype=torch.bfloat16), Layout.DGRAD)
        res, ref = dev.checked_gemm(ops), dev.reference_checksums(ops, dev.tile)
        flagged = max(float(d.max()) for d in numerics.checksum_diffs(res, ref))  # in units of the noise scale
        by_s = max(float(d.max()) for d in numerics.checksum_diffs(res, dataclasses.replace(ref, row_noise=None, col_noise=None)))
        assert numerics.Thresholds().tau < flagged and by_s <= numerics.accumulation_ceiling(k, max(dev.tile))


def test_noise_scale_is_the_models_and_never_looser_than_the_cap():
    # σ = unit·K^power·ρ, ρ = sqrt(Σ_k a²·Σ_{j∈t} b²), capped at cap·s/τ: recomputed here directly
    dev = CpuDevice()
    m, n, k = 40, 300, 160  # K above CHECKSUM_SPAN: σ uses K itself (below it, 128)
    a = dev.generate((m, k), "normal", 3)
    a[0] = 2.0**-20
    a[0, 5] = 64.0  # row 0: one product dominates each output; with a large unit K·ρ outgrows the cap there
    ops = GemmOperands(a, dev.generate((k, n), "normal", 4), Layout.DGRAD)
    tn = dev.tile[1]
    model = numerics.NoiseModel(unit=5e-8, power=1.0, cap=1e-6)
    ref = numerics.reference_checksums(ops, dev.tile, model)
    a64, b = ops.a_mk.double(), ops.b_kn.double()
    rho = (a64.square() @ numerics.sum_col_tiles(b.square(), tn)).sqrt()
    s = a64.abs() @ numerics.sum_col_tiles(b.abs(), tn)
    want = torch.minimum(5e-8 * k * rho, s * 1e-6 / numerics.DEFAULT_TAU)
    assert torch.allclose(ref.row_noise, want, rtol=1e-12) and torch.allclose(ref.row_scale, s, rtol=1e-12)
    assert bool((ref.row_noise * numerics.DEFAULT_TAU <= s * 1e-6 * (1 + 1e-12)).all())  # never looser than 1e-6·s
    capped = ref.row_noise < 5e-8 * k * rho
    assert bool(capped[0].all()) and not bool(capped[1:].any())  # the cap binds on the dominated row only
    # power-of-two scaling scales σ exactly, as it scales the differences
    scaled = ref.scaled(-7)
    assert torch.equal(scaled.row_noise, ref.row_noise * 2.0**-7) and torch.equal(scaled.col_noise, ref.col_noise * 2.0**-7)
    # without a model the checks divide by s (a τ in units of Σ|A||B|, "abs-product")
    plain = numerics.reference_checksums(ops, dev.tile)
    assert plain.row_noise is None and plain.noise()[0] is plain.row_scale


def test_noise_depth_is_at_least_the_checksum_span():
    # a checksum also sums up to CHECKSUM_SPAN fp32 outputs: below that K does not shrink the noise
    model = numerics.NoiseModel(unit=8e-9, power=1.0, cap=1e-4)
    assert model.depth(8) == model.depth(numerics.CHECKSUM_SPAN) == float(numerics.CHECKSUM_SPAN)
    assert model.depth(8192) == 8192.0
    assert numerics.NoiseModel(unit=1e-6, power=0.0, cap=1e-4).depth(8) == 1.0
