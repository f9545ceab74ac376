"""What the sensors tell a training loop: events (each also logged), the action the loop may
take, and the counters it can read at any time (docs/sensors.md)."""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass, field

from aegis_cli.ops.verdict import Evidence

log = logging.getLogger("aegis.sensors")

# event kinds: a verified suspicion (confirmed or cleared), one the queue had no room for, one whose
# verification failed, one confirmed but not saved, and a threshold raised after a cleared spike
KINDS = ("confirmed", "cleared", "dropped", "unverified", "unsaved", "threshold")


class Action(enum.IntEnum):
    """What the loop should do; the strongest action asked for in a step wins."""

    CONTINUE = 0
    CHECKPOINT = 1  # save a checkpoint of the last clean step (SensorHandle.last_clean_step)
    STOP = 2  # stop training: corruption confirmed


@dataclass
class SensorEvent:
    kind: str  # one of KINDS
    step: int  # the step the suspicion was raised in
    op: str  # the layer (module path) or checkpointed region
    site: str  # the launch's op id: train/LAYER/LAYOUT/MxNxK, or ckpt/REGION
    check: str  # e.g. gemm.row_checksum, checkpoint.output_fingerprint
    severity: str  # the verifier's verdict: FAULTY (confirmed), SUSPECT or HEALTHY (cleared)
    summary: str
    rank: int = 0
    latency_s: float | None = None  # from the suspicion being raised to its verification
    latency_steps: int | None = None
    bundle: str | None = None  # the vTask bundle saved for it
    evidence: list[Evidence] = field(default_factory=list)

    def to_dict(self) -> dict:
        d = {k: v for k, v in self.__dict__.items() if k != "evidence"}
        d["evidence"] = [e.to_dict() for e in self.evidence]
        return d


def default_action(event: SensorEvent) -> Action:
    """Without a callback: stop on confirmed corruption, carry on otherwise."""
    return Action.STOP if event.kind == "confirmed" else Action.CONTINUE


def log_event(event: SensorEvent) -> None:
    where = f"step {event.step} rank {event.rank} {event.op}"
    if event.kind == "confirmed":
        log.error("aegis sensors: CONFIRMED %s at %s: %s%s", event.check, where, event.summary,
                  f" (saved {event.bundle})" if event.bundle else "")
    elif event.kind == "unsaved":
        log.warning("aegis sensors: %s at %s not saved: %s", event.check, where, event.summary)
    elif event.kind in ("dropped", "unverified"):
        log.warning("aegis sensors: suspicion %s at %s (%s)", event.kind, where, event.summary)
    else:
        log.info("aegis sensors: %s %s at %s: %s", event.kind, event.check, where, event.summary)


@dataclass
class Latency:
    """Confirmation latency: from a suspicion being raised to its verification."""

    count: int = 0
    total_s: float = 0.0
    max_s: float = 0.0
    max_steps: int = 0

    def add(self, seconds: float, steps: int) -> None:
        self.count += 1
        self.total_s += seconds
        self.max_s = max(self.max_s, seconds)
        self.max_steps = max(self.max_steps, steps)

    def to_dict(self) -> dict:
        return {"verified": self.count, "mean_s": self.total_s / self.count if self.count else None,
                "max_s": self.max_s if self.count else None, "max_steps": self.max_steps if self.count else None}


@dataclass
class SensorStats:
    """Counters since instrument(); SensorHandle.stats() adds the queue and the controller's state."""

    steps: int = 0
    launches: int = 0  # instrumented GEMM launches (forward, dgrad, wgrad), sampled or not
    checked: int = 0  # of those, sampled and compared with the fp64 reference
    skipped_nonfinite: int = 0  # sampled launches whose inputs held NaN/Inf (no reference to compare with)
    attention_launches: int = 0  # SDPA calls the checked attention can compute, sampled or not (SensorConfig.attention)
    attention_unchecked: dict[str, int] = field(default_factory=dict)  # SDPA calls left to torch, by reason
    attention_clean_max: dict[str, float] = field(default_factory=dict)  # per invariant: the largest clean value ÷ τ
    regions: int = 0  # checkpointed regions run
    fingerprinted: int = 0  # of those, fingerprinted at forward and at recompute
    raised: int = 0  # suspicions raised by the sensors
    dropped: int = 0  # suspicions the queue had no room for
    unverified: int = 0  # suspicions whose verification raised an error (an event says which)
    confirmed: int = 0
    cleared: int = 0
    saved: int = 0  # vTask bundles written
    unsaved: int = 0  # confirmed events with no bundle (too large, not replayable, or no bundle_dir)
    clean_max_ratio: float = 0.0  # largest (normalised difference ÷ τ) among unflagged sampled checksums
    sense_s: float = 0.0  # time in the sensors (reference checksums, comparisons, fingerprints)
    verify_s: float = 0.0  # time in the verifier
    step_s: float = 0.0  # wall time between step boundaries, sensors and verifier included
    latency: Latency = field(default_factory=Latency)

    def overhead(self) -> float | None:
        """(sensing + verifying) ÷ the rest of the step time, over the whole run."""
        base = self.step_s - self.sense_s - self.verify_s
        return (self.sense_s + self.verify_s) / base if base > 0 else None

    def to_dict(self) -> dict:
        d = {k: v for k, v in self.__dict__.items() if k != "latency"}
        d["latency"] = self.latency.to_dict()
        d["attention_unchecked"] = dict(self.attention_unchecked)
        d["attention_clean_max"] = dict(self.attention_clean_max)
        d["overhead"] = self.overhead()
        return d
