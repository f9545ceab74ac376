"""``instrument(model, config)`` and the handle it returns: the state of one instrumented model's
sensors, the step boundary where the verifier runs, events, and statistics (docs/sensors.md)."""

from __future__ import annotations

import contextlib
import functools
import time
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any

import torch
import torch.utils.checkpoint as torch_checkpoint
from torch import nn

from aegis_cli.backends import get_backend
from aegis_cli.backends.base import Device, DeviceIdentity
from aegis_cli.faults.spec import FaultPlan
from aegis_cli.ops.errors import ConfigError
from aegis_cli.sensors import linear, sense
from aegis_cli.sensors.attention import AttentionRouter
from aegis_cli.sensors.checkpoint import CheckpointSensor
from aegis_cli.sensors.config import SensorConfig
from aegis_cli.sensors.control import Controller
from aegis_cli.sensors.events import Action, SensorEvent, SensorStats, default_action, log, log_event
from aegis_cli.sensors.lockstep import Lockstep
from aegis_cli.sensors.queue import Suspicion, SuspicionQueue
from aegis_cli.sensors.verifier import verify_one

MAX_EVENTS = 1000  # the events a handle keeps (every one is logged and passed to the callbacks)
# the handle of each instrumented model, newest last (sensors.checkpoint() uses the newest); a handle holds
# its model weakly, so a model that is dropped without uninstrument() does not live on here
_HANDLES: weakref.WeakKeyDictionary[nn.Module, SensorHandle] = weakref.WeakKeyDictionary()


def _rank(config: SensorConfig) -> int:
    if config.rank is not None:
        return config.rank
    dist = torch.distributed
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


_IDENTITIES: dict[int, DeviceIdentity] = {}  # each GPU's identity by CUDA index, read once per process


def _cuda_device(index: int) -> Device:
    """A CUDA Device for one handle, with its GPU's identity read once per process: reading it (NVML,
    0.8 ms on the H200) is what making a Device costs, and each handle would pay it again inside its
    first checked step. The Device itself is not shared: its state (``poison``) and kernel choice
    (AEGIS_CUDA_KERNEL, read as it is made) are the handle's own."""
    dev = get_backend("cuda").device(index, identity=_IDENTITIES.get(index))
    _IDENTITIES.setdefault(index, dev.identity)
    return dev


def _put_back(ref: weakref.ref, inner) -> None:
    """Restore a module's checkpoint function; the handle holds the module weakly (as _HANDLES holds the model)."""
    m = ref()
    if m is not None:
        m._gradient_checkpointing_func = inner


class SensorHandle:
    """The sensors of one instrumented model. Call ``step()`` once per training step, after
    backward and before ``optimizer.step()`` (or pass the optimizer to ``instrument``)."""

    def __init__(self, model: nn.Module, config: SensorConfig):
        self._model, self.config = weakref.ref(model), config
        self.rank = _rank(config)
        self.stats = SensorStats()
        self.controller = Controller(config.sample_prob, config.overhead_budget, config.coverage_steps,
                                     headroom=config.raise_headroom, max_raise=config.max_raise, decay=config.decay,
                                     seed=config.seed)
        # the same checks in the same steps on every data-parallel rank (only the budget's figures can differ)
        self.lockstep = Lockstep.join(config.group) if config.lockstep and config.overhead_budget is not None else None
        self.queue = SuspicionQueue(config.queue_size, config.queue_bytes)
        self.fault_plan: FaultPlan | None = config.fault_plan()
        self.events: deque[SensorEvent] = deque(maxlen=MAX_EVENTS)
        self.listeners: list[Callable[[SensorEvent], Action | None]] = [config.on_event] if config.on_event else []
        self.step_index = 0
        self.sensing = True  # off while the verifier re-runs work
        self._pinned = 0  # > 0 inside a fingerprinted region: every GEMM on the checked kernel (sense.run_gemm)
        self.enqueued = False  # unsampled checked kernels launched since the last step boundary (sense.run_gemm)
        self.pinned_marks: list = []  # (device, CUDA event) after the last boundary's enqueued kernels (sense.settle_pinned)
        self.unread: list = []  # sampled launches whose comparisons are enqueued, not yet read (sense.resolve)
        self.unread_bytes = 0
        self.timed: list = []  # (key, sense.CheckTimer) of attention checks on CUDA, charged at the step boundary (sense.resolve)
        self.nondeterministic: set[str] = set()  # regions whose recompute cannot be compared bit for bit
        self.action = Action.CONTINUE  # the strongest action asked for since the last step()
        self._names = {id(m): name or "model" for name, m in model.named_modules()}
        self._devices: dict[int | None, Device] = {}  # by CUDA index; None: the CPU reference path
        self._plans: dict[str, FaultPlan | None] = {}
        self._restore: list[Callable[[], None]] = []
        self.unchecked: list[str] = []  # Linear subclasses with a forward of their own (quantised, LoRA …): left alone
        self._regions = 0
        self._saved = 0
        self._sense_step = 0.0
        self._t0 = time.perf_counter()
        self._first_bad: int | None = None  # the first step with a confirmed or dropped suspicion
        self._hook = None
        self.pending = Action.CONTINUE  # the action of the last step boundary run by the optimizer hook
        # this step's largest (normalised difference ÷ τ), flagged or not, and the last closed step's
        # summary: compact per-step statistics a loop (or an all-gather across ranks) can compare
        self.step_max_ratio = 0.0
        self.last_step: dict = {}
        self._at_step_start = (0, 0)

    @property
    def model(self) -> nn.Module | None:
        return self._model()

    # -- what the sensors ask of the handle ------------------------------------------------------
    def device_for(self, t: torch.Tensor) -> Device:
        """The Device whose checked GEMM runs work on ``t``: its own GPU, else the CPU reference path."""
        index = (t.device.index or 0) if self.config.device != "cpu" and t.device.type == "cuda" else None
        dev = self._devices.get(index)
        if dev is None:
            dev = self._devices[index] = get_backend("cpu").device(0) if index is None else _cuda_device(index)
        return dev

    def fault_for(self, device: Device) -> FaultPlan | None:
        ident = device.identity.id
        if ident not in self._plans:
            self._plans[ident] = self.fault_plan.for_device(ident) if self.fault_plan is not None else None
        return self._plans[ident]

    def module_name(self, obj) -> str | None:
        return self._names.get(id(obj)) if isinstance(obj, nn.Module) else None

    def next_region(self) -> int:
        self._regions += 1
        return self._regions - 1

    @property
    def pinned(self) -> bool:
        """Whether GEMMs must run the checked kernel whatever the coin says (a fingerprinted region)."""
        return self._pinned > 0

    @contextlib.contextmanager
    def pin(self):
        """Inside: every instrumented GEMM runs the checked kernel, sampled or not, so a region's
        forward, recompute and re-runs compute the same bits whatever was sampled."""
        self._pinned += 1
        try:
            yield
        finally:
            self._pinned -= 1

    def add_sense_time(self, seconds: float) -> None:
        self._sense_step += seconds

    def charge(self, key: str, seconds: float) -> None:
        """A check of operator ``key`` took ``seconds``: its controller's cost, and this step's sensing."""
        self.controller.spent(key, seconds)
        self.add_sense_time(seconds)

    @contextlib.contextmanager
    def sensing_time(self, device: Device, key: str):
        """Time one sampled check of operator ``key`` (``sense.CheckTimer``), as a GEMM check is timed:
        on CUDA by events around it, charged at the step boundary (``sense.resolve``) after waiting for
        its end event, the device never synchronised for it; on the CPU its wall time, charged at once."""
        timer = sense.CheckTimer(device)
        yield
        timer.stop()
        if timer.on_device:
            self.timed.append((key, timer))
        else:
            self.charge(key, timer.seconds())

    def count_check(self, key: str, ratio: float, clean: bool) -> None:
        """One check of operator ``key`` read, its largest normalised difference ``ratio`` in units of
        its τ: this step's largest so far, and with ``clean`` (finite inputs, nothing flagged) the
        run's and the operator's largest clean one."""
        self.stats.checked += 1
        self.step_max_ratio = max(self.step_max_ratio, ratio)
        if clean:
            self.stats.clean_max_ratio = max(self.stats.clean_max_ratio, ratio)
            self.controller.clean(key, ratio)

    def raise_suspicion(self, s: Suspicion) -> None:
        self.stats.raised += 1
        if not self.queue.push(s):
            self.drop(s.step, s.op, s.site, s.checks[0])

    def suspect(self, kind: str, op: str, site: str, checks: list[str], max_value: float, size: int,
                context: Callable[[], Any]) -> None:
        """Raise a suspicion of this step holding ``size`` bytes, its context made by ``context()``
        (the copies): dropped before anything is copied when the queue has no room for it."""
        if not self.queue.fits(size):
            self.stats.raised += 1
            self.drop(self.step_index, op, site, checks[0])
            return
        self.raise_suspicion(Suspicion(kind, op, site, self.step_index, checks, max_value, context()))

    def unverifiable(self, op: str, site: str, check: str, why: str) -> None:
        """A flag that cannot be verified: counted, and the step is no longer known clean."""
        self.stats.raised += 1
        self.stats.unverified += 1
        self._mark_bad(self.step_index)
        self.emit(SensorEvent("unverified", self.step_index, op, site, check, "SUSPECT", why, rank=self.rank))

    def drop(self, step: int, op: str, site: str, check: str) -> None:
        """A suspicion the queue has no room for: counted, and the step is no longer known clean."""
        self.stats.dropped += 1
        self._mark_bad(step)
        self.emit(SensorEvent("dropped", step, op, site, check, "SUSPECT",
                              f"the queue is full ({len(self.queue)} waiting, {self.queue.bytes} bytes); raise queue_size or "
                              "queue_bytes, or verify more per step (verify_budget, min_verify)", rank=self.rank))

    def emit(self, event: SensorEvent) -> None:
        self.events.append(event)
        log_event(event)
        asked = [a for a in (fn(event) for fn in self.listeners) if a is not None]  # None: no opinion
        self.action = max(self.action, *asked) if asked else max(self.action, default_action(event))

    def subscribe(self, fn: Callable[[SensorEvent], Action | None]) -> None:
        """Call ``fn`` with every event from now on (besides config.on_event)."""
        self.listeners.append(fn)

    def _mark_bad(self, step: int) -> None:
        self._first_bad = step if self._first_bad is None else min(self._first_bad, step)

    def next_bundle_name(self, step: int, name: str, layout: str) -> str:
        """A new bundle's file name (without .aegis): step, rank, a running number, layer, layout."""
        self._saved += 1
        return f"step{step:07d}-rank{self.rank}-{self._saved:04d}-{name}-{layout}"

    # -- the step boundary ----------------------------------------------------------------------
    def step(self) -> Action:
        """End a step: verify queued suspicions within the verifier's budget, adapt sampling and
        thresholds, and return the strongest action asked for (then reset to CONTINUE)."""
        sense.resolve(self)  # this step's comparisons: waits for each one's end event, never drains the device
        sense.settle_pinned(self, list(self._devices.values()))  # kernels pinned regions only enqueued: a step late, no drain
        step_s = time.perf_counter() - self._t0
        base = max(step_s - self._sense_step, 0.0)
        verify_s = self._verify(self.config.verify_budget * base, self.config.min_verify)
        agreed = (base, None) if self.lockstep is None else self.lockstep.agree(self.step_index, base, self.controller.figures())
        if agreed is None:  # between the ranks' agreements: the probabilities stay
            self.controller.end_step(base, share=False)
        else:
            self.controller.end_step(*agreed)
        self.stats.steps += 1
        self.stats.step_s += step_s + verify_s
        self.stats.sense_s += self._sense_step
        self.stats.verify_s += verify_s
        checked, raised = self.stats.checked, self.stats.raised
        self.last_step = {"step": self.step_index, "checked": checked - self._at_step_start[0],
                          "raised": raised - self._at_step_start[1], "max_ratio": self.step_max_ratio,
                          "seconds": step_s, "sense_s": self._sense_step, "verify_s": verify_s}
        self._at_step_start, self.step_max_ratio = (checked, raised), 0.0
        self._sense_step, self._regions = 0.0, 0
        self.step_index += 1
        action, self.action = self.action, Action.CONTINUE
        self._t0 = time.perf_counter()
        return action

    def flush(self) -> Action:
        """Verify everything still queued, whatever the budget (the end of training, a test)."""
        sense.resolve(self)
        sense.settle_pinned(self, list(self._devices.values()), drain=True)
        self.stats.verify_s += self._verify(float("inf"), len(self.queue))
        action, self.action = self.action, Action.CONTINUE
        return action

    def _verify(self, budget_s: float, at_least: int) -> float:
        t0 = time.perf_counter()
        done = 0
        while len(self.queue) and (done < at_least or time.perf_counter() - t0 < budget_s):
            s = self.queue.pop()
            self.sensing = False
            try:
                verify_one(self, s)
            finally:
                self.sensing = True
            done += 1
        return time.perf_counter() - t0

    @property
    def last_clean_step(self) -> int | None:
        """The latest completed step whose suspicions, and those of every step before it, were all
        verified and cleared (none confirmed, dropped, unverified or waiting); None when there is none yet."""
        last = self.step_index - 1
        for s in (self._first_bad, self.queue.oldest_step()):
            if s is not None:
                last = min(last, s - 1)
        return last if last >= 0 else None

    def stats_dict(self) -> dict:
        """Every counter, the queue, confirmation latency, and each operator's sampling
        probability and threshold state."""
        injected = {"injected": self.fault_plan.describe(), "never_fired": self.fault_plan.never_fired()} if self.fault_plan else {}
        return {**self.stats.to_dict(), **injected, "queue": self.queue.to_dict(), "last_clean_step": self.last_clean_step,
                "rank": self.rank, "last_step": dict(self.last_step), "unchecked_modules": list(self.unchecked),
                "operators": self.controller.to_dict()}

    # -- instrumenting ----------------------------------------------------------------------------
    def _attach(self, optimizer) -> None:
        if self.config.attention:  # SDPA is one global function: one handle routes it at a time
            if isinstance(torch.nn.functional.scaled_dot_product_attention, AttentionRouter):
                raise ConfigError("scaled_dot_product_attention is already routed by another instrumented model")
            router = AttentionRouter(self)
            router.install()
            self._restore.append(router.restore)
        for name, m in self.model.named_modules():
            if isinstance(m, nn.Linear) and linear.patchable(m):
                self._restore.append(linear.patch(self, m, name or "model"))
            elif isinstance(m, nn.Linear):
                self.unchecked.append(name or "model")
            inner = m.__dict__.get("_gradient_checkpointing_func")
            if inner is not None:  # the Hugging Face convention: a layer checkpoints through this attribute
                m._gradient_checkpointing_func = CheckpointSensor(self, inner, name or "model")
                self._restore.append(functools.partial(_put_back, weakref.ref(m), inner))
        if optimizer is not None:
            self._hook = optimizer.register_step_pre_hook(lambda *_: self._optimizer_step())

    def _optimizer_step(self) -> None:
        self.pending = self.step()

    def close(self) -> None:
        """Verify what is queued, then restore the model exactly (``uninstrument``)."""
        if self.model is not None:
            uninstrument(self.model)


def instrument(model: nn.Module, config: SensorConfig | None = None, *, optimizer: torch.optim.Optimizer | None = None) -> SensorHandle:
    """Route every ``nn.Linear`` of ``model`` (forward, dgrad, wgrad) through checked GEMMs, and
    fingerprint its checkpointed regions; returns the handle. With ``optimizer``, the step boundary
    runs in a pre-hook of ``optimizer.step()`` and its action is left in ``handle.pending``."""
    if model in _HANDLES:
        raise ConfigError("this model is already instrumented; uninstrument it first")
    h = SensorHandle(model, config or SensorConfig())
    h._attach(optimizer)
    _HANDLES[model] = h
    return h


def uninstrument(model: nn.Module) -> SensorHandle | None:
    """Verify what is still queued and restore ``model`` exactly as it was; returns its handle
    (None if it was not instrumented)."""
    h = _HANDLES.pop(model, None)
    if h is None:
        return None
    try:
        h.flush()
        missed = h.fault_plan.never_fired() if h.fault_plan is not None else []
        if missed:  # a self-test whose fault never landed proves nothing: say so
            log.warning("aegis sensors: injected fault(s) never fired: %s", "; ".join(missed))
    finally:
        for restore in reversed(h._restore):
            restore()
        h._restore.clear()
        if h._hook is not None:
            h._hook.remove()
    return h


def checkpoint(function, *args, use_reentrant: bool = False, **kwargs):
    """``torch.utils.checkpoint.checkpoint`` with the recompute sensor of the newest instrumented
    model (plain checkpointing when none is): for code that calls checkpoint itself."""
    inner = torch_checkpoint.checkpoint
    handles = list(_HANDLES.values())
    if not handles:
        return inner(function, *args, use_reentrant=use_reentrant, **kwargs)
    return CheckpointSensor(handles[-1], inner, "")(function, *args, use_reentrant=use_reentrant, **kwargs)
