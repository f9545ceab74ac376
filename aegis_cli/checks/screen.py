"""Screening a checked GEMM where it ran, without a host sync (the burn-in, ``aegis scan --soak``).

Per launch, the fused fp32-accumulator checksums are compared with their fp64 references at τ
exactly as ``checks.gemm.checksum_signal`` decides them (docs/design.md §2.4), and reduced to
one count that stays on the device; NaN and Inf count as flagged. The comparison is
rearranged so the per-launch work is a subtraction and a compare:

    max(|Δ| − floor, 0) / max(s, 2⁻¹⁰²²) > τ   ⇔   |Δ| > τ·max(s, 2⁻¹⁰²²) + floor

with the right-hand side computed once per input set and scale, and launches that share it
compared together. Screening decides nothing:
a flagged launch is checked in full and confirmed by the scan's own checks (checks/gemm.py,
checks/judge.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from aegis_cli.ops import numerics
from aegis_cli.ops.gemm import GemmOperands, GemmResult, ReferenceChecksums

_TINY = 2.0**-1022  # numerics.normalised_diff's smallest scale


@dataclass(frozen=True)
class Limits:
    """fp64 references of the row and column checksums and the |Δ| beyond which each is flagged."""

    row: torch.Tensor  # (M, nt_n)
    row_limit: torch.Tensor
    col: torch.Tensor  # (nt_m, N)
    col_limit: torch.Tensor


def limits(ref: ReferenceChecksums, tau: float) -> Limits:
    """The screening limits of ``ref`` at ``tau`` (once per input set and scale), in the units the
    scan's checks use (ReferenceChecksums.noise: the device's noise scale σ where ``ref`` has it)."""
    row_unit, col_unit = ref.noise()
    return Limits(ref.row, row_unit.clamp(min=_TINY) * tau + ref.floor,
                  ref.col, col_unit.clamp(min=_TINY) * tau + ref.floor)


def flagged(rows: list[torch.Tensor], cols: list[torch.Tensor], lim: Limits) -> torch.Tensor:
    """Checksums beyond their limits in each of several launches with the same limits (their row
    sums ``rows`` and column sums ``cols``), as an int64 tensor (one count per launch) on their
    device, without a sync. Counted as total − within, so NaN counts as flagged."""
    r, c = torch.stack(rows), torch.stack(cols)  # (launches, M, nt_n), (launches, nt_m, N)
    within = ((r - lim.row).abs_() <= lim.row_limit).sum((1, 2)) + ((c - lim.col).abs_() <= lim.col_limit).sum((1, 2))
    return (lim.row.numel() + lim.col.numel()) - within


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
