"""Saving a confirmed GEMM or attention call as a vTask bundle that ``aegis replay`` and sweeps
consume (docs/bundle-format.md): the real operands, what the launch returned and where it ran,
through vtask/capture.py (GEMMs), vtask/attention.py (attention) and the bundle writer. One
bundle per confirmed event."""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path

from aegis_cli.ops.errors import AegisError
from aegis_cli.ops.verdict import Evidence, Verdict
from aegis_cli.sensors.attention import AttentionContext
from aegis_cli.sensors.queue import nbytes
from aegis_cli.sensors.sense import GemmContext
from aegis_cli.vtask.attention import capture_observed
from aegis_cli.vtask.bundle import BundleWriter
from aegis_cli.vtask.capture import ObservedGemm, capture_gemm
from aegis_cli.vtask.manifest import ID_CHARS
from aegis_cli.vtask.model import VTask
from aegis_cli.vtask.provenance import device_provenance

_UNSAFE = re.compile(f"[^{ID_CHARS.replace('/', '')}]")  # a vTask id's characters but '/': also a file name


def safe_name(text: str) -> str:
    """A layer or region name as vTask ids and file names may hold it."""
    return _UNSAFE.sub("_", text)[:120] or "_"


def provenance(device, *, step: int, rank: int, job: str, injected: bool) -> dict:
    return device_provenance(device.identity, rank=rank, step=step, job=job, injected=injected,
                             captured=datetime.now(timezone.utc).isoformat(timespec="seconds"), command_line=sys.argv)


def save_gemm(ctx: GemmContext, site: str, evidence: list[Evidence], reference, *, directory: str, name: str, step: int,
              rank: int, job: str, confirm_margin: float, max_bytes: int) -> tuple[str | None, str]:
    """Write the confirmed ``evidence`` of one launch as vTasks in ``directory``/``name``.aegis.
    Returns (path, "") or (None, why it was not saved)."""
    prov = provenance(ctx.device, step=step, rank=rank, job=job, injected=ctx.fault is not None)
    run = ObservedGemm(ctx.operands, ctx.result, case_id=site, op=ctx.layer, source="training")
    return _save(lambda: capture_gemm(run, _confirmed(evidence), tau=ctx.tau, confirm_margin=confirm_margin,
                                      provenance=prov, reference=reference), directory, name, max_bytes)


def save_attention(ctx: AttentionContext, evidence: list[Evidence], *, directory: str, name: str, step: int, rank: int,
                   job: str, confirm_margin: float, max_bytes: int) -> tuple[str | None, str]:
    """Write the confirmed ``evidence`` of one attention call as vTasks of kind attention (its
    copied Q, K, V, dO and outputs) in ``directory``/``name``.aegis; as ``save_gemm``."""
    prov = provenance(ctx.device, step=step, rank=rank, job=job, injected=ctx.fault is not None)
    return _save(lambda: capture_observed(ctx.ops, ctx.fwd, ctx.bwd, _confirmed(evidence), scale=ctx.scale,
                                          source="training", provenance=prov, confirm_margin=confirm_margin),
                 directory, name, max_bytes)


def _confirmed(evidence: list[Evidence]) -> list[Evidence]:
    return [e for e in evidence if e.severity is Verdict.FAULTY]


def _save(capture: Callable[[], list[VTask]], directory: str, name: str, max_bytes: int) -> tuple[str | None, str]:
    """The vTasks ``capture`` makes, written as ``directory``/``name``.aegis (an existing file of
    that name is never replaced: ``name.N.aegis``); (path, "") or (None, why not)."""
    try:
        vtasks = capture()
        size = max((nbytes(vt.tensors.values()) for vt in vtasks), default=0)
        if size > max_bytes:
            return None, f"its vTask would hold {size / 2**20:.0f} MiB, over max_vtask_bytes ({max_bytes / 2**20:.0f} MiB)"
        folder = Path(directory)
        folder.mkdir(parents=True, exist_ok=True)
        path, n = folder / f"{name}.aegis", 1
        while path.exists():  # an earlier run's bundle of the same name is evidence too: never replaced
            path, n = folder / f"{name}.{n}.aegis", n + 1
        with BundleWriter(path) as writer:
            for vt in vtasks:
                writer.add(vt)
    except AegisError as exc:  # e.g. operands a bundle may not hold (non-finite, or overflowing fp32 sums)
        return None, str(exc)
    except OSError as exc:
        return None, f"cannot write in {directory}: {exc.strerror or exc}"
    return str(path), ""
