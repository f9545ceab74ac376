"""FAULTY or SUSPECT: the one judgement of GEMM evidence (docs/design.md §7), for the scan's
confirmation re-runs and for replay alike.

In order:
  runs of the same inputs gave different bits     FAULTY (a deterministic kernel must not differ)
  a rigorous check fired                          FAULTY (an exact expectation or bound broken)
  fp32 rounding of these inputs could explain it  SUSPECT (the caller says so, e.g. replay of
                                                  inputs τ was not calibrated for)
  the flagged checksums, recomputed in fp64,      SUSPECT ("numerics: threshold too tight for
  lie within a rigorous rounding bound            this input?", checks/recompute.py)
  reproducible and ≥ the confirmation margin × τ  FAULTY
  otherwise                                       SUSPECT

Repetition alone proves nothing (a deterministic kernel repeats its own rounding), so a checksum
flag is FAULTY only when its recomputation shows bits beyond any rounding, or where none could
run.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from aegis_cli.checks.recompute import Recompute
from aegis_cli.ops.verdict import Verdict

# checks whose firing no rounding can explain: exact expectations and rigorous bounds
RIGOROUS = frozenset({"gemm.nonfinite", "gemm.output_rowsum", "gemm.pow2_exact", "gemm.element_reference",
                      "attention.nonfinite", "attention.pow2_exact"})


@dataclass(frozen=True)
class Judgement:
    severity: Verdict
    why: str  # a clause for a summary, e.g. "an exact expectation was broken"
    doubted: bool = False  # SUSPECT because rounding could explain it (``why`` is the caller's own)


def margin(max_value: float, tau: float) -> float:
    """How far over τ a checksum difference lies (a non-finite one is infinitely far)."""
    return max_value / tau if math.isfinite(max_value) else math.inf


def judge(checks: Iterable[str], *, distinct_outputs: int, reproducible: bool, margin: float | None,
          confirm_margin: float, rounding_doubt: Callable[[], str | None] | None = None,
          recompute: Recompute | None = None) -> Judgement:
    """The severity of ``checks`` that fired on a GEMM.

    ``distinct_outputs``: bit-distinct results among runs of the same inputs; ``reproducible``:
    the flag came back on every run; ``margin``: the checksum margin over τ (None without a
    checksum flag); ``rounding_doubt``: asked only where nothing rigorous decided, returns why
    fp32 rounding could explain the flag, or None; ``recompute``: what recomputing the flagged
    checksums found (None: not recomputed)."""
    checks = list(checks)
    if distinct_outputs > 1:
        return Judgement(Verdict.FAULTY, f"runs of a deterministic kernel gave {distinct_outputs} different results")
    if not checks:
        return Judgement(Verdict.HEALTHY, "every run clean and bit-identical")
    if any(c in RIGOROUS for c in checks):
        return Judgement(Verdict.FAULTY, "an exact expectation was broken")
    doubt = rounding_doubt() if rounding_doubt is not None else None
    if doubt:
        return Judgement(Verdict.SUSPECT, doubt, doubted=True)
    if recompute is not None and not recompute.wrong:
        over = f"{margin:.3g}× over threshold, but " if margin is not None else ""
        return Judgement(Verdict.SUSPECT, f"numerics: threshold too tight for this input? {over}{recompute.describe()}",
                         doubted=True)
    if reproducible and (margin or 0) >= confirm_margin:
        return Judgement(Verdict.FAULTY, f"{margin:.3g}× over threshold, bit-identical every run")
    return Judgement(Verdict.SUSPECT, f"only {margin:.3g}× over threshold (confirmation needs {confirm_margin:g}×)")
