"""Scale dithering: which power-of-two exponent pairs a sweep checks (docs/fleet.md §3.1).

A fault may be confined to a narrow band of magnitudes, and one sweep checks few scales: the
gemm probe runs each training GEMM at the workload's ``scan.scales`` (e.g. (0, 0), (-16, -16),
(16, 16), (-8, 8)), the pow2 probe a grid of exponent pairs ``step`` apart. Successive sweeps
move both by an offset, so that within ``step²`` sweeps the pow2 grid has visited every
exponent pair (a, b) of the exact range once (numerics.pow2_exact_safe still decides which
pairs of a grid are checkable; the others are skipped and counted):

    sweep index i → j = i mod step²;  q, r = divmod(j, step);  offset = (r, (q + r) mod step)

a bijection of 0 … step²−1 onto [0, step)² in which both offsets change every sweep from step
3 on (at step 2 no order of the four offsets can). The pow2 grid at offset (oa, ob) is every
a ≡ oa and b ≡ ob (mod step) inside the range; the gemm probe shifts each non-base scale by
the same offset centred on zero (−step/2 … step/2 − 1), so its scales wander over the band
around each workload scale. Index 0 is the undithered scan.
"""

from __future__ import annotations

import math

from aegis_cli.ops.numerics import BF16_MIN_NORMAL, SUM_LIMIT


def step_for(sweeps: int, max_step: int) -> int:
    """The grid step whose square is the largest period ≤ ``sweeps`` (at most ``max_step``); 0: off."""
    return 0 if sweeps <= 0 else max(1, min(math.isqrt(sweeps), max_step))


def offset(index: int, step: int) -> tuple[int, int]:
    """The grid offset (oa, ob) in [0, step)² of sweep ``index`` (see the module docstring)."""
    if step <= 1:
        return (0, 0)
    q, r = divmod(index % (step * step), step)
    return (r, (q + r) % step)


def centred(off: tuple[int, int], step: int) -> tuple[int, int]:
    """An offset of [0, step)² as a shift of [−step/2, step/2)²: 0 stays 0."""
    half = step // 2
    return tuple(((o + half) % step) - half for o in off) if step > 1 else (0, 0)


def grid(lo: int, hi: int, step: int, off: int) -> list[int]:
    """Exponents x in [lo, hi] with x ≡ off (mod step): at off 0 the multiples of ``step``."""
    first = lo + ((off - lo) % step)
    return list(range(first, hi + 1, step))


def shifted(scales: list[list[int]], shift: tuple[int, int]) -> list[list[int]]:
    """A workload's scale pairs moved by ``shift``; the base (0, 0) stays (everything is compared with it)."""
    out = []
    for ea, eb in scales:
        pair = [ea, eb] if (ea, eb) == (0, 0) else [ea + shift[0], eb + shift[1]]
        if pair not in out and (pair != [0, 0] or (ea, eb) == (0, 0)):
            out.append(pair)
    return out


def operand_range(smallest: float, largest: float) -> tuple[int, int]:
    """Exponents e with 2^e·[smallest, largest] normal and below the sum limit: outside them
    no pair can be exact (a necessary part of Magnitudes.exact_safe), so a grid need not go further."""
    return (math.ceil(math.log2(BF16_MIN_NORMAL / smallest)), math.ceil(math.log2(SUM_LIMIT / largest)) - 1)


def parse_pair(text: str) -> tuple[int, int]:
    """The type of the probes' offset options: ``"A,B"`` → (A, B), each within ±MAX_EXP."""
    try:
        a, b = (int(x) for x in str(text).split(","))
    except ValueError:
        raise ValueError("must be two integers A,B (e.g. 3,11)") from None
    if not (abs(a) <= MAX_EXP and abs(b) <= MAX_EXP):
        raise ValueError(f"must lie in -{MAX_EXP}…{MAX_EXP} each")
    return (a, b)


parse_pair.__name__ = "pair"
MAX_EXP = 256  # beyond any bf16 exponent range: an offset or shift larger than this checks nothing
