"""The fingerprint's documented properties (docs/fingerprints.md), on the CPU implementation."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from aegis_cli.ops import fingerprint as fp

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int8, torch.uint8, torch.int32, torch.int64]
INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def tensor_of(raw: bytes, dtype: torch.dtype) -> torch.Tensor:
    size = torch.empty((), dtype=dtype).element_size()
    raw = raw[: len(raw) // size * size]
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).clone()


tensors = st.tuples(st.binary(min_size=8, max_size=600), st.sampled_from(DTYPES)).map(lambda x: tensor_of(*x)).filter(
    lambda t: t.numel() >= 2)


def flip(t: torch.Tensor, index: int, bit: int) -> torch.Tensor:
    u = t.clone()
    iv = u.view(INT_VIEW[u.element_size()])
    mask = 1 << bit
    if u.element_size() > 1 and bit == u.element_size() * 8 - 1:
        mask = -mask  # the sign bit as a signed value of the view
    iv[index] ^= mask
    return u


@settings(max_examples=200, deadline=None)
@given(tensors, st.data())
def test_every_single_bit_flip_changes_the_fingerprint(t, data):
    i = data.draw(st.integers(0, t.numel() - 1))
    bit = data.draw(st.integers(0, t.element_size() * 8 - 1))
    assert fp.fingerprint(flip(t, i, bit)) != fp.fingerprint(t)


@settings(max_examples=200, deadline=None)
@given(tensors, st.data())
def test_two_identical_flips_do_not_cancel(t, data):
    i = data.draw(st.integers(0, t.numel() - 1))
    j = data.draw(st.integers(0, t.numel() - 1).filter(lambda j: j != i))
    bit = data.draw(st.integers(0, t.element_size() * 8 - 1))
    assert fp.fingerprint(flip(flip(t, i, bit), j, bit)) != fp.fingerprint(t)


@settings(max_examples=200, deadline=None)
@given(tensors, st.data())
def test_swapping_two_unequal_elements_changes_the_fingerprint(t, data):
    iv = t.view(INT_VIEW[t.element_size()])
    i = data.draw(st.integers(0, t.numel() - 1))
    others = [j for j in range(t.numel()) if iv[j] != iv[i]]
    if not others:
        return  # every element equal: a swap changes no bit
    j = data.draw(st.sampled_from(others))
    u = t.clone()
    u[i], u[j] = t[j], t[i]
    assert fp.fingerprint(u) != fp.fingerprint(t)


@settings(max_examples=100, deadline=None)
@given(tensors, st.sampled_from([8, 16, 24, 64, 4096]))
def test_blocks_sum_to_the_whole_and_localise_a_flip(t, block):
    if (block * t.element_size()) % 8:
        with pytest.raises(ValueError):
            fp.block_fingerprints(t, block)
        return
    blocks = fp.block_fingerprints(t, block)
    assert fp.combine(blocks) == fp.fingerprint(t)
    assert len(blocks) == -(-t.numel() // block)
    i = t.numel() // 2
    assert fp.differing_blocks(blocks, fp.block_fingerprints(flip(t, i, 0), block)) == [i // block]


def test_reference_definition():
    """The value is Σ fmix64(word ⊕ KEY ⊕ w·GOLDEN) mod 2^64 over little-endian words, written
    out here in plain Python integers: what the CUDA kernel must equal."""
    def fmix(k):
        m = (1 << 64) - 1
        k ^= k >> 33
        k = (k * 0xFF51AFD7ED558CCD) & m
        k ^= k >> 33
        k = (k * 0xC4CEB9FE1A85EC53) & m
        return k ^ (k >> 33)

    t = torch.tensor([1.5, -0.0, 3.25, float("nan"), -2.0], dtype=torch.bfloat16)
    raw = bytes(t.view(torch.uint8).numpy()) + b"\0" * 6
    want = sum(fmix(int.from_bytes(raw[8 * w : 8 * w + 8], "little") ^ 0xA5E615D0C0FFEE11 ^ ((w * 0x9E3779B97F4A7C15) & ((1 << 64) - 1)))
               for w in range(2)) % (1 << 64)
    assert fp.fingerprint(t) == want


def test_raw_bits_semantics():
    z = torch.tensor([0.0], dtype=torch.float32)
    assert fp.fingerprint(z) != fp.fingerprint(-z)  # -0.0 and +0.0 differ
    a = torch.tensor([0x7FC00000, 0x7FC00001], dtype=torch.int32).view(torch.float32)
    assert fp.fingerprint(a[:1]) != fp.fingerprint(a[1:])  # NaN payloads count
    x = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    assert fp.fingerprint(x.t()) == fp.fingerprint(x.t().contiguous())  # logical row-major order
    assert fp.fingerprint(torch.empty(0)) == 0
    with pytest.raises(ValueError):
        fp.fingerprint(torch.zeros(2, dtype=torch.complex128))


def test_diff_records_localise_element_bits_and_xor():
    g = torch.Generator().manual_seed(3)
    e = torch.randn(300, 70, generator=g).to(torch.bfloat16)
    a = e.clone()
    a.view(torch.int16)[123, 45] ^= 0x0010
    a.view(torch.int16)[299, 69] ^= -0x8000
    blocks, count, recs = fp.diff_records(e, a, block=4096)
    assert count == 2 and blocks == [(123 * 70 + 45) // 4096, (299 * 70 + 69) // 4096]
    assert [r["index"] for r in recs] == [123 * 70 + 45, 299 * 70 + 69]
    assert recs[0]["xor"] == "0x0010" and recs[1]["xor"] == "0x8000"
    assert int(recs[0]["expected"], 16) ^ int(recs[0]["actual"], 16) == 0x10


def test_collision_rate_of_random_errors_is_tiny():
    """Random multi-element corruptions of a random tensor: no two of 20 000 fingerprints
    collide (an ideal 64-bit hash collides with probability ≈ n²/2⁶⁵ ≈ 1e-11 here)."""
    rng = np.random.default_rng(5)
    base = rng.integers(0, 1 << 16, 4096, dtype=np.uint16)
    seen, tensors = set(), set()
    for _ in range(20_000):
        x = base.copy()
        idx = rng.integers(0, x.size, rng.integers(1, 6))
        x[idx] ^= rng.integers(1, 1 << 16, idx.size, dtype=np.uint16)
        tensors.add(x.tobytes())
        seen.add(fp.fingerprint(torch.from_numpy(x.view(np.int16))))
    assert fp.fingerprint(torch.from_numpy(base.view(np.int16))) not in seen or base.tobytes() in tensors
    assert len(seen) == len(tensors)  # distinct tensors, distinct fingerprints
