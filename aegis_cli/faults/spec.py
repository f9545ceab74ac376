"""Fault models for self-tests and ``aegis scan --inject`` (docs/design.md §9).

Grammar (docs/fault-injection.md)::

    SPEC  := FAULT (';' FAULT)*
    FAULT := MODEL [':' KEY '=' VALUE (',' KEY '=' VALUE)*]

Each fault acts where the hardware fault it models would act:
- target=acc  the fp32 accumulator, before the fused checksums (a matrix-unit fault);
- target=out  the bf16 output after the epilogue (a store-path fault; checksums don't see it);
- target=a|b  an operand tile as the matrix unit read it (the reference reads global memory,
              so the error spreads along a row or column of C and the checksum sees it);
- target=mem  a tensor a probe holds between writing and re-reading or comparing it (memory
              probe buffers, repeated outputs of the determinism, golden and cross-device
              probes): ``memflip`` flips stored bits, ``swap`` exchanges two stored elements.
              Only those probes apply it (docs/fingerprints.md); the GEMM backends never see it.
- target=attn.STAGE  one fp32 value of a checked-attention stage (ops/attention.py STAGES:
              load_q, scores, softmax, pv, lse in the forward; recompute_p, dp, dv, dk, dq in
              the backward), before any fused sum reads it: ``bitflip`` and ``mask`` XOR its
              bits, ``perturb`` adds ``r`` to it; ``index=`` pins the flat index, else it is drawn
              (docs/attention.md §5). Only the attention probe applies them.
A fault is permanent by default (fires on every launch, at positions fixed by its seed);
``prob=p`` makes it intermittent. The backend calls ``FaultPlan`` at each stage.
"""

from __future__ import annotations

import dataclasses
import zlib
from dataclasses import dataclass, field

import numpy as np

from aegis_cli.ops.attention import STAGES as ATTENTION_STAGES
from aegis_cli.ops.case import op_site
from aegis_cli.ops.errors import InjectSpecError

ATTN_TARGETS = {f"attn.{s}" for s in ATTENTION_STAGES}
MODELS = {
    # model: (allowed keys beyond the common ones, allowed targets)
    "bitflip": ({"bit", "count", "row", "col", "index"}, {"acc", "out", "a", "b"} | ATTN_TARGETS),
    "mask": ({"mask", "count", "row", "col", "index"}, {"acc", "out", "a", "b"} | ATTN_TARGETS),
    "stuck-lane": ({"mask", "stride", "offset"}, {"acc", "out"}),
    "replace": ({"span", "value", "row", "col"}, {"acc", "out", "a", "b"}),
    "perturb": ({"rate", "r", "index"}, {"acc"} | ATTN_TARGETS),
    "tile": ({"mode", "tile", "every", "sm", "value", "kstep"}, {"acc"}),
    "row": ({"mode", "row", "value"}, {"acc"}),
    "memflip": ({"bit", "count", "index"}, {"mem"}),
    "swap": ({"count", "index"}, {"mem"}),
}
DEFAULT_TARGET = {"memflip": "mem", "swap": "mem"}  # every other model defaults to acc
COMMON_KEYS = {"target", "prob", "seed", "device", "op"}
# Test hooks for fleet sweeps, applied by the per-device sweep worker (aegis_cli/fleet/worker.py)
# before it scans, never by `aegis scan` (parse_spec rejects them unless worker=True):
#   hang:seconds=N   the worker sleeps N seconds (a GPU that hangs its worker); when=replay: after
#                    its scan, before it replays the sweep's vTasks
#   crash:signal=S   the worker kills itself with signal S, default 9 (a worker that dies)
WORKER_MODELS = {"hang": {"seconds", "device", "when"}, "crash": {"signal", "device"}}
# Training-state faults (docs/training-guards.md): ``stateflip`` flips bits of an optimizer
# moment or a normalisation statistic right after a training step's update, as a fault in the
# optimizer's or the layer's arithmetic would leave it. Only the training guard applies them
# (faults/training.py); parse_spec refuses them elsewhere (training=True accepts them).
#   target=exp_avg|exp_avg_sq|max_exp_avg_sq (Adam's moments), running_var|running_mean
#   step=N     after the update of step N, its first execution only (a transient fault); without
#              step=, after every update (prob= draws per update)
#   persist=1  with step=N: after every execution of every step ≥ N, re-executions included
#   op=TEXT    only parameters (Adam) or modules (BatchNorm) whose name contains TEXT
TRAINING_MODELS = {"stateflip": ({"bit", "count", "index", "step", "persist"},
                                 {"exp_avg", "exp_avg_sq", "max_exp_avg_sq", "running_var", "running_mean"})}
MODELS.update(TRAINING_MODELS)
DEFAULT_TARGET["stateflip"] = "exp_avg_sq"
BIT_CLASSES = ("sign", "exp", "mant", "hi-mant", "lo-mant")
TILE_MODES = ("zero", "stuck", "shift", "skipk")
SPANS = ("1", "16", "64", "random")
VALUES = ("flip", "random", "copy", "zero")
KSTEP = 64  # the k-block a skipped-k-step fault drops (the kernels' k tile)


@dataclass(frozen=True)
class FaultSpec:
    model: str
    params: dict[str, str] = field(default_factory=dict)

    @property
    def target(self) -> str:
        return self.params.get("target", DEFAULT_TARGET.get(self.model, "acc"))

    @property
    def prob(self) -> float:
        return float(self.params.get("prob", "1"))

    @property
    def seed(self) -> int:
        return int(self.params.get("seed", "0"), 0)

    def get(self, key: str, default: str | None = None) -> str | None:
        return self.params.get(key, default)

    def as_int(self, key: str, default: str | None = None) -> int:
        """An integer parameter, read as the grammar checks it (0x…, 0o…, 0b… allowed)."""
        return int(self.params.get(key, default), 0)

    def __str__(self) -> str:
        kv = ",".join(f"{k}={v}" for k, v in self.params.items())
        return f"{self.model}:{kv}" if kv else self.model

    def applies_to(self, device_id: str, op: str) -> bool:
        dev = self.params.get("device")
        sub = self.params.get("op")
        return (dev is None or dev == device_id) and (sub is None or sub in op)


# Upper bounds of integer keys: counts become array sizes, SM ids a C int in the kernel
# parameters, everything else an int64 in numpy (row, col, offset, ... are taken modulo the
# GEMM's extent).
_INT_MAX = {"count": 1 << 24, "sm": (1 << 31) - 1, "mask": (1 << 64) - 1}


def _check_int(spec: str, key: str, value: str, lo: int = 0) -> None:
    try:
        v = int(value, 0)
    except ValueError:
        raise InjectSpecError(f"--inject {spec!r}: {key}={value!r} is not an integer") from None
    hi = _INT_MAX.get(key, 1 << 62)
    if not lo <= v <= hi:
        shown = f"{hi:#x}" if key == "mask" else hi  # a mask reads as bits
        raise InjectSpecError(f"--inject {spec!r}: {key}={value} must lie in [{lo}, {shown}]")


def _check_float(spec: str, key: str, value: str, lo: float, hi: float) -> None:
    try:
        v = float(value)
    except ValueError:
        raise InjectSpecError(f"--inject {spec!r}: {key}={value!r} is not a number") from None
    if not lo <= v <= hi:
        raise InjectSpecError(f"--inject {spec!r}: {key}={value} must lie in [{lo}, {hi}]")


def _validate(text: str, f: FaultSpec) -> None:
    extra, targets = MODELS[f.model]
    for key, value in f.params.items():
        if key not in extra | COMMON_KEYS:
            allowed = ", ".join(sorted(extra | COMMON_KEYS))
            raise InjectSpecError(f"--inject {text!r}: unknown key {key!r} for {f.model} (allowed: {allowed})")
        if value == "":
            raise InjectSpecError(f"--inject {text!r}: {key} has no value")
    if f.target not in targets:
        raise InjectSpecError(f"--inject {text!r}: target={f.target} not valid for {f.model} (valid: {', '.join(sorted(targets))})")
    p = f.params
    _validate_attention(text, f)
    for key in ("count", "row", "col", "stride", "offset", "every", "sm", "seed", "kstep", "index"):
        if key in p:
            _check_int(text, key, p[key], lo=1 if key in ("count", "stride", "every") else 0)
    if "prob" in p:
        _check_float(text, "prob", p["prob"], 0.0, 1.0)
    if "rate" in p:
        _check_float(text, "rate", p["rate"], 0.0, 1.0)
    if "r" in p:
        _check_float(text, "r", p["r"], 0.0, 1e12)
    if "value" in p and f.model in ("tile", "row"):
        _check_float(text, "value", p["value"], -3e38, 3e38)
    if "mask" in p:
        _check_int(text, "mask", p["mask"], lo=1)
        width = 32 if f.target == "acc" or is_attention(f) else 16  # fp32 accumulator and stages; bf16 output and operands
        if int(p["mask"], 0) >> width:  # bits the element lacks: dropped, so 0x10000 on a bf16 flipped nothing
            raise InjectSpecError(f"--inject {text!r}: mask={p['mask']} has bits above bit {width - 1}; "
                                  f"target={f.target} elements have {width}")
    if "bit" in p and p["bit"] not in BIT_CLASSES:
        _check_int(text, "bit", p["bit"])
        top = 63 if f.model == "memflip" else 31
        if int(p["bit"], 0) > top:
            raise InjectSpecError(f"--inject {text!r}: bit={p['bit']} must be 0..{top} or one of {', '.join(BIT_CLASSES)}")
    if f.model == "tile":
        if p.get("mode", "zero") not in TILE_MODES:
            raise InjectSpecError(f"--inject {text!r}: mode must be one of {', '.join(TILE_MODES)}")
        if "tile" in p:
            parts = p["tile"].split(".")
            if len(parts) != 2 or not all(x.isascii() and x.isdigit() and len(x) <= 18 for x in parts):
                raise InjectSpecError(f"--inject {text!r}: tile=ROW.COL expected (e.g. tile=0.1), got {p['tile']!r}")
        if sum(k in p for k in ("tile", "every", "sm")) > 1:
            raise InjectSpecError(f"--inject {text!r}: give at most one of tile=, every=, sm=")
    if f.model == "row" and p.get("mode", "zero") not in ("zero", "stuck"):
        raise InjectSpecError(f"--inject {text!r}: row mode must be zero or stuck")
    if f.model == "replace":
        if p.get("span", "1") not in SPANS:
            raise InjectSpecError(f"--inject {text!r}: span must be one of {', '.join(SPANS)}")
        if p.get("value", "flip") not in VALUES:
            raise InjectSpecError(f"--inject {text!r}: value must be one of {', '.join(VALUES)}")
        if p.get("span") == "random" and ("row" in p or "col" in p):  # its start is drawn over the whole tensor
            raise InjectSpecError(f"--inject {text!r}: span=random draws its own start; row= and col= pin spans 1, 16 and 64 only")
    if f.model in ("mask", "stuck-lane") and "mask" not in p:
        raise InjectSpecError(f"--inject {text!r}: {f.model} needs mask=0x…")
    if f.model == "perturb" and "r" not in p:
        raise InjectSpecError(f"--inject {text!r}: perturb needs r=… (multiple of the clean median checksum difference)")
    if f.model in TRAINING_MODELS:
        _validate_training(text, f)


def _validate_training(text: str, f: FaultSpec) -> None:
    for key in ("step", "index", "count"):
        if key in f.params:
            _check_int(text, key, f.params[key], lo=1 if key in ("step", "count") else 0)
    if f.params.get("persist", "0") not in ("0", "1"):
        raise InjectSpecError(f"--inject {text!r}: persist must be 0 or 1")
    if f.params.get("persist") == "1" and "step" not in f.params:
        raise InjectSpecError(f"--inject {text!r}: persist=1 needs step=N (without step= the fault fires after every update)")


def is_attention(f: FaultSpec) -> bool:
    return f.target in ATTN_TARGETS


def _validate_attention(text: str, f: FaultSpec) -> None:
    """An attention fault is one value of one stage per pass: ``index=`` pins it; row, col,
    count and rate (GEMM placements) mean nothing there. ``index=`` means nothing elsewhere
    (except for the memory models, which define it)."""
    if f.model in ("memflip", "swap"):
        return
    if is_attention(f):
        bad = sorted(k for k in ("row", "col", "rate") if k in f.params)
        if bad or f.params.get("count", "1") != "1":
            raise InjectSpecError(f"--inject {text!r}: target={f.target} hits one value per pass (index= pins it); "
                                  f"{', '.join(bad) or 'count'} does not apply")
    elif "index" in f.params:
        raise InjectSpecError(f"--inject {text!r}: index= pins an attention fault (target=attn.STAGE); "
                              f"target={f.target} takes row= and col=")


def _validate_worker(text: str, f: FaultSpec) -> None:
    for key in f.params:
        if key not in WORKER_MODELS[f.model]:
            raise InjectSpecError(f"--inject {text!r}: unknown key {key!r} for {f.model} (allowed: {', '.join(sorted(WORKER_MODELS[f.model]))})")
    if f.model == "hang":
        _check_float(text, "seconds", f.params.get("seconds", ""), 0.0, 86400.0)
        if f.params.get("when", "scan") not in ("scan", "replay"):
            raise InjectSpecError(f"--inject {text!r}: when must be scan or replay")
    if "signal" in f.params:
        _check_int(text, "signal", f.params["signal"], lo=1)


def parse_spec(text: str, *, worker: bool = False, training: bool = False) -> list[FaultSpec]:
    """Parse an ``--inject`` string into fault specs; InjectSpecError names the problem.
    ``worker=True`` also accepts the sweep-worker test hooks (WORKER_MODELS), ``training=True``
    only the training-state faults (TRAINING_MODELS)."""
    faults: list[FaultSpec] = []
    for part in filter(None, (p.strip() for p in text.split(";"))):
        model, _, rest = part.partition(":")
        model = model.strip()
        if model in WORKER_MODELS and not worker:
            raise InjectSpecError(f"--inject {part!r}: {model} is a test hook of sweep workers; only `aegis sweep` "
                                  "(inject: in sweep.yaml) applies it")
        if (model in TRAINING_MODELS) != training and model in MODELS:
            raise InjectSpecError(f"--inject {part!r}: " + (f"{model} acts on training state; only the training guard applies it"
                                                             if not training else f"the training guard applies only {', '.join(TRAINING_MODELS)}"))
        if model not in MODELS and model not in WORKER_MODELS:
            raise InjectSpecError(f"--inject {part!r}: unknown fault model {model!r} (known: {', '.join(MODELS)})")
        params: dict[str, str] = {}
        for kv in filter(None, (x.strip() for x in rest.split(","))):
            key, eq, value = kv.partition("=")
            if not eq:
                raise InjectSpecError(f"--inject {part!r}: expected KEY=VALUE, got {kv!r}")
            if key.strip() in params:
                raise InjectSpecError(f"--inject {part!r}: key {key.strip()!r} given twice")
            params[key.strip()] = value.strip()
        f = FaultSpec(model, params)
        if model in WORKER_MODELS:
            _validate_worker(part, f)
        else:
            _validate(part, f)
        faults.append(f)
    if not faults:
        raise InjectSpecError(f"--inject {text!r}: empty fault spec")
    return faults


@dataclass
class LaunchContext:
    """What a backend tells the plan about the launch it is corrupting."""

    device_id: str
    op: str  # case id of the GEMM (workload/op/layout/…)
    tile: tuple[int, int]
    tile_sm: np.ndarray | None = None  # (tiles_m, tiles_n) SM ids, when known
    clean_median: float | None = None  # median |Δ| of the clean fp32 row checksum (perturb)


@dataclass
class FaultPlan:
    """The faults to apply to launches on one device, with a record of what was done."""

    faults: list[FaultSpec]
    launches: int = 0
    injected: list[dict] = field(default_factory=list)
    # each fault's place in the spec as written (None: as listed, filled in by __post_init__). Positions and coins are seeded
    # by it, so a shared fault lands in the same place on every device whichever other devices'
    # faults were dropped from this one's plan
    slots: list[int] | None = None
    # slots of the faults that changed at least one element or tile somewhere (record()); one set
    # shared by every for_device() copy (dataclasses.replace keeps the reference), so the scan can
    # say which never did
    fired: set[int] = field(default_factory=set)

    def __post_init__(self) -> None:
        if self.slots is None:
            self.slots = list(range(len(self.faults)))

    @classmethod
    def parse(cls, text: str) -> FaultPlan:
        return cls(parse_spec(text))

    def for_device(self, device_id: str) -> FaultPlan | None:
        mine = [(f, s) for f, s in zip(self.faults, self.slots, strict=True) if f.params.get("device") in (None, device_id)]
        return dataclasses.replace(self, faults=[f for f, _ in mine], slots=[s for _, s in mine], injected=[],
                                   launches=0) if mine else None

    def check_devices(self, scanned: list[str]) -> None:
        """Refuse a fault aimed at a device the run does not scan: it would never fire and the
        self-test would report HEALTHY with fault_injected true."""
        for f in self.faults:
            dev = f.params.get("device")
            if dev is not None and dev not in scanned:
                raise InjectSpecError(f"--inject {str(f)!r}: device={dev} is not scanned (scanned: {', '.join(scanned)})")

    def never_fired(self) -> list[str]:
        """The faults that changed nothing anywhere: an ``op=`` matching nothing, or one that
        touched no element where it applied (``sm=`` naming an SM that ran no tile, ``rate=0``)."""
        return [str(f) for s, f in zip(self.slots, self.faults, strict=True) if s not in self.fired]

    def needs_clean_median(self) -> bool:
        return any(f.model == "perturb" and not is_attention(f) for f in self.faults)

    def describe(self) -> list[str]:
        return [str(f) for f in self.faults]

    # -- per-launch ---------------------------------------------------------------
    def active(self, ctx: LaunchContext, stage: str) -> list[tuple[FaultSpec, np.random.Generator]]:
        """Faults that fire at ``stage`` (operands|acc|out|mem|attn) on this launch. Positions come
        from a generator seeded by (fault seed, op) so a permanent fault sits still;
        firing of an intermittent fault is drawn per launch."""
        fired = []
        for i, f in zip(self.slots, self.faults, strict=True):
            st = "attn" if is_attention(f) else {"a": "operands", "b": "operands", "acc": "acc", "out": "out", "mem": "mem"}[f.target]
            if st != stage or not f.applies_to(ctx.device_id, ctx.op):
                continue
            if f.prob < 1.0:
                coin = np.random.default_rng([f.seed, i, self.launches, 0xC01])
                if coin.random() >= f.prob:
                    continue
            # positions depend on the case's shape group, not on its input scale: a permanent
            # fault sits at the same place whatever magnitudes flow through it
            site = op_site(ctx.op)
            pos_rng = np.random.default_rng([f.seed, i, zlib.crc32(site.encode())])
            fired.append((f, pos_rng))
        return fired

    def record(self, f: FaultSpec, ctx: LaunchContext, **what) -> None:
        self.injected.append({"fault": str(f), "op": ctx.op, "launch": self.launches, **what})
        # fired: it changed something; an active fault that hit no element or tile (sm=20 on 16
        # SMs, rate=0, a lane past the tensor) left the scan HEALTHY with no never-fired warning
        if what.get("elements", what.get("n_tiles", 1)):
            self.fired.add(next(s for s, g in zip(self.slots, self.faults, strict=True) if g is f))


def recent_injections(plan: FaultPlan | None, n: int = 4, case: str | None = None) -> list[dict]:
    """The last ``n`` injection records of ``plan`` (none without a plan), for evidence. With
    ``case``, only those of its shape group at any scale (a pow2 check compares with the base
    scale's run) and of either pass of it (an attention case launches ``CASE:fwd`` and
    ``CASE:bwd``): the plan's last records may be another case's, which the evidence would name."""
    if plan is None:
        return []
    site = op_site(case) if case is not None else None
    sites = (site, f"{site}:fwd", f"{site}:bwd")  # a GEMM case's launches, an attention case's passes
    out = []
    for r in reversed(plan.injected):  # newest first: the case's own records are the latest
        if len(out) == n:
            break
        if site is None or op_site(r["op"]) in sites:
            out.append(r)
    return out[::-1]

