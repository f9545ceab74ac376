"""Recomputing flagged checksums from the operands (docs/design.md §7.2): are the bits wrong, or
could fp32 rounding reach what was seen? Repetition cannot tell: a deterministic kernel repeats
its own rounding every time.

For each flagged checksum entry (row × column tile of the row sums, row tile × column of the
column sums; the worst MAX_ENTRIES by normalised difference) the C elements it sums are
recomputed in fp64 from the stored operands, with Σ|a||b| beside each. Two rigorous bounds:

  the observed fp32 checksum vs the fp64 sum of its elements: γ of K + span fp32 operations
  (numerics.accumulation_ceiling: each add rounding or, on a truncating matrix unit, chopping
  by ≤ 2⁻²³) times Σ|a||b| over the span, plus what subnormals can lose;
  each observed bf16 element vs its fp64 value: the element bound of ElementReference.

Either broken: bits are wrong beyond any rounding. Neither: rounding of these inputs can reach
the flag, which then confirms nothing on its own. Work is O(K·(entries·span)), never the GEMM.
fp64's own error (≈ K·2⁻⁵³ of Σ|a||b|) is 2⁻³⁰ of the bounds and is left out.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from aegis_cli.checks.gemm import Signal, element_bound
from aegis_cli.ops import numerics
from aegis_cli.ops.gemm import GemmOperands, GemmResult

MAX_ENTRIES = 64  # flagged checksum entries recomputed per signal, the worst first


@dataclass(frozen=True)
class Recompute:
    """What recomputing one signal's flagged checksums in fp64 found."""

    entries: int  # checksum entries recomputed
    elements: int  # C elements recomputed (the entries' tile rows or columns)
    beyond_bound: int  # entries and elements farther from fp64 than any rounding reaches
    worst_ratio: float  # largest |observed − fp64| ÷ its rigorous bound (> 1: beyond)

    @property
    def wrong(self) -> bool:
        """Whether bits are wrong: something lay beyond what rounding can reach."""
        return self.beyond_bound > 0

    def merge(self, other: Recompute | None) -> Recompute:
        if other is None:
            return self
        return Recompute(self.entries + other.entries, self.elements + other.elements,
                         self.beyond_bound + other.beyond_bound, max(self.worst_ratio, other.worst_ratio))

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def describe(self) -> str:
        return (f"{self.entries} flagged checksum(s) and {self.elements} output element(s) recomputed in fp64: "
                + (f"{self.beyond_bound} beyond any rounding (up to {self.worst_ratio:.3g}× the rigorous bound)" if self.wrong
                   else f"all within what fp32 rounding can reach (at most {self.worst_ratio:.2g} of the rigorous bound)"))


def worst_positions(sig: Signal, limit: int = MAX_ENTRIES) -> torch.Tensor:
    """The (at most ``limit``) flagged positions of a checksum signal with the largest normalised
    differences, (E, 2) int64 on the host."""
    where = sig.where
    if where.shape[0] <= limit or sig.diff is None:
        return where[:limit]
    d = sig.diff.cpu()[where[:, 0], where[:, 1]]
    return where[torch.topk(d, limit).indices]


def recompute(ops: GemmOperands, res: GemmResult, axes: str, where: torch.Tensor) -> Recompute | None:
    """Recompute the checksum entries at ``where`` (host (E, 2): (row, column tile) for ``axes``
    "row", (row tile, column) for "col") of ``res`` from ``ops``, where the tensors live. None
    where K is too deep for a finite bound (K·2⁻²³ ≥ ½): there rounding can reach anything."""
    if axes == "row":
        a, b, c, sums, span = ops.a_mk, ops.b_kn, res.c, res.row_sums, res.tile[1]
    else:  # a column checksum of C is a row checksum of Cᵀ = Bᵀ·Aᵀ
        a, b, c, sums, span = ops.b_kn.t(), ops.a_mk.t(), res.c.t(), res.col_sums.t(), res.tile[0]
        where = where[:, [1, 0]]
    k, n = b.shape
    sum_bound = numerics.accumulation_ceiling(k, span)
    if not math.isfinite(sum_bound):  # then γ_K of the elements has no finite value either
        return None
    floor_sum, floor_el = numerics.subnormal_slack(k, span), numerics.subnormal_slack(k)
    out = Recompute(0, 0, 0, 0.0)
    for t in sorted(set(where[:, 1].tolist())):
        rows = where[where[:, 1] == t, 0].to(a.device)
        j0, j1 = t * span, min(n, (t + 1) * span)
        a64, b64 = a[rows].double(), b[:, j0:j1].double()  # (r, K), (K, w)
        exact, mag = a64 @ b64, a64.abs() @ b64.abs()  # (r, w)
        el = _ratio(c[rows, j0:j1], exact, element_bound(exact, mag, k) + floor_el)
        cs = _ratio(sums[rows, t], exact.sum(1), sum_bound * mag.sum(1) + floor_sum)
        out = out.merge(Recompute(cs.numel(), el.numel(), int((el > 1).sum()) + int((cs > 1).sum()),
                                  max(float(el.max()), float(cs.max()))))
    return out


def _ratio(observed: torch.Tensor, exact: torch.Tensor, bound: torch.Tensor) -> torch.Tensor:
    """|observed − exact| ÷ bound, NaN/Inf observed → inf; a zero bound takes any difference as
    infinitely far."""
    err = torch.nan_to_num((observed.double() - exact).abs(), nan=math.inf, posinf=math.inf)
    return torch.where(err == 0, torch.zeros_like(err), err / bound.clamp(min=1e-300))


def merged(found: Iterable[Recompute | None]) -> Recompute | None:
    """Everything several recomputations found, as one (None if none ran)."""
    out = None
    for r in found:
        out = r.merge(out) if r is not None else out
    return out
