"""The sensors' checksum reference on CUDA: kernels/sensor_reference.cu launched on torch tensors.

    lean_side(left, right, t, rho) -> (sums, s, rho)  the values of ops.lean.lean_side (the torch
                                                  reference, which the CPU path runs), (R, nt) fp64
    tile_abs_sums(x, t) -> (M, nt) fp64           Σ|x| over column tiles (Device.tile_abs_sums)

One pass over the bf16 left operand (never an fp64 copy of it): the products on the fp64
tensor cores (DMMA), exact fp64 operands and fp64 accumulation, so the errors are of order
K·2⁻⁵³·s as the torch reference's (the kernel's header says why); with ρ, s is the stage bound
(lean.stage_bound). Launches on torch's current stream, through the one loader/launcher, no
synchronisation: the tile statistics of the right operand (with ρ also their stage maxima), the
products (K split over CTAs), and the reduction of the splits in split order (none for one
split). The split count follows the shape alone (an estimate of the products' time,
``splits_for``), so the bits repeat for a shape on any device of one architecture. Importing this
module does not import CuPy or touch CUDA.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from aegis_cli.backends import loader

KERNEL = "sensor_reference.cu"
TILES, BK = 16, 32  # SR_BN, SR_BK of the kernel (SR_BM: ``geometry``)
STAT_THREADS, RED_THREADS = 256, 256
WAVE_SMS = 132  # SMs of the GPU the split count is estimated for (H100/H200); fixed, so splits follow the shape only
MIN_SPLIT = 8 * BK  # k per CTA at least: the partials' traffic stays small beside the products
MAX_GRID = 1 << 16
SCALAR, VEC_K, VEC_R, VEC_R16 = 0, 1, 2, 3  # the kernel's load modes
DEFINES: dict[str, int] = {}  # build defines (SR_WARPS, SR_CTAS, SR_MMA_K, SR_KM_PACK, SR_WHOLE); benchmarks/sensor_reference.py compares builds


def geometry() -> tuple[int, int, int, int]:
    """(rows a CTA, threads a CTA, its shared memory in bytes, CTAs an SM) of the products in the
    build DEFINES makes: SR_BM, SR_THREADS, SR_SMEM (three stages of L, k-major rows padded by 16,
    and of the three statistics), SR_CTAS."""
    warps = DEFINES.get("SR_WARPS", 4)
    rows = 32 * warps
    return rows, rows, 3 * (BK * (rows + 16) * 2 + 3 * 512 * 8), DEFINES.get("SR_CTAS", 8 // warps)


def applies(left: torch.Tensor, right: torch.Tensor) -> bool:
    """Whether the kernel takes these operands: bf16 CUDA tensors on one device, nothing empty."""
    return (left.is_cuda and right.device == left.device and left.dtype == right.dtype == torch.bfloat16
            and left.dim() == right.dim() == 2 and left.numel() > 0 and right.numel() > 0)


def splits_for(r: int, k: int, nt: int, planes: int = 3) -> tuple[int, int]:
    """(splits, k per split) of K for an (R, K) left operand, nt tiles and ``planes`` outputs
    (3 with ρ², else 2), from the shape alone: the count of least estimated time (``_split_cost``)."""
    rows, _, _, per_sm = geometry()
    return _splits(-(-r // rows) * -(-nt // TILES), k, planes, per_sm, WAVE_SMS)


@functools.cache  # once per shape: a check asks for every launch
def _splits(blocks: int, k: int, planes: int, per_sm: int, sms: int) -> tuple[int, int]:
    best, best_cost = 1, float("inf")
    for splits in range(1, max(1, -(-k // MIN_SPLIT)) + 1):
        k_split = _k_split(k, splits)
        if -(-k // k_split) != splits:  # BK rounding leaves this count unreachable
            continue
        cost = _split_cost(blocks, splits, k_split, planes, per_sm, sms)
        if cost < best_cost:
            best, best_cost = splits, cost
    return best, _k_split(k, best)


def _k_split(k: int, splits: int) -> int:
    per = -(-k // splits)  # k per split, rounded up to whole stages
    return max(MIN_SPLIT, -(-per // BK) * BK)


TAIL = 0.75  # a lone CTA on an SM takes about this share of the time of two sharing it (H200, session 17)
PARTIALS = 1 / 8  # k of products a split's partials cost, per CTA row block × tile block and plane (H200, session 17)


def _split_cost(blocks: int, splits: int, k_split: int, planes: int, per_sm: int, sms: int) -> float:
    """Estimated time of the products, in k of one wave: every CTA does equal work, so the grid
    takes as many waves (``sms`` SMs at ``per_sm`` CTAs) as it fills, a last part-wave of at most
    one CTA an SM at TAIL of a wave (its CTAs run alone), each k_split long; and each split
    writes and reads back a plane of partials per output (tens of MB a check at 4-16 splits: 7 %
    of the products' time, benchmarks/RESULTS.md session 17)."""
    ctas, wave = blocks * splits, sms * per_sm
    full, tail = divmod(ctas, wave)
    waves = full + (0 if tail == 0 else TAIL if tail <= sms and per_sm > 1 else 1)
    return waves * k_split + PARTIALS * splits * blocks * planes


def _grid(items: int, threads: int) -> tuple[int]:
    """The grid of a grid-stride kernel over ``items`` with ``threads`` a CTA: a CTA per ``threads``
    items, at most MAX_GRID (the kernels loop over the rest)."""
    return (max(1, min(-(-items // threads), MAX_GRID)),)


def _mode(left: torch.Tensor) -> int:
    sr, sk = left.stride()
    if sk == 1 and sr % 8 == 0 and left.data_ptr() % 16 == 0:
        return VEC_K
    if sr == 1 and sk % 8 == 0 and left.data_ptr() % 16 == 0:
        return VEC_R16
    if sr == 1 and sk % 4 == 0 and left.data_ptr() % 8 == 0:
        return VEC_R
    return SCALAR


ST_COLS, ST_K, ST_VEC_COLS, ST_VEC_K = 0, 1, 2, 3  # the statistics' modes


def stats_mode(x: torch.Tensor, t: int) -> tuple[int, int]:
    """(mode, lanes per (k, tile)) of the statistics of bf16 ``x`` (K, N) over tiles of ``t``
    columns: 16-byte vectors where the contiguous dimension's rows and the data are 16-byte
    aligned (columns contiguous: also t a multiple of 8), else scalar loads. From the strides,
    alignment and t alone, so the summation order (and the bits) follow them."""
    sk, sn = x.stride()
    aligned = x.data_ptr() % 16 == 0
    if sn == 1 and sk % 8 == 0 and t % 8 == 0 and aligned:
        return ST_VEC_COLS, min(32, 1 << max(0, (t // 32).bit_length() - 1))  # about 4 vectors of 8 columns a lane
    if sk == 1 and sn % 8 == 0 and aligned:
        return ST_VEC_K, 32
    return (ST_K if sk == 1 and sn != 1 else ST_COLS), 32


def _stats(x: torch.Tensor, t: int, outs: list[torch.Tensor]) -> None:
    """Enqueue the statistics of ``x`` over tiles of ``t`` columns into ``outs`` (rt, rta, rtq; or rta alone)."""
    k, n = x.shape
    nt = -(-n // t)
    sk, sn = x.stride()
    mode, lanes = stats_mode(x, t)
    threads = {ST_VEC_COLS: k * nt * lanes, ST_VEC_K: -(-k // 64) * nt * 32, ST_K: k * nt}.get(mode, k * nt * 32)
    entry = ("aegis_sr_stats" if len(outs) == 3 else "aegis_sr_abs") + ("_k" if mode == ST_VEC_K else "")
    loader.run(KERNEL, entry, _grid(threads, STAT_THREADS), STAT_THREADS,
               [ctypes.c_uint64(x.data_ptr()), ctypes.c_int64(k), ctypes.c_int64(n), ctypes.c_int64(sk), ctypes.c_int64(sn),
                ctypes.c_int(t), ctypes.c_int(nt), ctypes.c_int(mode), ctypes.c_int(lanes),
                *(ctypes.c_uint64(s.data_ptr()) for s in outs)], on=x, defines=DEFINES)


def tile_stats(x: torch.Tensor, t: int) -> torch.Tensor:
    """(3, K, ceil(N/t)) fp64: Σ, Σ|·| and Σ·² of each row of bf16 ``x`` (K, N) over tiles of ``t``
    columns (any strides), enqueued without a sync."""
    k, n = x.shape
    stats = torch.empty((3, k, -(-n // t)), dtype=torch.float64, device=x.device)
    _stats(x, t, list(stats))
    return stats


def tile_abs_sums(x: torch.Tensor, t: int) -> torch.Tensor:
    """Σ|x| over tiles of ``t`` columns of a bf16 CUDA tensor (M, N): (M, ceil(N/t)) fp64, exact
    (bf16 values summed in fp64), the bits of ``tile_stats(x, t)[1]``; Σ|·| alone, enqueued without a sync."""
    m, n = x.shape
    out = torch.empty((m, -(-n // t)), dtype=torch.float64, device=x.device)
    _stats(x, t, [out])
    return out


def lean_side(left: torch.Tensor, right: torch.Tensor, t: int,
              rho: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Row checksums of left (R, K) · right (K, N) over tiles of ``t`` columns, as
    lean.lean_side: (sums, s, ρ), each (R, ceil(N/t)) fp64, enqueued without a sync; ρ None
    unless ``rho``. ``applies(left, right)`` must hold."""
    (r, k), n = left.shape, right.shape[1]
    nt = -(-n // t)
    f64 = {"dtype": torch.float64, "device": left.device}
    stats = tile_stats(right, t)
    if rho:  # s as lean.stage_bound: each stage's maximum of rta in its first row, in place
        blocks = -(-k // BK) * nt
        loader.run(KERNEL, "aegis_sr_stage_max", _grid(blocks, STAT_THREADS), STAT_THREADS,
                   [ctypes.c_uint64(stats[1].data_ptr()), ctypes.c_int64(k), ctypes.c_int(nt)], on=left, defines=DEFINES)
    planes = 3 if rho else 2  # sums, s, and ρ² if asked for
    splits, k_split = splits_for(r, k, nt, planes)
    part = torch.empty((planes, splits, r, nt), **f64)
    sr, sk_l = left.stride()
    rows, threads, smem, _ = geometry()
    loader.run(KERNEL, "aegis_sr_main" if rho else "aegis_sr_main_norho", (-(-r // rows), -(-nt // TILES), splits), threads,
               [ctypes.c_uint64(left.data_ptr()), ctypes.c_int64(r), ctypes.c_int64(k), ctypes.c_int64(sr), ctypes.c_int64(sk_l),
                ctypes.c_int(_mode(left)), *(ctypes.c_uint64(x.data_ptr()) for x in stats), ctypes.c_int(nt),
                ctypes.c_int64(k_split), ctypes.c_uint64(part.data_ptr())], on=left, smem=smem, defines=DEFINES)
    if splits == 1:  # the kernel wrote the results (ρ, not ρ²)
        return part[0, 0], part[1, 0], part[2, 0] if rho else None
    out = torch.empty((planes, r, nt), **f64)
    loader.run(KERNEL, "aegis_sr_reduce", _grid(r * nt, RED_THREADS), RED_THREADS,
               [ctypes.c_uint64(part.data_ptr()), ctypes.c_int(splits), ctypes.c_int64(r * nt),
                ctypes.c_uint64(out[0].data_ptr()), ctypes.c_uint64(out[1].data_ptr()),
                ctypes.c_uint64(out[2].data_ptr() if rho else 0)], on=left, defines=DEFINES)
    return out[0], out[1], out[2] if rho else None
