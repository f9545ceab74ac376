"""Training-state bounds (docs/training-guards.md, docs/design.md §9): pure checks of Adam's
moments and of normalisation layers' running variance against the history that produced them.

Adam / AdamW (torch.optim, β ∈ [1/2, 1), m₀ = v₀ = 0), with g_s the gradient the update
used at step s (g + λθ for Adam's coupled weight decay), G = max over steps ≤ t and elements
of |g_s|, w = 1 − β:

  train.adam_exp_avg      |m_t| ≤ (1 − β₁ᵗ)·G          m_t is a convex combination of 0 and the g_s
  train.adam_exp_avg_sq   v_t ≤ (1 − β₂ᵗ)·G²           the same for g_s²
  train.adam_moment_ratio m_t² ≤ C_t·v_t, elementwise   Cauchy–Schwarz on the two weighted sums:
                          C_t = (w₁²/w₂)·Σ_{k<t} (β₁²/β₂)ᵏ (≈ 52.9 for β = 0.9, 0.999); needs
                          no gradient history, and catches a v flipped towards zero
  train.adam_amsgrad      v_t ≤ max_exp_avg_sq_t ≤ (1 − β₂ᵗ)·G²
  train.nonfinite         NaN or Inf in a moment

These hold exactly in real arithmetic. In fp32 every update x ← β·x + w·y is modelled as
β(1+α)·x + w(1+γ)·y with |α|, |γ| ≤ κu (u = 2⁻²⁴, κ = ROUNDING_OPS covers lerp, foreach and
fused implementations for β ≥ 1/2), plus an absolute 2⁻¹⁴⁸ per update for results that fall
into the subnormal range. The bounds below are the real-arithmetic bounds re-derived for that
model (β → β(1+κu) and so on), so they are rigorous for computed fp32 moments at every step,
with a slack that does not grow with t: about 1 + κu/(1−β).

BatchNorm (train.norm_running_var): running_var_t = (1−a)·running_var_{t−1} + a·σ²_t with σ²_t
the unbiased batch variance (a = momentum, or 1/t when momentum is None) is a convex
combination of its initial value r₀ and the σ²_s, so per channel
min(r₀, min σ²) ≤ running_var_t ≤ max(r₀, max σ²). The recurrence's rounding is bounded as
above; the batch variance the layer computed and the one the guard saw differ by their own
rounding, which has no input-independent bound: VAR_SLACK (relative) covers it for inputs whose
mean is within ~100 standard deviations of zero. This check finds huge or negative values, not
fine drift. running_mean (train.norm_running_mean) is bounded the same way by the batch means,
widened by VAR_SLACK of max(|mean|, std): a mean's rounding is relative to the inputs' size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from aegis_cli.ops.verdict import Evidence, Verdict

ROUNDING_OPS = 8  # κ: relative roundings charged to each coefficient of one update (≤ 4 happen)
VAR_SLACK = 1e-2  # relative: two fp32 computations of one batch variance (see the module doc)
EVAL_SLACK = 1e-9  # relative: the fp64 evaluation of the bounds themselves
SCREEN = 1e-6  # relative margin of the fp32 screen of the moment ratio (> 4 roundings of 2⁻²⁴)

RIGOROUS = ("train.adam_exp_avg", "train.adam_exp_avg_sq", "train.adam_moment_ratio", "train.adam_amsgrad", "train.nonfinite")


@dataclass(frozen=True)
class Violation:
    """One broken bound on one state tensor."""

    check: str
    tensor: str  # e.g. "fc1.weight:exp_avg_sq" or "bn1:running_var"
    step: int
    value: float  # the worst observed value (max |m|, max v, or the worst ratio's numerator)
    bound: float
    index: int  # flat index of the worst element (-1 when not applicable)

    @property
    def ratio(self) -> float:
        return self.value / self.bound if self.bound > 0 else math.inf

    def to_dict(self) -> dict:
        return {"check": self.check, "tensor": self.tensor, "step": self.step, "value": self.value,
                "bound": self.bound, "ratio": self.ratio, "index": self.index}


def check_betas(beta1: float, beta2: float) -> None:
    """The rounding model above needs β ∈ [1/2, 1) (the lerp's error is relative to w/β)."""
    for name, b in (("beta1", beta1), ("beta2", beta2)):
        if not 0.5 <= b < 1.0:
            raise ValueError(f"{name}={b}: the Adam bounds are derived for 0.5 ≤ β < 1")


def _geometric(x: float, t: int) -> float:
    """Σ_{k<t} xᵏ in fp64, accurate for x near 1."""
    if x == 1.0:
        return float(t)
    return -math.expm1(t * math.log(x)) / (1.0 - x) if x > 0 else 1.0


def unit(dtype: torch.dtype) -> tuple[float, float]:
    """(unit roundoff, absolute error of one update in the subnormal range: four roundings of
    half the subnormal spacing) of a floating-point dtype; fp32: (2⁻²⁴, 2⁻¹⁴⁸). Moments stored in
    bf16 or fp16 (Adam keeps them in the parameters' dtype) get bounds valid for their own, much
    coarser, rounding: looser, and vacuous where β·(1 + κu) ≥ 1."""
    fi = torch.finfo(dtype)
    return fi.eps / 2.0, 2.0 * fi.tiny * fi.eps


def ema_gain(beta: float, t: int, dtype: torch.dtype = torch.float32) -> float:
    """Largest Σ of the weights an fp32 EMA x_t = β·x_{t−1} + (1−β)·y_t (x₀ = 0) can give its
    inputs after t updates: (1−β)(1+κu)·Σ_{k<t} (β(1+κu))ᵏ. Exact arithmetic: 1 − βᵗ."""
    e = ROUNDING_OPS * unit(dtype)[0]
    return (1.0 - beta) * (1.0 + e) * _geometric(beta * (1.0 + e), t) * (1.0 + EVAL_SLACK)


def ema_floor(beta: float, dtype: torch.dtype = torch.float32) -> float:
    """Absolute error of an EMA whose terms underflow: one update's, decayed by β (inf where the
    decay with rounding does not contract)."""
    u, under = unit(dtype)
    decay = beta * (1.0 + ROUNDING_OPS * u)
    return under / (1.0 - decay) if decay < 1.0 else math.inf


def ratio_constant(beta1: float, beta2: float, t: int, dtype: torch.dtype = torch.float32) -> float:
    """C̃_t with m_t² ≤ C̃_t·v_t for fp32 moments: (w₁²/w₂)·q·Σ_{k<t} (ρq)ᵏ with ρ = β₁²/β₂ and
    q = (1+κu)²/(1−κu), the exact-arithmetic C_t with every weight's rounding charged."""
    e = ROUNDING_OPS * unit(dtype)[0]
    q = (1.0 + e) ** 2 / (1.0 - e)
    w1, w2 = 1.0 - beta1, 1.0 - beta2
    return w1 * w1 / w2 * q * _geometric(beta1 * beta1 / beta2 * q, t) * (1.0 + EVAL_SLACK)


def effective_grad_bound(grad_max: float, param_max: float, weight_decay: float, decoupled: bool,
                         dtype: torch.dtype = torch.float32) -> float:
    """Bound of |g| as the update used it: Adam's coupled decay adds λθ (one fp32 add and one
    multiply: charged as κu); AdamW's decoupled decay leaves g alone."""
    if decoupled or weight_decay == 0.0:
        return grad_max
    return (grad_max + abs(weight_decay) * param_max) * (1.0 + ROUNDING_OPS * unit(dtype)[0])


def _worst(x: torch.Tensor) -> tuple[float, int]:
    """(max, flat index) of x; NaN anywhere wins, so a NaN is never hidden behind a finite max."""
    flat = x.reshape(-1)
    nan = torch.isnan(flat)
    if bool(nan.any()):
        return math.nan, int(nan.nonzero()[0, 0])
    i = int(torch.argmax(flat))
    return float(flat[i]), i


def _over(value: float, bound: float) -> bool:
    return not value <= bound  # NaN is over every bound


def _screen(m: torch.Tensor, v: torch.Tensor, c: float) -> torch.Tensor:
    """C̃(1 − SCREEN)·v − m² in fp32, elementwise: negative wherever the moment ratio may be
    broken. Never positive where it is: its three roundings are within SCREEN of C̃·v where m² is
    near it, a product that underflows loses less than C̃·floor_v, and an m whose square
    underflows lies below √(C̃·floor_v)."""
    m, v = m.float(), v.float()  # in fp32 whatever the moments' dtype (no copy for fp32 moments)
    return v.mul(c * (1.0 - SCREEN)).addcmul_(m, m, value=-1.0)


def _ratio(name: str, step: int, m: torch.Tensor, v: torch.Tensor, c: float, fm: float, fv: float) -> list[Violation]:
    """|m| ≤ √(C̃·(v + floor_v)) + floor_m per element: the fp32 screen, then fp64 on the
    screened elements only."""
    slack = _screen(m, v, c)
    if not float(slack.min()) < 0.0:
        return []
    idx = (slack.reshape(-1) < 0.0).nonzero()[:, 0]
    mm = m.reshape(-1)[idx].double().abs()
    allowed = (v.reshape(-1)[idx].double().clamp(min=0.0) + fv).mul_(c).sqrt_().add_(fm)
    val, k = _worst(mm / allowed)
    if not _over(val, 1.0):
        return []
    return [Violation("train.adam_moment_ratio", f"{name}:exp_avg", step, float(mm[k]), float(allowed[k]), int(idx[k]))]


def moment_bounds(step: int, grad_bound: float, beta1: float, beta2: float,
                  dtype: torch.dtype = torch.float32) -> tuple[float, float]:
    """(bound of max|m|, bound of max v) after ``step`` updates of moments stored in ``dtype``:
    the EMA gain times |g| (v: |g|²), plus the underflow floor. check_adam and adam_clear alike."""
    return (ema_gain(beta1, step, dtype) * grad_bound + ema_floor(beta1, dtype),
            ema_gain(beta2, step, dtype) * grad_bound * grad_bound + ema_floor(beta2, dtype))


def adam_summary(exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, step: int, beta1: float, beta2: float,
                 max_exp_avg_sq: torch.Tensor | None = None) -> torch.Tensor:
    """Six fp64 numbers, computed where the moments live without a host synchronisation: max|m|,
    min v, max v, the ratio screen's minimum, and for AMSGrad max(v − vmax) and max vmax (zeros
    without). A caller batches them for many tensors into one transfer; ``adam_clear`` says
    whether check_adam needs to look closer."""
    m, v = exp_avg.detach(), exp_avg_sq.detach()
    m_lo, m_hi = torch.aminmax(m)
    v_lo, v_hi = torch.aminmax(v)
    screen = _screen(m, v, ratio_constant(beta1, beta2, max(step, 1), m.dtype)).min()
    if max_exp_avg_sq is not None:
        vmax = max_exp_avg_sq.detach()
        below, top = (v - vmax).max(), vmax.max()
    else:
        below = top = torch.zeros((), dtype=v.dtype, device=v.device)
    return torch.stack([torch.maximum(-m_lo, m_hi), v_lo, v_hi, screen, below, top]).double()


def adam_clear(summary: list[float], step: int, grad_bound: float, beta1: float, beta2: float,
               dtype: torch.dtype = torch.float32) -> bool:
    """True when an adam_summary of moments stored in ``dtype`` shows every bound kept (NaN never does)."""
    m_top, v_low, v_top, screen, below, vmax_top = summary
    m_bound, v_bound = moment_bounds(step, grad_bound, beta1, beta2, dtype)
    return (step <= 0 or (m_top <= m_bound and v_low >= 0.0
                          and v_top <= v_bound and screen >= 0.0 and below <= 0.0 and vmax_top <= v_bound))


def check_adam(name: str, step: int, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, grad_bound: float,
               beta1: float, beta2: float, max_exp_avg_sq: torch.Tensor | None = None) -> list[Violation]:
    """Every Adam bound on one parameter's moments after ``step`` updates (state["step"]),
    given ``grad_bound`` ≥ every |g| the updates used (effective_grad_bound of the running
    maxima). Returns the broken ones, worst element each; [] when the state is consistent."""
    check_betas(beta1, beta2)
    out: list[Violation] = []
    if step <= 0:
        return out
    m = exp_avg.detach()
    v = exp_avg_sq.detach()
    dt = m.dtype
    fm, fv = ema_floor(beta1, dt), ema_floor(beta2, dt)
    m_low, m_high = (float(x) for x in torch.aminmax(m))  # propagates NaN: one pass finds both
    m_top = max(-m_low, m_high) if math.isfinite(m_low) and math.isfinite(m_high) else m_low + m_high
    v_low, v_top = (float(x) for x in torch.aminmax(v))
    for key, t, top in (("exp_avg", m, m_top), ("exp_avg_sq", v, v_top)):
        if not math.isfinite(top):
            val, idx = _worst(t.abs())
            out.append(Violation("train.nonfinite", f"{name}:{key}", step, val, math.inf, idx))
    if out:
        return out
    m_bound, v_bound = moment_bounds(step, grad_bound, beta1, beta2, dt)
    if _over(m_top, m_bound):
        out.append(Violation("train.adam_exp_avg", f"{name}:exp_avg", step, m_top, m_bound, int(torch.argmax(m.abs()))))
    if _over(v_top, v_bound):
        out.append(Violation("train.adam_exp_avg_sq", f"{name}:exp_avg_sq", step, v_top, v_bound, int(torch.argmax(v))))
    if v_low < 0.0:  # a sum of squares: a sign flip
        out.append(Violation("train.adam_exp_avg_sq", f"{name}:exp_avg_sq", step, v_low, 0.0, int(torch.argmin(v))))
    out += _ratio(name, step, m, v, ratio_constant(beta1, beta2, step, dt), fm, fv)
    if max_exp_avg_sq is not None:
        vmax = max_exp_avg_sq.detach()
        below, bi = _worst((v - vmax).double())  # vmax = max(vmax, v) exactly: never below v
        top, ti = _worst(vmax)
        if _over(below, 0.0):
            out.append(Violation("train.adam_amsgrad", f"{name}:max_exp_avg_sq", step, float(vmax.reshape(-1)[bi]),
                                 float(v.reshape(-1)[bi]), bi))
        elif _over(top, v_bound):
            out.append(Violation("train.adam_amsgrad", f"{name}:max_exp_avg_sq", step, top, v_bound, ti))
    return out


def _recurrence_slack(momentum: float | None, batches: int, dtype: torch.dtype) -> tuple[float, float]:
    """(relative slack, absolute floor) of a running statistic's EMA: ema_gain's fixed point for
    its smallest weight a (momentum, or 1/t for a cumulative average); inf where κu ≥ a."""
    a = momentum if momentum is not None else 1.0 / max(batches, 1)
    e = ROUNDING_OPS * unit(dtype)[0]
    if e >= a:
        return math.inf, math.inf
    return (1.0 + e) / (1.0 - e / a) - 1.0, ema_floor(1.0 - a, dtype)


def running_var_bounds(var_min: torch.Tensor, var_max: torch.Tensor, momentum: float | None,
                       batches: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Per channel (lo, hi) that running_var must lie in, given the per-channel extremes of its
    starting value and of every unbiased batch variance since (``var_min``, ``var_max``) and
    the ``batches`` training-mode updates so far (num_batches_tracked)."""
    rec, floor = _recurrence_slack(momentum, batches, dtype)
    if math.isinf(rec):
        return torch.full_like(var_min.double(), -math.inf), torch.full_like(var_max.double(), math.inf)
    slack = (1.0 + rec) * (1.0 + VAR_SLACK)
    return var_min.double() / slack - floor, var_max.double() * slack + floor


def running_mean_bounds(mean_min: torch.Tensor, mean_max: torch.Tensor, var_max: torch.Tensor, momentum: float | None,
                        batches: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Per channel (lo, hi) for running_mean, from the extremes of its starting value and of the
    batch means. Both computations of a batch mean err relative to the inputs' magnitude, not to
    the mean (which may be near 0), so the hull widens by VAR_SLACK of max(|mean|, std)."""
    rec, floor = _recurrence_slack(momentum, batches, dtype)
    lo, hi = mean_min.double(), mean_max.double()
    if math.isinf(rec):
        return torch.full_like(lo, -math.inf), torch.full_like(hi, math.inf)
    scale = torch.maximum(torch.maximum(lo.abs(), hi.abs()), var_max.double().clamp(min=0.0).sqrt())
    widen = (rec + VAR_SLACK) * scale + floor
    return lo - widen, hi + widen


def check_running_stat(name: str, key: str, step: int, stat: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> list[Violation]:
    """A running statistic (``key``: running_var or running_mean) within [lo, hi] per channel;
    NaN or Inf is a violation. The worst channel is the one farthest outside, relative to the
    bound's magnitude."""
    x = stat.detach().double().reshape(-1)
    lo, hi = lo.reshape(-1), hi.reshape(-1)
    bad = ~torch.isfinite(x)
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        return [Violation("train.nonfinite", f"{name}:{key}", step, float(x[i]), math.inf, i)]
    out_of = (x > hi) | (x < lo)
    if not bool(out_of.any()):
        return []
    # the worst: farthest outside relative to the bound's magnitude (bounds are finite where broken)
    dist = torch.where(out_of, torch.maximum(x - hi, lo - x) / torch.maximum(hi.abs(), lo.abs()).clamp(min=1e-300),
                       torch.zeros_like(x))
    _, i = _worst(dist)
    xi = float(x[i])
    return [Violation(f"train.norm_{key}", f"{name}:{key}", step, xi, float(hi[i] if xi > hi[i] else lo[i]), i)]


def evidence(v: Violation, *, reruns: int, reproduced: int, injected: list[dict]) -> Evidence:
    """A violation as the scan's Evidence. A rigorous bound broken proves corrupted state
    (FAULTY, as any broken exact expectation, docs/design.md §7.2); the running statistics' checks
    slack is heuristic, so they stay SUSPECT."""
    return Evidence(check=v.check, severity=Verdict.FAULTY if v.check in RIGOROUS else Verdict.SUSPECT,
                    case_id=f"train/step{v.step}/{v.tensor}", op=v.tensor,
                    summary=f"{v.tensor} at step {v.step}: {v.value:.6g} against bound {v.bound:.6g}",
                    threshold=v.bound, max_value=v.value, margin=v.ratio, elements=1,
                    samples=[{"index": v.index, "value": v.value, "bound": v.bound}],
                    reruns=reruns, reproduced=reproduced, injected=list(injected))
