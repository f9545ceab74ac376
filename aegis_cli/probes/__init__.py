"""Probes: each runs one family of checks on one device and returns evidence.

A probe is registered under a stable name in ``PROBES``; ``aegis scan --probes`` picks
them (default ``DEFAULT_PROBES``). Signature::

    probe(device, ctx: ProbeContext) -> list[Evidence]

and it may add a JSON-able summary under ``ctx.stats[name]`` (shown in the report).

A node probe (``register_node``) sees every scanned device at once, after the per-device
probes: ``probe(devices, ctx) -> {device_id: [Evidence]}``, with ``ctx.fault`` the whole
plan (``plan.for_device`` picks a device's faults) and ``ctx.stats[name]`` copied into
each device's report. Probes may declare options, set with ``--probe-option NAME.KEY=V``
and read with ``ctx.option(NAME, KEY)``.

A probe reads what it was asked for from ``ctx.config`` (a ProbeConfig: seed, re-runs, case,
options, thresholds, …), never the scan's own options, and counts its launches, failed
launches and flagged cases in ``ctx.tally`` (probes/confirmation.py): once it has confirmed
FAULTY, it confirms later cases cheaply and gives only the first few in full; with fail-fast
it stops at that first confirmed FAULTY. It may register a ``preflight(devices,
ctx)`` that refuses, before any probe runs, what it could not do (ConfigError: too little
memory, a case it never gives, a golden file without this device), and a ``count_cases(devices,
config)`` giving how many ``progress("case")`` events it will send (the scan's progress total;
when a device is done, the scan sends those that fail-fast or a failure left unsent).
``workload_for`` names the workload a device runs (the gemm and attention probes and the
burn-in share it), so no probe imports another.
"""

from __future__ import annotations

import copy
import functools
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from aegis_cli.ops.case import CaseId
from aegis_cli.probes.confirmation import DEFAULT_IN_FULL, Tally

if TYPE_CHECKING:
    from aegis_cli.backends.base import Device
    from aegis_cli.faults.spec import FaultPlan
    from aegis_cli.ops.numerics import Thresholds
    from aegis_cli.ops.verdict import Evidence
    from aegis_cli.ops.workloads import Workload

DEFAULT_PROBES = ("gemm", "determinism", "pow2", "memory", "crossdevice", "attention")
DEFAULT_RERUNS = 5  # re-runs of a flagged case (aegis scan --reruns)
MAX_RERUNS = 1000  # re-runs of one flagged case; a typo (--reruns 1000000) must not hang a scan or a burn-in


def _default_thresholds() -> Thresholds:
    from aegis_cli.ops.numerics import Thresholds  # imports torch: not at `import aegis_cli.probes` (a fast CLI start)

    return Thresholds()


@dataclass(frozen=True)
class ProbeConfig:
    """What the probes are asked to do: the part of a scan's options they read."""

    seed: int = 0
    reruns: int = DEFAULT_RERUNS  # re-runs of a flagged case to confirm it
    case: str | None = None  # re-run exactly this case id
    probes: tuple[str, ...] = DEFAULT_PROBES  # every probe of the run (a node probe asks whether it runs alone)
    probe_options: dict[str, str] = field(default_factory=dict)  # "probe.key" → value (--probe-option)
    thresholds: Thresholds = field(default_factory=_default_thresholds)
    golden: str | None = None  # golden fingerprint file to compare against
    workload: str | None = None  # the GEMM workload (None: the backend's default)
    keep_flagged: bool = False  # keep each flagged GEMM run as observed (ProbeContext.captured)
    # once a probe has confirmed FAULTY: flagged cases given as full evidence, the rest counted
    # and confirmed cheaply (probes/confirmation.py); None: every case in full
    evidence_in_full: int | None = DEFAULT_IN_FULL
    fail_fast: bool = False  # stop the device at its first confirmed FAULTY (ctx.tally says what was skipped)


@dataclass
class ProbeContext:
    config: ProbeConfig
    fault: FaultPlan | None
    progress: Callable[..., None]  # progress("case" | "step", device=..., case=...): "case" counts toward the scan's total
    stats: dict[str, Any] = field(default_factory=dict)
    captured: dict[str, Any] = field(default_factory=dict)  # case id → a run kept as observed (never serialised)
    tally: Tally | None = None  # launches, failures and "k of n" per case (None: from config)

    def __post_init__(self) -> None:
        if self.tally is None:
            self.tally = Tally(in_full=self.config.evidence_in_full, fail_fast=self.config.fail_fast)

    def option(self, probe: str, key: str) -> Any:
        """The value of ``--probe-option probe.key=…`` converted to its declared type, else its default."""
        raw = self.config.probe_options.get(f"{probe}.{key}")
        return PROBE_OPTIONS[probe][key][1] if raw is None else convert_option(probe, key, raw)

    def case_part(self, probe: str) -> str | None:
        """The part after ``probe/`` of ``--case probe/PART/…`` (what to re-run), else None."""
        return CaseId.parse(self.config.case).part(probe) if self.config.case else None

    def case_choice(self, probe: str, ids: dict[str, Any], device_id: str) -> Any:
        """With a ``--case`` of ``probe``: what ``ids`` (each case id the probe gives on this
        device → what it runs then) maps it to, exactly as the device names its cases; an id
        that matched nothing (another shape, a typo) ran nothing and said HEALTHY, so ConfigError
        names the cases instead. None without a ``--case`` of ``probe``."""
        from aegis_cli.ops.errors import ConfigError

        if self.case_part(probe) is None:
            return None
        if self.config.case not in ids:
            raise ConfigError(f"case {self.config.case!r}: the {probe} probe has no such case on {device_id} "
                              f"(its cases: {', '.join(ids)})")
        return ids[self.config.case]


def bounded(typ: type, lo: float, hi: float, auto: float | None = None) -> Callable[[str], object]:
    """An option type: ``typ`` in [lo, hi] (NaN refused), or exactly ``auto`` (the "by mode"
    value) when given. Values that would check nothing or never finish are refused before any
    work: HEALTHY means every check ran."""

    def parse(v: str):
        x = typ(v)
        if auto is not None and x == auto:
            return x
        if not lo <= x <= hi:
            raise ValueError(f"must lie in {lo}…{hi}" + (f" (or be {auto}: by mode)" if auto is not None else ""))
        return x

    parse.__name__ = typ.__name__
    return parse


def quick_or_full(v: str) -> str:
    """The type of the probes' ``mode`` option."""
    if v not in ("quick", "full"):
        raise ValueError(v)
    return v


ProbeFn = Callable[["Device", ProbeContext], "list[Evidence]"]
NodeProbeFn = Callable[["list[Device]", ProbeContext], "dict[str, list[Evidence]]"]
Preflight = Callable[["list[Device]", ProbeContext], object]  # raises ConfigError (or GoldenError); result unused
CaseCount = Callable[["list[Device]", ProbeConfig], int]
PROBES: dict[str, ProbeFn] = {}
NODE_PROBES: dict[str, NodeProbeFn] = {}
PROBE_OPTIONS: dict[str, dict[str, tuple[type, Any, str]]] = {}  # probe → key → (type, default, help)
PREFLIGHTS: dict[str, Preflight] = {}
CASE_COUNTS: dict[str, CaseCount] = {}


def _registrar(table: dict, name: str, options: dict[str, tuple[type, Any, str]] | None, preflight: Preflight | None,
               count_cases: CaseCount | None = None):
    def deco(fn):
        table[name] = fn
        PROBE_OPTIONS[name] = dict(options or {})
        if preflight is not None:
            PREFLIGHTS[name] = preflight
        if count_cases is not None:
            CASE_COUNTS[name] = count_cases
        return fn

    return deco


def register(name: str, options: dict[str, tuple[type, Any, str]] | None = None, *, preflight: Preflight | None = None,
             count_cases: CaseCount | None = None):
    """Register a per-device probe ``fn(device, ctx) -> [Evidence]``, with its preflight and case count."""
    return _registrar(PROBES, name, options, preflight, count_cases)


def register_node(name: str, options: dict[str, tuple[type, Any, str]] | None = None, *, preflight: Preflight | None = None):
    """Register a node probe ``fn(devices, ctx) -> {device_id: [Evidence]}``, with its preflight."""
    return _registrar(NODE_PROBES, name, options, preflight)


def convert_option(probe: str, key: str, raw: str) -> Any:
    """``raw`` converted by the declared type of ``probe.key``; ConfigError names the option
    and, for a value out of range, the range."""
    from aegis_cli.ops.errors import ConfigError

    typ = PROBE_OPTIONS[probe][key][0]
    try:
        return typ(raw)
    except ValueError as exc:
        why = str(exc) if str(exc).startswith("must") else f"is not a valid {typ.__name__}"
        raise ConfigError(f"probe option {probe}.{key}={raw!r} {why}") from None


def parse_probe_options(items: dict[str, str]) -> dict[str, str]:
    """Check ``probe.key`` names and values (types and ranges) against the declared options
    (ConfigError), before any probe runs: a bad value must not surface after an hour of others."""
    from aegis_cli.ops.errors import ConfigError

    load_all()
    for name, raw in items.items():
        probe, _, key = name.partition(".")
        if probe not in PROBE_OPTIONS or key not in PROBE_OPTIONS[probe]:
            known = ", ".join(f"{p}.{k}" for p in sorted(PROBE_OPTIONS) for k in sorted(PROBE_OPTIONS[p]))
            raise ConfigError(f"unknown probe option {name!r} (known: {known})")
        convert_option(probe, key, raw)
    return dict(items)


def check_reruns(n: int, name: str = "--reruns") -> None:
    """Refuse re-runs outside 1…MAX_RERUNS (the scan's, the burn-in's and a sweep's)."""
    from aegis_cli.ops.errors import ConfigError

    if not 1 <= n <= MAX_RERUNS:
        raise ConfigError(f"{name} must lie in 1…{MAX_RERUNS}, got {n}")


def case_probe(case: str) -> str:
    """The probe that owns case id ``case``: ids start with its name, GEMM ids with a workload's."""
    head = CaseId.parse(case).prefix if case else ""  # a fleet finding may name no case
    return head if head in PROBES or head in NODE_PROBES else "gemm"


DEFAULT_CPU_WORKLOAD = "cpu-quick"
DEFAULT_GPU_WORKLOAD = "llama3-70b"


def workload_for(config: ProbeConfig, device: Device) -> Workload:
    """The catalog the workload probes (gemm, attention) and the burn-in run on ``device``:
    ``config.workload``, else the CPU or GPU default. Read once per process (again if a file given
    by path changes); each caller gets its own copy, so none can change another's."""
    name = config.workload or (DEFAULT_CPU_WORKLOAD if device.identity.backend == "cpu" else DEFAULT_GPU_WORKLOAD)
    return copy.deepcopy(_workload(name, _file_stamp(name)))


def _file_stamp(name: str) -> tuple | None:
    """(size, mtime) of the file ``name`` names, if any: an edited catalog file is read again."""
    try:
        st = os.stat(name)
    except OSError:
        return None
    return st.st_size, st.st_mtime_ns


@functools.lru_cache(maxsize=16)
def _workload(name: str, _stamp: tuple | None) -> Workload:
    from aegis_cli.ops import workloads  # reads YAML: not at `import aegis_cli.probes`
    from aegis_cli.ops.errors import ConfigError

    wl = workloads.load(name)
    load_all()
    if wl.name in PROBES or wl.name in NODE_PROBES:  # case ids start with the workload's name
        raise ConfigError(f"workload name {wl.name!r} is also a probe's: its case ids could not be re-run with --case")
    return wl


@functools.cache
def load_all() -> None:
    """Import the probe modules so they register themselves (no GPU is touched); once per
    process, however many callers ask."""
    import importlib
    import pkgutil

    for mod in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{mod.name}")
