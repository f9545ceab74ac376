"""Training-state guards (docs/training-guards.md): bound checks on Adam's moments and on
BatchNorm running variances after every step, and recovery by re-execution.

    guard = TrainingGuard(model, optimizer, step_fn)   # step_fn(model, optimizer, batch) -> loss
    for batch in loader:
        loss = guard.step(batch)

Before each step the guard snapshots parameters, buffers, optimizer state (and any
``extra_state`` such as an LR scheduler) into one of two rotating buffers, and keeps the batch
and the RNG states (torch's CPU generator, every initialised CUDA generator, any
``generators`` given). An optimizer step pre-hook keeps a running max of |grad| per
parameter tensor (and of |θ| under Adam's coupled weight decay); a BatchNorm forward pre-hook
keeps per-channel extremes of the batch variances. After the step, checks/training.py
compares every moment and running variance with its bound. On a violation the guard restores
the snapshot from two steps back, re-executes those steps with the same batches and RNG states
and checks again: clean → the event is ``recovered`` and training goes on from bit-identical
state; violated again ``retries`` times → ``reproduced``, and TrainingStateError is raised
for the loop to hand off (sensors/handoff.py).
"""

from __future__ import annotations

import copy
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from aegis_cli.checks import training as bounds
from aegis_cli.faults.spec import FaultPlan, parse_spec
from aegis_cli.faults.training import state_faults
from aegis_cli.ops.errors import AegisError, ConfigError
from aegis_cli.ops.verdict import Evidence
from aegis_cli.sensors.collective import any_rank
from aegis_cli.sensors.queue import nbytes
from aegis_cli.sensors.snapshot import Snapshot, rng_for, rng_state, set_rng_state, to_device

log = logging.getLogger("aegis.sensors.guards")
StepFn = Callable[[torch.nn.Module, torch.optim.Optimizer, Any], Any]
_BN = torch.nn.modules.batchnorm._BatchNorm


@dataclass
class GuardEvent:
    """A broken training-state bound and what the guard did about it."""

    step: int  # the step after which the bound broke
    violations: list[bounds.Violation]
    outcome: str = ""  # "recovered" (clean after re-execution) or "reproduced"
    restored_to: int = 0  # the state restored: after this step
    replayed: list[int] = field(default_factory=list)  # steps re-executed (last attempt)
    attempts: int = 0
    seconds: float = 0.0
    device: str = ""
    injected: list[dict] = field(default_factory=list)  # self-test faults that fired at this step

    def evidence(self) -> list[Evidence]:
        """The violations as Evidence (checks/training.py), for reports and the sensors' events."""
        again = self.attempts if self.outcome == "reproduced" else 0
        return [bounds.evidence(v, reruns=self.attempts, reproduced=again, injected=self.injected) for v in self.violations]

    def to_dict(self) -> dict:
        d = dict(self.__dict__)
        d["violations"] = [v.to_dict() for v in self.violations]
        return d


def _describe(violations: list[bounds.Violation]) -> str:
    if not violations:
        return "a violation on another rank"
    v = violations[0]
    return f"{v.check} on {v.tensor} ({v.value:.3g} vs bound {v.bound:.3g})"


class TrainingStateError(AegisError):
    """A training-state bound broke again after re-execution from a clean snapshot."""

    def __init__(self, event: GuardEvent):
        super().__init__(f"training state: {_describe(event.violations)} at step {event.step} "
                         f"reproduced after {event.attempts} re-execution(s)")
        self.event = event


def _to_host(rows: list[torch.Tensor]) -> list[list[float]]:
    """Rows of small fp64 tensors as Python lists, one stack and copy per device."""
    out: list[list[float] | None] = [None] * len(rows)
    by_device: dict[torch.device, list[int]] = {}
    for k, r in enumerate(rows):
        by_device.setdefault(r.device, []).append(k)
    for idx in by_device.values():
        for k, vals in zip(idx, torch.stack([rows[k] for k in idx]).cpu().tolist(), strict=True):
            out[k] = vals
    return out


class TrainingGuard:
    """Guards one model and its torch.optim.Adam/AdamW optimizer; see the module doc."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, step_fn: StepFn, *,
                 extra_state: Iterable[Any] = (), generators: Iterable[torch.Generator] = (),
                 snapshot_device: str | torch.device | None = None, retries: int = 1,
                 callback: Callable[[GuardEvent], None] | None = None, inject: str | FaultPlan | None = None,
                 device_id: str | None = None, group: Any = None, sync: bool | None = None):
        if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):  # AdamW subclasses Adam only in recent torch
            raise ConfigError(f"TrainingGuard bounds torch.optim.Adam and AdamW; got {type(optimizer).__name__}")
        for g in optimizer.param_groups:
            b1, b2 = (float(b) for b in g["betas"])
            try:
                bounds.check_betas(b1, b2)
            except ValueError as exc:
                raise ConfigError(f"TrainingGuard: {exc}") from None
        if retries < 1:
            raise ConfigError("TrainingGuard: retries must be at least 1")
        self.model, self.optimizer, self.step_fn = model, optimizer, step_fn
        self.extra_state = list(extra_state)
        self.generators = list(generators)
        self.snapshot_device = torch.device(snapshot_device) if snapshot_device is not None else None
        self.retries, self.callback = retries, callback
        self.plan = FaultPlan(parse_spec(inject, training=True)) if isinstance(inject, str) else inject
        self.params = [p for g in optimizer.param_groups for p in g["params"]]
        self._groups = [g for g in optimizer.param_groups for _ in g["params"]]
        first = self.params[0] if self.params else None
        self.device_id = device_id or (f"{first.device.type}:{first.device.index or 0}" if first is not None else "cpu:0")
        self.param_names = self._names()
        # SyncBatchNorm's variance spans every rank's batch, which this rank's hook does not see
        self.norms = {n: m for n, m in model.named_modules()
                      if isinstance(m, _BN) and m.track_running_stats and not isinstance(m, torch.nn.SyncBatchNorm)}
        # data parallel: every rank must restore and re-execute together (the backward's
        # collectives), so the ranks agree on "any violation anywhere" after every check
        dist = torch.distributed
        self.group = group
        self.sync = sync if sync is not None else bool(dist.is_available() and dist.is_initialized()
                                                       and dist.get_world_size(group) > 1)
        self.steps = 0  # steps completed (and checked) so far
        self.last_clean_step = 0
        self.events: list[GuardEvent] = []
        self.stats = {"steps": 0, "checks": 0, "check_s": 0.0, "snapshot_s": 0.0, "replayed_steps": 0}
        self._ring = [Snapshot(), Snapshot()]
        self._history: deque = deque(maxlen=2)  # (step, batch, rng state) of the last two steps
        self._trackers: dict[str, torch.Tensor] = {}
        self._seed_trackers()
        self._hooks: list = []
        self._attach()

    def _attach(self) -> None:
        self._hooks = [self.optimizer.register_step_pre_hook(self._pre_step)]
        self._hooks += [m.register_forward_pre_hook(self._norm_hook(n)) for n, m in self.norms.items()]

    # -- trackers ------------------------------------------------------------------------
    def _names(self) -> list[str]:
        by_id = {id(p): n for n, p in self.model.named_parameters()}
        return [by_id.get(id(p), f"param{i}") for i, p in enumerate(self.params)]

    @torch.no_grad()
    def _seed_trackers(self) -> None:
        """A guard attached mid-run starts from the state it finds: each moment is a weighted sum
        of an unseen history whose largest |g| it bounds from below (checks/training.py)."""
        for i, p in enumerate(self.params):
            g = torch.zeros((), dtype=torch.float64, device=p.device)
            st = self.optimizer.state.get(p, {})
            t = int(st["step"]) if "step" in st else 0
            if t > 0 and p.numel():
                b1, b2 = (float(b) for b in self._groups[i]["betas"])
                dt = st["exp_avg"].dtype
                g = torch.maximum(st["exp_avg"].abs().max().double() / bounds.ema_gain(b1, t, dt),
                                  (st["exp_avg_sq"].max().double() / bounds.ema_gain(b2, t, dt)).sqrt())
            self._trackers[f"g{i}"] = g
            self._trackers[f"p{i}"] = torch.zeros((), dtype=torch.float64, device=p.device)
        for n, m in self.norms.items():  # the running variance now is one end of its convex hull
            for key, stat in (("v", m.running_var), ("m", m.running_mean)):
                self._trackers[f"{key}min:{n}"] = stat.detach().double().clone()
                self._trackers[f"{key}max:{n}"] = stat.detach().double().clone()

    @torch.no_grad()
    def _pre_step(self, optimizer, args, kwargs) -> None:
        """Before each update: the running max of |g| (and |θ| for coupled decay) per tensor."""
        for i, p in enumerate(self.params):
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise ConfigError(f"TrainingGuard: sparse gradient on {self.param_names[i]} is not bounded")
            g = self._trackers[f"g{i}"]
            torch.maximum(g, torch.linalg.vector_norm(p.grad, ord=float("inf")).double(), out=g)
            grp = self._groups[i]
            if grp["weight_decay"] and not grp.get("decoupled_weight_decay", False):
                pm = self._trackers[f"p{i}"]
                torch.maximum(pm, torch.linalg.vector_norm(p, ord=float("inf")).double(), out=pm)

    def _norm_hook(self, name: str):
        @torch.no_grad()
        def hook(module, inputs) -> None:
            if not module.training:
                return
            x = inputs[0].detach()
            dims = [0, *range(2, x.dim())]
            var, mean = torch.var_mean(x.float(), dim=dims, correction=1)  # what updates the running stats
            for key, val in (("v", var.double()), ("m", mean.double())):
                lo, hi = self._trackers[f"{key}min:{name}"], self._trackers[f"{key}max:{name}"]
                torch.minimum(lo, val, out=lo)
                torch.maximum(hi, val, out=hi)
        return hook

    # -- checks ----------------------------------------------------------------------------
    @torch.no_grad()
    def check(self, step: int) -> list[bounds.Violation]:
        """Every bound on the current state (after ``step``)."""
        t0 = time.perf_counter()
        out: list[bounds.Violation] = []
        todo = []  # (index, state, step, betas, summary) per parameter with moments
        live = [(i, st) for i, p in enumerate(self.params) if (st := self.optimizer.state.get(p)) and "exp_avg" in st]
        # fused or capturable Adam keeps its step count on the device: one transfer per device, not one per tensor
        steps = [int(r[0]) for r in _to_host([torch.as_tensor(st["step"], dtype=torch.float64).reshape(1) for _, st in live])]
        for (i, st), t in zip(live, steps, strict=True):
            grp = self._groups[i]
            b1, b2 = (float(b) for b in grp["betas"])
            vmax = st.get("max_exp_avg_sq") if grp.get("amsgrad") else None
            row = torch.cat([bounds.adam_summary(st["exp_avg"], st["exp_avg_sq"], t, b1, b2, vmax),
                             self._trackers[f"g{i}"].reshape(1), self._trackers[f"p{i}"].reshape(1)])
            todo.append((i, st, t, (b1, b2), vmax, row))
        rows = _to_host([r for *_, r in todo])  # one transfer per device, not one per tensor
        for (i, st, t, (b1, b2), vmax, _), row in zip(todo, rows, strict=True):
            grp = self._groups[i]
            dt = st["exp_avg"].dtype
            gb = bounds.effective_grad_bound(row[6], row[7], float(grp["weight_decay"]),
                                             bool(grp.get("decoupled_weight_decay", False)), self.params[i].dtype)
            if not bounds.adam_clear(row[:6], t, gb, b1, b2, dt):  # look closer: which bound, which element
                out += bounds.check_adam(self.param_names[i], t, st["exp_avg"], st["exp_avg_sq"], gb, b1, b2, vmax)
        if self.sync and self.norms:
            self._union_norm_hulls()
        for n, m in self.norms.items():
            tr, batches = self._trackers, int(m.num_batches_tracked)
            lo, hi = bounds.running_var_bounds(tr[f"vmin:{n}"], tr[f"vmax:{n}"], m.momentum, batches, m.running_var.dtype)
            out += bounds.check_running_stat(n, "running_var", step, m.running_var, lo, hi)
            lo, hi = bounds.running_mean_bounds(tr[f"mmin:{n}"], tr[f"mmax:{n}"], tr[f"vmax:{n}"], m.momentum, batches,
                                                m.running_mean.dtype)
            out += bounds.check_running_stat(n, "running_mean", step, m.running_mean, lo, hi)
        self.stats["checks"] += 1
        self.stats["check_s"] += time.perf_counter() - t0
        return out

    # -- snapshots ---------------------------------------------------------------------------
    def _state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        tensors = {f"param/{i}": p.detach() for i, p in enumerate(self.params)}
        tensors.update({f"buffer/{n}": b for n, b in self.model.named_buffers()})
        tensors.update({f"tracker/{k}": t for k, t in self._trackers.items()})
        values: dict[str, Any] = {"groups": [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups],
                                  "extra": [x.state_dict() for x in self.extra_state]}
        for i, p in enumerate(self.params):
            for k, v in self.optimizer.state.get(p, {}).items():
                if torch.is_tensor(v):
                    tensors[f"opt/{i}/{k}"] = v
                else:
                    values[f"opt/{i}/{k}"] = v
        return tensors, values

    def _save(self, step: int) -> None:
        t0 = time.perf_counter()
        tensors, values = self._state()
        self._ring[step % 2].save(step, tensors, values, self.snapshot_device)
        self.stats["snapshot_s"] += time.perf_counter() - t0

    @torch.no_grad()
    def _restore(self, snap: Snapshot) -> None:
        live, _ = self._state()
        for k, saved in snap.tensors.items():
            if k.startswith("opt/"):
                continue
            live[k].copy_(saved)
        for g, saved in zip(self.optimizer.param_groups, snap.values["groups"], strict=True):
            g.update(copy.deepcopy(saved))
        for x, saved in zip(self.extra_state, snap.values["extra"], strict=True):
            x.load_state_dict(copy.deepcopy(saved))
        for i, p in enumerate(self.params):  # optimizer state as it was, created lazily or not yet
            keys = {k.split("/", 2)[2] for k in (*snap.tensors, *snap.values) if k.startswith(f"opt/{i}/")}
            if not keys:
                self.optimizer.state.pop(p, None)
                continue
            st = self.optimizer.state[p]
            for k in list(st):
                if k not in keys:
                    del st[k]
            for k in keys:
                saved = snap.tensors.get(f"opt/{i}/{k}")
                if saved is None:
                    st[k] = copy.deepcopy(snap.values[f"opt/{i}/{k}"])
                elif torch.is_tensor(st.get(k)) and st[k].shape == saved.shape and st[k].dtype == saved.dtype:
                    st[k].copy_(saved)
                else:
                    st[k] = saved.to(snap.devices[f"opt/{i}/{k}"], copy=True)

    def memory_bytes(self) -> dict:
        """Bytes held: the two snapshots, the two kept batches aside (they are references)."""
        snaps = sum(s.nbytes() for s in self._ring)
        trackers = nbytes(self._trackers.values())
        return {"snapshots": snaps, "trackers": trackers, "snapshot_device": str(self.snapshot_device or "same")}

    # -- the step --------------------------------------------------------------------------
    def _run(self, step: int, batch: Any, rng: dict, first: bool) -> tuple[Any, list[bounds.Violation], list[dict]]:
        set_rng_state(rng, self.generators)
        out = self.step_fn(self.model, self.optimizer, batch)
        injected = state_faults(self.plan, step, first, self._state_by_name(), self.device_id)
        return out, self.check(step), injected

    def _state_by_name(self) -> dict[str, dict[str, torch.Tensor]]:
        named = {self.param_names[i]: {k: v for k, v in self.optimizer.state.get(p, {}).items() if torch.is_tensor(v)}
                 for i, p in enumerate(self.params)}
        named.update({n: {"running_var": m.running_var, "running_mean": m.running_mean} for n, m in self.norms.items()})
        return named

    def step(self, batch: Any) -> Any:
        """One guarded training step: returns what ``step_fn`` returned (after a recovery, what
        its clean re-execution returned)."""
        t = self.steps + 1
        self._save(t - 1)  # the state before step t
        rng = rng_state(self.generators)
        self._history.append((t, batch, rng))
        out, violations, injected = self._run(t, batch, rng, first=True)
        if self._agree(violations):
            out = self._recover(t, violations, injected)
        self.steps = self.last_clean_step = t
        self.stats["steps"] += 1
        return out

    def _recover(self, t: int, violations: list[bounds.Violation], injected: list[dict]) -> Any:
        t0 = time.perf_counter()
        ev = GuardEvent(step=t, violations=violations, device=self.device_id, injected=injected)
        log.warning("aegis guard: %s at step %d: restoring and re-executing", _describe(violations), t)
        out, bad = None, True
        while bad and ev.attempts < self.retries:
            ev.attempts += 1
            out, again, bad, ev.restored_to, ev.replayed = self.reexecute(t)
        ev.outcome = "reproduced" if bad else "recovered"
        ev.seconds = time.perf_counter() - t0
        if bad:
            ev.violations = again
        self.events.append(ev)
        log.log(logging.ERROR if bad else logging.WARNING, "aegis guard: step %d %s after %d re-execution(s)",
                t, ev.outcome, ev.attempts)
        if self.callback is not None:
            self.callback(ev)
        if bad:
            raise TrainingStateError(ev)
        return out

    @torch.no_grad()
    def _union_norm_hulls(self) -> None:
        """Data parallel: DDP broadcasts rank 0's buffers before each forward, so a rank's running
        statistics mix every rank's batches. Their hull is the union of the ranks' hulls: one
        all-reduce (max of the maxima and of the negated minima)."""
        keys = [f"{k}:{n}" for n in self.norms for k in ("vmin", "vmax", "mmin", "mmax")]
        flat = torch.cat([(-self._trackers[k] if "min:" in k else self._trackers[k]).reshape(-1) for k in keys])
        torch.distributed.all_reduce(flat, op=torch.distributed.ReduceOp.MAX, group=self.group)
        at = 0
        for k in keys:
            t = self._trackers[k]
            part = flat[at:at + t.numel()].view_as(t)
            t.copy_(-part if "min:" in k else part)
            at += t.numel()

    def _agree(self, violations: list[bounds.Violation]) -> bool:
        """Whether any rank (this one alone without ``sync``) saw a violation: one all-reduce."""
        return any_rank(bool(violations), self.group) if self.sync else bool(violations)

    def reexecute(self, t: int) -> tuple[Any, list[bounds.Violation], bool, int, list[int]]:
        """Restore the oldest snapshot (the state two steps before ``t``'s end, or the first one)
        and re-execute up to step ``t`` with the kept batches and RNG states. Returns (the last
        step's output, this rank's violations after the first step that broke a bound on any
        rank or after step t, whether any rank's did, the step restored to, the steps re-executed)."""
        snap = min((s for s in self._ring if 0 <= s.step < t), key=lambda s: s.step)
        self._restore(snap)
        kept = {s: (b, r) for s, b, r in self._history}
        out, violations, bad, done = None, [], False, []
        for j in range(snap.step + 1, t + 1):
            if j > snap.step + 1:
                self._save(j - 1)  # re-executed, checked: the clean state before step j
            out, violations, _ = self._run(j, *kept[j], first=False)
            done.append(j)
            self.stats["replayed_steps"] += 1
            bad = self._agree(violations)
            if bad:
                break
        return out, violations, bad, snap.step, done

    def rerun_on(self, device: str | torch.device, device_id: str, step: int) -> list[bounds.Violation]:
        """Re-execute the kept steps up to ``step`` on a copy of the model and optimizer on
        ``device`` (``device_id`` names it for the fault plan's ``device=``), from the oldest
        snapshot, with the same batches, RNG states (this device's CUDA generator state goes to
        the other's) and grad-history trackers. Returns the violations there, [] if clean. The
        guarded model is left restored to that snapshot (the last state known clean)."""
        device = torch.device(device)
        snap = min((s for s in self._ring if 0 <= s.step < step), key=lambda s: s.step)
        self._restore(snap)
        self.close()  # deepcopy would carry this guard's hooks into the copy
        try:
            model = copy.deepcopy(self.model).to(device)
        finally:
            self._attach()
        index = {id(p): i for i, p in enumerate(self.model.parameters())}
        copies = list(model.parameters())
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [copies[index[id(p)]] for p in g["params"]]}
                  for g in self.optimizer.param_groups]
        optimizer = type(self.optimizer)(groups)
        optimizer.load_state_dict(self.optimizer.state_dict())  # moves the moments to the copy's device
        # one rank's copy, outside the process group: a collective there would wait for ranks that never join
        other = TrainingGuard(model, optimizer, self.step_fn, generators=self.generators, inject=self.plan, device_id=device_id,
                              sync=False)
        try:
            with torch.no_grad():
                for k, t in other._trackers.items():
                    t.copy_(snap.tensors[f"tracker/{k}"])
            src = self.params[0].device if self.params else torch.device("cpu")
            for j, batch, rng in self._history:
                if snap.step < j <= step:
                    _, violations, _ = other._run(j, to_device(batch, device), rng_for(rng, src, device), first=False)
                    if violations:
                        return violations
            return []
        finally:
            other.close()

    def close(self) -> None:
        """Remove the hooks; the model and optimizer are left as they are."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
