"""Bit-exact snapshots and RNG states for the training guard's re-execution (sensors/guards.py).

A ``Snapshot`` copies named tensors into buffers it keeps between saves (two rotating
snapshots cost two copies of the state, never more) and deep-copies small values (param
groups, scheduler state). The RNG helpers capture and restore torch's CPU generator, every
initialised CUDA generator and any extra generators.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from aegis_cli.sensors.queue import nbytes


def rng_state(generators: list[torch.Generator]) -> dict:
    state = {"cpu": torch.get_rng_state(), "gens": [g.get_state() for g in generators]}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict, generators: list[torch.Generator]) -> None:
    torch.set_rng_state(state["cpu"])
    for g, s in zip(generators, state["gens"], strict=True):
        g.set_state(s)
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])


def rng_for(state: dict, src: torch.device, dst: torch.device) -> dict:
    """RNG states for re-executing on ``dst`` what ran on ``src``: ``dst``'s CUDA generator
    gets the state ``src``'s had, so a dropout mask is drawn the same there."""
    if src.type == dst.type == "cuda" and "cuda" in state:
        cuda = list(state["cuda"])
        cuda[dst.index or 0] = state["cuda"][src.index or 0]
        state = {**state, "cuda": cuda}
    return state


def to_device(batch: Any, device: torch.device) -> Any:
    """``batch`` with every tensor in it (nested in lists, tuples, named tuples, dicts) on ``device``."""
    if torch.is_tensor(batch):
        return batch.to(device)
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(to_device(b, device) for b in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(b, device) for b in batch)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    return batch


class Snapshot:
    """A bit-exact copy of named tensors (buffers reused between saves) and deep-copied values."""

    def __init__(self) -> None:
        self.step = -1
        self.tensors: dict[str, torch.Tensor] = {}
        self.devices: dict[str, torch.device] = {}  # where each tensor lives in training
        self.values: dict[str, Any] = {}

    @torch.no_grad()
    def save(self, step: int, tensors: dict[str, torch.Tensor], values: dict[str, Any], device: torch.device | None) -> None:
        for k, t in tensors.items():
            buf = self.tensors.get(k)
            where = device or t.device
            if buf is None or buf.shape != t.shape or buf.dtype != t.dtype or buf.device.type != where.type:
                # host copies of device tensors in pinned memory: the copy runs at full bus speed
                pin = where.type == "cpu" and t.device.type == "cuda"
                buf = self.tensors[k] = torch.empty(t.shape, dtype=t.dtype, device=where, pin_memory=pin)
            buf.copy_(t)
            self.devices[k] = t.device
        for k in set(self.tensors) - set(tensors):
            del self.tensors[k], self.devices[k]
        self.values = copy.deepcopy(values)
        self.step = step

    def nbytes(self) -> int:
        return nbytes(self.tensors.values())
