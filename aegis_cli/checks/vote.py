"""The power-of-two vote (docs/design.md §5): which runs of one GEMM case group are wrong.

C(2ᵃ·A, 2ᵇ·B) = 2ᵃ⁺ᵇ·C(A, B) bit for bit, so every run of a case group, scaled back to the
base scale, is a candidate for one true result. When a scaled run disagrees with the base
run, one of the two is wrong, and comparing the pair cannot say which. The vote does, in two
rounds:

1. each scale's own runs (the base and its re-runs; a scaled run and any re-runs of it) give
   that scale's bits: those more than half its runs share, else none (the scale abstains);
2. the bits more than half the scales gave are the true result; every run that differs from
   them is odd. Without such bits the vote is undecided (the caller falls back to comparing
   with the base run, and says so).

Scales vote, not runs: re-runs of one scale repeat a fault that sits still, so counting them
as votes would let a base corrupted in every run outvote the scaled runs it spared. The vote
still assumes most scales are right: one fault that corrupts most scales alike wins it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Vote:
    """The outcome of one vote over the runs' bit patterns (fingerprints), scale by scale."""

    majority: Hashable | None  # the bits more than half the scales gave; None: undecided
    votes: int  # scales that gave the most common bits
    scales: int  # scales in all
    odd: tuple[tuple[int, int], ...]  # (scale, run) of every run off the majority (none when undecided)

    @property
    def decided(self) -> bool:
        return self.majority is not None


def majority(prints: Sequence[Hashable]) -> Hashable | None:
    """The bits more than half of ``prints`` share, or None."""
    if not prints:
        return None
    ((top, n),) = Counter(prints).most_common(1)
    return top if 2 * n > len(prints) else None


def vote(scales: Sequence[Sequence[Hashable]]) -> Vote:
    """``scales[i]``: the bit patterns of scale i's runs, scaled back to the base scale."""
    own = Counter(b for b in map(majority, scales) if b is not None)
    top, votes = own.most_common(1)[0] if own else (None, 0)
    if 2 * votes <= len(scales):
        return Vote(None, votes, len(scales), ())
    odd = tuple((i, j) for i, runs in enumerate(scales) for j, p in enumerate(runs) if p != top)
    return Vote(top, votes, len(scales), odd)


def failures(prints: Sequence[Hashable], reference: Hashable) -> int:
    """How many of one scale's runs gave other bits than ``reference`` (the majority, or the
    base run's when the vote was undecided): the reproductions of the fault itself."""
    return sum(p != reference for p in prints)
