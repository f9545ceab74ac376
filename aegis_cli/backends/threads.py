"""How many threads torch's CPU kernels use when aegis runs as a command.

torch starts one intra-op thread per core. On a small or busy node (a CI runner, a node whose
cores are busy feeding GPUs, a sweep with one worker per GPU) that oversubscribes the cores and
every small CPU GEMM spends its time handing work between threads: the default CPU scan took
18–34 s on a busy 2-core machine with torch's default and about 1.2 s with one thread. So the
commands set the count deliberately (docs/architecture.md, "Threads"):

  AEGIS_THREADS=N        exactly N (a sweep gives each worker its share this way)
  OMP_NUM_THREADS=N      respected as torch respects it
  otherwise              half the cores this process may run on, at least 1, at most 8

Only the command-line entry points and sweep workers call this: importing aegis as a library
never changes the caller's thread settings.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from aegis_cli.ops.errors import ConfigError

MAX_DEFAULT = 8  # the CPU reference path gains little past this on the shapes it runs


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask, e.g. a cgroup's cpuset), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not Linux
        return max(1, os.cpu_count() or 1)


def _aegis_threads(env: Mapping[str, str]) -> int | None:
    """AEGIS_THREADS as a positive integer, or None when unset."""
    raw = env.get("AEGIS_THREADS", "").strip()
    if not raw:
        return None
    try:
        n = int(raw)
    except ValueError:
        n = 0
    if n < 1:
        raise ConfigError(f"AEGIS_THREADS must be a positive integer, got {raw!r}")
    return n


def chosen_threads(environ: Mapping[str, str] | None = None) -> int | None:
    """The intra-op thread count aegis asks for, or None to leave torch's own choice
    (OMP_NUM_THREADS given: torch already follows it)."""
    env = os.environ if environ is None else environ
    if (n := _aegis_threads(env)) is not None:
        return n
    if env.get("OMP_NUM_THREADS", "").strip():
        return None
    return max(1, min(MAX_DEFAULT, usable_cores() // 2))


def share(workers: int, environ: Mapping[str, str] | None = None) -> int:
    """Threads for each of ``workers`` processes running side by side: the cores divided
    between them (at least 1 each), or what AEGIS_THREADS says."""
    env = os.environ if environ is None else environ
    if (n := _aegis_threads(env)) is not None:
        return n
    return max(1, min(MAX_DEFAULT, usable_cores() // max(1, workers)))


def apply_thread_policy(environ: Mapping[str, str] | None = None) -> int:
    """Set torch's intra-op threads by the policy above; returns the count in force."""
    import torch

    n = chosen_threads(environ)
    if n is not None and torch.get_num_threads() != n:
        torch.set_num_threads(n)
    return torch.get_num_threads()
