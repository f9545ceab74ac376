"""Seeded attention operands for the attention tests (small shapes: the CPU reference is torch)."""

from __future__ import annotations

from aegis_cli.ops.attention import AttentionOperands
from aegis_cli.ops.numerics import generate_bf16


def draw(b: int, hq: int, hkv: int, s: int, d: int, causal: bool = True, dist: str = "normal",
         seed: int = 0) -> AttentionOperands:
    """Fresh seeded bf16 Q, K, V, dO (B, H, S, D) of one distribution."""
    g = lambda shape, i: generate_bf16(shape, dist, seed * 16 + i, "cpu")
    return AttentionOperands(g((b, hq, s, d), 0), g((b, hkv, s, d), 1), g((b, hkv, s, d), 2), g((b, hq, s, d), 3), causal)


def run(ops: AttentionOperands, fault=None):
    """Forward and backward of the CPU reference, with ``fault`` (an AttentionFault) in both."""
    from aegis_cli.ops.attention import flash_backward, flash_forward

    sc = ops.shape.scale
    fwd = flash_forward(ops.q, ops.k, ops.v, causal=ops.causal, scale=sc, fault=fault)
    bwd = flash_backward(ops.q, ops.k, ops.v, fwd.o, fwd.lse, ops.do, causal=ops.causal, scale=sc, fault=fault)
    return fwd, bwd
