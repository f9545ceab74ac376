"""Fingerprints computed where a tensor lives: the CUDA kernel (fingerprint_cuda.py) for GPU
tensors, the CPU twin (ops/fingerprint.py) otherwise; both give the same bits, so a probe
compares values from any device. Importing this module does not import CuPy or touch CUDA.
"""

from __future__ import annotations

import torch

from aegis_cli.backends import fingerprint_cuda
from aegis_cli.ops import fingerprint


def device_fingerprint(t: torch.Tensor) -> int:
    """``fingerprint.fingerprint(t)`` computed on ``t``'s device."""
    return fingerprint_cuda.gpu_fingerprint(t) if t.device.type == "cuda" else fingerprint.fingerprint(t)


def device_fingerprint_tensor(t: torch.Tensor) -> torch.Tensor:
    """``fingerprint.fingerprint(t)`` as a one-element int64 tensor (two's complement bits) on
    ``t``'s device; on a GPU enqueued without a host sync, so many can be compared there."""
    if t.device.type == "cuda":
        return fingerprint_cuda.gpu_fingerprint_tensor(t)
    return torch.tensor([fingerprint.fingerprint(t)], dtype=torch.uint64).view(torch.int64)


def device_block_tensor(t: torch.Tensor, block: int = fingerprint.BLOCK_ELEMS) -> torch.Tensor:
    """``fingerprint.block_tensor(t, block)`` computed on ``t``'s device (int64, left there)."""
    return fingerprint_cuda.gpu_block_tensor(t, block) if t.device.type == "cuda" else fingerprint.block_tensor(t, block)


def device_block_fingerprints(t: torch.Tensor, block: int = fingerprint.BLOCK_ELEMS) -> list[int]:
    """``fingerprint.block_fingerprints(t, block)`` computed on ``t``'s device."""
    return fingerprint.unsigned(device_block_tensor(t, block))


def diff_records(expected: torch.Tensor, actual: torch.Tensor, block: int = fingerprint.BLOCK_ELEMS,
                 limit: int = 8) -> tuple[list[int], int, list[dict]]:
    """``fingerprint.diff_records`` with the block fingerprints taken on the tensors' device, so
    only the differing blocks are read back to the host."""
    fingerprint.check_comparable(expected, actual)  # before any kernel runs
    blocks = fingerprint.differing_blocks(device_block_fingerprints(expected, block), device_block_fingerprints(actual, block))
    return fingerprint.diff_records(expected, actual, block, limit, blocks=blocks)
