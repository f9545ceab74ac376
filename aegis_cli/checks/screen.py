"""Screening a checked GEMM where it ran, without a host sync (the burn-in, ``aegis scan --soak``).

Per launch, the fused fp32-accumulator checksums are compared with their fp64 references at τ
as ``checks.gemm.checksum_signal`` decides them (docs/design.md §2.4), and reduced to one count
that stays on the device; NaN and Inf count as flagged. The comparison is rearranged so the
per-launch work reads each checksum once and compares it with two fp32 bounds:

    max(|Δ| − floor, 0) / max(s, 2⁻¹⁰²²) > τ   ⇔   |Δ| > L,  L = τ·max(s, 2⁻¹⁰²²) + floor
    ⇔   x < ref − L  or  x > ref + L            ⇔   x < lo  or  x > hi

with ref ± L computed in fp64 once per input set and scale, and rounded inward to fp32 (lo the
smallest fp32 ≥ ref − L, hi the largest ≤ ref + L): a checksum x is an fp32 number, so comparing
it with the fp32 bounds gives the same answer as with the fp64 ones, at a sixth of the memory
traffic of an fp64 difference. Screening decides nothing: a flagged launch is checked in full
and confirmed by the scan's own checks (checks/gemm.py, checks/judge.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from aegis_cli.ops import numerics
from aegis_cli.ops.gemm import GemmOperands, GemmResult, ReferenceChecksums


@dataclass(frozen=True)
class Limits:
    """The fp32 bounds each checksum must lie within (inclusive): outside them it is flagged."""

    row_lo: torch.Tensor  # (M, nt_n) fp32
    row_hi: torch.Tensor
    col_lo: torch.Tensor  # (nt_m, N) fp32
    col_hi: torch.Tensor

    @property
    def count(self) -> int:
        return self.row_lo.numel() + self.col_lo.numel()


def _inward(lo: torch.Tensor, hi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp64 bounds as fp32 ones that no fp32 value crosses differently: lo rounded up, hi down."""
    lo32, hi32 = lo.float(), hi.float()
    up, down = torch.full_like(lo32, float("inf")), torch.full_like(hi32, float("-inf"))
    return (torch.where(lo32.double() < lo, torch.nextafter(lo32, up), lo32),
            torch.where(hi32.double() > hi, torch.nextafter(hi32, down), hi32))


def limits(ref: ReferenceChecksums, tau: float) -> Limits:
    """The screening bounds of ``ref`` at ``tau`` (once per input set and scale), in the units the
    scan's checks use (ReferenceChecksums.noise: the device's noise scale σ where ``ref`` has it)."""
    row_l, col_l = (unit.clamp(min=numerics.SMALLEST_SCALE) * tau + ref.floor for unit in ref.noise())
    return Limits(*_inward(ref.row - row_l, ref.row + row_l), *_inward(ref.col - col_l, ref.col + col_l))


def _within(x: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    return torch.ge(x, lo).logical_and_(torch.le(x, hi)).sum((1, 2))


def flagged(rows: torch.Tensor | list[torch.Tensor], cols: torch.Tensor | list[torch.Tensor], lim: Limits) -> torch.Tensor:
    """Checksums beyond their limits in each of several launches with the same limits (their row
    sums ``rows`` and column sums ``cols``: stacked, (launches, M, nt_n) and (launches, nt_m, N),
    or lists stacked here), as an int64 tensor (one count per launch) on their device, without a
    sync. Counted as total − within, so NaN counts as flagged."""
    r = rows if isinstance(rows, torch.Tensor) else torch.stack(rows)
    c = cols if isinstance(cols, torch.Tensor) else torch.stack(cols)
    return lim.count - (_within(r, lim.row_lo, lim.row_hi) + _within(c, lim.col_lo, lim.col_hi))


def clean_max(res: GemmResult, ref: ReferenceChecksums, tau: float) -> torch.Tensor:
    """The largest normalised difference among the checksums at or under ``tau`` (0-d fp64, on
    the device): the noise statistic of the scan (``ProbeStats.clean_max``)."""
    d_row, d_col = numerics.checksum_diffs(res, ref)
    zero = d_row.new_zeros(())
    return torch.maximum(torch.where(d_row <= tau, d_row, zero).amax(), torch.where(d_col <= tau, d_col, zero).amax())


def magnitudes(ops: GemmOperands) -> torch.Tensor:
    """(min nonzero |A|, max |A|, min nonzero |B|, max |B|) as a float32 tensor where the operands
    live, without a sync: ``numerics.magnitudes`` (the reference, on the host) read on the device.
    A min is inf and its max 0 when an operand is all zeros."""
    out = []
    for x in (ops.a, ops.b):  # stored order does not change a min or max
        x = x.abs()
        out += [torch.where(x != 0, x, torch.full((), float("inf"), dtype=x.dtype, device=x.device)).amin(), x.amax()]
    return torch.stack(out).float()
