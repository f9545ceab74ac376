"""The data types of one GEMM: how training stores its operands, the operands, a checked
GEMM's result and its fp64 reference checksums. No device knowledge.

GEMM convention: C[M, N] = A[M, K] · B[K, N], bf16 in, fp32 accumulate, bf16 out.
Operands are *stored* as training stores them (see ``Layout``); ``GemmOperands``
gives the logical M×K / K×N views.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


class Layout(str, enum.Enum):
    """How a training GEMM stores its operands.

    fwd:   Y = X·Wᵀ   A = X stored (M, K);  B = Wᵀ, stored as W (N, K)
    dgrad: dX = dY·W  A = dY stored (M, K); B = W stored (K, N)
    wgrad: dW = dYᵀ·X A = dYᵀ, stored as dY (K, M); B = X stored (K, N)
    """

    FWD = "fwd"
    DGRAD = "dgrad"
    WGRAD = "wgrad"

    def a_stored_shape(self, m: int, k: int) -> tuple[int, int]:
        return (k, m) if self is Layout.WGRAD else (m, k)

    def b_stored_shape(self, k: int, n: int) -> tuple[int, int]:
        return (n, k) if self is Layout.FWD else (k, n)


@dataclass
class GemmOperands:
    """Stored operands of one GEMM plus its layout."""

    a: torch.Tensor  # bf16, stored shape per layout
    b: torch.Tensor  # bf16, stored shape per layout
    layout: Layout

    @property
    def a_mk(self) -> torch.Tensor:  # (M, K) view
        return self.a.t() if self.layout is Layout.WGRAD else self.a

    @property
    def b_kn(self) -> torch.Tensor:  # (K, N) view
        return self.b.t() if self.layout is Layout.FWD else self.b

    @property
    def mnk(self) -> tuple[int, int, int]:
        m, k = self.a_mk.shape
        return m, self.b_kn.shape[1], k


@dataclass
class GemmResult:
    """What a checked GEMM returns.

    row_sums[i, t] = Σ_{j in column tile t} acc[i, j]   fp32, (M, ceil(N/tn))
    col_sums[t, j] = Σ_{i in row tile t} acc[i, j]      fp32, (ceil(M/tm), N)
    Both are taken from the fp32 accumulator before bf16 rounding, in a fixed order.
    """

    c: torch.Tensor  # (M, N) bf16
    row_sums: torch.Tensor
    col_sums: torch.Tensor
    tile: tuple[int, int]  # (tm, tn): checksum granularity
    tile_sm: torch.Tensor | None = None  # int32 (ceil(M/tm), ceil(N/tn)): SM that ran each tile
    kernel: str = ""  # which kernel/variant ran, for evidence
    injected: bool = False  # a fault plan touched this launch


@dataclass
class ReferenceChecksums:
    """fp64 checksums computed on a path independent of the one that produced C.

    row[i, t] = Σ_k A[i, k] · (Σ_{j in tile t} B[k, j]);  row_scale the same with |A|, |B|
    col[t, j] = Σ_k (Σ_{i in tile t} A[i, k]) · B[k, j];  col_scale likewise
    The scales are the magnitudes the sums are made of (docs/design.md §2.4); row_noise and
    col_noise the clean noise a device's accumulation leaves in each sum (numerics.NoiseModel,
    docs/design.md §3), which the checks divide differences by (None: the scale).
    floor is the absolute difference the bottom of the fp32 range alone can make (subnormals
    flushed to zero on FTZ devices, or rounded); it does not scale with the inputs.
    """

    row: torch.Tensor  # fp64 (M, ceil(N/tn))
    col: torch.Tensor  # fp64 (ceil(M/tm), N)
    row_scale: torch.Tensor  # fp64, same shape as row
    col_scale: torch.Tensor  # fp64, same shape as col
    floor: float = 0.0
    row_noise: torch.Tensor | None = None  # fp64, same shape as row
    col_noise: torch.Tensor | None = None  # fp64, same shape as col

    def scaled(self, e: int) -> ReferenceChecksums:
        """The references of the operands scaled by 2^e in all: every field but the floor scales
        exactly (fp64)."""
        f = 2.0**e
        by = lambda t: None if t is None else t * f
        return ReferenceChecksums(self.row * f, self.col * f, self.row_scale * f, self.col_scale * f, self.floor,
                                  by(self.row_noise), by(self.col_noise))

    def noise(self) -> tuple[torch.Tensor, torch.Tensor]:
        """What the checks divide row and column differences by: the noise scale, else the magnitude."""
        return (self.row_scale if self.row_noise is None else self.row_noise,
                self.col_scale if self.col_noise is None else self.col_noise)


@dataclass(frozen=True)
class GemmShape:
    op: str
    layout: Layout
    m: int
    n: int
    k: int

    @property
    def flops(self) -> int:
        return 2 * self.m * self.n * self.k
