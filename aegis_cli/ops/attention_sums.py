"""The attention invariants' reference sides, noise scales, magnitudes, thresholds and rounding
bounds (docs/attention.md §2–§4). Everything fp64, wherever the tensors live.

Each invariant compares a fused fp32 sum of a kernel with its fp64 expectation. The difference
is read two ways:
- in units of σ, the spread that the bf16 roundings of P and dS (each ≤ 2⁻⁹ relative,
  independent) give the sum, plus fp32 accumulation: the statistic τ is set on (``diff``);
- in units of s, a magnitude that bounds every rounding of the sum (as the GEMM checksums,
  docs/design.md §2.4): above ``rounding_bound``·s no rounding explains it (``rel``).
Cheap ones read only the operands (O(S·D) per head); "needs P/dS" ones read the fp64
reference attention (O(S²·D)), computed once per case.

  o_rowsum   O·1 = P·(V·1)                 σ = 2⁻⁸(‖P_i∘(V·1)‖₂ + ‖P_i‖₂·|P_i·(V·1)|)   s = Σ_j P_ij‖v_j‖₁        needs P
  lse        saved LSE = log Σ_j exp(s_ij)  σ = s = scale·‖q_i‖₁·max|K| + |lse_i| + 1 (fp32 only)          needs P
  dv_colsum  1ᵀdV = Σ_group 1ᵀdO           σ = 2⁻⁸(Σ_i dO_id²‖P_i‖₂²)^½                  s = Σ_group Σ_i |dO_id|   cheap
  dk_colsum  1ᵀdK = 0                      σ = scale·2⁻⁸(Σ_i q_id²(‖dS_i‖₂ + r_i)²)^½    s = scale·Σ_i a_i|q_id|  cheap
  dq_rowsum  dQ·1 = scale·dS·(K·1)         σ = scale·2⁻⁸(‖dS_i∘(K·1)‖₂ + r_i|P_i·(K·1)|) s = scale·Σ_j P_ij(A_ij + Ā_i)‖k_j‖₁  needs dS
with a_i = 2·‖dO_i‖₁·max|V| ≥ Σ_j |dS_ij|, A_ij = Σ_d |dO_id||v_jd| ≥ |dP_ij|, Ā_i = Σ_j P_ij A_ij,
r_i = ‖P_i∘dP_i‖₂ + ‖dO_i∘O_i‖₂ (the spread of D_i's error). Each σ also carries 4·2⁻²³·s (fp32).
The cheap two take ‖P_i‖₂ and ‖dS_i‖₂ from the reference where there is one, else their bounds
‖P_i‖₂ ≤ 1 and ‖dS_i‖₂ + r_i ≤ 2·max_j‖v_j‖₂·‖dO_i‖₂: still O(S·D), a looser σ.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from aegis_cli.ops.attention import AttentionBackward, AttentionForward, AttentionOperands, AttentionReference
from aegis_cli.ops.numerics import U_ACC, U_BF16, gamma_acc, normalised_diff, pow2_scale

FORWARD_INVARIANTS = ("o_rowsum", "lse")
BACKWARD_INVARIANTS = ("dv_colsum", "dk_colsum", "dq_rowsum")
INVARIANTS = FORWARD_INVARIANTS + BACKWARD_INVARIANTS


def _groups(t: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """(B, Hq, …) → (B, Hkv, G, …): each KV head's query heads, in order."""
    b, h = t.shape[:2]
    return t.reshape(b, kv_heads, h // kv_heads, *t.shape[2:])


@dataclass(frozen=True)
class AttentionThresholds:
    """τ per invariant, in units of its σ (the LSE: of its s): set from the clean noise measured
    on the CPU reference (docs/attention.md §4, docs/attention-coverage.md: no false positive in
    the clean runs there, with the margin stated). A flag within ``rounding_bound`` can be
    rounding: SUSPECT, never FAULTY."""

    tau: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_TAU))

    def __post_init__(self) -> None:
        for name, t in self.tau.items():
            if name not in INVARIANTS or not 0 < t < 1e6:
                raise ValueError(f"attention threshold {name}={t}: unknown invariant or outside (0, 1e6)")


# the clean maxima measured on the CPU reference (docs/attention-coverage.md), times a margin
DEFAULT_TAU = {"o_rowsum": 8.0, "lse": 1e-6, "dv_colsum": 10.0, "dk_colsum": 6.0, "dq_rowsum": 8.0}


@dataclass
class Diffs:
    """One run's fused sums against their expectations: ``diff`` in units of σ (what τ is set
    on), ``rel`` in units of s (what the rounding bound is in), and the values compared."""

    diff: dict[str, torch.Tensor] = field(default_factory=dict)
    rel: dict[str, torch.Tensor] = field(default_factory=dict)
    observed: dict[str, torch.Tensor] = field(default_factory=dict)
    expected: dict[str, torch.Tensor] = field(default_factory=dict)

    def add(self, name: str, observed: torch.Tensor, expected: torch.Tensor, sigma: torch.Tensor, s: torch.Tensor) -> None:
        self.observed[name], self.expected[name] = observed, expected
        self.diff[name] = normalised_diff(observed, expected, sigma + 4 * U_ACC * s)
        self.rel[name] = normalised_diff(observed, expected, s)

    def update(self, other: Diffs) -> None:
        for mine, theirs in ((self.diff, other.diff), (self.rel, other.rel), (self.observed, other.observed),
                             (self.expected, other.expected)):
            mine.update(theirs)


def _reach(ops: AttentionOperands, scale: float) -> torch.Tensor:
    """scale·‖q_i‖₁·max|K| per query (B, Hq, S), fp64: a bound on every |s_ij| of query i."""
    kmax = ops.k.double().abs().amax(dim=(-1, -2)).repeat_interleave(ops.shape.group, dim=1)  # (B, Hq)
    return scale * ops.q.double().abs().sum(-1) * kmax.unsqueeze(-1)


def softmax_reach(ops: AttentionOperands, scale: float) -> float:
    """max over heads and queries of scale·‖q_i‖₁·max|K|: a bound on every |s_ij| and on the
    absolute fp32 error scale of the scores."""
    return float(_reach(ops, scale).max())


def lse_scale(ops: AttentionOperands, lse: torch.Tensor, scale: float) -> torch.Tensor:
    """The LSE's s per query (B, Hq, S): scale·‖q_i‖₁·max|K| + |lse_i| + 1 (its σ, fp32 noise only)."""
    return _reach(ops, scale) + lse.abs() + 1


def reference_disagreement(got: AttentionReference, want: AttentionReference, ops: AttentionOperands,
                           scale: float) -> dict[str, float]:
    """How far one reference's sides lie from another's, in the units the checks judge them by:
    o_rowsum and dq_rowsum in their σ, the LSE in its τ·s, the spreads and p_min relative (the
    largest over queries). A kernel's sides against ops/attention.reference."""
    rel = lambda x, w: float(((x - w).abs() / w.abs().clamp_min(1e-300)).max())
    out = {side: float(((getattr(got, side) - getattr(want, side)).abs() / getattr(want, sig).clamp_min(1e-300)).max())
           for side, sig in (("o_rowsum", "o_rowsum_sigma"), ("dq_rowsum", "dq_rowsum_sigma"))}
    out["lse"] = float(((got.lse - want.lse).abs() / lse_scale(ops, want.lse, scale)).max()) / DEFAULT_TAU["lse"]
    for name in SPREAD_SIDES:
        out[name] = rel(getattr(got, name), getattr(want, name))
    out["p_min"] = abs(got.p_min - want.p_min) / max(want.p_min, 1e-300)
    return out


# the reference's spreads and magnitudes (AttentionReference fields): what σ and s are made of
SPREAD_SIDES = ("o_rowsum_scale", "dq_rowsum_scale", "o_rowsum_sigma", "dq_rowsum_sigma", "p_rms", "ds_rms")


def forward_diffs(ops: AttentionOperands, fwd: AttentionForward, ref: AttentionReference, scale: float) -> Diffs:
    s_lse = lse_scale(ops, ref.lse, scale)
    out = Diffs()
    out.add("o_rowsum", fwd.o_rowsum, ref.o_rowsum, ref.o_rowsum_sigma, ref.o_rowsum_scale)
    out.add("lse", fwd.lse, ref.lse, s_lse * (1 - 4 * U_ACC), s_lse)  # fp32 noise only: σ is s
    return out


def backward_diffs(ops: AttentionOperands, bwd: AttentionBackward, ref: AttentionReference | None,
                   scale: float) -> Diffs:
    """The backward's invariants; without ``ref`` (no fp64 attention), the cheap two only."""
    kv = ops.shape.kv_heads
    do = _groups(ops.do.double(), kv)  # (B, Hkv, G, S, D)
    q = _groups(ops.q.double(), kv)
    v = ops.v.double()
    vmax = v.abs().amax(dim=(-1, -2))[:, :, None, None]  # (B, Hkv, 1, 1)
    vnorm = v.square().sum(-1).amax(-1).sqrt()[:, :, None]  # (B, Hkv, 1): max_j ‖v_j‖₂
    a = 2 * do.abs().sum(-1) * vmax  # (B, Hkv, G, S) ≥ Σ_j |dS_ij|
    out = Diffs()
    # without the reference: ‖P_i‖₂ ≤ 1 and ‖dS_i‖₂ + r_i ≤ 2·max_j ‖v_j‖₂·‖dO_i‖₂ (Cauchy–Schwarz)
    p_rms = _groups(ref.p_rms, kv).unsqueeze(-1) if ref is not None else 1.0
    ds_rms = (_groups(ref.ds_rms, kv) if ref is not None else 2 * vnorm.unsqueeze(-1) * do.square().sum(-1).sqrt())
    out.add("dv_colsum", bwd.dv_colsum, do.sum(dim=(2, 3)), 2.0**-8 * (do * p_rms).square().sum(dim=(2, 3)).sqrt(),
            do.abs().sum(dim=(2, 3)))
    dk_sigma = scale * 2.0**-8 * (q.square() * ds_rms.square().unsqueeze(-1)).sum(dim=(2, 3)).sqrt()
    out.add("dk_colsum", bwd.dk_colsum, torch.zeros_like(bwd.dk_colsum, dtype=torch.float64), dk_sigma,
            scale * (a.unsqueeze(-1) * q.abs()).sum(dim=(2, 3)))
    if ref is not None:
        out.add("dq_rowsum", bwd.dq_rowsum, ref.dq_rowsum, ref.dq_rowsum_sigma, ref.dq_rowsum_scale)
    return out


def rounding_bound(name: str, ops: AttentionOperands, scale: float) -> float:
    """How far (normalised) a healthy kernel's sum can lie from its fp64 value under the error
    model of docs/attention.md §3: bf16 rounding of P (and of dS: ×3 for dK, dQ), fp32 scores
    off by γ_D of their reach (twice: P's exponent and the LSE), fp32 accumulation over every key,
    query and group head. Above it, rounding cannot explain a difference."""
    sh = ops.shape
    delta = gamma_acc(sh.head_dim) * softmax_reach(ops, scale) + 8 * U_ACC
    acc = gamma_acc(sh.seq * sh.group + sh.head_dim + 8)
    if name == "lse":
        return gamma_acc(sh.head_dim + sh.seq + 16)
    if name in ("o_rowsum", "dv_colsum"):
        return U_BF16 * (1 + 2.0**-6) + 2 * delta + acc
    return 3 * (U_BF16 * (1 + 2.0**-6) + 2 * delta) + acc


def scaled_operands(ops: AttentionOperands, ev: int, edo: int) -> AttentionOperands:
    """V·2^ev and dO·2^edo: exact for bf16 in the normal range (Q and K scalings are not: the
    softmax is not homogeneous)."""
    return AttentionOperands(ops.q, ops.k, pow2_scale(ops.v, ev), pow2_scale(ops.do, edo), ops.causal)


def pow2_safe(ops: AttentionOperands, ref: AttentionReference, ev: int, edo: int) -> bool:
    """Whether V·2^ev, dO·2^edo must give bit-exactly scaled outputs: ev + edo = 0 (dS = P∘(dP − D)
    then keeps its bits, however small P is), and the smallest products P·V and P·dO stay normal
    at both scales (and V, dO far from overflow)."""
    if ev + edo:
        return False
    if ev == 0:
        return True
    small = lambda t: float(t.double().abs()[t != 0].min()) if bool((t != 0).any()) else 1.0
    big = lambda t: float(t.double().abs().max())
    p_min = ref.p_min
    lo = min(small(ops.v) * 2.0 ** min(ev, 0), small(ops.do) * 2.0 ** min(edo, 0))
    hi = max(big(ops.v) * 2.0 ** max(ev, 0), big(ops.do) * 2.0 ** max(edo, 0))
    return p_min * lo > 2.0**-100 and hi * ops.shape.seq < 2.0**100 and math.isfinite(hi)
