"""The burn-in's schedule (docs/soak.md): which inputs, scales and repeats each launch of
``aegis scan --soak`` sees, a function of the seed alone, so every launch maps to a case id
and scan seed that ``aegis scan --seed S --case ID`` re-runs.

Input set i holds one (shape, distribution) of the workload, drawn with scan seed
``case_seed(seed, "soak", i)`` exactly as the scan draws that case; its scales are the base and
pairs drawn from that seed across the whole range where scaling its inputs is exact
(numerics.pow2_exact_safe), bands the scan's grid skips included; each scale runs ``repeats``
times, more for small shapes, so every set is about the same GEMM work.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from aegis_cli.ops import dither, numerics
from aegis_cli.ops.case import case_seed
from aegis_cli.probes.gemm import GemmCase

SCALES = 8  # scales per input set: the base and up to 7 exact-safe pairs
# GEMM work per input set (~0.8 s on an H200): its draw, fp64 references and each scale's set-up
# (scaled operands, expected fingerprint, limits) took 2-5 % of a set half this size (measured
# with a sync, benchmarks/soak_parts.py), so a set is long enough to make them ~1-2 %
SET_FLOPS = {"cuda": 4.8e14, "cpu": 1e8}
REPEATS = (2, 512)  # runs of each scale per set: at least two, so fingerprints of repeats compare
# every launch's checksums are screened; its C is fingerprinted at this rate (a full read of C,
# up to 15 % of a GEMM with K = 1280), and always on a scale's last repeat
FINGERPRINT_EVERY = 8


@dataclass(frozen=True)
class SetPlan:
    """Input set ``index``: its case (shape, distribution, scan seed), scales and repeats; its
    launches are numbered from ``first`` (the base run), scale by scale, up to ``repeats`` each
    (fewer when the burn-in's time runs out)."""

    index: int
    case: GemmCase
    scales: tuple[tuple[int, int], ...]
    repeats: int
    first: int


def set_case(wl, seed: int, index: int) -> GemmCase:
    """The case of input set ``index``: shapes rotate fastest, then distributions; its scan seed
    is drawn from the soak's seed and the index (a valid ``--seed``)."""
    shapes, dists = wl.gemms(), wl.scan.distributions
    return GemmCase(wl.name, shapes[index % len(shapes)], dists[(index // len(shapes)) % len(dists)],
                    case_seed(seed, "soak", index))


def draw_scales(mag: numerics.Magnitudes | None, seed: int, n: int = SCALES) -> tuple[tuple[int, int], ...]:
    """The base and up to ``n - 1`` pairs (ea, eb) drawn uniformly over the range where scaling
    these inputs is exact (numerics.pow2_exact_safe): the sum first, then its split."""
    out = [(0, 0)]
    if mag is None or not mag.exact_safe(0, 0):
        return tuple(out)
    lg = math.log2
    (ea_lo, ea_hi), (eb_lo, eb_hi) = dither.operand_range(mag.amin, mag.amax), dither.operand_range(mag.bmin, mag.bmax)
    e_lo = math.ceil(-100 - lg(mag.amin * mag.bmin))
    e_hi = math.floor(lg(numerics.SUM_LIMIT / (mag.amax * mag.bmax * mag.k * numerics.CHECKSUM_SPAN)))
    rng = np.random.default_rng([seed, 0x50A4])
    for _ in range(64 * n):
        if len(out) == n or e_lo > e_hi:
            break
        e = int(rng.integers(e_lo, e_hi + 1))
        lo, hi = max(ea_lo, e - eb_hi), min(ea_hi, e - eb_lo)
        if lo > hi:
            continue
        ea = int(rng.integers(lo, hi + 1))
        pair = (ea, e - ea)
        if pair not in out and numerics.pow2_exact_safe(mag, *pair):
            out.append(pair)
    return tuple(out)


def pow2(t: torch.Tensor, e: int) -> torch.Tensor:
    """``numerics.pow2_scale(t, e)`` in one pass where 2^e is an fp32 normal (bf16 times an fp32
    scalar is computed in fp32 and rounded once): the same bits wherever the scaling is exact,
    which is all the schedule uses (pow2_exact_safe)."""
    if e == 0:
        return t
    return t * 2.0**e if t.dtype == torch.bfloat16 and -126 <= e <= 127 else numerics.pow2_scale(t, e)


def fingerprinted(repeat: int, repeats: int) -> bool:
    """Whether repeat ``repeat`` (from 0) of a scale's ``repeats`` has its C fingerprinted: every
    FINGERPRINT_EVERY-th, and the last, so every scale compares at least one run after its first."""
    return repeat % FINGERPRINT_EVERY == FINGERPRINT_EVERY - 1 or repeat == repeats - 1


def repeats_for(flops: int, scales: int, backend: str) -> int:
    lo, hi = REPEATS
    return max(lo, min(hi, round(SET_FLOPS.get(backend, SET_FLOPS["cpu"]) / (scales * flops))))


def set_plan(wl, seed: int, index: int, first: int, backend: str, mag: numerics.Magnitudes | None) -> SetPlan:
    case = set_case(wl, seed, index)
    scales = draw_scales(mag, case.seed)
    return SetPlan(index, case, scales, repeats_for(case.shape.flops, len(scales), backend), first)
