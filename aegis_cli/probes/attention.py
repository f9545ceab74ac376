"""The attention probe (docs/attention.md): checked flash-attention forward and backward on
the workload's per-GPU attention shape, across input distributions and exact input scales.

Shape from the workload's model config: query heads = heads / TP, KV heads = max(1, kv_heads /
TP), head dim = hidden / heads, sequence = seq_len (at most ``max_seq``: 256 on a CPU by
default), batch = micro_batch, causal. For each distribution the probe draws Q, K, V, dO once
and computes the fp64 reference once; each scale (V·2^a, dO·2^b with a + b = 0: exact, where
Q·2^a or K·2^a would change the softmax) runs forward and backward through the attention checks
(checks/attention.py), and from the second scale on every output must be the base run's, scaled,
bit for bit. A flagged case is re-run; the re-runs decide FAULTY vs SUSPECT.

Case ids: ``attention/DIST/b1h8k2s192d32c/s+0+0`` (batch, query heads, KV heads, sequence,
head dim, causal; the scale exponents of V and dO).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from aegis_cli.backends.base import Device, memory_shortfall
from aegis_cli.checks import attention as checks
from aegis_cli.checks import judge
from aegis_cli.faults.spec import FaultPlan, recent_injections
from aegis_cli.ops import attention_sums as sums
from aegis_cli.ops.attention import BLOCK, AttentionOperands, AttentionShape
from aegis_cli.ops.case import CaseId, case_seed, scale_token
from aegis_cli.ops.errors import ConfigError
from aegis_cli.ops.verdict import Evidence, Verdict
from aegis_cli.ops.workloads import Workload
from aegis_cli.probes import ProbeConfig, ProbeContext, bounded, register, workload_for

SCALES = ((0, 0), (8, -8), (-8, 8))  # (V, dO) exponents: a + b = 0 keeps dS's bits (docs/attention.md §6)
CPU_MAX_SEQ = 256
MAX_SAMPLES = 8
OPTIONS = {"max_seq": (bounded(int, 1, 1 << 17, auto=0), 0,
                       f"longest sequence to check (0: the workload's; at most {CPU_MAX_SEQ} on a CPU)")}


def shape_for(wl: Workload, device: Device, max_seq: int) -> AttentionShape:
    m = wl.model
    cap = max_seq or (CPU_MAX_SEQ if device.identity.backend == "cpu" else m.seq_len)
    return AttentionShape(m.micro_batch, m.heads // m.tp, max(1, m.kv_heads // m.tp), min(m.seq_len, cap),
                          m.head_dim, causal=True)


@dataclass(frozen=True)
class AttentionCase:
    shape: AttentionShape
    dist: str
    seed: int

    @property
    def group_id(self) -> CaseId:
        return CaseId("attention", (self.dist, self.shape.token()))

    def case_id(self, ev: int, edo: int) -> str:
        return str(self.group_id.with_scale(ev, edo))

    def operands(self, device: Device) -> AttentionOperands:
        s, gid = self.shape, str(self.group_id)
        q_shape, kv_shape = (s.batch, s.q_heads, s.seq, s.head_dim), (s.batch, s.kv_heads, s.seq, s.head_dim)
        draw = lambda shape, name: device.generate(shape, self.dist, case_seed(self.seed, gid, name))
        return AttentionOperands(draw(q_shape, "Q"), draw(kv_shape, "K"), draw(kv_shape, "V"), draw(q_shape, "dO"), s.causal)


def plan_cases(wl: Workload, device: Device, config: ProbeConfig, max_seq: int) -> list[AttentionCase]:
    shape = shape_for(wl, device, max_seq)
    cases = [AttentionCase(shape, dist, config.seed) for dist in wl.scan.distributions]
    if config.case is not None:
        cid = CaseId.parse(config.case)
        cases = [c for c in cases if cid.extends(c.group_id)]
        if not cases or cid.scale not in SCALES:
            raise ConfigError(f"case {config.case!r}: the attention probe has no such case on {device.identity.id} "
                              f"(its cases: attention/DIST/{shape.token()}/SCALE with DIST one of "
                              f"{', '.join(wl.scan.distributions)} and SCALE one of {', '.join(scale_token(*s) for s in SCALES)})")
    return cases


def case_bytes(s: AttentionShape) -> int:
    """Peak memory of one case: bf16 operands and outputs (and their scaled copies), the fp64
    reference (7 tensors of B·H·S·D) and its row chunk of P, dP, dS, |dO|·|V|ᵀ (256 rows)."""
    bhsd = s.batch * s.q_heads * s.seq * s.head_dim
    return 120 * bhsd + 6 * 8 * s.batch * s.q_heads * min(s.seq, 256) * s.seq


def preflight(devices: list[Device], ctx: ProbeContext) -> None:
    for d in devices:
        wl = workload_for(ctx.config, d)
        shape = shape_for(wl, d, ctx.option("attention", "max_seq"))
        if d.identity.backend != "cpu" and shape.head_dim > 128:
            raise ConfigError(f"workload {wl.name!r}: attention head dim {shape.head_dim}; the CUDA kernels take up to 128")
        plan_cases(wl, d, ctx.config, ctx.option("attention", "max_seq"))
        short = memory_shortfall(d, case_bytes(shape))
        if short is not None:
            raise ConfigError(f"workload {wl.name!r}: attention {shape.token()} needs about "
                              f"{case_bytes(shape) / 2**30:.1f} GiB on {d.identity.id}, {short[1]}; lower attention.max_seq")


def count_cases(devices: list[Device], config: ProbeConfig) -> int:
    """The cases the probe runs over ``devices`` (a --case at a scale also runs the base scale)."""
    if config.case is not None:
        return (1 if CaseId.parse(config.case).scale == (0, 0) else 2) * len(devices)
    return sum(len(SCALES) * len(workload_for(config, d).scan.distributions) for d in devices)


def run_pass(device: Device, ops: AttentionOperands, fault: FaultPlan | None, cid: str, scale: float | None = None):
    """Forward and backward of case ``cid`` on ``device`` at softmax ``scale`` (default 1/√D):
    the launch ops ``cid:fwd`` and ``cid:bwd`` are where ``fault``'s positions are drawn (at
    every scale of the case alike)."""
    sc = ops.shape.scale if scale is None else scale
    fwd = device.attention_forward(ops.q, ops.k, ops.v, causal=ops.causal, scale=sc, fault=fault, op=f"{cid}:fwd")
    bwd = device.attention_backward(ops.q, ops.k, ops.v, fwd.o, fwd.lse, ops.do, causal=ops.causal, scale=sc,
                                    fault=fault, op=f"{cid}:bwd")
    return fwd, bwd


def check_pass(device: Device, ops: AttentionOperands, ref, th: sums.AttentionThresholds, fault: FaultPlan | None,
               cid: str, expected: dict | None):
    """run_pass of ``ops`` and the attention checks on its outputs: (forward, backward, Checked)."""
    fwd, bwd = run_pass(device, ops, fault, cid)
    return fwd, bwd, checks.check_attention(ops, fwd, bwd, ref, ops.shape.scale, th, expected=expected)


@dataclass
class ScaledRun:
    """One scale of a case (V·2^ev, dO·2^edo) as ``scaled_runs`` ran it; ``checked`` None: the
    scaling would not be exact for these inputs, nothing ran."""

    ev: int
    edo: int
    ops: AttentionOperands | None = None
    ref: object = None  # the fp64 reference, rescaled
    expected: dict | None = None  # the base run's outputs scaled; None for the base run itself
    fwd: object = None
    bwd: object = None
    checked: checks.Checked | None = None


def scaled_runs(device: Device, base_ops: AttentionOperands, base_ref, th: sums.AttentionThresholds,
                fault: FaultPlan | None, cid_of, keep=lambda _ev, _edo: True):
    """The runs of one case as the probe makes them (module docstring), lazily, in the order of
    SCALES (those ``keep(ev, edo)`` keeps): the inputs scaled exactly, forward and backward through
    the checks against the fp64 reference rescaled and, after the first run (the base), against
    the base run's outputs scaled. ``cid_of(ev, edo)``: the run's case id, where ``fault`` draws
    its positions."""
    base = None
    for ev, edo in SCALES:
        if not keep(ev, edo):
            continue
        if not sums.pow2_safe(base_ops, base_ref, ev, edo):
            yield ScaledRun(ev, edo)
            continue
        ops = sums.scaled_operands(base_ops, ev, edo)
        ref = base_ref.rescaled(ev, edo)
        expected = checks.expected_at(base, ev, edo) if base is not None else None
        fwd, bwd, checked = check_pass(device, ops, ref, th, fault, cid_of(ev, edo), expected)
        if base is None:
            base = checks.outputs_of(fwd, bwd)
        yield ScaledRun(ev, edo, ops, ref, expected, fwd, bwd, checked)


@dataclass
class Stats:
    cases: int = 0
    runs: int = 0
    skipped_scales: int = 0
    clean_max: dict[str, float] = field(default_factory=dict)  # per invariant: largest normalised difference under τ
    clean_ratio: float = 0.0  # largest (clean difference ÷ τ) over every invariant
    shape: dict = field(default_factory=dict)
    seconds: float = 0.0


class AttentionProbe:
    def __init__(self, device: Device, th: sums.AttentionThresholds, *, reruns: int, confirm_margin: float,
                 fault: FaultPlan | None, on_case=None, stop=None):
        self.device, self.th, self.reruns, self.confirm_margin, self.fault = device, th, reruns, confirm_margin, fault
        self.on_case = on_case or (lambda _cid: None)
        # stop(cid): whether the device stops at the FAULTY confirmed in case ``cid`` (fail-fast, Tally.stop)
        self.stop = stop or (lambda _cid: False)
        self.skipped: list[str] = []  # case ids fail-fast left unrun
        self.failed_runs = 0  # runs (forward and backward) with any signal
        self.stats = Stats()

    def _once(self, ops: AttentionOperands, ref, expected, cid: str):
        fwd, bwd, checked = check_pass(self.device, ops, ref, self.th, self.fault, cid, expected)
        self._count(checked)
        return fwd, bwd, checked

    def _count(self, checked: checks.Checked) -> None:
        self.stats.runs += 1
        self.failed_runs += bool(checked.signals)

    def run(self, case: AttentionCase, only: str | None = None) -> list[Evidence]:
        t0 = time.perf_counter()
        base_ops = case.operands(self.device)
        base_ref = self.device.attention_reference(base_ops, case.shape.scale)
        self.stats.cases += 1
        evidence = []
        keep = lambda ev, edo: only is None or (ev, edo) == (0, 0) or case.case_id(ev, edo) == only
        for x in scaled_runs(self.device, base_ops, base_ref, self.th, self.fault, case.case_id, keep):
            cid = case.case_id(x.ev, x.edo)
            if x.checked is None:
                if cid == only:
                    raise ConfigError(f"case {cid!r} cannot run with seed {case.seed}: the scale would take these inputs "
                                      "out of the range where scaling V and dO is exact")
                self.stats.skipped_scales += 1
                self.on_case(cid)
                continue
            self._count(x.checked)
            self._note(x.checked)
            found = self._confirm(case, x) if x.checked.signals and (only is None or cid == only) else []
            evidence += found
            self.on_case(cid)
            if any(e.severity is Verdict.FAULTY for e in found) and self.stop(cid):
                rest = [case.case_id(*sc) for sc in SCALES[SCALES.index((x.ev, x.edo)) + 1:]]
                self.skip([r for r in rest if only is None or r == only])
                break
        self.stats.seconds += time.perf_counter() - t0
        return evidence

    def skip(self, case_ids: list[str]) -> None:
        """Cases fail-fast leaves unrun, named in the report (the scan counts them as progress)."""
        self.skipped += case_ids

    def _note(self, checked: checks.Checked) -> None:
        for name, v in checked.clean_max.items():
            self.stats.clean_max[name] = max(self.stats.clean_max.get(name, 0.0), v)
            self.stats.clean_ratio = max(self.stats.clean_ratio, v / checked.tau[name])

    def _confirm(self, case: AttentionCase, x: ScaledRun) -> list[Evidence]:
        """Re-run the flagged run ``x``; each signal is judged by how often it came back and whether
        the runs' bits agreed (the kernels are deterministic)."""
        ev, edo, fwd, bwd, checked = x.ev, x.edo, x.fwd, x.bwd, x.checked
        cid = case.case_id(ev, edo)
        fp = lambda f, b: tuple(self.device.fingerprint(t) for t in checks.outputs_of(f, b).values())
        prints = {fp(fwd, bwd)}
        seen = {s.check: 0 for s in checked.signals}
        for _ in range(self.reruns):
            f2, b2, c2 = self._once(x.ops, x.ref, x.expected, cid)
            prints.add(fp(f2, b2))
            for s in c2.signals:
                if s.check in seen:
                    seen[s.check] += 1
        out = []
        for sig in checked.signals:
            tau = checked.tau.get(sig.tensor) if sig.check in checks.INVARIANT_CHECKS else None
            j = checks.judge_signal(sig, distinct_outputs=len(prints), reproducible=seen[sig.check] == self.reruns,
                                    tau=tau, confirm_margin=self.confirm_margin)
            out.append(self._evidence(case, ev, edo, sig, tau, seen[sig.check], len(prints), j, fwd, bwd))
        return out

    def _evidence(self, case, ev, edo, sig, tau, reproduced, distinct, j, fwd, bwd) -> Evidence:
        s, cid = case.shape, case.case_id(ev, edo)
        samples, blocks = _samples(sig), sorted({tuple(x) for x in _blocks(sig)})
        ev_ = Evidence(check=sig.check, severity=j.severity, case_id=cid, summary="", op="attention",
                       shape={"batch": s.batch, "q_heads": s.q_heads, "kv_heads": s.kv_heads, "seq": s.seq,
                              "head_dim": s.head_dim, "causal": s.causal},
                       dist=case.dist, scale=[ev, edo], seed=case.seed, threshold=tau, max_value=sig.max_value,
                       margin=judge.margin(sig.max_value, tau) if tau else None, elements=sig.elements, samples=samples,
                       tiles=[list(b) for b in blocks][:16], reruns=self.reruns, reproduced=reproduced,
                       distinct_outputs=distinct, kernel=f"{fwd.kernel}/{bwd.kernel}",
                       injected=recent_injections(self.fault, case=cid))
        where = f"{sig.tensor} " + ", ".join(f"{k}={v}" for k, v in samples[0].items() if k in _NAMES) if samples else ""
        ev_.summary = (f"{sig.check}: {sig.elements} value(s) flagged at V·2^{ev}, dO·2^{edo} ({where}); "
                       f"failed {reproduced + 1} of {self.reruns + 1} runs; {j.why}")
        return ev_


_NAMES = ("head", "kv_head", "query_block", "key_block", "column")


def _blocks(sig: checks.AttentionSignal) -> list[tuple[int, int]]:
    """(head, query or key block) of each flagged position that names one."""
    out = []
    for pos in sig.where[:4096].tolist():
        p = sig.position(tuple(pos), BLOCK)
        block = p.get("query_block", p.get("key_block"))
        if block is not None:
            out.append((p.get("head", p.get("kv_head")), block))
    return out


def _samples(sig: checks.AttentionSignal) -> list[dict]:
    """The largest differences (invariants), else the first positions, with what was seen."""
    host = {k: t.cpu() for k, t in (("observed", sig.observed), ("expected", sig.expected),
                                     ("normalised_diff", sig.diff)) if t is not None}  # one copy each, not one per sample
    if "normalised_diff" in host:
        d = host["normalised_diff"]
        flat = torch.topk(d.reshape(-1), min(MAX_SAMPLES, sig.elements)).indices
        coords = torch.stack(torch.unravel_index(flat, d.shape), 1).tolist()
    else:
        coords = sig.where[:MAX_SAMPLES].tolist()
    out = []
    for c in coords:
        sample = sig.position(tuple(c), BLOCK)
        sample.update({k: float(t[tuple(c)]) for k, t in host.items()})
        out.append(sample)
    return out


@register("attention", OPTIONS, preflight=preflight, count_cases=count_cases)
def attention_probe(device: Device, ctx: ProbeContext) -> list[Evidence]:
    """Checked flash attention, forward and backward, on the workload's attention shape."""
    config = ctx.config
    wl = workload_for(config, device)
    max_seq = ctx.option("attention", "max_seq")
    probe = AttentionProbe(device, sums.AttentionThresholds(), reruns=config.reruns,
                           confirm_margin=config.thresholds.confirm_margin, fault=ctx.fault,
                           on_case=lambda cid: ctx.progress("case", device=device.identity.id, case=cid), stop=ctx.tally.stop)
    evidence: list[Evidence] = []
    cases = plan_cases(wl, device, config, max_seq)
    tally = ctx.tally.probe("attention")
    for i, case in enumerate(cases):
        found = probe.run(case, only=config.case)
        shown: set[str] = set()
        for ev in found:  # each case given in full counts once, whatever number of its checks fired
            tally.flagged(ev.case_id, ev.check, ev.reruns + 1, ev.reproduced + 1, shown=ev.case_id not in shown)
            shown.add(ev.case_id)
        evidence += found
        if ctx.tally.stopped:  # fail-fast stopped in this case: the later cases are skipped
            probe.skip([c.case_id(ev, edo) for c in cases[i + 1:] for ev, edo in SCALES])
            break
    tally.skipped += probe.skipped
    tally.launches += probe.stats.runs
    tally.failed += probe.failed_runs
    st = probe.stats
    st.shape = {"token": cases[0].shape.token(), "workload": wl.name} if cases else {}
    ctx.stats["attention"] = {**st.__dict__, "tau": dict(sums.DEFAULT_TAU)}
    return evidence
