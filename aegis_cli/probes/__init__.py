"""Probes: each runs one family of checks on one device and returns evidence.

A probe is registered under a stable name in ``PROBES``; ``aegis scan --probes`` picks
them (default ``DEFAULT_PROBES``). Signature::

    probe(device, ctx: ProbeContext) -> list[Evidence]

and it may add a JSON-able summary under ``ctx.stats[name]`` (shown in the report).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from aegis_cli.backends.base import Device
    from aegis_cli.inject import FaultPlan
    from aegis_cli.scan import ScanOptions
    from aegis_cli.verdict import Evidence


@dataclass
class ProbeContext:
    opts: ScanOptions
    fault: FaultPlan | None
    progress: Callable[..., None]  # progress("case", device=..., case=...)
    stats: dict[str, Any] = field(default_factory=dict)


ProbeFn = Callable[["Device", ProbeContext], "list[Evidence]"]
PROBES: dict[str, ProbeFn] = {}
DEFAULT_PROBES = ("gemm",)


def register(name: str):
    def deco(fn: ProbeFn) -> ProbeFn:
        PROBES[name] = fn
        return fn

    return deco


def load_all() -> None:
    """Import the probe modules so they register themselves (no GPU is touched)."""
    import importlib
    import pkgutil

    for mod in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{mod.name}")
