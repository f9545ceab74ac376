"""The tiled flash-attention reference against fp64 attention (itself checked against torch's
autograd in fp64), its determinism, its fused sums, and the fault hook of each stage."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from aegis_cli.ops import attention as A
from aegis_cli.ops import attention_sums as sums
from aegis_cli.ops.errors import ConfigError, InjectSpecError
from tests.attention_helpers import draw, run

SHAPES = [(1, 4, 2, 100, 64, True), (1, 2, 2, 130, 128, False), (2, 4, 1, 37, 64, True), (1, 2, 1, 1, 64, True),
          (1, 8, 2, 70, 32, False)]


def test_fp64_reference_is_torch_autograd_in_fp64():
    ops = draw(1, 4, 2, 50, 64, causal=True, seed=3)
    sc = ops.shape.scale
    ref = A.reference(ops, sc, rows=16, outputs=True)  # several row chunks
    q, k, v = (t.double().requires_grad_() for t in (ops.q, ops.k, ops.v))
    o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=sc, enable_gqa=True)
    o.backward(ops.do.double())
    for mine, theirs in ((ref.o, o.detach()), (ref.dq, q.grad), (ref.dk, k.grad), (ref.dv, v.grad)):
        assert torch.allclose(mine, theirs, rtol=1e-12, atol=1e-12)
    lse = torch.logsumexp((q.detach() @ k.detach().repeat_interleave(2, 1).transpose(-1, -2) * sc).masked_fill(
        torch.ones(50, 50, dtype=torch.bool).triu(1), float("-inf")), -1)
    assert torch.allclose(ref.lse, lse, rtol=1e-12)


@pytest.mark.parametrize("causal", [True, False])
def test_row_sides_are_their_definitions(causal):
    """Each side the invariants read, from whole fp64 P and dS matrices by its definition (the
    reference forms none of them: row sums through per-key vectors, block by block); the outputs
    do not change the sides' bits."""
    ops = draw(2, 4, 2, 45, 32, causal=causal, seed=11)
    sc = ops.shape.scale
    ref = A.reference(ops, sc, rows=16)
    full = A.reference(ops, sc, rows=16, outputs=True)
    q, do = ops.q.double(), ops.do.double()
    k, v = (t.double().repeat_interleave(2, 1) for t in (ops.k, ops.v))
    s = q @ k.transpose(-1, -2) * sc
    if causal:
        s = s.masked_fill(torch.ones(45, 45, dtype=torch.bool).triu(1), float("-inf"))
    p = torch.softmax(s, -1)
    o, dp = p @ v, do @ v.transpose(-1, -2)
    ds = p * (dp - (p * dp).sum(-1, keepdim=True))
    a = do.abs() @ v.abs().transpose(-1, -2)
    kabs, v1, k1 = k.abs().sum(-1).unsqueeze(-2), v.sum(-1).unsqueeze(-2), k.sum(-1).unsqueeze(-2)
    rms = lambda x: x.square().sum(-1).sqrt()
    r = rms(p * dp) + rms(do * o)
    want = {"o_rowsum": o.sum(-1), "dq_rowsum": sc * (ds @ k).sum(-1), "lse": torch.logsumexp(s, -1),
            "o_rowsum_scale": (p * v.abs().sum(-1).unsqueeze(-2)).sum(-1),
            "dq_rowsum_scale": sc * (p * (a + (p * a).sum(-1, keepdim=True)) * kabs).sum(-1),
            "o_rowsum_sigma": 2.0**-8 * (rms(p * v1) + rms(p) * (p * v1).sum(-1).abs()),
            "dq_rowsum_sigma": sc * 2.0**-8 * (rms(ds * k1) + r * (p * k1).sum(-1).abs()),
            "p_rms": rms(p), "ds_rms": rms(ds) + r}
    for name, w in want.items():
        got = getattr(ref, name)
        assert torch.allclose(got, w, rtol=1e-13, atol=1e-13 * float(w.abs().max())), name
        assert torch.equal(got, getattr(full, name)), name
    assert ref.o is None and ref.dk is None and full.o is not None
    assert ref.p_min == pytest.approx(float(p.masked_fill(torch.isinf(s), 1.0).min()), rel=1e-13)
    k = ops.k.clone()
    k[1, 0, 7, 3] = float("inf")  # a non-finite key: that head's sides are not finite, the others' unchanged
    bad = A.reference(A.AttentionOperands(ops.q, k, ops.v, ops.do, causal), sc, rows=16)
    assert not bad.lse[1, :2].isfinite().all() and torch.equal(bad.o_rowsum[0], ref.o_rowsum[0])
    assert bad.p_min == 0.0  # no P is known there: pow2_safe never trusts an exact scaling


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_flash_matches_fp64_within_bf16(shape):
    ops = draw(*shape, seed=sum(shape))
    fwd, bwd = run(ops)
    ref = A.reference(ops, ops.shape.scale, outputs=True)
    assert fwd.o.dtype == bwd.dq.dtype == torch.bfloat16 and fwd.lse.dtype == torch.float32
    assert bwd.dk.shape == bwd.dv.shape == ops.k.shape and bwd.dq.shape == ops.q.shape
    for got, want in ((fwd.o, ref.o), (bwd.dq, ref.dq), (bwd.dk, ref.dk), (bwd.dv, ref.dv)):
        # bf16 outputs from bf16 P and dS: a few bf16 ulps of the largest value (dQ, dK of one key are
        # 0 in fp64 and rounding-sized here: D_i and dP_ii summed in different orders)
        err = (got.double() - want).abs().max() / (want.abs().max() + 1e-3)
        assert err < 2e-2, err
    assert (fwd.lse.double() - ref.lse).abs().max() < 1e-5
    # the fused sums are the fp32 accumulators' sums: the bf16 outputs' sums lie within their rounding
    assert torch.allclose(fwd.o_rowsum.double(), fwd.o.double().sum(-1), rtol=0, atol=float(fwd.o.double().abs().sum(-1).max()) * 2**-8)
    assert torch.allclose(bwd.dv_colsum.double(), bwd.dv.double().sum(-2), atol=float(bwd.dv.double().abs().sum(-2).max()) * 2**-8)


def test_backward_repeats_bit_identical():
    ops = draw(1, 4, 2, 130, 64, seed=5)
    a, b = run(ops), run(ops)
    for x, y in zip((a[0].o, a[0].lse, *a[1].tensors().values()), (b[0].o, b[0].lse, *b[1].tensors().values()), strict=True):
        assert torch.equal(x.view(torch.int16 if x.element_size() == 2 else torch.int32),
                           y.view(torch.int16 if y.element_size() == 2 else torch.int32))


def test_reference_ignores_torchs_default_dtype():
    """A training script may set float64 as torch's default dtype: the reference still accumulates in
    fp32, as the kernels do (the same bits)."""
    ops = draw(1, 2, 2, 70, 32, seed=9)
    a = run(ops)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        b = run(ops)
    finally:
        torch.set_default_dtype(old)
    for x, y in zip((a[0].o, a[0].lse, *a[1].tensors().values()), (b[0].o, b[0].lse, *b[1].tensors().values()), strict=True):
        assert x.dtype == y.dtype and torch.equal(x, y)


@pytest.mark.parametrize("stage", list(A.STAGES))
def test_each_stage_fault_changes_what_it_feeds(stage):
    ops = draw(1, 2, 1, 70, 64, causal=True, seed=9)
    shape = ops.shape
    clean = run(ops)
    coords = [0] * len(shape.stage_shape(stage))
    coords[-1] = 3 if len(coords) == 4 else 66
    if len(coords) == 4:
        coords[-2] = 66  # query (or key) 66 in the second block; with key 3 a computed score
    index = 0
    for c, n in zip(coords, shape.stage_shape(stage), strict=True):
        index = index * n + c
    fault = A.AttentionFault(stage, index, xor=1 << 29).check(shape)  # an exponent bit: a large change
    hit = run(ops, fault)
    outs = lambda r: [r[0].o, r[0].lse, r[0].o_rowsum, *r[1].tensors().values()]
    changed = [not torch.equal(x, y) for x, y in zip(outs(clean), outs(hit), strict=True)]
    assert any(changed)
    if stage in A.BACKWARD_STAGES:  # a backward fault leaves the forward alone
        assert not any(changed[:3])
    sums = {"pv": (2, "o_rowsum"), "dq": (6, "dq_rowsum"), "lse": (1, "lse")}
    if stage in sums:  # the fault sits in the block and row it names, and nowhere else
        i, name = sums[stage]
        assert (outs(clean)[i] != outs(hit)[i]).nonzero().tolist() == [[0, 0, 66]], name


def test_fault_validation_and_tuple():
    shape = A.AttentionShape(1, 4, 2, 16, 64, True)
    f = A.AttentionFault("dv", 5, xor=0x80000000, add=0.5)
    assert f.as_tuple() == ("dv", 5, 0x80000000, 0.5)
    assert f.coords(shape) == (0, 0, 0, 5)
    assert f.moved(shape, A.AttentionShape(1, 4, 2, 16, 128, True)).index == 5
    assert A.AttentionFault("dv", 64).moved(shape, A.AttentionShape(1, 4, 2, 16, 128, True)).index == 128
    with pytest.raises(InjectSpecError):
        A.AttentionFault("nope", 0)
    with pytest.raises(InjectSpecError):
        A.AttentionFault("dv", 1 << 40).check(shape)
    with pytest.raises(InjectSpecError):
        A.AttentionFault("dv", 0, xor=1 << 32)
    with pytest.raises(ConfigError):
        A.AttentionShape(1, 3, 2, 16, 64)  # 3 query heads cannot share 2 KV heads


def test_rescaled_reference_is_the_reference_of_scaled_inputs():
    ops = draw(1, 2, 1, 40, 64, seed=2)
    sc = ops.shape.scale
    for outputs in (False, True):
        base = A.reference(ops, sc, outputs=outputs).rescaled(3, -2)
        scaled = A.reference(A.AttentionOperands(ops.q, ops.k, (ops.v.float() * 8).bfloat16(), (ops.do.float() / 4).bfloat16(), True),
                             sc, outputs=outputs)
        assert (base.o is None) is (not outputs)
        tensors = [n for n, t in vars(base).items() if isinstance(t, torch.Tensor)]
        assert len(tensors) == (13 if outputs else 9)
        for n in tensors:
            assert torch.allclose(getattr(base, n), getattr(scaled, n), rtol=1e-12, atol=0), n


def test_reference_disagreement_is_in_the_checks_units():
    ops = draw(1, 2, 1, 48, 32, seed=9)
    sc = ops.shape.scale
    ref = A.reference(ops, sc)
    assert set(sums.reference_disagreement(ref, ref, ops, sc).values()) == {0.0}
    moved = dataclasses.replace(ref, o_rowsum=ref.o_rowsum + 0.5 * ref.o_rowsum_sigma, p_rms=ref.p_rms * 1.25)
    got = sums.reference_disagreement(moved, ref, ops, sc)
    assert abs(got["o_rowsum"] - 0.5) < 1e-9 and abs(got["p_rms"] - 0.25) < 1e-9 and got["dq_rowsum"] == 0.0
