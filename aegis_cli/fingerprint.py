"""Bitwise tensor fingerprints (DESIGN §2.3), CPU implementation.

    h = Σ_i mix64(bits_i ⊕ salt(i))  mod 2^64,   salt(i) = mix64(i ⊕ SALT_KEY)

``bits_i`` are the raw bits of element i (flat, row-major order) zero-extended to 64
bits; ``mix64`` is the murmur3 64-bit finaliser, a bijection. Hence:
- any change of one element changes h (a bijection of a changed input changes its term);
- the salt makes the term position-dependent, so swapping two unequal elements changes h
  (with probability ≈ 1 − 2⁻⁶⁴), and two identical flips in different elements don't cancel;
- addition mod 2^64 is order-independent, so a parallel GPU reduction gives the same bits.
-0.0 and +0.0 differ; NaN payloads count. The CUDA kernel (kernels/fingerprint.cu) must
produce the same value for the same bytes.

Per-block fingerprints (``BLOCK_ELEMS`` elements per block) localise a difference; the
whole-tensor value is the sum of the block values mod 2^64.
"""

from __future__ import annotations

import numpy as np
import torch

SALT_KEY = np.uint64(0xA5E615D0C0FFEE11)
BLOCK_ELEMS = 1 << 16
_M1 = np.uint64(0xFF51AFD7ED558CCD)
_M2 = np.uint64(0xC4CEB9FE1A85EC53)
_S33 = np.uint64(33)

_BITS_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def mix64(k: np.ndarray) -> np.ndarray:
    """murmur3 fmix64 on a uint64 array (wrapping arithmetic)."""
    k = k ^ (k >> _S33)
    k = k * _M1
    k = k ^ (k >> _S33)
    k = k * _M2
    return k ^ (k >> _S33)


def raw_bits(t: torch.Tensor) -> np.ndarray:
    """The tensor's element bits as a flat uint64 array (zero-extended), host side."""
    t = t.detach().contiguous().reshape(-1).to("cpu")
    size = t.element_size()
    if size not in _BITS_VIEW:
        raise ValueError(f"unsupported element size {size} for fingerprinting")
    ints = t.view(_BITS_VIEW[size]).numpy()
    unsigned = ints.view(np.dtype(f"u{size}"))
    return unsigned.astype(np.uint64)


def element_terms(bits: np.ndarray, start: int = 0) -> np.ndarray:
    """mix64(bits_i ⊕ salt(i)) for i = start … start+len−1."""
    idx = np.arange(start, start + bits.size, dtype=np.uint64)
    with np.errstate(over="ignore"):
        return mix64(bits ^ mix64(idx ^ SALT_KEY))


def _wrapping_sum(x: np.ndarray) -> int:
    with np.errstate(over="ignore"):
        return int(np.sum(x, dtype=np.uint64))


def fingerprint(t: torch.Tensor) -> int:
    """The 64-bit fingerprint of ``t``'s bits, as a Python int in [0, 2^64)."""
    return _wrapping_sum(element_terms(raw_bits(t)))


def block_fingerprints(t: torch.Tensor, block: int = BLOCK_ELEMS) -> list[int]:
    """Fingerprint of each run of ``block`` consecutive elements (last one may be short)."""
    terms = element_terms(raw_bits(t))
    return [_wrapping_sum(terms[s : s + block]) for s in range(0, terms.size, block)]


def combine(blocks: list[int]) -> int:
    """Whole-tensor fingerprint from its block fingerprints."""
    return sum(blocks) % (1 << 64)


def first_difference(expected: torch.Tensor, actual: torch.Tensor, limit: int = 8) -> list[dict]:
    """Up to ``limit`` miscompare records (flat index, expected/actual bits, XOR mask)."""
    e, a = raw_bits(expected), raw_bits(actual)
    if e.size != a.size:
        raise ValueError(f"cannot compare tensors of {e.size} and {a.size} elements")
    where = np.flatnonzero(e != a)[:limit]
    width = expected.element_size() * 2
    return [
        {
            "index": int(i),
            "expected": f"0x{int(e[i]):0{width}x}",
            "actual": f"0x{int(a[i]):0{width}x}",
            "xor": f"0x{int(e[i] ^ a[i]):0{width}x}",
        }
        for i in where
    ]


def count_differences(expected: torch.Tensor, actual: torch.Tensor) -> int:
    return int(np.count_nonzero(raw_bits(expected) != raw_bits(actual)))


def hex64(h: int) -> str:
    return f"{h:016x}"
