"""Fleet hand-off (docs/training-guards.md): what a confirmed event says about the GPU, and an
exit code a scheduler can act on.

A confirmed event is re-run on the GPU it happened on ("here") and, when the job has another
GPU, on that one ("there"), from the same inputs:

    here         there          cause        why
    reproduced   clean          HARDWARE     the computation is right elsewhere: this GPU is at fault
    reproduced   reproduced     SOFTWARE     the data, the software or the numerics, not the GPU
    reproduced   (none)         UNRESOLVED   persistent here, nothing to compare with: replay elsewhere
    clean        clean / none   TRANSIENT    a one-off: recorded, the GPU watched
    inconsistent any            HARDWARE     identical inputs gave different bits here
    clean        reproduced     UNRESOLVED   the other device misbehaves on it, not this one

A device whose re-run could not run (ERROR) or whose own runs disagreed ("inconsistent" there)
counts as no other device. Re-runs go through vTask replay (``classify_bundles``) for sensor
events saved as bundles, and through the training guard's re-execution (``classify_guard``)
for training-state events.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass

import torch

from aegis_cli.faults.spec import FaultPlan
from aegis_cli.ops.verdict import Verdict
from aegis_cli.sensors.guards import GuardEvent, TrainingGuard
from aegis_cli.vtask.replay import ReplayOptions, run_replay

log = logging.getLogger("aegis.sensors.handoff")
REPRODUCED, CLEAN, INCONSISTENT = "reproduced", "not_reproduced", "inconsistent"


class Cause(str, enum.Enum):
    HARDWARE = "hardware"
    SOFTWARE = "software"
    TRANSIENT = "transient"
    UNRESOLVED = "unresolved"


class HandoffExit(enum.IntEnum):
    """Process exit codes of a training job that stops on a classified event. They sit apart
    from aegis's 0–3 (ops/errors.py ExitCode), from sysexits.h (64–78), from the shell's
    126–127 and from 128+signal."""

    TRANSIENT = 80  # restart from the last clean checkpoint, on this node if need be; the GPU is watched
    HARDWARE = 81  # drain this GPU (quarantine), restart elsewhere from the last clean checkpoint
    SOFTWARE = 82  # do not drain: the job reproduces it on other GPUs; the owner must look
    UNRESOLVED = 83  # persistent here, not compared: replay the saved vTasks on another GPU (aegis replay, sweep)


@dataclass
class Classification:
    cause: Cause
    here: str  # REPRODUCED, CLEAN or INCONSISTENT
    there: str | None  # the same, or None: no other device (or its re-run was not usable)
    here_device: str
    there_device: str | None = None
    detail: str = ""

    @property
    def exit_code(self) -> HandoffExit:
        return HandoffExit[self.cause.name]

    def to_dict(self) -> dict:
        return {"cause": self.cause.value, "exit_code": int(self.exit_code), "here": self.here, "there": self.there,
                "here_device": self.here_device, "there_device": self.there_device, "detail": self.detail}


def classify(here: str, there: str | None) -> tuple[Cause, str]:
    """The table of the module doc: (cause, one line why)."""
    if here == INCONSISTENT:
        return Cause.HARDWARE, "re-runs of identical inputs disagreed here"
    if there == INCONSISTENT:
        there = None  # the other device is misbehaving: it tells nothing about this one
    if here == REPRODUCED:
        if there == CLEAN:
            return Cause.HARDWARE, "reproduced here, clean on another device"
        if there == REPRODUCED:
            return Cause.SOFTWARE, "reproduced on another device too: data, software or numerics"
        return Cause.UNRESOLVED, "reproduced here; no other device to compare with"
    if there == REPRODUCED:
        return Cause.UNRESOLVED, "clean here but reproduced on the other device"
    return Cause.TRANSIENT, "reproduced nowhere"


def _finish(c: Classification) -> Classification:
    log.log(logging.WARNING if c.cause is Cause.TRANSIENT else logging.ERROR,
            "aegis hand-off: %s (%s; here %s on %s, there %s on %s): exit code %d", c.cause.value, c.detail, c.here,
            c.here_device, c.there, c.there_device, c.exit_code)
    return c


def _replay_outcome(bundles: list[str], device: str, inject: str | None) -> str | None:
    """Replay every vTask on one device: INCONSISTENT if any run disagreed, REPRODUCED if any
    reproduced, CLEAN if none did; None if the device could not replay (ERROR)."""
    spec = None
    if inject:
        plan = FaultPlan.parse(inject).for_device(device)  # faults pinned to other devices do not apply here
        spec = ";".join(plan.describe()) if plan else None
    report = run_replay(ReplayOptions(bundles=list(bundles), devices=device, inject=spec, command_line=["handoff"]))
    dr = report.devices[0]
    if dr.verdict is Verdict.ERROR:
        return None
    outcomes = {o["outcome"] for o in dr.probe_stats["replay"]["outcomes"]}
    return INCONSISTENT if INCONSISTENT in outcomes else REPRODUCED if REPRODUCED in outcomes else CLEAN


def classify_bundles(bundles: list[str], here: str, there: str | None = None, *, inject: str | None = None) -> Classification:
    """Classify a confirmed event saved as vTask bundles by replaying them on ``here`` (the
    device it happened on, e.g. ``cuda:3``) and on ``there`` (another device of the job, or
    None). ``inject`` is a self-test fault spec for the replays (``device=`` pins it)."""
    h = _replay_outcome(bundles, here, inject)
    failed = h is None
    if failed:
        h = REPRODUCED  # the device that confirmed the event cannot even replay it: never call that transient
    t = _replay_outcome(bundles, there, inject) if there else None
    cause, why = classify(h, t)
    why += "; the replay here failed (ERROR)" if failed else ""
    return _finish(Classification(cause, h, t, here, there, why))


def classify_guard(guard: TrainingGuard, event: GuardEvent, there: str | torch.device | None = None,
                   there_id: str | None = None) -> Classification:
    """Classify a training-state event. Here: the guard's own re-execution (``event.outcome``).
    There: the kept steps re-executed on a copy on ``there`` (TrainingGuard.rerun_on), only
    when it reproduced here. The guarded model is left at the last state known clean."""
    h = REPRODUCED if event.outcome == "reproduced" else CLEAN
    t = None
    if there is not None and h == REPRODUCED:
        dev = torch.device(there)
        label = there_id or f"{dev.type}:{dev.index or 0}"
        t = REPRODUCED if guard.rerun_on(dev, label, event.step) else CLEAN
    cause, why = classify(h, t)
    tid = there_id or (str(there) if there is not None else None)
    return _finish(Classification(cause, h, t, event.device, tid if t is not None else None, why))
