"""The attention checks: clean runs stay under τ, a fault at each stage fires the invariant that
sees it, exact scalings hold bit for bit, and the judgement keeps flags that rounding could
explain SUSPECT."""

from __future__ import annotations

import pytest

from aegis_cli.checks import attention as checks
from aegis_cli.ops import attention as A
from aegis_cli.ops import attention_sums as sums
from aegis_cli.ops.verdict import Verdict
from tests.attention_helpers import draw, run

TH = sums.AttentionThresholds()


def fired(ops, fault=None, expected=None):
    fwd, bwd = run(ops, fault)
    ref = A.reference(ops, ops.shape.scale)
    c = checks.check_attention(ops, fwd, bwd, ref, ops.shape.scale, TH, expected=expected)
    return {s.check for s in c.signals}, c


@pytest.mark.parametrize("dist", ["normal", "uniform", "heavy"])
@pytest.mark.parametrize("shape", [(1, 4, 2, 70, 64, True), (1, 2, 1, 33, 128, False)], ids=lambda s: "x".join(map(str, s)))
def test_clean_runs_stay_under_tau(dist, shape):
    got, c = fired(draw(*shape, dist=dist, seed=7))
    assert got == set()
    assert set(c.clean_max) == set(sums.INVARIANTS)
    assert all(v < TH.tau[k] for k, v in c.clean_max.items())


# a large change at each stage, and the invariant that must see it
CATCHES = {"load_q": "lse", "scores": "lse", "softmax": "o_rowsum", "pv": "o_rowsum", "lse": "lse",
           "recompute_p": "dv_colsum", "dp": "dk_colsum", "dv": "dv_colsum", "dk": "dk_colsum", "dq": "dq_rowsum"}


@pytest.mark.parametrize("stage", list(CATCHES))
def test_each_stage_is_caught_by_its_invariant(stage):
    ops = draw(1, 4, 2, 70, 64, causal=True, seed=11)
    shape = ops.shape
    coords = [0, 1, 40, 5][: len(shape.stage_shape(stage))]
    if len(coords) == 3:
        coords[-1] = 5 if stage != "lse" else 40
    index = 0
    for c, n in zip(coords, shape.stage_shape(stage), strict=True):
        index = index * n + c
    got, _ = fired(ops, A.AttentionFault(stage, index, add=1e4 if stage == "dp" else 4.0))  # dP feeds dS times P_ij
    assert "attention." + CATCHES[stage] in got


def test_exact_scalings_hold_bit_for_bit_and_a_changed_value_breaks_them():
    ops = draw(1, 4, 2, 70, 64, seed=4)
    base_f, base_b = run(ops)
    base = checks.outputs_of(base_f, base_b)
    for ev, edo in ((8, -8), (-8, 8)):
        scaled = sums.scaled_operands(ops, ev, edo)
        assert sums.pow2_safe(ops, A.reference(ops, ops.shape.scale), ev, edo)
        f, b = run(scaled)
        assert checks.pow2_signal(checks.outputs_of(f, b), checks.expected_at(base, ev, edo)) is None
    f, b = run(sums.scaled_operands(ops, 8, -8), A.AttentionFault("dq", 77, xor=1 << 20))  # a mantissa bit bf16 keeps
    sig = checks.pow2_signal(checks.outputs_of(f, b), checks.expected_at(base, 8, -8))
    assert sig is not None and sig.tensor in ("dq", "dq_rowsum")


def test_scalings_that_leave_dS_alone_only():
    ops = draw(1, 2, 1, 20, 64, seed=1)
    ref = A.reference(ops, ops.shape.scale)
    assert not sums.pow2_safe(ops, ref, 8, 8)  # dS·2^16 may leave the normal range where P is tiny


def test_judgement():
    ops = draw(1, 2, 1, 40, 64, seed=3)
    bound = sums.rounding_bound("dv_colsum", ops, ops.shape.scale)
    tau = TH.tau["dv_colsum"]
    import torch

    # flagged at 3τ (in σ), and at 0.9 or 10 times the rounding bound (in s)
    sig = lambda rel: checks.AttentionSignal("attention.dv_colsum", 3 * tau, torch.zeros((1, 3), dtype=torch.long),
                                             "dv_colsum", bound=bound, rel_max=rel)
    j = checks.judge_signal(sig(bound * 0.9), distinct_outputs=1, reproducible=True, tau=tau, confirm_margin=1.0)
    assert j.severity is Verdict.SUSPECT and "rounding" in j.why
    j = checks.judge_signal(sig(bound * 10), distinct_outputs=1, reproducible=True, tau=tau, confirm_margin=1.0)
    assert j.severity is Verdict.FAULTY
    j = checks.judge_signal(sig(bound * 0.9), distinct_outputs=2, reproducible=False, tau=tau, confirm_margin=1.0)
    assert j.severity is Verdict.FAULTY  # runs of a deterministic kernel disagreed
