"""The GEMM checks (docs/design.md §2, §5): pure functions from one run's result, its fp64
reference and τ to signals. The scan's GEMM probe and replay run these same checks:

  gemm.row_checksum       fp32-accumulator row sums per column tile vs fp64 A·(B·1), |Δ|/s > τ
  gemm.col_checksum       fp32-accumulator column sums per row tile vs fp64 (1ᵀA)·B, |Δ|/s > τ
  gemm.output_rowsum      Σ of the bf16 output vs the accumulator row sums, beyond a rigorous
                          rounding bound (sees store-path faults the fused sums cannot)
  gemm.nonfinite          NaN/Inf in C from finite inputs
  gemm.element_reference  every element vs the fp64 product, beyond a rigorous error bound
                          (replay, where the GEMM is small enough to afford the product)
  gemm.pow2_exact         C(2^a·A, 2^b·B) must equal 2^(a+b)·C(A, B) bit for bit

A signal says where a check fired and holds the tensors a sample reads; each caller formats
its own samples from it (the probe names tiles and SMs, replay maps a sub-GEMM's rows back
to the full GEMM's).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from aegis_cli.ops import numerics
from aegis_cli.ops.gemm import GemmOperands, GemmResult, ReferenceChecksums

CHECKSUM_CHECKS = ("gemm.row_checksum", "gemm.col_checksum")
POW2_CHECK = "gemm.pow2_exact"


GEMM_CHECKS = (*CHECKSUM_CHECKS, "gemm.output_rowsum", POW2_CHECK, "gemm.nonfinite")
ELEMENT_CHECK = "gemm.element_reference"

# what a signal's positions index, and the sample keys that name them
_POSITION_KEYS = {"row": ("row", "col_tile"), "col": ("row_tile", "col"), "element": ("row", "col")}


def _same(i: int) -> int:
    return i


@dataclass
class Signal:
    """One check that fired on one run."""

    check: str
    max_value: float  # normalised difference (checksums), multiple of the bound (output_rowsum,
    # element_reference) or 1.0 (an exact expectation broken)
    where: torch.Tensor  # (E, 2) int64 on the host: every flagged position, in row-major order
    # what a position indexes: "row" (row, column tile) of the row sums, "col" (row tile, column)
    # of the column sums, "element" (row, column) of C
    axes: str
    observed: torch.Tensor | None = None  # the values checked, indexed by a position
    expected: torch.Tensor | None = None  # what they should be
    diff: torch.Tensor | None = None  # normalised differences (checksums)
    bound: torch.Tensor | None = None  # the rounding bound a value broke (output_rowsum, element_reference)

    @property
    def elements(self) -> int:
        return int(self.where.shape[0])

    @property
    def rows(self) -> list[int]:
        """Output rows the signal names (none for a column checksum, which names row tiles)."""
        return self.where[:, 0].tolist() if self.axes != "col" else []

    @property
    def cols(self) -> list[int]:
        """Output columns the signal names (none where it names column tiles)."""
        return self.where[:, 1].tolist() if self.axes != "row" else []

    def position(self, r: int, c: int, full_row: Callable[[int], int] = _same,
                 full_col: Callable[[int], int] = _same) -> dict:
        """The sample keys of position (r, c), e.g. {"row": r, "col_tile": c}; ``full_row`` and
        ``full_col`` map a sub-GEMM's output rows and columns to the full GEMM's (tiles stay)."""
        kr, kc = _POSITION_KEYS[self.axes]
        return {kr: full_row(r) if kr == "row" else r, kc: full_col(c) if kc == "col" else c}

    def tile(self, r: int, c: int, tm: int, tn: int) -> tuple[int, int]:
        """The (row tile, column tile) that position (r, c) lies in."""
        return (r // tm if self.axes != "col" else r, c // tn if self.axes != "row" else c)

    def tiles(self, tm: int, tn: int) -> list[tuple[int, int]]:
        """Every tile a flagged position lies in, sorted."""
        return sorted({self.tile(r, c, tm, tn) for r, c in self.where.tolist()})


def bf16_bits(t: torch.Tensor, r: int, c: int) -> int:
    """The 16 bits of bf16 element (r, c)."""
    return int(t[r, c].view(torch.int16).item()) & 0xFFFF


@dataclass
class Checked:
    """Every signal of one run, and the checksum differences for the noise statistics."""

    signals: list[Signal]
    d_row: torch.Tensor
    d_col: torch.Tensor
    tau: float

    def clean_max(self) -> float | None:
        """The largest normalised difference among the checksums that stayed under τ."""
        clean = torch.cat([self.d_row[~(self.d_row > self.tau)].reshape(-1), self.d_col[~(self.d_col > self.tau)].reshape(-1)])
        return float(clean.max()) if clean.numel() else None


def check_gemm(res: GemmResult, ref: ReferenceChecksums, tau: float, *, expected: torch.Tensor | None = None,
               element_ref: tuple[torch.Tensor, torch.Tensor] | None = None) -> Checked:
    """Every GEMM check of one run: the checksums against ``ref`` at ``tau``, the output-side
    checks, each element against ``element_ref`` = (fp64 product, error bound) where given, and
    C bit for bit against ``expected`` (2^(a+b)·C of the base run) where given."""
    d_row, d_col = numerics.checksum_diffs(res, ref)  # (M, nt_n), (nt_m, N)
    found = [checksum_signal("gemm.row_checksum", d_row, res.row_sums, ref.row, tau),
             checksum_signal("gemm.col_checksum", d_col, res.col_sums, ref.col, tau),
             nonfinite_signal(res.c, ref), output_rowsum_signal(res),
             element_signal(res.c, *element_ref) if element_ref is not None else None,
             pow2_signal(res.c, expected) if expected is not None else None]
    return Checked([s for s in found if s is not None], d_row, d_col, tau)


def checksum_signal(check: str, d: torch.Tensor, sums: torch.Tensor, ref: torch.Tensor, tau: float) -> Signal | None:
    """Fused checksums ``sums`` whose normalised difference ``d`` from the fp64 ``ref`` is over τ."""
    flag = d > tau
    if not bool(flag.any()):
        return None
    return Signal(check, float(d.max()), flag.nonzero().cpu(), "row" if check == "gemm.row_checksum" else "col",
                  observed=sums, expected=ref, diff=d)


def nonfinite_signal(c: torch.Tensor, ref: ReferenceChecksums) -> Signal | None:
    """NaN/Inf in C, where the inputs were finite (their fp64 checksums are)."""
    if bool(torch.isfinite(c).all()) or not bool(torch.isfinite(ref.row).all()):
        return None
    return Signal("gemm.nonfinite", 1.0, (~torch.isfinite(c)).nonzero().cpu(), "element", observed=c)


def output_rowsum_signal(res: GemmResult) -> Signal | None:
    """Column-tile sums of the bf16 output off the accumulator row sums by more than rounding."""
    over, ratio, bound = numerics.output_rowsum_excess(res, res.tile[1])
    if not bool(over.any()):
        return None
    return Signal("gemm.output_rowsum", float(ratio[over].max()), over.nonzero().cpu(), "row",
                  observed=res.row_sums, bound=bound)


def element_signal(c: torch.Tensor, exact: torch.Tensor, bound: torch.Tensor) -> Signal | None:
    """Elements of C farther from the fp64 product ``exact`` than ``bound`` (ElementReference)."""
    err = torch.nan_to_num((c.double() - exact).abs(), nan=math.inf)
    bad = err > bound
    if not bool(bad.any()):
        return None
    return Signal(ELEMENT_CHECK, float((err / bound.clamp(min=1e-300))[bad].max()), bad.nonzero().cpu(), "element",
                  observed=c, expected=exact, bound=bound)


def pow2_signal(c: torch.Tensor, expected: torch.Tensor) -> Signal | None:
    """Elements of C that differ bit for bit from the exact expectation ``expected``."""
    where = numerics.bf16_mismatches(c, expected)
    if not where.numel():
        return None
    return Signal(POW2_CHECK, 1.0, where, "element", observed=c, expected=expected)


def localise(rows: Signal | None, cols: Signal | None, tm: int, tn: int, limit: int) -> list[list[int]]:
    """Elements where a flagged row (within its column tile) meets a flagged column (within
    its row tile): the candidates for a corrupted accumulator element, at most ``limit``."""
    out: list[list[int]] = []
    if rows is None or cols is None or rows.elements > 4096:
        return out
    by_tile: dict[tuple[int, int], list[int]] = {}
    for ti, j in cols.where.tolist():
        by_tile.setdefault((ti, j // tn), []).append(j)
    for i, t in rows.where.tolist():
        for j in by_tile.get((i // tm, t), []):
            out.append([i, j])
            if len(out) >= limit:
                return out
    return out


def checks_elements(m: int, n: int, k: int, budget: int) -> bool:
    """Whether every element can be checked against the fp64 product: at most ``budget``
    multiply-adds, and K below 2²², where γ_K has no finite value (inf·0 would be a NaN bound)."""
    return m * n * k <= budget and math.isfinite(numerics.gamma_acc(k))


def element_bound(exact: torch.Tensor, mag: torch.Tensor, k: int) -> torch.Tensor:
    """How far a healthy bf16 C element can lie from its fp64 value ``exact`` (``mag`` = Σ|a||b|
    of its K products), less the subnormal slack: γ_K of fp32 accumulation (u = 2⁻²³, truncating
    units allowed), then one bf16 rounding of the accumulated value."""
    gamma = numerics.gamma_acc(k)
    return (exact.abs() + gamma * mag) * (numerics.U_BF16 * (1 + 2.0**-6)) + gamma * mag * 1.01


@dataclass
class ElementReference:
    """The fp64 product of a GEMM's operands and a rigorous bound on how far a healthy bf16
    C can lie from it: fp32 accumulation (γ_K of Σ|a||b|, truncating units allowed), then
    one bf16 rounding of the accumulated value."""

    exact: torch.Tensor  # (M, N) fp64, exact up to fp64 rounding
    bound: torch.Tensor  # (M, N) fp64, scales with the inputs
    floor: float  # what subnormals can lose; does not scale with the inputs

    @classmethod
    def of(cls, ops: GemmOperands) -> ElementReference:
        a64, b64 = ops.a_mk.double(), ops.b_kn.double()
        k = a64.shape[1]
        exact = a64 @ b64
        return cls(exact, element_bound(exact, a64.abs() @ b64.abs(), k), numerics.subnormal_slack(k))

    def at_scale(self, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(product, bound) for operands scaled by 2^e in all (exact in fp64)."""
        f = 2.0**e
        return self.exact * f, self.bound * f + self.floor
