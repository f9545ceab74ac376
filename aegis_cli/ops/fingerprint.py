"""Bitwise tensor fingerprints (docs/design.md §4.2), CPU implementation (docs/fingerprints.md).

A tensor's bytes, in contiguous row-major order, are read as little-endian 64-bit words
(the last one zero-padded)::

    h = Σ_w mix64(word_w ⊕ KEY ⊕ w·GOLDEN)  mod 2^64

``mix64`` is the murmur3 64-bit finaliser, a bijection; ``w`` is the word's position.
Hence:
- any change of the bits of one word (one element, or several elements sharing a word)
  changes h, with certainty (a bijection of a changed input changes its term);
- the position term makes a word's contribution depend on where it sits, so swapping two
  unequal elements changes h, and two identical flips in different words don't cancel
  (each fails only with probability ≈ 2⁻⁶⁴);
- addition mod 2^64 is exact and order-independent, so a parallel GPU reduction gives the
  same bits as this code (kernels/fingerprint.cu is the GPU twin; the two must agree).
-0.0 and +0.0 differ; NaN payloads count. Words, not elements, are hashed so the GPU pays
one mix per 8 bytes whatever the dtype (1-, 2-, 4- and 8-byte elements are supported).

Per-block fingerprints (``block`` elements each, ``block × element size`` a multiple of
8 bytes) localise a difference; the whole-tensor value is the sum of the block values.
``diff_records`` turns a mismatch into miscompare records (index, expected/actual bits,
XOR mask) reading back only the differing blocks. This module knows no device:
backends/fingerprints.py computes the same values where a tensor lives (the CUDA kernel
for GPU tensors).
"""

from __future__ import annotations

import numpy as np
import torch

SALT_KEY = np.uint64(0xA5E615D0C0FFEE11)
GOLDEN = np.uint64(0x9E3779B97F4A7C15)
BLOCK_ELEMS = 1 << 16
MASK64 = (1 << 64) - 1
_M1 = np.uint64(0xFF51AFD7ED558CCD)
_M2 = np.uint64(0xC4CEB9FE1A85EC53)
_S33 = np.uint64(33)

_BITS_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def mix64(k: np.ndarray) -> np.ndarray:
    """murmur3 fmix64 on a uint64 array (wrapping arithmetic)."""
    with np.errstate(over="ignore"):
        k = k ^ (k >> _S33)
        k = k * _M1
        k = k ^ (k >> _S33)
        k = k * _M2
        return k ^ (k >> _S33)


def int_view(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bits as a signed integer tensor of the same element size (a view: no copy)."""
    return t.view(_BITS_VIEW[t.element_size()])


def _flat(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    if t.element_size() not in _BITS_VIEW:
        raise ValueError(f"unsupported element size {t.element_size()} for fingerprinting")
    return t.contiguous().reshape(-1)


def raw_bits(t: torch.Tensor) -> np.ndarray:
    """The tensor's element bits as a flat uint64 array (zero-extended), host side."""
    t = _flat(t).to("cpu")
    size = t.element_size()
    ints = t.view(_BITS_VIEW[size]).numpy()
    unsigned = ints.view(np.dtype(f"u{size}"))
    return unsigned.astype(np.uint64)


def words(t: torch.Tensor) -> np.ndarray:
    """The tensor's bytes as little-endian uint64 words, the last one zero-padded (host)."""
    raw = _flat(t).to("cpu").view(torch.uint8).numpy()
    pad = (-raw.size) % 8
    if pad:
        raw = np.concatenate([raw, np.zeros(pad, dtype=np.uint8)])
    return raw.view("<u8").astype(np.uint64, copy=False)


def word_terms(w: np.ndarray, start: int = 0) -> np.ndarray:
    """mix64(word ⊕ KEY ⊕ pos·GOLDEN) for positions start … start+len−1."""
    pos = np.arange(start, start + w.size, dtype=np.uint64)
    with np.errstate(over="ignore"):
        return mix64(w ^ SALT_KEY ^ (pos * GOLDEN))


def _wrapping_sum(x: np.ndarray) -> int:
    with np.errstate(over="ignore"):
        return int(np.sum(x, dtype=np.uint64))


def fingerprint(t: torch.Tensor) -> int:
    """The 64-bit fingerprint of ``t``'s bits, as a Python int in [0, 2^64)."""
    return _wrapping_sum(word_terms(words(t)))


def _block_words(t: torch.Tensor, block: int) -> int:
    size = t.element_size()
    if block < 1 or (block * size) % 8:
        raise ValueError(f"block of {block} elements × {size} B is not a whole number of 8-byte words")
    return block * size // 8


def block_tensor(t: torch.Tensor, block: int = BLOCK_ELEMS) -> torch.Tensor:
    """Per-block fingerprints as an int64 tensor (two's complement bits), host side: the CPU
    twin of fingerprint_cuda.gpu_block_tensor."""
    bw = _block_words(t, block)
    terms = word_terms(words(t))
    pad = (-terms.size) % bw  # zero terms add nothing to the short last block
    if pad:
        terms = np.concatenate([terms, np.zeros(pad, dtype=np.uint64)])
    with np.errstate(over="ignore"):
        sums = terms.reshape(-1, bw).sum(axis=1, dtype=np.uint64)
    return torch.from_numpy(sums.view(np.int64).copy())


def unsigned(blocks: torch.Tensor) -> list[int]:
    """Block fingerprints held as int64 bits (block_tensor, gpu_block_tensor) as Python ints in [0, 2^64)."""
    return [v & MASK64 for v in blocks.cpu().tolist()]


def block_fingerprints(t: torch.Tensor, block: int = BLOCK_ELEMS) -> list[int]:
    """Fingerprint of each run of ``block`` consecutive elements (last one may be short)."""
    return unsigned(block_tensor(t, block))


def combine(blocks: list[int]) -> int:
    """Whole-tensor fingerprint from its block fingerprints."""
    return sum(blocks) % (1 << 64)


def differing_blocks(expected: list[int], actual: list[int]) -> list[int]:
    if len(expected) != len(actual):
        raise ValueError(f"cannot compare {len(expected)} and {len(actual)} block fingerprints")
    return [i for i, (e, a) in enumerate(zip(expected, actual, strict=True)) if e != a]


def _records(e: np.ndarray, a: np.ndarray, where: np.ndarray, size: int, offset: int) -> list[dict]:
    width = size * 2
    return [
        {
            "index": int(i) + offset,
            "expected": f"0x{int(e[i]):0{width}x}",
            "actual": f"0x{int(a[i]):0{width}x}",
            "xor": f"0x{int(e[i] ^ a[i]):0{width}x}",
        }
        for i in where
    ]


def check_comparable(expected: torch.Tensor, actual: torch.Tensor) -> None:
    """ValueError unless the two tensors have one shape and dtype (their bits can be compared)."""
    if expected.shape != actual.shape or expected.dtype != actual.dtype:
        raise ValueError(f"cannot compare {tuple(expected.shape)}/{expected.dtype} with {tuple(actual.shape)}/{actual.dtype}")


def diff_records(expected: torch.Tensor, actual: torch.Tensor, block: int = BLOCK_ELEMS, limit: int = 8,
                 blocks: list[int] | None = None) -> tuple[list[int], int, list[dict]]:
    """Localise how ``actual`` differs from ``expected`` (same shape and dtype).

    Returns (differing block indices, differing elements in them, up to ``limit`` records
    with flat index, expected/actual bits and XOR mask). Only differing blocks are read
    back to the host; ``blocks`` skips the fingerprinting when the caller already knows them
    (without it, the blocks are fingerprinted here, on the host: backends.fingerprints.diff_records
    fingerprints them on the tensors' device).
    """
    check_comparable(expected, actual)
    if blocks is None:
        blocks = differing_blocks(block_fingerprints(expected, block), block_fingerprints(actual, block))
    ef, af = _flat(expected), _flat(actual)
    count, records = 0, []
    for b in blocks:
        sl = slice(b * block, min(ef.numel(), (b + 1) * block))
        e, a = raw_bits(ef[sl]), raw_bits(af[sl])
        where = np.flatnonzero(e != a)
        count += int(where.size)
        if len(records) < limit:
            records += _records(e, a, where[: limit - len(records)], expected.element_size(), sl.start)
    return blocks, count, records


def hex64(h: int) -> str:
    return f"{h:016x}"
