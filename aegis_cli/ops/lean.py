"""The in-training sensors' checksum references (docs/sensors.md §2.1): the scan's values
(numerics.reference_checksums) from one read of each operand and fp64 slices of the large one,
never a whole fp64 copy of it, one side at a time (``lean_side``; a Device's kernel on CUDA,
``Device.lean_side``, with this as its reference), and with ρ the stage bound of s.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from aegis_cli.ops.gemm import GemmOperands, ReferenceChecksums
from aegis_cli.ops.numerics import NoiseModel, checksum_floor, col_tiles, rows_only

LEAN_SLICE = 1 << 22  # elements of the large operand in fp64 at a time (32 MiB: it stays in a GPU's L2 cache)
S_STAGE = 32  # k a stage of the bound on s that checks with ρ use (``stage_bound``; the CUDA kernel's SR_BK)


def lean_side(left: torch.Tensor, right: torch.Tensor, t: int,
              rho: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Row checksums of left (R, K) · right (K, N) over tiles of ``t`` columns: (sums, s, ρ), each
    (R, ceil(N/t)) fp64: the sums are the scan's reference; s is Σ_k |L_ik|·rta_kj (rta: the tile
    sums of |right|), or with ``rho`` its bound ``stage_bound``, which only σ's cap uses.

    The tile statistics of ``right`` (Σ, Σ|·|, Σ·²) are reductions read straight from its bf16
    values into fp64 (no copy); ``left`` is copied to fp64 one slice of LEAN_SLICE elements (all
    rows, a range of K) at a time, and each slice adds its products to the sums, then (in place)
    its |·| and ·² to s and ρ²: the large operand is read from memory once, and its fp64 copy never
    exceeds one slice, which on a GPU stays in L2 for the fp64 products. (Slices of rows
    instead, measured on the H200, gave products of a few hundred rows that kept few SMs busy.)
    Exact products, fp64 accumulation: an error of order K·2⁻⁵³·s, with s ≤ √(128K)·ρ: at K = 8192
    at most about 10⁻⁵ of the CUDA kernels' σ and 10⁻³ of the CPU path's. ``rho=False``: ρ is
    None (not computed) and s exact; the sums are the same bits."""
    r, k = left.shape
    x3 = col_tiles(right, t)
    nt = x3.shape[1]
    rt = x3.sum(-1, dtype=torch.float64)  # (K, nt), exact: bf16 values summed in fp64
    rt_abs = torch.linalg.vector_norm(x3, 1, dim=-1, dtype=torch.float64)
    sums, s = rt.new_zeros((r, nt)), rt.new_zeros((r, nt))
    step = max(1, LEAN_SLICE // max(r, 1))  # slices along K: every product keeps all R rows (the GPU's parallelism)
    if rho:
        rt_sq = torch.linalg.vector_norm(x3, 2, dim=-1, dtype=torch.float64).square_()
        rt_max = _stage_max(rt_abs)
        rho2 = rt.new_zeros((r, nt))
        step = -(-step // S_STAGE) * S_STAGE  # whole stages a slice
    for j in range(0, k, step):
        a = left[:, j:j + step].double()
        sums.addmm_(a, rt[j:j + step])
        a.abs_()
        if rho:
            s.addmm_(_stage_sums(a), rt_max[j // S_STAGE:(j + step) // S_STAGE])
            rho2.addmm_(a.square_(), rt_sq[j:j + step])
        else:
            s.addmm_(a, rt_abs[j:j + step])
    return sums, s, rho2.sqrt_() if rho else None


def stage_bound(left: torch.Tensor, right: torch.Tensor, t: int) -> torch.Tensor:
    """The bound on s = Σ_k |L_ik|·rta_kj that checks with ρ use: Σ_b (Σ_{k∈b} |L_ik|)·max_{k∈b}
    rta_kj over stages b of S_STAGE consecutive k, (R, ceil(N/t)) fp64. Never below s, equal where
    rta is flat within each stage; a product of K/S_STAGE, where s is one of K (docs/sensors.md
    §2.1 says where σ feels the difference: rows of a few dominant products, at most)."""
    return _stage_sums(left.double().abs()) @ _stage_max(torch.linalg.vector_norm(col_tiles(right, t), 1, dim=-1,
                                                                                 dtype=torch.float64))


def _stage_sums(a: torch.Tensor) -> torch.Tensor:
    """Σ over each stage of S_STAGE columns of fp64 ``a`` (R, W): (R, ceil(W/S_STAGE))."""
    r, w = a.shape
    if w % S_STAGE:  # a ragged last stage (a copy; whole stages are a view)
        a = torch.nn.functional.pad(a, (0, -w % S_STAGE))
    return a.reshape(r, -1, S_STAGE).sum(-1)


def _stage_max(x: torch.Tensor) -> torch.Tensor:
    """The largest of each stage of S_STAGE rows of non-negative fp64 ``x`` (K, nt), NaN if any is NaN."""
    k, nt = x.shape
    if k % S_STAGE:
        x = torch.nn.functional.pad(x, (0, 0, 0, -k % S_STAGE))
    return x.reshape(-1, S_STAGE, nt).amax(1)


LeanSide = Callable[[torch.Tensor, torch.Tensor, int, bool], tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]  # as lean_side


def lean_sides(ops: GemmOperands, tile: tuple[int, int], rho: bool, cols: bool,
               side: LeanSide) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]:
    """The lean references' (sums, s, ρ) of the rows, as A·(tile sums of B), and with ``cols`` also
    of the columns, as (Bᵀ·(tile sums of Aᵀ))ᵀ, each by ``side`` (``lean_side`` or a Device's);
    ``rho=False``: ρ None. Shared by ``lean_reference`` and the sensors' comparison."""
    tm, tn = tile
    out = [side(ops.a_mk, ops.b_kn, tn, rho)]
    if cols:
        out.append(tuple(None if x is None else x.t() for x in side(ops.b_kn.t(), ops.a_mk.t(), tm, rho)))
    return out


def lean_reference(ops: GemmOperands, tile: tuple[int, int], noise: NoiseModel | None = None, *, cols: bool = True,
                   side: LeanSide | None = None) -> ReferenceChecksums:
    """numerics.reference_checksums' fields from ``lean_sides`` (each side by ``side``, default
    ``lean_side``), σ given ``noise`` (then with ρ, and s its stage bound); ``cols=False``: rows
    only (forward and dgrad compare rows)."""
    k = ops.mnk[2]
    rho = noise is not None  # ρ only feeds σ
    (row, row_scale, row_rho), *col_side = lean_sides(ops, tile, rho, cols, side or lean_side)
    row_noise = noise.scale(row_rho, row_scale, k) if rho else None
    if not cols:
        return rows_only(row, row_scale, row_noise, ops.mnk, tile)
    col, col_scale, col_rho = col_side[0]
    col_noise = noise.scale(col_rho, col_scale, k) if rho else None
    return ReferenceChecksums(row=row, col=col, row_scale=row_scale, col_scale=col_scale,
                              floor=checksum_floor(k, tile), row_noise=row_noise, col_noise=col_noise)
