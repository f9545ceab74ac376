"""The training-state bounds (checks/training.py): the closed forms, tightness on the
gradient sequences that attain them, no violation on torch's own fp32 Adam implementations
(including the extremal and underflowing cases), and flags on corrupted state."""

from __future__ import annotations

import math

import pytest
import torch

from aegis_cli.checks import training as tb

IMPLS = [{"foreach": False}, {"foreach": True}, {"fused": True}]


def run_adam(grads: list[torch.Tensor], betas=(0.9, 0.999), **impl):
    """torch's Adam on one parameter fed the given gradients; returns its state."""
    p = torch.nn.Parameter(torch.zeros_like(grads[0]))
    opt = torch.optim.Adam([p], lr=1e-3, betas=betas, **impl)
    for g in grads:
        p.grad = g.clone()
        opt.step()
    return opt.state[p]


def exact_c(b1: float, b2: float, t: int) -> float:
    return sum((1 - b1) ** 2 / (1 - b2) * (b1 * b1 / b2) ** k for k in range(t))


def test_closed_forms_match_real_arithmetic():
    # C_∞ for the default betas: the 52.9 of docs/design.md §9
    assert tb.ratio_constant(0.9, 0.999, 10**7) == pytest.approx(0.01 / 0.001 / (1 - 0.81 / 0.999), rel=1e-5)
    for b1, b2, t in ((0.9, 0.999, 1), (0.9, 0.999, 37), (0.5, 0.6, 9), (0.95, 0.9, 25)):  # last: β₁² > β₂, C_t grows
        assert tb.ratio_constant(b1, b2, t) == pytest.approx(exact_c(b1, b2, t), rel=1e-4)
        assert tb.ema_gain(b1, t) == pytest.approx(1 - b1**t, rel=1e-5)
        assert tb.ema_gain(b1, t) >= 1 - b1**t  # rounding slack only ever widens


@pytest.mark.parametrize("impl", IMPLS)
def test_constant_gradient_attains_the_magnitude_bounds_without_breaking_them(impl):
    g = torch.full((64,), 0.37)
    st = run_adam([g] * 40, **impl)
    gb = 0.37
    m_bound = tb.ema_gain(0.9, 40) * gb
    v_bound = tb.ema_gain(0.999, 40) * gb * gb
    assert 0.99999 < st["exp_avg"].max().item() / m_bound <= 1.0
    assert 0.99999 < st["exp_avg_sq"].max().item() / v_bound <= 1.0
    assert tb.check_adam("p", 40, st["exp_avg"], st["exp_avg_sq"], gb, 0.9, 0.999) == []


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("betas", [(0.9, 0.999), (0.5, 0.6), (0.95, 0.9)])
def test_cauchy_schwarz_equality_case_is_tight_and_holds(impl, betas):
    """g_s ∝ (β₁/β₂)^(t−s) makes m_t² = C_t·v_t exactly in real arithmetic."""
    b1, b2 = betas
    t = 30
    base = torch.linspace(0.5, 2.0, 64)
    grads = [base * (b1 / b2) ** (t - s) for s in range(1, t + 1)]
    st = run_adam(grads, betas=betas, **impl)
    ratio = (st["exp_avg"].double() ** 2 / (tb.ratio_constant(b1, b2, t) * st["exp_avg_sq"].double())).max().item()
    assert 0.9999 < ratio <= 1.0
    gmax = max(float(g.abs().max()) for g in grads)
    assert tb.check_adam("p", t, st["exp_avg"], st["exp_avg_sq"], gmax, b1, b2) == []


@pytest.mark.parametrize("impl", IMPLS)
def test_random_heavy_tailed_and_underflowing_gradients_raise_nothing(impl):
    gen = torch.Generator().manual_seed(7)
    grads = []
    for s in range(200):
        g = torch.randn(256, generator=gen) * torch.exp(torch.randn(256, generator=gen) * 4)
        if s % 3 == 0:
            g = g * 1e-24  # g² and (1−β₂)·g² underflow: v can be 0 where m is not
        grads.append(g)
    st = run_adam(grads, **impl)
    gmax = max(float(g.abs().max()) for g in grads)
    assert tb.check_adam("p", 200, st["exp_avg"], st["exp_avg_sq"], gmax, 0.9, 0.999) == []
    tiny = run_adam([torch.full((8,), 1e-23)] * 5, **impl)  # every v underflows to 0
    assert (tiny["exp_avg_sq"] == 0).all() and (tiny["exp_avg"] != 0).all()
    assert tb.check_adam("p", 5, tiny["exp_avg"], tiny["exp_avg_sq"], 1e-23, 0.9, 0.999) == []


def test_corrupted_moments_are_flagged():
    gen = torch.Generator().manual_seed(1)
    grads = [torch.randn(128, generator=gen) for _ in range(20)]
    st = run_adam(grads)
    gmax = max(float(g.abs().max()) for g in grads)
    m, v = st["exp_avg"].clone(), st["exp_avg_sq"].clone()

    def clear(m, v, vmax=None) -> bool:  # the guard's batched fast path agrees with check_adam
        return tb.adam_clear(tb.adam_summary(m, v, 20, 0.9, 0.999, vmax).tolist(), 20, gmax, 0.9, 0.999)

    assert clear(m, v) and clear(m, v, v.clone())
    v[5] = v[5] * 2.0**40
    assert not clear(m, v)
    assert [x.check for x in tb.check_adam("p", 20, m, v, gmax, 0.9, 0.999)] == ["train.adam_exp_avg_sq"]
    v = st["exp_avg_sq"].clone()
    v[9] = v[9] * 2.0**-40  # a huge step: only the ratio sees it
    assert not clear(m, v)
    out = tb.check_adam("p", 20, m, v, gmax, 0.9, 0.999)
    assert [(x.check, x.index) for x in out] == [("train.adam_moment_ratio", 9)] and out[0].ratio > 1
    m[3] = math.nan
    assert not clear(m, st["exp_avg_sq"])
    assert [x.check for x in tb.check_adam("p", 20, m, st["exp_avg_sq"], gmax, 0.9, 0.999)] == ["train.nonfinite"]
    vmax = st["exp_avg_sq"].clone()
    vmax[2] = vmax[2] / 2  # amsgrad's max below the current v: impossible
    assert not clear(st["exp_avg"], st["exp_avg_sq"], vmax)
    out = tb.check_adam("p", 20, st["exp_avg"], st["exp_avg_sq"], gmax, 0.9, 0.999, max_exp_avg_sq=vmax)
    assert [(x.check, x.index) for x in out] == [("train.adam_amsgrad", 2)]


def test_weight_decay_and_beta_range():
    assert tb.effective_grad_bound(1.0, 10.0, 0.1, decoupled=True) == 1.0
    assert tb.effective_grad_bound(1.0, 10.0, 0.1, decoupled=False) == pytest.approx(2.0, rel=1e-5)
    with pytest.raises(ValueError, match=r"0\.5"):
        tb.check_betas(0.3, 0.999)


@pytest.mark.parametrize("momentum", [0.1, None])
def test_batchnorm_running_stats_stay_in_the_hull_of_batch_statistics(momentum):
    bn = torch.nn.BatchNorm1d(6, momentum=momentum)
    gen = torch.Generator().manual_seed(3)
    lo = bn.running_var.detach().double().clone()
    hi = lo.clone()
    mlo, mhi = bn.running_mean.detach().double().clone(), bn.running_mean.detach().double().clone()
    for _ in range(30):
        x = torch.randn(16, 6, generator=gen) * torch.rand(6, generator=gen) * 5 + 3
        var = x.double().var(dim=0, correction=1)
        lo, hi = torch.minimum(lo, var), torch.maximum(hi, var)
        mean = x.double().mean(dim=0)
        mlo, mhi = torch.minimum(mlo, mean), torch.maximum(mhi, mean)
        bn(x)
    a, b = tb.running_var_bounds(lo, hi, momentum, int(bn.num_batches_tracked))
    assert tb.check_running_stat("bn", "running_var", 30, bn.running_var, a, b) == []
    rv = bn.running_var.clone()
    rv[4] = hi[4] * 1e3
    assert [(x.check, x.index) for x in tb.check_running_stat("bn", "running_var", 30, rv, a, b)] == [("train.norm_running_var", 4)]
    rv[4] = -1.0
    assert [x.check for x in tb.check_running_stat("bn", "running_var", 30, rv, a, b)] == ["train.norm_running_var"]
    rv[4] = math.inf
    assert [x.check for x in tb.check_running_stat("bn", "running_var", 30, rv, a, b)] == ["train.nonfinite"]
    a, b = tb.running_mean_bounds(mlo, mhi, hi, momentum, int(bn.num_batches_tracked))
    assert tb.check_running_stat("bn", "running_mean", 30, bn.running_mean, a, b) == []
    rm = bn.running_mean.clone()
    rm[1] = -rm[1] * 2.0**20
    assert [(x.check, x.index) for x in tb.check_running_stat("bn", "running_mean", 30, rm, a, b)] == [("train.norm_running_mean", 1)]


@pytest.mark.parametrize("impl", IMPLS[:2])
def test_bf16_moments_get_bounds_for_their_own_rounding(impl):
    """Adam keeps the moments in the parameters' dtype: bf16 parameters, bf16 moments (u = 2⁻⁸)."""
    gen = torch.Generator().manual_seed(5)
    grads = [(torch.randn(128, generator=gen) * 3).bfloat16() for _ in range(50)] + [torch.full((128,), 0.37).bfloat16()] * 30
    st = run_adam(grads, betas=(0.9, 0.95), **impl)
    assert st["exp_avg"].dtype == torch.bfloat16
    gmax = max(float(g.abs().max()) for g in grads)
    assert tb.check_adam("p", 80, st["exp_avg"], st["exp_avg_sq"], gmax, 0.9, 0.95) == []
    assert tb.ema_gain(0.9, 80, torch.bfloat16) > tb.ema_gain(0.9, 80)  # looser than fp32's
    assert tb.ema_floor(0.999, torch.bfloat16) == math.inf  # β₂(1 + κu) ≥ 1: no bound on v in bf16
    v = st["exp_avg_sq"].clone()
    v[7] = 2.0**100
    assert [x.check for x in tb.check_adam("p", 80, st["exp_avg"], v, gmax, 0.9, 0.95)] == ["train.adam_exp_avg_sq"]
