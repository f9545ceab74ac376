"""The bounded queue between the sensors (in the step, on the critical path) and the verifier
(at step boundaries). A suspicion holds its minimal context: the tensors a re-run needs, copied
so that the training loop may change its own in place. The queue is bounded in count and in
the bytes its suspicions hold; a suspicion with no room is dropped and counted, never waited for."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch


def nbytes(tensors) -> int:
    """The bytes the tensors among ``tensors`` hold."""
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


@dataclass
class Suspicion:
    kind: str  # "gemm" | "attention" | "checkpoint"
    op: str  # the layer or region
    site: str  # the launch's op id
    step: int
    checks: list[str]  # what fired
    max_value: float  # the largest normalised difference (gemm) or 1.0 (a fingerprint mismatch)
    context: Any  # what the verifier needs: sensors.sense.GemmContext, sensors.attention.AttentionContext
    # or sensors.checkpoint.RegionContext
    raised_at: float = field(default_factory=time.perf_counter)

    @property
    def nbytes(self) -> int:
        return nbytes(self.context.tensors())


class SuspicionQueue:
    def __init__(self, size: int, max_bytes: int):
        self.size, self.max_bytes = size, max_bytes
        self._items: deque[Suspicion] = deque()
        self.bytes = 0
        self.peak = 0

    def fits(self, nbytes: int) -> bool:
        """Whether a suspicion holding ``nbytes`` would be queued now (asked before copying its tensors)."""
        return len(self._items) < self.size and self.bytes + nbytes <= self.max_bytes

    def push(self, s: Suspicion) -> bool:
        """Queue ``s``; False (the caller counts a drop) when it has no room."""
        nb = s.nbytes
        if not self.fits(nb):
            return False
        self._items.append(s)
        self.bytes += nb
        self.peak = max(self.peak, len(self._items))
        return True

    def pop(self) -> Suspicion | None:
        if not self._items:
            return None
        s = self._items.popleft()
        self.bytes -= s.nbytes
        return s

    def oldest_step(self) -> int | None:
        return min((s.step for s in self._items), default=None)

    def __len__(self) -> int:
        return len(self._items)

    def to_dict(self) -> dict:
        return {"depth": len(self._items), "peak": self.peak, "bytes": self.bytes, "size": self.size, "max_bytes": self.max_bytes}
