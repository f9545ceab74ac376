"""The attention sides kernel (kernels/attention_sides.cu through ``CudaDevice.attention_reference``)
against its reference, torch's fp64 ``ops/attention.reference``: each compared side within a
small fraction of what its check allows (o_rowsum and dq_rowsum of their σ, the LSE of its τ·s),
the spreads and p_min within 1 %, repeats bit-identical, the checks' verdicts unchanged, and
non-finite operands left to the reference. GPU tier: skipped without CUDA and CuPy."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from aegis_cli.checks import attention as checks
from aegis_cli.ops import attention as A
from aegis_cli.ops import attention_sums as sums
from aegis_cli.ops.fingerprint import int_view
from tests.attention_helpers import draw

pytestmark = pytest.mark.gpu

SHAPES = [(1, 8, 1, 1024, 128, True), (2, 4, 2, 333, 64, True), (1, 4, 4, 200, 64, False), (1, 8, 2, 192, 32, True),
          (1, 2, 2, 300, 96, False), (1, 2, 1, 1, 128, True)]


def _device():
    from aegis_cli.backends.cuda import CudaDevice

    return CudaDevice(0)


def _on(ops: A.AttentionOperands, dev, **scaled) -> A.AttentionOperands:
    """``ops`` on the device, each operand named in ``scaled`` times its factor (then bf16 again)."""
    t = {n: getattr(ops, n).to(dev.torch_device) for n in ("q", "k", "v", "do")}
    t = {n: (x.double() * scaled[n]).bfloat16() if n in scaled else x for n, x in t.items()}
    return A.AttentionOperands(t["q"], t["k"], t["v"], t["do"], ops.causal)


def _assert_close(got, want, ops) -> None:
    err = sums.reference_disagreement(got, want, ops, ops.shape.scale)
    bound = {"o_rowsum": 1e-3, "dq_rowsum": 1e-3, "lse": 0.05, "p_min": 1e-2} | dict.fromkeys(sums.SPREAD_SIDES, 1e-2)
    bad = {n: e for n, e in err.items() if not e <= bound[n]}
    assert not bad, (bad, err)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dist", ["normal", "heavy"])
def test_sides_match_the_fp64_reference_and_repeat(shape, dist):
    dev = _device()
    ops = _on(draw(*shape, dist=dist, seed=sum(shape)), dev)
    want = A.reference(ops, ops.shape.scale)
    got = dev.attention_reference(ops, ops.shape.scale)
    _assert_close(got, want, ops)
    again = dev.attention_reference(ops, ops.shape.scale)
    for f in dataclasses.fields(A.AttentionReference):
        x, y = getattr(got, f.name), getattr(again, f.name)
        if isinstance(x, torch.Tensor):
            assert torch.equal(int_view(x), int_view(y)), f.name
    assert got.p_min == again.p_min


@pytest.mark.parametrize("case", ["peaked", "flat_dp", "small_v"])
def test_sides_on_hard_inputs(case):
    """Peaked softmax (Q × 16: P nearly one-hot, p_min underflows fp32), dP nearly constant along
    a row (V's rows one vector plus 1 % noise: dS small against P·dP), V tiny (2⁻⁶⁰)."""
    dev = _device()
    base = draw(2, 4, 2, 256, 128, seed=11)
    if case == "peaked":
        ops = _on(base, dev, q=16.0)
    elif case == "small_v":
        ops = _on(base, dev, v=2.0**-60)
    else:
        v = base.v[:, :, :1].double() + 0.01 * base.v.double()
        ops = _on(A.AttentionOperands(base.q, base.k, v.bfloat16(), base.do, True), dev)
    _assert_close(dev.attention_reference(ops, ops.shape.scale), A.reference(ops, ops.shape.scale), ops)


def test_the_checks_judge_alike_and_a_fault_still_fires():
    dev = _device()
    ops = _on(draw(1, 8, 2, 512, 128, seed=4), dev)
    sc = ops.shape.scale
    f = dev.attention_forward(ops.q, ops.k, ops.v, causal=True, scale=sc)
    b = dev.attention_backward(ops.q, ops.k, ops.v, f.o, f.lse, ops.do, causal=True, scale=sc)
    th = sums.AttentionThresholds()
    torch_ref, kern_ref = A.reference(ops, sc), dev.attention_reference(ops, sc)
    a, k = (checks.check_attention(ops, f, b, r, sc, th) for r in (torch_ref, kern_ref))
    assert not a.signals and not k.signals
    for name, v in a.clean_max.items():
        assert abs(k.clean_max[name] - v) <= 0.01 * th.tau[name] + 1e-3 * v, (name, v, k.clean_max[name])
    # one row of O·1 off by 64 of its σ: both references see it
    bad = dataclasses.replace(f, o_rowsum=f.o_rowsum.clone())
    bad.o_rowsum[0, 3, 100] += float(64 * torch_ref.o_rowsum_sigma[0, 3, 100])
    for r in (torch_ref, kern_ref):
        assert "attention.o_rowsum" in {s.check for s in checks.check_attention(ops, bad, b, r, sc, th).signals}


def test_non_finite_operands_take_the_reference():
    dev = _device()
    ops = _on(draw(1, 2, 2, 64, 64, seed=3), dev)
    ops.v[0, 1, 5, 7] = float("nan")
    got, want = dev.attention_reference(ops, ops.shape.scale), A.reference(ops, ops.shape.scale)
    for f in dataclasses.fields(A.AttentionReference):
        x, y = getattr(got, f.name), getattr(want, f.name)
        if isinstance(x, torch.Tensor):
            assert torch.equal(x.isnan(), y.isnan()) and torch.equal(x.nan_to_num(), y.nan_to_num()), f.name
