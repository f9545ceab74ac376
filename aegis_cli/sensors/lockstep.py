"""Sampling in lockstep across data-parallel ranks (docs/sensors.md §4).

In synchronous data-parallel training every step waits for its slowest rank, so a check delays
the whole job in the step it runs in. Ranks that choose their checks independently take turns at
being the slowest: with many ranks, some rank checks in nearly every step, and the job pays the
dearest rank's checks every step instead of one rank's average. The coin is seeded alike on every
rank and the coverage floor's phases follow the seed and the operators' names, so the ranks choose
alike wherever their probabilities are equal; under the time-measured budget the probabilities
follow each rank's own measured times and drift apart.

``Lockstep`` gives every rank the same figures to share the budget from. Every ``every`` steps
(from step 0) the ranks all-reduce (MAX) a header (a checksum and the count of the operator names,
each also negated) and then one vector: minus the step's time without sensors, each operator's
launches and seconds a check. Every rank then shares the budget from the shortest step and the
dearest costs (the budget as the slowest rank would set it), bit for bit alike, and keeps those
probabilities until the next agreement. The collectives block the host at those boundaries (with
NCCL, the device too: its tensors live there); between them nothing is exchanged. If the ranks'
operators differ (the header's MAX and −MAX disagree: not one data-parallel replica, e.g. pipeline
stages in the group), every rank sees it at once, warns, and shares from its own figures from
then on.
"""

from __future__ import annotations

import logging
import zlib

import torch

from aegis_cli.sensors.collective import all_max

log = logging.getLogger("aegis.sensors")
EVERY = 50  # steps between agreements


class Lockstep:
    def __init__(self, group=None, every: int | None = None):
        self.group, self.every = group, every or EVERY
        self.active = True  # False once the ranks' operators differed: each rank on its own figures

    @classmethod
    def join(cls, group=None, every: int | None = None) -> Lockstep | None:
        """A lockstep over ``group`` (None: torch.distributed's default), or None without a group of
        two ranks or more."""
        dist = torch.distributed
        if not dist.is_available() or not dist.is_initialized() or dist.get_world_size(group) < 2:
            return None
        return cls(group, every)

    def agree(self, step: int, base_s: float, figures: dict[str, tuple[int, float]]) -> tuple[float, dict] | None:
        """(step time, figures) to share the budget from at this boundary, alike on every rank; None
        between agreements (keep the probabilities). A collective at every ``every``-th step."""
        if not self.active:
            return base_s, figures
        if step % self.every:
            return None
        names = sorted(figures)
        h = zlib.crc32("\n".join(names).encode())
        head = self._max([h, -h, len(names), -len(names)])
        if head[0] != -head[1] or head[2] != -head[3]:
            log.warning("aegis sensors: the ranks' operators differ (%d here): each rank samples on its own figures "
                        "from step %d, out of lockstep", len(names), step)
            self.active = False
            return base_s, figures
        v = self._max([-base_s, *(x for n in names for x in figures[n])])
        return -v[0], {n: (int(v[1 + 2 * i]), v[2 + 2 * i]) for i, n in enumerate(names)}

    def _max(self, values: list[float]) -> list[float]:
        return all_max(values, self.group)
