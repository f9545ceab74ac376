"""Faults in tensors a probe holds (``inject target=mem``): bit flips and swapped elements in
stored outputs, applied in place."""

from __future__ import annotations

import numpy as np
import torch

from aegis_cli.faults.spec import BIT_CLASSES, FaultPlan, FaultSpec, LaunchContext
from aegis_cli.faults.tensor import pick_bit, signed
from aegis_cli.ops import fingerprint


def _apply_memflip(plan: FaultPlan, f: FaultSpec, rng: np.random.Generator, ctx: LaunchContext, t: torch.Tensor) -> None:
    flat = fingerprint.int_view(t).reshape(-1)  # t is contiguous: a view, edits land in t
    bits = t.element_size() * 8
    n = flat.numel()
    count = min(f.as_int("count", "1"), n)
    if f.get("index") is not None:
        idx = (f.as_int("index") + np.arange(count)) % n
    else:
        idx = rng.choice(n, size=count, replace=False) if n > count else np.arange(n)
    spec = f.get("bit", "exp" if t.is_floating_point() else "0")
    if spec not in BIT_CLASSES and int(spec, 0) >= bits:
        # bit=N counts memory bits from the chosen element's lowest one on (little-endian): on
        # elements narrower than N bits it lands in a following element, not at N mod width
        idx = (np.asarray(idx) + int(spec, 0) // bits) % n
        spec = str(int(spec, 0) % bits)
    masks = [1 << pick_bit(spec, bits, rng) for _ in idx]
    ii = torch.from_numpy(np.asarray(idx, dtype=np.int64)).to(t.device)
    vals = masks if flat.dtype == torch.uint8 else [signed(m, bits) for m in masks]
    mv = torch.tensor(vals, dtype=flat.dtype, device=t.device)
    flat[ii] = flat[ii] ^ mv
    plan.record(f, ctx, target="mem", positions=[int(i) for i in idx[:16]], masks=[f"0x{m:x}" for m in masks[:16]],
                elements=len(idx))


def _apply_swap(plan: FaultPlan, f: FaultSpec, rng: np.random.Generator, ctx: LaunchContext, t: torch.Tensor) -> None:
    flat = fingerprint.int_view(t).reshape(-1)
    n = flat.numel()
    pairs = []
    for c in range(f.as_int("count", "1")):
        i = (f.as_int("index") + 2 * c) % n if f.get("index") is not None else int(rng.integers(0, n))
        # the partner: the next element whose bits differ (a swap of equal bits changes nothing)
        for step in range(1, min(n, 4096)):
            j = (i + step) % n
            if int(flat[i]) != int(flat[j]):
                break
        else:
            continue
        vi, vj = flat[i].clone(), flat[j].clone()
        flat[i], flat[j] = vj, vi
        pairs.append([i, j])
    plan.record(f, ctx, target="mem", pairs=pairs[:16], elements=2 * len(pairs))


def stored_faults(fault: FaultPlan | None, device_id: str, op: str, tensors: dict[str, torch.Tensor]) -> bool:
    """Apply ``target=mem`` faults to tensors a probe holds (in place; contiguous tensors).
    Each call is one 'launch' of the plan (``prob=`` draws per call). True if any fired."""
    if fault is None:
        return False
    ctx = LaunchContext(device_id, op, (1, 1))
    fired = False
    for f, rng in fault.active(ctx, "mem"):
        name = sorted(tensors)[int(rng.integers(0, len(tensors)))] if len(tensors) > 1 else next(iter(tensors))
        t = tensors[name]
        if not t.is_contiguous():
            raise ValueError(f"stored fault on a non-contiguous tensor {name}")
        ctx_named = LaunchContext(ctx.device_id, f"{op}:{name}", ctx.tile)
        (_apply_memflip if f.model == "memflip" else _apply_swap)(fault, f, rng, ctx_named, t)
        fired = True
    fault.launches += 1
    return fired
