"""Data-parallel outlier warning (docs/training-guards.md): every rank passes in one compact
statistic per step (e.g. the largest normalised checksum difference its sensors saw), the
ranks all-gather them over torch.distributed, and a rank far above the others gets a warning.

Data-parallel ranks run the same layers on different batches of the same distribution, so
their clean checksum noise has one scale. A GPU that corrupts a little, below the checksum
threshold τ, can still sit orders of magnitude above its peers. The comparison is robust and
leave-one-out, in decades: rank r is flagged when

    log10 x_r > median_{others} + max(k · 1.4826 · MAD_{others}, min_decades)

(MAD: the median absolute deviation of the other ranks' log10 values; with two ranks it is 0
and the margin is min_decades). A non-finite statistic is always flagged. It is a warning,
never a confirmed SDC: only a verifier's recomputation confirms. Quiet for the first
``warmup`` steps (no collective either), while the loss scale and activations settle.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from aegis_cli.sensors.collective import collective_device

log = logging.getLogger("aegis.sensors.outlier")
TINY = 1e-300  # a zero statistic (nothing sampled, or an exact result) sits at log10 = -300
MAD_SCALE = 1.4826  # MAD → standard deviation for normal data


def outliers(values: list[float], k: float = 5.0, min_decades: float = 1.0) -> tuple[list[int], list[float]]:
    """(flagged ranks, each rank's threshold in log10) for one step's statistics."""
    logs = [math.log10(max(v, TINY)) if math.isfinite(v) else math.inf for v in values]
    flagged, limits = [], []
    for r, x in enumerate(logs):
        others = [y for i, y in enumerate(logs) if i != r and math.isfinite(y)]
        if not others:
            limits.append(math.inf)
            flagged += [r] if not math.isfinite(values[r]) else []
            continue
        ref = statistics.median(others)
        mad = statistics.median(abs(y - ref) for y in others)
        limit = ref + max(k * MAD_SCALE * mad, min_decades)
        limits.append(limit)
        if not math.isfinite(values[r]) or x > limit:
            flagged.append(r)
    return flagged, limits


@dataclass
class OutlierResult:
    step: int
    values: list[float]  # the statistic of every rank, by rank
    flagged: list[int]  # ranks over their threshold
    limits: list[float]  # each rank's threshold (log10)
    rank: int  # this process's rank

    @property
    def warned(self) -> bool:
        """True on a flagged rank."""
        return self.rank in self.flagged

    def to_dict(self) -> dict:
        return {**self.__dict__, "warned": self.warned}


@dataclass
class OutlierWarning:
    """Call ``observe(step, value)`` on every rank at the same steps (it is a collective)."""

    warmup: int = 20  # steps observed before any comparison
    k: float = 5.0
    min_decades: float = 1.0
    group: object = None  # torch.distributed process group; None: the default one
    callback: Callable[[OutlierResult], None] | None = None  # called on a flagged rank
    observed: int = 0
    warnings: list[OutlierResult] = field(default_factory=list)  # this rank's

    def observe(self, step: int, value: float) -> OutlierResult | None:
        """None during warm-up or without a process group of two ranks or more; else the
        step's comparison, identical on every rank."""
        self.observed += 1
        dist = torch.distributed
        if self.observed <= self.warmup or not dist.is_available() or not dist.is_initialized():
            return None
        world = dist.get_world_size(self.group)
        if world < 2:
            return None
        mine = torch.tensor([float(value)], dtype=torch.float64, device=collective_device(self.group))
        gathered = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(gathered, mine, group=self.group)
        values = [float(t.item()) for t in gathered]
        flagged, limits = outliers(values, self.k, self.min_decades)
        res = OutlierResult(step, values, flagged, limits, dist.get_rank(self.group))
        if res.warned:
            self.warnings.append(res)
            log.warning("aegis outlier: rank %d's statistic %.3g at step %d is over %.3g (other ranks' median %.3g): "
                        "a warning, not a confirmed fault", res.rank, value, step, 10 ** limits[res.rank],
                        statistics.median(v for i, v in enumerate(values) if i != res.rank))
            if self.callback is not None:
                self.callback(res)
        return res
