"""``F.scaled_dot_product_attention`` through the checked attention (docs/sensors.md §2.3), opt-in
(``SensorConfig.attention``).

While a model is instrumented, ``torch.nn.functional.scaled_dot_product_attention`` is replaced
by a function that sends the calls the checked attention computes (4-D Q, K, V of one batch,
sequence and head dim; no mask other than ``is_causal``; no dropout; KV heads equal to the query
heads, or dividing them with ``enable_gqa``) through a custom autograd function: the forward on
``Device.attention_forward``, the backward on ``Device.attention_backward`` (bf16 operands, fp32
accumulators, deterministic). Any other call goes to torch's own function and is counted in
``stats.attention_unchecked`` by reason. On CUDA, where the call computes in bf16 (outside
pinned regions and self-tests), it is drawn at its forward instead: unsampled, it runs torch's
own SDPA, as uninstrumented, since the checked kernels cost far more than torch's (a third of
cuDNN's speed in the example GPT's step, benchmarks/RESULTS.md).

A sampled call is sensed after its backward, when forward and backward sums exist: the attention
checks (checks/attention.py ``check_attention``, the probe's, against the fp64 reference) at the
invariants' τ, timed by ``SensorHandle.sensing_time`` (CUDA events read at the step boundary, as
a GEMM check's). A flagged call's operands and outputs are copied and queued (kind ``attention``);
the verifier re-runs it (``verify_attention``) and judges each signal by checks/attention.py
``judge_signal``, as the probe's confirmation does. Calls are named by their order in the step:
``train/sdpa#I/SHAPE`` (an ``--inject`` ``op=`` matches a part of it; the passes are ``…:fwd``
and ``…:bwd``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from aegis_cli.backends.base import Device
from aegis_cli.checks import attention as checks
from aegis_cli.faults.spec import FaultPlan, recent_injections
from aegis_cli.ops import attention_sums as sums
from aegis_cli.ops.attention import BLOCK, AttentionBackward, AttentionForward, AttentionOperands, AttentionShape
from aegis_cli.ops.errors import ConfigError
from aegis_cli.ops.verdict import Evidence, Verdict, worst
from aegis_cli.probes.attention import run_pass
from aegis_cli.sensors.linear import draws_at_forward
from aegis_cli.sensors.queue import nbytes

BF16 = torch.bfloat16
MAX_SAMPLES = 8


@dataclass
class AttentionContext:
    """A flagged call, copied: what the verifier re-runs and what it compares with."""

    device: Device
    fault: FaultPlan | None
    ops: AttentionOperands
    fwd: AttentionForward
    bwd: AttentionBackward
    scale: float
    site: str
    key: str  # the operator (sdpa/SHAPE): whose τ a cleared spike raises
    th: sums.AttentionThresholds  # the τ it was flagged at: the verifier judges at the same

    def tensors(self) -> list[torch.Tensor]:
        return _held(self.ops, self.fwd, self.bwd)


def _held(ops: AttentionOperands, fwd: AttentionForward, bwd: AttentionBackward) -> list[torch.Tensor]:
    """The tensors a queued call holds (its context copies them): sized before they are copied."""
    return [ops.q, ops.k, ops.v, ops.do, *checks.outputs_of(fwd, bwd).values()]


def unsupported(q, k, v, attn_mask, dropout_p, enable_gqa) -> str | None:
    """Why the checked attention cannot compute this call (None: it can)."""
    if attn_mask is not None:
        return "attn_mask"
    if dropout_p != 0.0:
        return "dropout"
    if not all(isinstance(t, torch.Tensor) and t.dim() == 4 and t.is_floating_point() for t in (q, k, v)):
        return "not 4-D floating point"
    if q.shape[0] != k.shape[0] or q.shape[2:] != k.shape[2:] or k.shape != v.shape or 0 in q.shape:
        return "shape"
    if q.shape[1] % k.shape[1] or (q.shape[1] != k.shape[1] and not enable_gqa):
        return "kv heads"
    if q.device.type not in ("cpu", "cuda") or q.device != k.device or q.device != v.device:
        return "device"
    if q.device.type == "cuda" and q.shape[3] > 128:
        return "head dim"
    return None


@dataclass
class _Call:
    """One routed call: its device, name, operator key and scale; ``drawn``: sampled at its forward
    (the fast path), else None: the controller is asked after its backward."""

    h: object  # the SensorHandle
    device: Device
    site: str
    key: str
    causal: bool
    scale: float
    drawn: bool | None

    def sense(self, ops: AttentionOperands, fwd: AttentionForward, bwd: AttentionBackward) -> None:
        h, key = self.h, self.key
        if not h.sensing or (self.drawn is None and not h.controller.want(key)):
            return
        with h.sensing_time(self.device, key):
            floor = sums.AttentionThresholds().tau
            raised = h.controller.tau(key, 1.0)  # the operator's adaptive raise (sensors/control.py), 1 at its floor
            th = sums.AttentionThresholds({n: t * raised for n, t in floor.items()})
            checked = checks.check_attention(ops, fwd, bwd, self.device.attention_reference(ops, self.scale), self.scale, th)
            ratios = {n: v / checked.tau[n] for n, v in checked.clean_max.items()}
            h.count_check(key, max(ratios.values(), default=0.0), not checked.signals)
            worst = h.stats.attention_clean_max
            for n, r in ratios.items():
                worst[n] = max(worst.get(n, 0.0), r)
            if checked.signals:
                top = max(s.max_value / floor.get(s.tensor, 1.0) for s in checked.signals)  # × the floor's τ
                h.suspect("attention", self.site.split("/")[1], self.site, [s.check for s in checked.signals], top,
                          nbytes(_held(ops, fwd, bwd)),
                          lambda: AttentionContext(
                              self.device, h.fault_for(self.device), _copy(ops),
                              AttentionForward(*(t.clone() for t in (fwd.o, fwd.lse, fwd.o_rowsum)), kernel=fwd.kernel),
                              AttentionBackward(*(t.clone() for t in bwd.tensors().values()), kernel=bwd.kernel),
                              self.scale, self.site, key, th))


def _copy(ops: AttentionOperands) -> AttentionOperands:
    return AttentionOperands(*(t.detach().clone() for t in (ops.q, ops.k, ops.v, ops.do)), ops.causal)


class CheckedAttentionFunction(torch.autograd.Function):
    """softmax(scale·QKᵀ)·V with forward and backward on the device's checked attention."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: _Call) -> torch.Tensor:
        dev, home = call.device, q.device
        where = "cpu" if dev.identity.backend == "cpu" else home  # the reference path for tensors that live elsewhere
        q2, k2, v2 = (t.detach().to(where, BF16).contiguous() for t in (q, k, v))
        fwd = dev.attention_forward(q2, k2, v2, causal=call.causal, scale=call.scale,
                                    fault=call.h.fault_for(dev), op=f"{call.site}:fwd")
        ctx.save_for_backward(q2, k2, v2, fwd.o, fwd.lse, fwd.o_rowsum)
        ctx.call, ctx.kernel = call, fwd.kernel
        ctx.dtypes = (q.dtype, k.dtype, v.dtype)
        return fwd.o.to(home, q.dtype)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, do: torch.Tensor):
        q2, k2, v2, o, lse, o_rowsum = ctx.saved_tensors
        call: _Call = ctx.call
        dev, home = call.device, do.device
        do2 = do.to(q2.device, BF16).contiguous()
        bwd = dev.attention_backward(q2, k2, v2, o, lse, do2, causal=call.causal, scale=call.scale,
                                     fault=call.h.fault_for(dev), op=f"{call.site}:bwd")
        call.sense(AttentionOperands(q2, k2, v2, do2, call.causal), AttentionForward(o, lse, o_rowsum, ctx.kernel), bwd)
        return (*(g.to(home, dt) for g, dt in zip((bwd.dq, bwd.dk, bwd.dv), ctx.dtypes, strict=True)), None)


class AttentionRouter:
    """The replacement of ``F.scaled_dot_product_attention`` for one handle; ``restore`` puts back
    what was there."""

    def __init__(self, h):
        self.h, self.step, self.calls = h, -1, 0
        self.original = F.scaled_dot_product_attention

    def install(self) -> None:
        F.scaled_dot_product_attention = self

    def restore(self) -> None:
        if F.scaled_dot_product_attention is self:
            F.scaled_dot_product_attention = self.original

    def _unchecked(self, reason: str) -> None:
        counts = self.h.stats.attention_unchecked
        counts[reason] = counts.get(reason, 0) + 1

    def __call__(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        reason = unsupported(query, key, value, attn_mask, dropout_p, enable_gqa)
        try:
            shape = AttentionShape.of(query, key, bool(is_causal)) if reason is None else None
        except ConfigError:  # a dimension beyond what the checked attention takes
            reason = "shape"
        if reason is not None:
            self._unchecked(reason)
            kw = {"enable_gqa": enable_gqa} if enable_gqa else {}
            return self.original(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                                 scale=scale, **kw)
        if self.step != self.h.step_index:  # calls are numbered from 0 in each step
            self.step, self.calls = self.h.step_index, 0
        site, op = f"train/sdpa#{self.calls}/{shape.token()}", f"sdpa/{shape.token()}"
        self.calls += 1
        self.h.stats.attention_launches += 1
        drawn = None
        if draws_at_forward(self.h, query, key, value):  # as a Linear's fast path
            grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
            if not (grad and self.h.controller.want(op)):  # not sensed: torch's SDPA, as uninstrumented
                kw = {"enable_gqa": enable_gqa} if enable_gqa else {}
                return self.original(query, key, value, is_causal=is_causal, scale=scale, **kw)
            drawn = True
        sc = shape.scale if scale is None else float(scale)
        call = _Call(self.h, self.h.device_for(query), site, op, bool(is_causal), sc, drawn)
        with torch.autocast(query.device.type, enabled=False):
            return CheckedAttentionFunction.apply(query, key, value, call)


@dataclass
class AttentionOutcome:
    severity: Verdict
    evidence: list[Evidence]
    summary: str
    doubted: bool = False  # cleared because rounding of these inputs can reach the flag


def verify_attention(ctx: AttentionContext, reruns: int, confirm_margin: float) -> AttentionOutcome:
    """Re-run a flagged call ``reruns`` times on its copied operands; judge each signal of the
    observed run by how often it came back and whether the runs' bits agreed."""
    dev, ops, th = ctx.device, ctx.ops, ctx.th
    ref = dev.attention_reference(ops, ctx.scale)
    first = checks.check_attention(ops, ctx.fwd, ctx.bwd, ref, ctx.scale, th)
    fp = lambda f, b: tuple(dev.fingerprint(t) for t in checks.outputs_of(f, b).values())
    prints = {fp(ctx.fwd, ctx.bwd)}
    seen = {s.check: 0 for s in first.signals}
    for _ in range(reruns):
        f2, b2 = run_pass(dev, ops, ctx.fault, ctx.site, ctx.scale)
        prints.add(fp(f2, b2))
        for s in checks.check_attention(ops, f2, b2, ref, ctx.scale, th).signals:
            if s.check in seen:
                seen[s.check] += 1
    if not first.signals:
        return AttentionOutcome(Verdict.HEALTHY, [], "no attention check fires on the observed run")
    evidence, doubted = [], False
    for sig in first.signals:
        tau = first.tau.get(sig.tensor) if sig.check in checks.INVARIANT_CHECKS else None
        j = checks.judge_signal(sig, distinct_outputs=len(prints), reproducible=seen[sig.check] == reruns, tau=tau,
                                confirm_margin=confirm_margin)
        doubted |= j.doubted
        s = ops.shape
        ev = Evidence(check=sig.check, severity=j.severity, case_id=ctx.site, summary="", op="attention",
                      shape={"batch": s.batch, "q_heads": s.q_heads, "kv_heads": s.kv_heads, "seq": s.seq,
                             "head_dim": s.head_dim, "causal": s.causal},
                      threshold=tau, max_value=sig.max_value, elements=sig.elements,
                      samples=[sig.position(tuple(p), BLOCK) for p in sig.where[:MAX_SAMPLES].tolist()],
                      reruns=reruns, reproduced=seen[sig.check], distinct_outputs=len(prints),
                      kernel=f"{ctx.fwd.kernel}/{ctx.bwd.kernel}", injected=recent_injections(ctx.fault, case=ctx.site))
        ev.summary = (f"{sig.check}: {sig.elements} value(s) flagged in training ({sig.tensor}); failed "
                      f"{seen[sig.check] + 1} of {reruns + 1} runs; {j.why}")
        evidence.append(ev)
    severity = worst(e.severity for e in evidence)
    lead = max(evidence, key=lambda e: e.severity.rank)
    return AttentionOutcome(severity, evidence, lead.summary, doubted=doubted and severity is not Verdict.FAULTY)
