"""The sensors' comparison on CUDA: kernels/sensor_compare.cu launched on torch tensors.

    compare(sides, u, p, b, w, summary) -> [d, …]   one launch for a check's sides (rows; wgrad
                                                   also columns), enqueued without a sync

Each side is (sums fp32, ref, s, ρ or None, Σ|c| or None, floor), every array (R, T) with any
strides, ref, s, ρ, Σ|c| fp64. Returns each side's normalised differences d (R, T) fp64, the bits
of the torch path (aegis_cli/sensors/sense.py ``sigma_of`` and ``numerics.normalised_diff``, the
CPU path and the reference), and leaves in ``summary`` (fp64, sides + 1, set by the caller to 0.0 …
0.0, 1.0: ``new_summary``) each side's largest d and 0.0 in the last slot when some s is not finite. The kernel's
header states the formulas. Importing this module does not import CuPy or touch CUDA.
"""

from __future__ import annotations

import ctypes

import torch

from aegis_cli.backends import loader

KERNEL = "sensor_compare.cu"
THREADS = 256  # SC_THREADS of the kernel
MAX_BLOCKS = 1024  # per side: a few waves on a large GPU, from the shape only


class _Side(ctypes.Structure):  # SC_Side
    _fields_ = [("sums", ctypes.c_void_p), ("ref", ctypes.c_void_p), ("s", ctypes.c_void_p), ("rho", ctypes.c_void_p),
                ("cabs", ctypes.c_void_p), ("d", ctypes.c_void_p), ("rows", ctypes.c_int64), ("cols", ctypes.c_int64),
                *((f"{name}_{axis}", ctypes.c_int64) for name in ("sums", "ref", "s", "rho", "cabs") for axis in "rc"),
                ("floor", ctypes.c_double)]


class _Params(ctypes.Structure):  # SC_Params
    _fields_ = [("side", _Side * 2), ("u", ctypes.c_double), ("p", ctypes.c_double), ("b", ctypes.c_double),
                ("w", ctypes.c_double), ("summary", ctypes.c_void_p), ("nsides", ctypes.c_int)]


Side = tuple  # (sums, ref, s, ρ or None, Σ|c| or None, floor)


def applies(sides: list[Side]) -> bool:
    """Whether the kernel takes these sides: one or two, CUDA tensors on one device with the dtypes
    and shapes above, nothing empty. Decided before anything is allocated for them."""
    if not 1 <= len(sides) <= 2 or not sides[0][0].is_cuda:
        return False
    home = sides[0][0].device
    for sums, *f64, _floor in sides:
        arrays = [x for x in f64 if x is not None]
        if sums.dtype != torch.float32 or sums.dim() != 2 or sums.numel() == 0 or sums.device != home:
            return False
        if any(x.dtype != torch.float64 or x.shape != sums.shape or x.device != home for x in arrays):
            return False
    return True


def new_summary(sides: int, device: torch.device) -> torch.Tensor:
    """The summary a comparison of ``sides`` starts from, 0.0 … 0.0, 1.0, made on the device (a
    memset and a fill; ``x[-1] = 1.0`` would copy the number from the host and wait for the stream)."""
    summary = torch.zeros(sides + 1, dtype=torch.float64, device=device)
    summary[sides:].fill_(1.0)
    return summary


def _side(sums: torch.Tensor, ref: torch.Tensor, s: torch.Tensor, rho: torch.Tensor | None, cabs: torch.Tensor | None,
          floor: float, d: torch.Tensor) -> _Side:
    ptr = lambda x: None if x is None else x.data_ptr()
    strides = [v for x in (sums, ref, s, rho, cabs) for v in (x.stride() if x is not None else (0, 0))]
    return _Side(ptr(sums), ptr(ref), ptr(s), ptr(rho), ptr(cabs), ptr(d), sums.shape[0], sums.shape[1], *strides, floor)


def compare(sides: list[Side], u: float, p: float, b: float, w: float, summary: torch.Tensor) -> list[torch.Tensor]:
    """Enqueue the comparison of ``sides`` (``applies``) on torch's current stream, into ``summary``
    (``new_summary`` on the sides' device); returns each side's d."""
    ds = [torch.empty(x[0].shape, dtype=torch.float64, device=summary.device) for x in sides]
    packed = [_side(*x, d) for x, d in zip(sides, ds, strict=True)]
    packed += [_Side()] * (2 - len(packed))  # an unused slot: no block reads it (grid y = sides)
    params = _Params((_Side * 2)(*packed), u, p, b, w, summary.data_ptr(), len(sides))
    blocks = min(MAX_BLOCKS, max(-(-x[0].numel() // THREADS) for x in sides))
    loader.run(KERNEL, "aegis_sc_compare", (blocks, len(sides)), THREADS, [params], on=summary)
    return ds
