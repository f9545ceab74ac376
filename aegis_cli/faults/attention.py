"""Attention faults (``target=attn.STAGE``, faults/spec.py) as the kernels take them: one
``AttentionFault`` per pass (ops/attention.py), with the same seeded draw on both backends.

The position is ``index=`` modulo the stage's size, else drawn from the plan's generator,
seeded by the fault and the case's shape group (a permanent fault sits at one place at every
input scale). In the causal (S, S) stages only computed scores are drawn (key j ≤ query i):
a hardware fault cannot strike a tile the kernel skips. ``bitflip`` XORs one bit of its class
(``bit=``, default exp) of the fp32 value, ``mask`` XORs ``mask=``, ``perturb`` adds ``r``.
"""

from __future__ import annotations

import math

import numpy as np

from aegis_cli.faults.spec import FaultPlan, FaultSpec, LaunchContext
from aegis_cli.faults.tensor import pick_bit
from aegis_cli.ops.attention import BLOCK, AttentionFault, AttentionShape

SQUARE = ("scores", "softmax", "dp", "recompute_p")


def _index(f: FaultSpec, stage: str, shape: AttentionShape, rng: np.random.Generator) -> int:
    dims = shape.stage_shape(stage)
    n = math.prod(dims)
    if f.get("index") is not None:
        return f.as_int("index") % n
    if stage in SQUARE and shape.causal:
        lead = int(rng.integers(0, n // (shape.seq * shape.seq)))
        i = int(rng.integers(0, shape.seq))
        j = int(rng.integers(0, i + 1))
        return (lead * shape.seq + i) * shape.seq + j
    return int(rng.integers(0, n))


def draw(f: FaultSpec, shape: AttentionShape, rng: np.random.Generator) -> AttentionFault:
    """The one value ``f`` corrupts in a pass of ``shape``, and how."""
    stage = f.target.removeprefix("attn.")
    index = _index(f, stage, shape, rng)
    if f.model == "perturb":
        return AttentionFault(stage, index, 0, float(f.get("r")))
    mask = f.as_int("mask") if f.model == "mask" else 1 << pick_bit(f.get("bit", "exp"), 32, rng)
    return AttentionFault(stage, index, mask, 0.0)


def pass_fault(plan: FaultPlan | None, device_id: str, op: str, shape: AttentionShape,
               stages: tuple[str, ...]) -> AttentionFault | None:
    """What a backend asks before one attention pass (a launch of the plan, its stages
    ``stages``): the fault to hand the kernel, recorded, or None. One value per pass, as the
    kernels take it: the first active fault of the spec wins, and the others are not recorded
    (they did not fire on this launch)."""
    if plan is None:
        return None
    ctx, fault = LaunchContext(device_id, op, (BLOCK, BLOCK)), None
    for f, rng in plan.active(ctx, "attn"):
        if f.target.removeprefix("attn.") not in stages:
            continue
        fault = draw(f, shape, rng)
        plan.record(f, ctx, target=f.target, elements=1, stage=fault.stage, index=fault.index,
                    position=list(fault.coords(shape)), xor=f"0x{fault.xor:08x}", add=fault.add)
        break
    plan.launches += 1
    return fault
