"""Two test tiers: everything runs on the CPU; ``@pytest.mark.gpu`` tests need CUDA + CuPy
and are skipped with a reason elsewhere."""

from __future__ import annotations

import importlib.util

import pytest


def _cuda_reason() -> str | None:
    if importlib.util.find_spec("cupy") is None:
        return "CuPy is not installed"
    try:
        import torch

        if not torch.cuda.is_available():
            return "no CUDA device visible to torch"
    except Exception as exc:  # pragma: no cover - depends on the machine
        return f"CUDA probe failed: {exc}"
    return None


def pytest_configure(config):
    # the thread count the aegis commands use (backends/threads.py): torch's default of one
    # thread per core oversubscribes a small or busy CI machine and multiplies the suite's time
    from aegis_cli.backends.threads import apply_thread_policy

    apply_thread_policy()


def pytest_collection_modifyitems(config, items):
    reason = _cuda_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=f"gpu test: {reason}")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
