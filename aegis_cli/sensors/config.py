"""What a training loop may set for its sensors (docs/sensors.md), checked when made.

Every field has a default that suits a real job: every operator sampled under a 1% overhead
budget, a verifier that spends at most 1% of a step, τ at the calibrated floor. Tests and
self-tests check every launch (``sample_prob=1``, ``overhead_budget=None``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from aegis_cli.faults.spec import FaultPlan
from aegis_cli.ops.errors import ConfigError
from aegis_cli.ops.numerics import Thresholds

if TYPE_CHECKING:
    from aegis_cli.sensors.events import Action, SensorEvent


def _range(name: str, value: float, lo: float, hi: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (lo <= value <= hi) or math.isnan(value):
        raise ConfigError(f"sensor config: {name} must lie in {lo:g}…{hi:g}, got {value!r}")


def _integer(name: str, value, lo: int, none_ok: bool = False) -> None:
    if none_ok and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise ConfigError(f"sensor config: {name} must be an integer ≥ {lo}{' or None' if none_ok else ''}, got {value!r}")


@dataclass(kw_only=True)
class SensorConfig:
    """How the sensors of one training job sense, verify, save and react."""

    # where the checked GEMMs run: "auto" (on the tensors' own device: our CUDA kernels for CUDA
    # tensors, the CPU reference path for host tensors) or "cpu" (always the reference path)
    device: str = "auto"
    thresholds: Thresholds = field(default_factory=Thresholds)  # τ's floor and the confirmation margin
    # sampling: the probability that a launch of an operator is checked, before any budget is measured
    sample_prob: float = 1.0
    # the share of the step (without sensors) the sensing may take; None keeps sample_prob fixed
    overhead_budget: float | None = 0.01
    coverage_steps: int | None = 100  # every operator is checked at least once in this many steps, whatever the budget (None: no floor)
    # the verifier: its share of the step at each step boundary, and how many it verifies there even over it
    verify_budget: float = 0.01
    min_verify: int = 1
    reruns: int = 2  # re-runs of a flagged GEMM when it is verified
    queue_size: int = 16  # suspicions waiting for the verifier; more are dropped (and counted)
    queue_bytes: int = 1 << 30  # the tensors they may hold together (a flagged GEMM holds copies of A, B and C)
    # adaptive thresholds: a cleared spike raises its operator's τ to headroom × the spike, at most
    # max_raise × the floor; the raise decays by ``decay`` per check of that operator back to the floor
    raise_headroom: float = 2.0
    max_raise: float = 1e3
    decay: float = 0.9
    attention: bool = False  # route F.scaled_dot_product_attention through the checked attention while instrumented
    fingerprints: bool = True  # fingerprint checkpointed regions (original vs recomputed activations)
    bundle_dir: str | None = None  # where confirmed events are saved as vTask bundles (None: not saved)
    max_vtask_bytes: int = 512 << 20  # a confirmed GEMM whose vTask would be larger is reported, not saved
    job: str = ""  # the job's name, in provenance
    rank: int | None = None  # None: torch.distributed's rank when initialised, else 0
    seed: int = 0  # the sampling coin's seed (never torch's RNG: the model's random stream stays its own)
    # data-parallel ranks share the budget from agreed figures, so they check the same launches in the same
    # steps (sensors/lockstep.py): every rank's step boundary is then a collective every 50 steps, over
    # ``group`` (a torch.distributed process group; None: the default one); without torch.distributed, nothing
    lockstep: bool = True
    group: object = None
    inject: str | None = None  # a self-test: --inject faults applied to the checked GEMMs and checkpointed inputs
    on_event: Callable[[SensorEvent], Action | None] | None = None  # called for each event; may ask the loop to act

    def __post_init__(self) -> None:
        if self.device not in ("auto", "cpu"):
            raise ConfigError(f"sensor config: device must be 'auto' or 'cpu', got {self.device!r}")
        _range("sample_prob", self.sample_prob, 0.0, 1.0)
        if self.overhead_budget is not None:
            _range("overhead_budget", self.overhead_budget, 1e-6, 10.0)
        _range("verify_budget", self.verify_budget, 0.0, 10.0)
        _range("decay", self.decay, 0.0, 1.0)
        _range("raise_headroom", self.raise_headroom, 1.0, 1e6)
        _range("max_raise", self.max_raise, 1.0, 1e12)
        for name in ("min_verify", "reruns", "queue_size", "queue_bytes", "max_vtask_bytes", "seed"):
            _integer(name, getattr(self, name), 0 if name in ("min_verify", "seed") else 1)
        _integer("coverage_steps", self.coverage_steps, 1, none_ok=True)
        _integer("rank", self.rank, 0, none_ok=True)
        for name in ("attention", "lockstep"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"sensor config: {name} must be true or false, got {getattr(self, name)!r}")
        if self.inject is not None:
            FaultPlan.parse(self.inject)  # refused now (InjectSpecError), not at the first launch

    def fault_plan(self) -> FaultPlan | None:
        return FaultPlan.parse(self.inject) if self.inject else None
