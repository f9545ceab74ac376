"""The attention checks (docs/attention.md): pure functions from one forward+backward run, its
operands, the fp64 reference and τ to signals, and their judgement after re-runs.

  attention.o_rowsum     fused Σ_d O (fp32 accumulator) vs fp64 P·(V·1), per query      |Δ|/s > τ
  attention.lse          saved log-sum-exp vs the fp64 one, per query                     |Δ|/s > τ
  attention.dv_colsum    fused Σ_keys dV vs Σ_group Σ_queries dO, per KV head and column  |Δ|/s > τ
  attention.dk_colsum    fused Σ_keys dK vs 0, per KV head and column                     |Δ|/s > τ
  attention.dq_rowsum    fused Σ_d dQ vs fp64 scale·dS·(K·1), per query                   |Δ|/s > τ
  attention.nonfinite    NaN/Inf in any output from finite inputs                          rigorous
  attention.pow2_exact   V·2^a, dO·2^b must scale every output exactly (a + b = 0)         rigorous

A flag within the rounding bound of its invariant (ops/attention_sums.rounding_bound) could be
rounding: it stays SUSPECT however often it repeats. Runs of the deterministic kernels that
differ bit for bit are FAULTY (checks/judge.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from aegis_cli.checks import judge
from aegis_cli.ops import attention_sums as sums
from aegis_cli.ops.attention import AttentionBackward, AttentionForward, AttentionOperands, AttentionReference
from aegis_cli.ops.attention_sums import AttentionThresholds
from aegis_cli.ops.fingerprint import int_view
from aegis_cli.ops.numerics import pow2_scale

PREFIX = "attention."
POW2_CHECK = "attention.pow2_exact"
NONFINITE_CHECK = "attention.nonfinite"
INVARIANT_CHECKS = tuple(PREFIX + n for n in sums.INVARIANTS)
ATTENTION_CHECKS = (*INVARIANT_CHECKS, NONFINITE_CHECK, POW2_CHECK)
# what one position of each output's or sum's tensor names
OUTPUT_AXES = {"o": ("batch", "head", "query", "column"), "dq": ("batch", "head", "query", "column"),
               "dk": ("batch", "kv_head", "key", "column"), "dv": ("batch", "kv_head", "key", "column"),
               "lse": ("batch", "head", "query"), "o_rowsum": ("batch", "head", "query"),
               "dq_rowsum": ("batch", "head", "query"), "dk_colsum": ("batch", "kv_head", "column"),
               "dv_colsum": ("batch", "kv_head", "column")}


@dataclass
class AttentionSignal:
    """One check that fired on one run."""

    check: str
    max_value: float  # difference in units of σ (invariants), 1.0 (an exact expectation broken)
    where: torch.Tensor  # (E, n) int64 on the host: flagged positions of ``tensor``
    tensor: str  # which output or sum the positions index (OUTPUT_AXES)
    observed: torch.Tensor | None = None
    expected: torch.Tensor | None = None
    diff: torch.Tensor | None = None
    bound: float | None = None  # rounding bound in units of s (invariants)
    rel_max: float | None = None  # the largest flagged difference in units of s

    @property
    def elements(self) -> int:
        return int(self.where.shape[0])

    def position(self, flat: tuple[int, ...], block: int) -> dict:
        """The sample keys of one position, with its query or key block of ``block`` rows."""
        out = dict(zip(OUTPUT_AXES[self.tensor], flat, strict=True))
        for axis in ("query", "key"):
            if axis in out:
                out[f"{axis}_block"] = out[axis] // block
        return out


@dataclass
class Checked:
    signals: list[AttentionSignal]
    clean_max: dict[str, float]  # per invariant: the largest normalised difference under τ
    tau: dict[str, float]


def invariant_signals(diffs: sums.Diffs, th: AttentionThresholds, ops: AttentionOperands, scale: float) -> Checked:
    """The invariants of ``diffs`` over their τ; the clean maxima of the rest."""
    found, clean = [], {}
    for name, d in diffs.diff.items():
        tau = th.tau[name]
        flag = d > tau
        rest = d[~flag]
        clean[name] = float(rest.max()) if rest.numel() else 0.0
        if bool(flag.any()):
            found.append(AttentionSignal(PREFIX + name, float(d.max()), flag.nonzero().cpu(), name,
                                         observed=diffs.observed[name], expected=diffs.expected[name], diff=d,
                                         bound=sums.rounding_bound(name, ops, scale), rel_max=float(diffs.rel[name][flag].max())))
    return Checked(found, clean, {n: th.tau[n] for n in diffs.diff})


def nonfinite_signal(outputs: dict[str, torch.Tensor]) -> AttentionSignal | None:
    for name, t in outputs.items():
        bad = ~torch.isfinite(t)
        if bool(bad.any()):
            return AttentionSignal(NONFINITE_CHECK, 1.0, bad.nonzero().cpu(), name, observed=t)
    return None


def pow2_signal(outputs: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> AttentionSignal | None:
    """The first output (in ``outputs``' order) that differs bit for bit from its exact expectation."""
    for name, t in outputs.items():
        if name in expected and not torch.equal(int_view(t), int_view(expected[name])):
            where = (int_view(t) != int_view(expected[name])).nonzero().cpu()
            return AttentionSignal(POW2_CHECK, 1.0, where, name, observed=t, expected=expected[name])
    return None


def outputs_of(fwd: AttentionForward | None, bwd: AttentionBackward | None) -> dict[str, torch.Tensor]:
    out = {}
    if fwd is not None:
        out.update(o=fwd.o, lse=fwd.lse, o_rowsum=fwd.o_rowsum)
    if bwd is not None:
        out.update(bwd.tensors())
    return out


def check_attention(ops: AttentionOperands, fwd: AttentionForward, bwd: AttentionBackward | None,
                    ref: AttentionReference | None, scale: float, th: AttentionThresholds,
                    expected: dict[str, torch.Tensor] | None = None) -> Checked:
    """Every attention check of one run: the invariants (the forward's and dQ's need ``ref``),
    NaN/Inf, and each output bit for bit against ``expected`` (the base run's, scaled) where given."""
    diffs = sums.Diffs()
    if ref is not None:
        diffs.update(sums.forward_diffs(ops, fwd, ref, scale))
    if bwd is not None:
        diffs.update(sums.backward_diffs(ops, bwd, ref, scale))
    checked = invariant_signals(diffs, th, ops, scale)
    outs = outputs_of(fwd, bwd)
    for extra in (nonfinite_signal(outs), pow2_signal(outs, expected) if expected is not None else None):
        if extra is not None:
            checked.signals.append(extra)
    return checked


def expected_at(base: dict[str, torch.Tensor], ev: int, edo: int) -> dict[str, torch.Tensor]:
    """The base run's outputs as V·2^ev, dO·2^edo must give them, exactly: O by 2^ev, dV by
    2^edo, dQ and dK by 2^(ev+edo), the LSE unchanged."""
    e = {"o": ev, "o_rowsum": ev, "lse": 0, "dq": ev + edo, "dk": ev + edo, "dv": edo, "dq_rowsum": ev + edo,
         "dk_colsum": ev + edo, "dv_colsum": edo}
    return {k: pow2_scale(t, e[k]) for k, t in base.items()}


def judge_signal(sig: AttentionSignal, *, distinct_outputs: int, reproducible: bool, tau: float | None,
                 confirm_margin: float) -> judge.Judgement:
    """FAULTY or SUSPECT for one signal after re-runs (checks/judge.py's rules): a flag within
    its invariant's rounding bound could be rounding, however often it repeats."""
    margin = judge.margin(sig.max_value, tau) if tau else None

    def doubt() -> str | None:
        if sig.bound is not None and sig.rel_max is not None and sig.rel_max <= sig.bound:
            return (f"{margin:.3g}× over threshold, but within the rounding bound of this invariant "
                    f"({sig.rel_max:.3g}·s ≤ {sig.bound:.3g}·s): could be rounding")
        return None

    return judge.judge((sig.check,), distinct_outputs=distinct_outputs, reproducible=reproducible, margin=margin,
                       confirm_margin=confirm_margin, rounding_doubt=doubt)
