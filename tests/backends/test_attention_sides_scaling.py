"""The exact power-of-two scalings the attention sides launcher applies around its kernel
(backends/cuda_attention.py: V and each dO row to a largest magnitude in [½, 1), the sides scaled
back), on the CPU: the kernel itself runs in test_attention_sides_gpu.py."""

from __future__ import annotations

import math

import torch

from aegis_cli.backends.cuda_attention import _exponent, _pow2


def test_pow2_is_exact_over_the_normal_exponents():
    e = torch.arange(-126, 128)
    want = torch.tensor([math.ldexp(1.0, int(x)) for x in e], dtype=torch.float64)
    assert torch.equal(_pow2(e, torch.float64), want)
    assert torch.equal(_pow2(e, torch.bfloat16).double(), want)


def test_exponent_is_frexps_and_clamped():
    xs = [0.0, 1e-40, 2.0**-126, 0.3, 0.5, 1.0, 3.0, 1e30, 3e38]
    got = _exponent(torch.tensor(xs)).tolist()
    assert got == [min(126, max(-125, math.frexp(x)[1])) for x in xs]


def test_scaling_bf16_operands_is_exact_and_lands_in_half_to_one():
    g = torch.Generator().manual_seed(7)
    for mag in (2.0**-100, 1e-8, 1.0, 3e4, 2.0**100):
        do = (torch.randn(2, 3, 17, 64, generator=g) * mag).bfloat16()
        e = _exponent(do.abs().amax(-1, keepdim=True))
        scaled = do * _pow2(-e, torch.bfloat16)
        assert scaled.dtype == torch.bfloat16
        top = scaled.abs().amax(-1)
        assert bool(((top >= 0.5) & (top < 1)).all()), (mag, top.min(), top.max())
        assert torch.equal(scaled.double() * _pow2(e, torch.float64), do.double())  # undone exactly
