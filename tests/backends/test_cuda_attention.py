"""Tier 2 (GPU): the checked flash-attention kernels (backends/cuda_attention.py) against plain
softmax attention in fp64, their fused invariant sums against the fp64 sums of their own outputs,
bit-identical repeats, every fault stage changing exactly what it feeds, and bad shapes refused."""

from __future__ import annotations

import math

import pytest
import torch

from aegis_cli.ops.errors import ConfigError, InjectSpecError

pytestmark = pytest.mark.gpu
BF16_TOL = 1e-2  # ‖out − ref‖ / ‖ref‖ for bf16 operands (typical 2e-3 to 4e-3)
SUM_SLACK = 2.0 ** -8  # |fused − Σ bf16 outputs| ≤ this · Σ |outputs|: their rounding, with margin


def _ca():
    from aegis_cli.backends import cuda_attention

    return cuda_attention


# the default tiles (two m-tiles per warp in the forward and dQ kernels, the dK/dV grid heavy-first
# over all heads), and one m-tile per warp in key order (benchmarks/attention.py --tune)
TUNES = {"default": {}, "mt1": {"ATTN_FWD_MT": 1, "ATTN_DQ_MT": 1, "ATTN_DQ_BN": 64, "ATTN_DKDV_HEAVY_FIRST": 0}}


@pytest.fixture(params=list(TUNES))
def tuned(request):
    ca = _ca()
    old = dict(ca.TUNE)
    ca.TUNE.update(TUNES[request.param])
    yield ca
    ca.TUNE.clear()
    ca.TUNE.update(old)


def _inputs(b, hq, hkv, s, d, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)

    def r(*shape):
        return torch.randn(shape, generator=g, device="cuda", dtype=torch.float32).to(torch.bfloat16)

    return r(b, hq, s, d), r(b, hkv, s, d), r(b, hkv, s, d), r(b, hq, s, d)


def _reference(q, k, v, do, causal, scale):
    """Plain softmax attention in fp64 with autograd: (O, lse, dQ, dK, dV)."""
    rep = q.shape[1] // k.shape[1]
    qd, kd, vd = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    s = scale * qd @ kd.repeat_interleave(rep, 1).transpose(-1, -2)
    if causal:
        n = q.shape[2]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), -math.inf)
    lse = torch.logsumexp(s, -1)
    o = torch.softmax(s, -1) @ vd.repeat_interleave(rep, 1)
    o.backward(do.double())
    return o.detach(), lse.detach(), qd.grad, kd.grad, vd.grad


def _rel(x, ref):
    return float((x.double() - ref).norm() / ref.norm().clamp_min(1e-30))


def _sum_ok(fused, outputs, dim):
    """The fused fp32 sum is the sum of the fp32 accumulator whose bf16 rounding we got back."""
    ref = outputs.double().sum(dim)
    bound = SUM_SLACK * outputs.double().abs().sum(dim) + 1e-6
    assert not torch.isnan(fused).any()
    err = (fused.double() - ref).abs()
    assert bool((err <= bound).all()), f"fused sum off by {float((err / bound).max()):.2f}× its bound"


CASES = [  # (B, Hq, Hkv, S, D, causal)
    (1, 2, 2, 1, 64, False), (1, 2, 1, 17, 128, True), (2, 4, 2, 64, 64, True), (1, 4, 4, 100, 128, False),
    (2, 8, 1, 257, 128, True), (1, 3, 1, 300, 64, False), (1, 4, 2, 129, 64, True), (1, 2, 2, 512, 128, True),
    (2, 2, 1, 200, 128, False), (1, 1, 1, 1000, 64, True),
]


@pytest.mark.parametrize("case", CASES, ids=["b{}h{}kv{}s{}d{}{}".format(*c[:5], "c" if c[5] else "") for c in CASES])
def test_matches_fp64_reference_and_sums(case, tuned):
    ca = tuned
    b, hq, hkv, s, d, causal = case
    q, k, v, do = _inputs(b, hq, hkv, s, d, seed=hash(case) % 10_000)
    scale = 1.0 / math.sqrt(d) if s % 2 else 0.3  # the default scale and another one
    o, lse, o_rowsum = ca.attention_forward(q, k, v, causal=causal, scale=scale, poison=True)
    dq, dk, dv, dq_rs, dk_cs, dv_cs = ca.attention_backward(q, k, v, o, lse, do, causal=causal, scale=scale,
                                                            poison=True)
    torch.cuda.synchronize()
    ro, rlse, rdq, rdk, rdv = _reference(q, k, v, do, causal, scale)
    for name, x, ref in (("O", o, ro), ("dQ", dq, rdq), ("dK", dk, rdk), ("dV", dv, rdv)):
        assert not torch.isnan(x).any(), f"{name} has unwritten (NaN) elements"
        if s == 1 and name in ("dQ", "dK"):
            # one key: the softmax is constant, so dQ = dK = 0 exactly and ours is the rounding
            # residue of dP − delta (seen: 2e-7)
            assert float(x.double().abs().max()) < 1e-4, f"{name}: {float(x.double().abs().max()):.1e} for S = 1"
            continue
        assert _rel(x, ref) < BF16_TOL, f"{name}: relative error {_rel(x, ref):.2e}"
    assert float((lse.double() - rlse).abs().max()) < 1e-4 * max(1.0, float(rlse.abs().max()))
    _sum_ok(o_rowsum, o, -1)
    _sum_ok(dq_rs, dq, -1)
    _sum_ok(dk_cs, dk, -2)
    _sum_ok(dv_cs, dv, -2)


@pytest.mark.parametrize("causal", [False, True])
def test_repeats_are_bit_identical(causal, tuned):
    ca = tuned
    q, k, v, do = _inputs(2, 8, 2, 333, 128, seed=5)
    runs = []
    for _ in range(3):
        o, lse, ors = ca.attention_forward(q, k, v, causal=causal, scale=0.125)
        runs.append((o, lse, ors, *ca.attention_backward(q, k, v, o, lse, do, causal=causal, scale=0.125)))
    for other in runs[1:]:
        for x, y in zip(runs[0], other, strict=True):
            assert torch.equal(x.view(torch.int8) if x.dtype == torch.bfloat16 else x.view(torch.int32),
                               y.view(torch.int8) if y.dtype == torch.bfloat16 else y.view(torch.int32))


def test_nosums_build_computes_the_same_outputs():
    ca = _ca()
    q, k, v, do = _inputs(1, 4, 2, 190, 64, seed=9)
    o, lse, _ = ca.attention_forward(q, k, v, causal=True, scale=0.125)
    o2, lse2, rs2 = ca.attention_forward(q, k, v, causal=True, scale=0.125, variant="nosums")
    assert torch.equal(o, o2) and torch.equal(lse, lse2) and torch.isnan(rs2).all()
    g1 = ca.attention_backward(q, k, v, o, lse, do, causal=True, scale=0.125)
    g2 = ca.attention_backward(q, k, v, o, lse, do, causal=True, scale=0.125, variant="nosums")
    assert all(torch.equal(x, y) for x, y in zip(g1[:3], g2[:3], strict=True))


# (stage, where (b, h, i, j|d), add) → which outputs change: row i of (b, h) for query-side
# tensors, row j of (b, h // G) for key-side ones; everything else must stay bit-identical.
B, HQ, HKV, S, D = 2, 4, 2, 150, 64
FAULTS = {
    "load_q": ((1, 3, 40, 5), 2.0, {"o": "i", "lse": "i", "o_rowsum": "i"}),
    "scores": ((0, 1, 70, 33), 3.0, {"o": "i", "lse": "i", "o_rowsum": "i"}),
    "softmax": ((1, 2, 99, 98), 0.75, {"o": "i", "lse": "i", "o_rowsum": "i"}),
    "pv": ((0, 0, 10, 7), 1.0, {"o": "i", "o_rowsum": "i"}),
    "lse": ((1, 1, 149, None), 1.0, {"lse": "i"}),
    "dv": ((1, 1, 77, 3), 1.0, {"dv": "j", "dv_colsum": "all"}),
    "dk": ((0, 0, 149, 63), 1.0, {"dk": "j", "dk_colsum": "all"}),
    "dq": ((1, 3, 0, 0), 1.0, {"dq": "i", "dq_rowsum": "i"}),
    "dp": ((0, 2, 120, 64), 5.0, {"dq": "i", "dq_rowsum": "i", "dk": "j", "dk_colsum": "all"}),
    "recompute_p": ((1, 0, 66, 65), 0.5, {"dq": "i", "dq_rowsum": "i", "dk": "j", "dk_colsum": "all",
                                          "dv": "j", "dv_colsum": "all"}),
}
NAMES = ("o", "lse", "o_rowsum", "dq", "dk", "dv", "dq_rowsum", "dk_colsum", "dv_colsum")


def _flat(stage, b, h, i, x):
    if stage == "lse":
        return (b * HQ + h) * S + i
    if stage in ("load_q", "pv", "dq"):
        return ((b * HQ + h) * S + i) * D + x
    if stage in ("dv", "dk"):
        return ((b * HKV + h // (HQ // HKV)) * S + i) * D + x
    return ((b * HQ + h) * S + i) * S + x


def _run(ca, q, k, v, do, stage, fault):
    """A forward-stage fault: the forward's outputs. A backward one: the backward's, from a clean forward
    (the forward's O and lse feed the backward, so a forward fault reaches every gradient)."""
    if stage in ca.ATTN_FWD_STAGES:
        return dict(zip(NAMES[:3], ca.attention_forward(q, k, v, causal=True, scale=0.125, fault=fault), strict=True))
    o, lse, _ = ca.attention_forward(q, k, v, causal=True, scale=0.125)
    grads = ca.attention_backward(q, k, v, o, lse, do, causal=True, scale=0.125, fault=fault)
    return dict(zip(NAMES[3:], grads, strict=True))


@pytest.mark.parametrize("stage", list(FAULTS))
def test_fault_stage_changes_what_it_feeds(stage, tuned):
    ca = tuned
    (b, h, i, x), add, expect = FAULTS[stage]
    q, k, v, do = _inputs(B, HQ, HKV, S, D, seed=31)
    idx = _flat(stage, b, h, i, x or 0)
    clean = _run(ca, q, k, v, do, stage, (stage, idx, 0, 0.0))  # the injection build, editing nothing
    hit = _run(ca, q, k, v, do, stage, (stage, idx, 0, add))
    kvh, key = h // (HQ // HKV), i if stage in ("dv", "dk") else x
    for name in clean:
        diff = (clean[name] != hit[name])
        if name not in expect:
            assert not diff.any(), f"{stage}: {name} changed"
            continue
        where = expect[name]
        sel = torch.zeros_like(diff)
        if where == "i":
            sel[b, h, i] = True
        elif where == "j":
            sel[b, kvh, key] = True
        else:
            sel[b, kvh] = True
        assert diff[sel].any(), f"{stage}: {name} unchanged"
        assert not diff[~sel].any(), f"{stage}: {name} changed outside the fault's row"


def test_bad_inputs_are_one_line_errors():
    ca = _ca()
    q, k, v, _ = _inputs(1, 4, 3, 32, 64, seed=1)
    with pytest.raises(ConfigError, match="query heads"):
        ca.attention_forward(q, k, v, causal=False, scale=0.1)
    q, k, v, _ = _inputs(1, 2, 1, 32, 96, seed=1)
    with pytest.raises(ConfigError, match="head dim"):
        ca.attention_forward(q, k, v, causal=False, scale=0.1)
    q, k, v, _ = _inputs(1, 2, 1, 32, 64, seed=1)
    with pytest.raises(ConfigError, match="shape"):
        ca.attention_forward(q, k[:, :, :16].contiguous(), v, causal=False, scale=0.1)
    with pytest.raises(ConfigError, match=r"want torch\.bfloat16"):
        ca.attention_forward(q.float(), k, v, causal=False, scale=0.1)
    with pytest.raises(InjectSpecError, match="outside"):
        ca.attention_forward(q, k, v, causal=False, scale=0.1, fault=("scores", 10**9, 1, 0.0))
    with pytest.raises(InjectSpecError, match="stage"):
        ca.attention_forward(q, k, v, causal=False, scale=0.1, fault=("nope", 0, 1, 0.0))
