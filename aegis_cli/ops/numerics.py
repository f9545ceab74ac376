"""Checksums, normalisation, thresholds and power-of-two scaling (docs/design.md §2, §3, §5).

Everything here is device-agnostic torch: it runs where the tensors live, so the CUDA
backend reuses it for the comparison side. The reference side of a checksum is fp64.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from aegis_cli.ops.errors import ConfigError
from aegis_cli.ops.gemm import GemmOperands, GemmResult, ReferenceChecksums

DISTRIBUTIONS = ("normal", "uniform", "heavy")
BF16_MIN_NORMAL = 2.0**-126  # fp32's too: bf16 keeps fp32's exponent range
BF16_MAX = 3.3895313892515355e38
SUM_LIMIT = BF16_MAX / 4  # what any fp32 partial sum of a checked GEMM must stay below (margin 4)
U_BF16 = 2.0**-8  # unit roundoff of bf16 (8-bit significand, round to nearest)
U_FP32 = 2.0**-24
U_ACC = 2.0**-23  # fp32 accumulation unit roundoff, allowing truncating matrix units (chopping)
FP32_MIN_NORMAL = BF16_MIN_NORMAL  # the most one fp32 operation loses at the bottom of the range (FTZ flush)
CHECKSUM_SPAN = 128  # the most outputs one fused checksum sums (the largest tile side of any backend)
DEFAULT_TAU = 3.5  # flag a checksum 3.5× over the largest clean value its device was calibrated on (NoiseModel)
TAU_MAX = 1e12  # the largest τ a vTask bundle may record
S_FLOOR = 1e-6  # the former calibrated τ in units of Σ|A||B|: with the accumulation bound, NoiseModel.cap


def fill_distribution(out: torch.Tensor, dist: str, gen: torch.Generator) -> torch.Tensor:
    """Fill fp32 ``out`` in place from ``dist`` with unit-ish spread; returns ``out``.

    normal: N(0, 1); uniform: U(-√3, √3) (unit variance); heavy: Student-t, 3 degrees
    of freedom (rare large values, like activation outliers).
    """
    if dist == "normal":
        out.normal_(generator=gen)
    elif dist == "uniform":
        out.uniform_(-math.sqrt(3.0), math.sqrt(3.0), generator=gen)
    elif dist == "heavy":
        out.normal_(generator=gen)
        chi = torch.empty((3, *out.shape), dtype=out.dtype, device=out.device)
        chi.normal_(generator=gen)
        out.div_(chi.square().sum(0).div_(3.0).sqrt_().clamp_(min=1e-3))
    else:
        raise ConfigError(f"unknown input distribution {dist!r} (known: {', '.join(DISTRIBUTIONS)})")
    return out


def generate_bf16(shape: tuple[int, ...], dist: str, seed: int, device: str | torch.device) -> torch.Tensor:
    """Seeded bf16 tensor on ``device``; bits depend on (shape, dist, seed, backend RNG)."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed & 0x7FFF_FFFF_FFFF_FFFF)
    x = torch.empty(shape, dtype=torch.float32, device=device)
    return fill_distribution(x, dist, gen).to(torch.bfloat16)


def n_tiles(n: int, t: int) -> int:
    return -(-n // t)


def col_tiles(x: torch.Tensor, t: int) -> torch.Tensor:
    """(M, N) → (M, ceil(N/t), t): x's tiles of ``t`` columns, the last zero-padded (a view when
    none is needed). The one tiling that sum_col_tiles, abs_col_tiles and lean.lean_side reduce over."""
    m, n = x.shape
    nt = n_tiles(n, t)
    if nt * t != n:
        x = torch.nn.functional.pad(x, (0, nt * t - n))
    return x.reshape(m, nt, t)


def sum_col_tiles(x: torch.Tensor, tn: int) -> torch.Tensor:
    """(M, N) → (M, ceil(N/tn)): Σ over each tile of tn columns (zero-padded)."""
    return col_tiles(x, tn).sum(-1)


def sum_row_tiles(x: torch.Tensor, tm: int) -> torch.Tensor:
    """(M, N) → (ceil(M/tm), N): Σ over each tile of tm rows (zero-padded)."""
    return sum_col_tiles(x.t(), tm).t()


def reference_checksums(ops: GemmOperands, tile: tuple[int, int], noise: NoiseModel | None = None, *,
                        cols: bool = True) -> ReferenceChecksums:
    """fp64 row/column checksum references, their magnitudes s and, given a device's ``noise``
    model, the noise scale σ of each sum (NoiseModel.scale), from the stored operands.

    Cost O(K·(M+N)·tiles), far below the GEMM; runs on the operands' device in fp64,
    a path the bf16 matrix unit never touches. ``cols=False`` leaves the column part empty. The
    in-training sensors' references (one read of each operand) are ops/lean.py's.
    """
    tm, tn = tile
    a = ops.a_mk.to(torch.float64, copy=True)  # (M, K)
    b = ops.b_kn.to(torch.float64, copy=True)  # (K, N)
    row = a @ sum_col_tiles(b, tn)
    col = sum_row_tiles(a, tm) @ b
    a, b = a.abs_(), b.abs_()  # in place: no third fp64 copy of the operands
    row_scale = a @ sum_col_tiles(b, tn)
    col_scale = sum_row_tiles(a, tm) @ b
    row_noise = col_noise = None
    if noise is not None:
        a, b = a.square_(), b.square_()
        k = ops.mnk[2]
        row_noise = noise.scale((a @ sum_col_tiles(b, tn)).sqrt_(), row_scale, k)
        col_noise = noise.scale((sum_row_tiles(a, tm) @ b).sqrt_(), col_scale, k)
    ref = ReferenceChecksums(row=row, col=col, row_scale=row_scale, col_scale=col_scale,
                             floor=checksum_floor(ops.mnk[2], tile), row_noise=row_noise, col_noise=col_noise)
    return ref if cols else rows_only(ref.row, ref.row_scale, ref.row_noise, ops.mnk, tile)


def rows_only(row: torch.Tensor, row_scale: torch.Tensor, row_noise: torch.Tensor | None, mnk: tuple[int, int, int],
              tile: tuple[int, int]) -> ReferenceChecksums:
    """Row references alone: empty column fields, the floor of the row sums."""
    empty = row.new_zeros((0, mnk[1]))
    return ReferenceChecksums(row=row, col=empty, row_scale=row_scale, col_scale=empty, floor=checksum_floor(mnk[2], tile, cols=False),
                              row_noise=row_noise, col_noise=None if row_noise is None else empty)


def abs_col_tiles(x: torch.Tensor, t: int) -> torch.Tensor:
    """Σ|x| over each tile of ``t`` columns of x (M, N): (M, ceil(N/t)) fp64, read straight from x
    (the sensors' Σ|c|; Device.tile_abs_sums)."""
    return torch.linalg.vector_norm(col_tiles(x, t), 1, dim=-1, dtype=torch.float64)


@dataclass(frozen=True)
class NoiseModel:
    """How far a device's fp32 accumulation leaves a clean checksum from its fp64 reference
    (docs/calibration.md): σ = unit · K^power · ρ, with ρ = sqrt(Σ_k A_ik² · Σ_{j∈t} B_kj²) for
    the row sum of row i over column tile t (columns alike).

    Each rounding of an fp32 partial sum errs by up to an ulp of that sum, so the error follows
    the partial sums: for zero-mean inputs they walk like √k·ρ/√K, and for a row dominated by one
    product P they sit near |P| ≈ ρ, where Σ|A||B| would say nothing of the other K−1 products.
    A sequential sum rounding to nearest adds such errors as a random walk (power ½; the CPU's
    blocked fp32 GEMM measured no growth at all, power 0); a matrix unit that chops errs the same
    way step after step (power 1). ``unit`` is the device's calibrated constant:
    the largest clean |Δ|/(K^power·ρ) measured (``source`` says where), so clean values are ≤ 1
    on the calibration set and τ = DEFAULT_TAU is a margin over them.

    ``cap``: in units of s = Σ|A||B|, the most a threshold at DEFAULT_TAU may allow (the former
    accumulation bound): σ never exceeds cap·s/DEFAULT_TAU, so no threshold is looser than it was.
    """

    unit: float
    power: float
    cap: float
    source: str = ""

    def capped_at(self, bound: float) -> NoiseModel:
        """This model with its cap at a device's accumulation ``bound`` (÷ s, Device.accumulation_bound
        at its K), never below S_FLOOR, the former calibrated τ."""
        return dataclasses.replace(self, cap=max(S_FLOOR, bound))

    def depth(self, k: int) -> float:
        """The K^power factor, with K no less than CHECKSUM_SPAN: a checksum also sums up to that
        many fp32 outputs, whose rounding does not shrink with K (measured on the H200: at K = 8
        a clean difference reached 7× the noise the bare K^power would give)."""
        return float(max(k, CHECKSUM_SPAN)) ** self.power

    def scale(self, rho: torch.Tensor, s: torch.Tensor, k: int) -> torch.Tensor:
        """σ of sums with root-sum-squares ``rho`` and magnitudes ``s``, K deep (fp64)."""
        return torch.minimum(rho * (self.unit * self.depth(k)), s * (self.cap / DEFAULT_TAU))

    def describe(self, k: int) -> dict:
        return {"unit": self.unit, "power": self.power, "cap": self.cap, "source": self.source,
                "sigma_per_rho": self.unit * self.depth(k)}


def subnormal_slack(k: int, outputs: int = 1) -> float:
    """Absolute error the bottom of the fp32 range can add to a sum of ``outputs`` K-term dot
    products: each product, each partial sum and each output may be flushed to zero (FTZ, as
    our CUDA kernels compile) or rounded as a subnormal, losing < 2^-126 each. Far below any
    value that matters; without it, inputs whose products are subnormal read as faults."""
    return (2 * k + 2) * outputs * FP32_MIN_NORMAL


def checksum_floor(k: int, tile: tuple[int, int], cols: bool = True) -> float:
    """ReferenceChecksums.floor of references at checksum ``tile`` (tm, tn): subnormal_slack over
    the most outputs one checksum sums, max(tm, tn); a row checksum's tn alone without ``cols``."""
    tm, tn = tile
    return subnormal_slack(k, max(tm, tn) if cols else tn)


SMALLEST_SCALE = 2.0**-1022  # a zero noise scale divides by the smallest fp64 normal instead


def normalised_diff(observed: torch.Tensor, ref: torch.Tensor, scale: torch.Tensor, floor: float = 0.0) -> torch.Tensor:
    """max(|observed − ref| − floor, 0) / scale in fp64 (``floor``: ReferenceChecksums.floor);
    a zero scale (all-zero operands) divides by the smallest normal so any difference above
    the floor is flagged. NaN/Inf observed → inf."""
    d = ((observed.to(torch.float64) - ref).abs() - floor).clamp(min=0.0)
    d = d / scale.clamp(min=SMALLEST_SCALE)
    return torch.nan_to_num(d, nan=math.inf, posinf=math.inf)


def checksum_diffs(res: GemmResult, ref: ReferenceChecksums) -> tuple[torch.Tensor, torch.Tensor]:
    """Normalised differences of the fused row sums (M, nt_n) and column sums (nt_m, N) from
    their fp64 references, in units of their noise scale σ (ReferenceChecksums.noise)."""
    row_noise, col_noise = ref.noise()
    return (normalised_diff(res.row_sums, ref.row, row_noise, ref.floor),
            normalised_diff(res.col_sums, ref.col, col_noise, ref.floor))


def median_row_diff(res: GemmResult, ref: ReferenceChecksums) -> float:
    """Median |fused row sum − reference| of a run, unnormalised: on a clean run, the unit of a
    ``perturb`` fault (FaultPlan.needs_clean_median)."""
    return float((res.row_sums.double() - ref.row).abs().median())


def output_rowsum_diff(res: GemmResult, tn: int) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16-output check: Σ over each column tile of the rounded output against the
    fp32-accumulator row sums. Returns (|Σ c − Σ acc|, Σ|c|·u_bf16) in fp64: the second is
    a rigorous rounding bound (each element is off its accumulator by ≤ u·|c|), so a
    difference above it cannot be rounding."""
    c = res.c.to(torch.float64)
    out_sum = sum_col_tiles(c, tn)
    abs_sum = sum_col_tiles(c.abs(), tn)
    # output rounding, plus the fp32 tile sum's own rounding of order tn·u32·Σ|acc|, plus what
    # flushing or rounding subnormals (each output and each partial sum) can lose
    bound = abs_sum * U_BF16 * (1 + U_BF16) + abs_sum * (tn * U_FP32 * 2) + 2 * tn * FP32_MIN_NORMAL
    d = (out_sum - res.row_sums.to(torch.float64)).abs()
    return torch.nan_to_num(d, nan=math.inf, posinf=math.inf), bound


def output_rowsum_excess(res: GemmResult, tn: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(over, ratio, bound) of the bf16-output check: where |Σ c − Σ acc| exceeds its rounding
    bound (output_rowsum_diff), the difference in units of that bound, and the bound."""
    diff, bound = output_rowsum_diff(res, tn)
    return diff > bound, diff / bound.clamp(min=1e-300), bound


def bf16_mismatches(c: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
    """(row, col) positions, on the host, where two bf16 tensors differ bit for bit (an empty
    (0, 2) tensor when they are identical)."""
    ci, ei = c.view(torch.int16), expected.view(torch.int16)
    if torch.equal(ci, ei):
        return torch.empty((0, 2), dtype=torch.long)
    return (ci != ei).nonzero().cpu()


@dataclass(frozen=True)
class Thresholds:
    """Thresholds on normalised differences: a checksum is flagged when |Δ|/σ > tau, σ the noise
    scale of its device's NoiseModel (docs/calibration.md), in which the largest clean value of
    the device's calibration run is 1: tau = 3.5 flags what lies 3.5× beyond it. An explicit
    tau (``--threshold``) means what it says on every device: 1e-10 flags every checksum, and the
    fp64 recomputation then says whether any bits are wrong (checks/judge.py).
    ``tau_bf16`` is the bf16-output comparison mode used for the sensitivity study only.
    """

    tau: float = DEFAULT_TAU
    tau_bf16: float = 3e-3
    # a flag that reproduces bit for bit this far over tau is FAULTY (once the fp64 recomputation
    # puts bits beyond rounding), below it SUSPECT
    confirm_margin: float = 1.0

    def __post_init__(self) -> None:
        if not (0 < self.tau <= TAU_MAX and 0 < self.tau_bf16 < 1):
            raise ConfigError(f"thresholds must lie in (0, {TAU_MAX:g}] (τ, in units of the calibrated noise) and (0, 1) "
                              f"(τ_bf16), got tau={self.tau}, tau_bf16={self.tau_bf16}")
        if not 1 <= self.confirm_margin <= 1e12:  # the range a vTask bundle records (bundle-format.md)
            raise ConfigError(f"confirm margin must lie in 1…1e12 (a factor over τ), got {self.confirm_margin}")


def pow2_scale(t: torch.Tensor, e: int) -> torch.Tensor:
    """t·2^e, exact for bf16 when nothing leaves the normal range (checked by caller). Two
    factors of 2^(e/2): 2^e alone is not an fp32 for |e| ≥ 128 (replay --scales 64,64), while
    the result and every intermediate lie between t and t·2^e."""
    if e == 0:
        return t
    half = e // 2
    return (t.to(torch.float32) * (2.0**half) * (2.0 ** (e - half))).to(t.dtype)


@dataclass(frozen=True)
class Magnitudes:
    """Smallest and largest nonzero |A| and |B| of one GEMM, and its K: all that the
    power-of-two exactness rule needs, read once per case and reused for every scale."""

    amin: float
    amax: float
    bmin: float
    bmax: float
    k: int

    def exact_safe(self, ea: int, eb: int) -> bool:
        """True when scaling A by 2^ea and B by 2^eb keeps every input, product, partial sum
        and output normal in fp32 and bf16, so C(2^ea·A, 2^eb·B) = 2^(ea+eb)·C(A, B) bit for bit,
        the fused checksums included (each sums up to CHECKSUM_SPAN outputs).

        Partial sums can cancel to any small value, but cancellation to a value whose exponent
        is below the products' lowest nonzero bit only happens at exact zero, which scales
        exactly; so bounding products and |A|·|B| row sums suffices.
        """
        amin, amax = self.amin * 2.0**ea, self.amax * 2.0**ea
        bmin, bmax = self.bmin * 2.0**eb, self.bmax * 2.0**eb
        # smallest product must stay a normal fp32 (FTZ on the GPU) and survive in the sum's ulp
        if amin < BF16_MIN_NORMAL or bmin < BF16_MIN_NORMAL or amin * bmin < 2.0**-100:
            return False
        # each operand itself must stay finite: 2^64·A with 2^-64·B keeps the products in range
        if amax >= SUM_LIMIT or bmax >= SUM_LIMIT:
            return False
        return amax * bmax * self.k * CHECKSUM_SPAN < SUM_LIMIT


def magnitudes(ops: GemmOperands) -> Magnitudes | None:
    """The operands' magnitude range; None when either is all zeros (then any scale is exact)."""
    a, b = ops.a_mk.float().abs(), ops.b_kn.float().abs()
    a_nz, b_nz = a[a != 0], b[b != 0]
    if a_nz.numel() == 0 or b_nz.numel() == 0:
        return None
    return Magnitudes(a_nz.min().item(), a_nz.max().item(), b_nz.min().item(), b_nz.max().item(), a.shape[1])


def overflow_bound(ops: GemmOperands, chunk: int = 1 << 22) -> float:
    """An upper bound, in fp64, on every fp32 partial sum a checked GEMM of ``ops`` forms: the
    largest Σ_k |A_ik|·|B_kj| over outputs (bounded row-wise and column-wise, whichever is
    tighter: O(K·(M+N)), no GEMM), times the CHECKSUM_SPAN outputs a checksum adds up.
    Works through slices of about ``chunk`` elements, so a bundle at its size limit does not
    need several fp64 copies of its operands."""
    a, b = ops.a_mk, ops.b_kn  # (M, K), (K, N)
    (m, k), n = a.shape, b.shape[1]
    if a.numel() == 0 or b.numel() == 0:
        return 0.0
    step = max(1, chunk // k)  # rows of A, or columns of B, per slice
    b_max = abs_max_along(b, 1, chunk)  # max_j |B_kj|
    a_max = abs_max_along(a, 0, chunk)  # max_i |A_ik|
    by_row = max(float((a[i:i + step].double().abs() @ b_max).max()) for i in range(0, m, step))
    by_col = max(float((a_max @ b[:, j:j + step].double().abs()).max()) for j in range(0, n, step))
    return min(by_row, by_col) * CHECKSUM_SPAN


def abs_max_along(x: torch.Tensor, dim: int, chunk: int = 1 << 22) -> torch.Tensor:
    """max |x| along ``dim`` of a 2-D tensor, in fp64, through slices of about ``chunk``
    elements (no full-size copy): max_i |A_ik| of A (M, K) is abs_max_along(A, 0)."""
    n, keep = x.shape[dim], x.shape[1 - dim]
    step = max(1, chunk // max(keep, 1))
    return torch.stack([x.narrow(dim, i, min(step, n - i)).abs().amax(dim) for i in range(0, n, step)]).amax(0).double()


def gamma_acc(n: int) -> float:
    """γ_n = n·u/(1 − n·u) of n fp32 accumulation steps, u = U_ACC (truncating units allowed):
    the relative error bound of an n-term sum; inf where n·u ≥ ½ (no finite bound)."""
    nu = n * U_ACC
    return nu / (1 - nu) if nu < 0.5 else math.inf


def accumulation_ceiling(k: int, span: int) -> float:
    """Worst-case |Δ|/s of an fp32 checksum of ``span`` K-deep dot products, whatever the data:
    each of the K + span adds may round (or, on a truncating matrix unit, chop) by 2⁻²³ of a
    partial sum ≤ s. Far above the calibrated τ, which holds for the scan's input distributions;
    on other data a flag below this ceiling may be rounding, not corruption."""
    return gamma_acc(k + span)


def pow2_exact_safe(ops: GemmOperands | Magnitudes | None, ea: int, eb: int) -> bool:
    """Whether C(2^ea·A, 2^eb·B) = 2^(ea+eb)·C(A, B) bit for bit: Magnitudes.exact_safe at that
    scale and at the base scale both (a base C with flushed or rounded-away products is no
    exact expectation), for operands (measured here) or for magnitudes measured once."""
    mag = magnitudes(ops) if isinstance(ops, GemmOperands) else ops
    return mag is None or (mag.exact_safe(0, 0) and mag.exact_safe(ea, eb))
