"""GPU fingerprints: kernels/fingerprint.cu launched on torch CUDA tensors.

    gpu_fingerprint(t) -> int                      == fingerprint.fingerprint(t)
    gpu_fingerprint_tensor(t) -> int64 tensor (1,) the same, left on the device (no sync)
    gpu_block_fingerprints(t, block) -> list[int]  == fingerprint.block_fingerprints(t, block)
    gpu_block_tensor(t, block) -> int64 tensor     the same, left on the device (many blocks)

Launches go through the one loader/launcher (``loader.run``) on torch's current stream of the
tensor's device, so they order correctly with the torch work that produced the tensor. Importing this module does not import CuPy or touch CUDA.
"""

from __future__ import annotations

import ctypes

import torch

from aegis_cli.backends import loader
from aegis_cli.ops.errors import DeviceError
from aegis_cli.ops.fingerprint import BLOCK_ELEMS, MASK64, _block_words, _flat, unsigned

KERNEL = "fingerprint.cu"
THREADS = 256
MAX_GRID = 1 << 20
WHOLE_BLOCK_WORDS = 1 << 14  # 128 KiB per CTA for whole-tensor fingerprints


def _prepare(t: torch.Tensor) -> torch.Tensor:
    if t.device.type != "cuda":
        raise DeviceError(f"gpu fingerprint of a tensor on {t.device}")
    t = _flat(t)
    if t.numel() and t.data_ptr() % 16:
        t = t.clone()  # the kernel reads 16-byte vectors
    return t


def _launch_blocks(t: torch.Tensor, bw: int) -> torch.Tensor:
    """int64 (nblocks,) on t's device: Σ of word terms over each run of ``bw`` words."""
    nbytes = t.numel() * t.element_size()
    nwords = -(-nbytes // 8)
    nblocks = -(-nwords // bw)
    out = torch.empty(nblocks, dtype=torch.int64, device=t.device)
    loader.run(KERNEL, "aegis_fp_blocks", (min(nblocks, MAX_GRID),), THREADS,
               [ctypes.c_uint64(t.data_ptr()), ctypes.c_int64(nbytes), ctypes.c_int64(bw), ctypes.c_uint64(out.data_ptr()),
                ctypes.c_int64(nblocks)], on=t)
    return out


def _check(dev: torch.device) -> None:
    try:
        torch.cuda.synchronize(dev)
    except RuntimeError as exc:
        raise DeviceError(f"fingerprint kernel failed on {dev}: {exc}") from exc


def _whole_block_words(t: torch.Tensor) -> int:
    """Words per CTA for a whole-tensor fingerprint: enough CTAs to fill the GPU, at
    most 128 KiB each; even, so every CTA starts on a 16-byte vector."""
    nwords = -(-t.numel() * t.element_size() // 8)
    sms = torch.cuda.get_device_properties(t.device).multi_processor_count
    bw = -(-nwords // (sms * 16))
    return max(256, min(WHOLE_BLOCK_WORDS, bw + (bw & 1)))


def gpu_fingerprint_tensor(t: torch.Tensor) -> torch.Tensor:
    """The fingerprint of a CUDA tensor's bits as a one-element int64 tensor left on its device
    (two's complement bits), enqueued without a sync: a burn-in compares many on the device."""
    t = _prepare(t)
    if t.numel() == 0:
        return torch.zeros(1, dtype=torch.int64, device=t.device)
    res = torch.empty(1, dtype=torch.int64, device=t.device)
    blocks = _launch_blocks(t, _whole_block_words(t))
    loader.run(KERNEL, "aegis_fp_sum", (1,), 1024,
               [ctypes.c_uint64(blocks.data_ptr()), ctypes.c_int64(blocks.numel()), ctypes.c_uint64(res.data_ptr())], on=t)
    return res


def gpu_fingerprint(t: torch.Tensor) -> int:
    """64-bit fingerprint of a CUDA tensor's bits (same value as the CPU implementation)."""
    res = gpu_fingerprint_tensor(t)
    _check(res.device)
    return int(res.item()) & MASK64


def gpu_block_tensor(t: torch.Tensor, block: int = BLOCK_ELEMS) -> torch.Tensor:
    """Per-block fingerprints as an int64 tensor on the device (two's complement bits)."""
    t = _prepare(t)
    bw = _block_words(t, block)
    if t.numel() == 0:
        return torch.empty(0, dtype=torch.int64, device=t.device)
    out = _launch_blocks(t, bw)
    _check(t.device)
    return out


def gpu_block_fingerprints(t: torch.Tensor, block: int = BLOCK_ELEMS) -> list[int]:
    """Fingerprint of each run of ``block`` consecutive elements (last one may be short)."""
    return unsigned(gpu_block_tensor(t, block))
