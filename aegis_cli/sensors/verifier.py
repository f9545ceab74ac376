"""One queued suspicion, verified at a step boundary: judged (sensors/verify.py for GEMMs,
sensors/attention.py for attention calls, sensors/checkpoint.py for recomputed regions), saved
when confirmed and replayable (GEMMs and attention, sensors/save.py), and turned into an event;
a cleared spike raises its operator's threshold (sensors/control.py)."""

from __future__ import annotations

import time

from aegis_cli.ops.verdict import Verdict
from aegis_cli.sensors.attention import verify_attention
from aegis_cli.sensors.checkpoint import verify_region
from aegis_cli.sensors.events import SensorEvent
from aegis_cli.sensors.queue import Suspicion
from aegis_cli.sensors.save import safe_name, save_attention, save_gemm
from aegis_cli.sensors.sense import op_key
from aegis_cli.sensors.verify import verify_gemm

NOT_REPLAYABLE = "not saved: a recomputed region has no vTask kind (bundles hold GEMMs and attention)"
NO_DIR = "not saved: no bundle_dir configured"


def _save(h, s: Suspicion, evidence: list, out) -> tuple[str | None, str]:
    """Save a confirmed GEMM or attention suspicion as a bundle: (path, "") or (None, why not)."""
    cfg = h.config
    kw = dict(directory=cfg.bundle_dir, step=s.step, rank=h.rank, job=cfg.job,
              confirm_margin=cfg.thresholds.confirm_margin, max_bytes=cfg.max_vtask_bytes)
    if s.kind == "gemm":
        name = h.next_bundle_name(s.step, safe_name(s.op), s.context.operands.layout.value)
        return save_gemm(s.context, s.site, evidence, out.reference, name=name, **kw)
    return save_attention(s.context, evidence, name=h.next_bundle_name(s.step, safe_name(s.op), "attention"), **kw)


def verify_one(h, s: Suspicion) -> SensorEvent:
    """Verify ``s`` for handle ``h``, emit its event(s) and return the main one."""
    cfg = h.config
    bundle, unsaved = None, ""
    try:
        margin = cfg.thresholds.confirm_margin
        out = (verify_gemm(s.context, s.site, cfg.reruns, margin) if s.kind == "gemm"
               else verify_attention(s.context, cfg.reruns, margin) if s.kind == "attention"
               else verify_region(s.context, s.op, s.site, cfg.reruns))
    except Exception as exc:  # a failed verification is an event: it must not end the training step
        h.stats.unverified += 1
        h._mark_bad(s.step)
        event = SensorEvent("unverified", s.step, s.op, s.site, s.checks[0], "SUSPECT",
                            f"verification failed: {type(exc).__name__}: {exc}", rank=h.rank)
        h.emit(event)
        return event
    severity = out.severity
    confirmed = severity is Verdict.FAULTY
    evidence, summary = ([out.evidence], out.evidence.summary) if s.kind == "checkpoint" else (out.evidence, out.summary)
    if s.kind == "checkpoint":
        unsaved = NOT_REPLAYABLE if confirmed else ""
        if out.nondeterministic:
            h.nondeterministic.add(s.site)
    elif confirmed:  # a GEMM or an attention call: replayable
        bundle, unsaved = _save(h, s, evidence, out) if cfg.bundle_dir is not None else (None, NO_DIR)
    elif out.doubted:  # a spike rounding can reach: raise this operator's τ above it for a while
        # a GEMM's τ and spike in units of its σ; an attention call's in units of each invariant's floor τ
        key, floor = (op_key(s.op, s.context.operands.layout), s.context.floor) if s.kind == "gemm" else (s.context.key, 1.0)
        tau = h.controller.spike(key, s.max_value, floor)
        if tau is not None:
            h.emit(SensorEvent("threshold", s.step, s.op, s.site, s.checks[0], severity.value,
                               f"τ of {key} raised to {tau:.3g} after a cleared spike of {s.max_value:.3g}", rank=h.rank))
    latency = time.perf_counter() - s.raised_at
    h.stats.latency.add(latency, h.step_index - s.step)
    if confirmed:
        h.stats.confirmed += 1
        h._mark_bad(s.step)
    else:
        h.stats.cleared += 1
    if bundle:
        h.stats.saved += 1
    elif confirmed:
        h.stats.unsaved += 1
    event = SensorEvent("confirmed" if confirmed else "cleared", s.step, s.op, s.site, s.checks[0], severity.value,
                        summary + (f" ({unsaved})" if unsaved else ""), rank=h.rank, latency_s=latency,
                        latency_steps=h.step_index - s.step, bundle=bundle, evidence=evidence)
    h.emit(event)
    if confirmed and unsaved and s.kind != "checkpoint" and cfg.bundle_dir is not None:
        h.emit(SensorEvent("unsaved", s.step, s.op, s.site, s.checks[0], severity.value, unsaved, rank=h.rank))
    return event
