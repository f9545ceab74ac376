"""Training-state faults (``stateflip``, faults/spec.py TRAINING_MODELS): bit flips in an
optimizer moment or a normalisation statistic, applied in place right after a step's update.

The caller (sensors/guards.py) names the state tensors, ``{"fc1.weight": {"exp_avg": t, …},
"bn1": {"running_var": t, …}}``, and says which step just ran and whether it ran for the first
time (a re-execution after a restore is not). Which tensor and which elements are hit is drawn
from the fault's seed and slot alone, so a fault that fires again lands in the same place.
"""

from __future__ import annotations

import numpy as np
import torch

from aegis_cli.faults.spec import FaultPlan, FaultSpec, LaunchContext
from aegis_cli.faults.stored import _apply_memflip as flip_bits
from aegis_cli.ops.errors import InjectSpecError


def _fires(plan: FaultPlan, f: FaultSpec, slot: int, step: int, first: bool) -> bool:
    at = f.get("step")
    if at is None:
        due = True
    elif f.get("persist") == "1":
        due = step >= int(at, 0)
    else:
        due = first and step == int(at, 0)
    if due and f.prob < 1.0:
        due = np.random.default_rng([f.seed, slot, plan.launches, 0xC01]).random() < f.prob
    return due


def _dense(t: torch.Tensor) -> torch.Tensor | None:
    """``t`` as a contiguous view of its own memory (a channels_last moment is dense with its dims in
    another order: ``index=`` then counts in memory order), or None where it has gaps."""
    v = t.permute(sorted(range(t.dim()), key=lambda d: -t.stride(d)))
    return v if v.is_contiguous() else None


def state_faults(plan: FaultPlan | None, step: int, first: bool, tensors: dict[str, dict[str, torch.Tensor]],
                 device_id: str) -> list[dict]:
    """Apply the plan's training-state faults due after ``step`` on the device the caller calls
    ``device_id`` (``device=`` matches it); one call is one 'launch' of the plan. Returns the
    injection records of this call (also in ``plan.injected``)."""
    if plan is None:
        return []
    before = len(plan.injected)
    for slot, f in zip(plan.slots, plan.faults, strict=True):
        names = sorted(n for n, st in tensors.items() if f.target in st and (f.get("op") is None or f.get("op") in n))
        if f.get("device") not in (None, device_id) or not names or not _fires(plan, f, slot, step, first):
            continue
        rng = np.random.default_rng([f.seed, slot, 0x57A7E])  # fixed per fault: the same tensor and elements every time
        name = names[int(rng.integers(0, len(names)))]
        t = _dense(tensors[name][f.target])
        if t is None:
            raise InjectSpecError(f"stateflip: {name}:{f.target} does not fill its memory densely; no element order to flip in")
        ctx = LaunchContext(device_id, f"train/step{step}/{name}:{f.target}", (1, 1))
        with torch.no_grad():
            flip_bits(plan, f, rng, ctx, t)
        plan.injected[-1].update(target=f.target, step=step)
    plan.launches += 1
    return plan.injected[before:]
