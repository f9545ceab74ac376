"""vTasks of kind ``attention`` (docs/bundle-format.md §3.5): a scan's flagged attention case
saved with its inputs and what was observed, and its replay on any device.

Capture: the scan's draw of Q, K, V, dO (probes/attention.py, bit for bit on the device that drew
it) at the case's scale, and one forward+backward re-run of it with the scan's faults (the scan
keeps no attention run), one vTask per flagged check. Replay: ``repeat`` runs of forward and
backward through checks/attention.py against the fp64 reference of the stored inputs, each run
bit for bit against the others and, at a scaled capture, against the base scale's run scaled
back (V·2^-a, dO·2^-b restore it exactly); an injected fault lands where it landed at capture
(the launch ops are the capture's, ``CASE:fwd`` and ``CASE:bwd``).
"""

from __future__ import annotations

import torch

from aegis_cli.backends.base import Device
from aegis_cli.checks import attention as checks
from aegis_cli.faults.spec import FaultPlan, recent_injections
from aegis_cli.ops import attention_sums as sums
from aegis_cli.ops.attention import AttentionBackward, AttentionForward, AttentionOperands, AttentionShape
from aegis_cli.ops.fingerprint import int_view
from aegis_cli.ops.verdict import Evidence, Verdict, worst
from aegis_cli.probes.attention import AttentionCase, case_bytes, run_pass
from aegis_cli.vtask.capture import vtask_id
from aegis_cli.vtask.manifest import NOT_ID
from aegis_cli.vtask.model import ATTENTION_INPUTS, AttentionSpec, VTask

RERUN = "re-run at save time on the capturing device"
_OUTCOMES = {"reproduced": "reproduced here", "not_reproduced": "not reproduced here",
             "inconsistent": "inconsistent between runs"}


def _flat(t: torch.Tensor) -> torch.Tensor:
    """A (B, H, …) tensor as a bundle stores it: 2-D, on the host."""
    return t.detach().to("cpu").reshape(-1, t.shape[-1]).contiguous()


def capture_scan_case(device: Device, evidence: list[Evidence], fault: FaultPlan | None, provenance: dict) -> list[VTask]:
    """The vTasks of one flagged attention case of a scan (``evidence``: its findings at one scale)."""
    ev = evidence[0]
    s = ev.shape
    shape = AttentionShape(s["batch"], s["q_heads"], s["kv_heads"], s["seq"], s["head_dim"], s["causal"])
    ops = sums.scaled_operands(AttentionCase(shape, ev.dist, ev.seed).operands(device), *ev.scale)
    fwd, bwd = run_pass(device, ops, fault, ev.case_id)
    return capture_observed(ops, fwd, bwd, evidence, scale=shape.scale, source=RERUN, provenance=provenance,
                            draw=(tuple(ev.scale), ev.seed, ev.dist))


def capture_observed(ops: AttentionOperands, fwd: AttentionForward, bwd: AttentionBackward, evidence: list[Evidence], *,
                     scale: float, source: str, provenance: dict, confirm_margin: float = 1.0,
                     draw: tuple[tuple[int, int], int, str] | None = None) -> list[VTask]:
    """One vTask per piece of ``evidence`` (the findings of one forward+backward run: ``ops`` at
    softmax ``scale``, its outputs ``fwd`` and ``bwd``; ``source`` says how those were obtained;
    ``confirm_margin`` as the findings were judged). ``draw``: (input scale, seed, distribution)
    of a scan's seeded draw; None for inputs that are no draw (a training step's, at their own
    scale). Each finding's case id names the run's launches (``CASE:fwd``, ``CASE:bwd``), where a
    replay's injected faults land; its vTask id is that case id with what an id may not hold
    replaced."""
    (ea, eb), seed, dist = draw or ((0, 0), None, None)
    sh = ops.shape
    spec = AttentionSpec(sh.batch, sh.q_heads, sh.kv_heads, sh.seq, sh.head_dim, sh.causal, scale)
    tensors = {"q": _flat(ops.q), "k": _flat(ops.k), "v": _flat(ops.v), "do": _flat(ops.do),
               **{k: _flat(t) for k, t in checks.outputs_of(fwd, bwd).items()}}
    out = []
    for e in evidence:
        observed = {"severity": e.severity.value, "summary": e.summary[:4096], "elements": e.elements,
                    "reruns": e.reruns, "reproduced": e.reproduced, "distinct_outputs": e.distinct_outputs,
                    "source": source, "samples": [{k: v for k, v in x.items() if isinstance(v, (int, float, str))}
                                                  for x in e.samples[:8]]}
        if e.max_value is not None:
            observed["max_normalised_diff"] = e.max_value
        vid = NOT_ID.sub("_", vtask_id(provenance, e.case_id, e.check))
        out.append(VTask(id=vid, check=e.check, op="attention", gemm=None, attention=spec, kind="attention",
                         tensors=tensors, tau=e.threshold if e.threshold is not None else 1.0,
                         normalisation="rounding-spread", confirm_margin=confirm_margin, scale=(ea, eb), case_id=e.case_id,
                         seed=seed, dist=dist, observed=observed, provenance=provenance))
    return out


def replay_bytes(vt: VTask) -> int:
    """Upper estimate of the memory replaying ``vt`` holds (probes.attention.case_bytes' rule)."""
    a = vt.attention
    return 2 * case_bytes(AttentionShape(a.batch, a.q_heads, a.kv_heads, a.seq, a.head_dim, a.causal))


def replay(device: Device, vt: VTask, repeat: int, fault: FaultPlan | None, bundle: str) -> tuple[dict, Evidence | None]:
    """Replay one attention vTask ``repeat`` times; (outcome for the report, evidence or None)."""
    a = vt.attention
    ops = AttentionOperands(*(vt.full(r).to(device.torch_device) for r in ATTENTION_INPUTS), a.causal)
    cid = vt.case_id or vt.id  # the capture's launch ops: injected faults land where they landed then
    ref = device.attention_reference(ops, a.scale)
    th = sums.AttentionThresholds()
    expected = None
    ev_, edo = vt.scale
    if (ev_, edo) != (0, 0):  # the base scale, restored exactly: every run must be its outputs, scaled
        base = sums.scaled_operands(ops, -ev_, -edo)
        expected = checks.expected_at(checks.outputs_of(*run_pass(device, base, fault, cid, a.scale)), ev_, edo)
    prints, fired, first = set(), {}, None
    for _ in range(repeat):
        fwd, bwd = run_pass(device, ops, fault, cid, a.scale)
        c = checks.check_attention(ops, fwd, bwd, ref, a.scale, th, expected=expected)
        prints.add(tuple(device.fingerprint(t) for t in checks.outputs_of(fwd, bwd).values()))
        for s in c.signals:
            fired.setdefault(s.check, [s, c.tau.get(s.tensor), 0])[2] += 1
        first = first or (fwd, bwd)
    distinct = len(prints)
    outcome = "inconsistent" if distinct > 1 else "reproduced" if fired else "not_reproduced"
    judged = {k: checks.judge_signal(s, distinct_outputs=distinct, reproducible=n == repeat, tau=tau if k in checks.INVARIANT_CHECKS
                                     else None, confirm_margin=vt.confirm_margin) for k, (s, tau, n) in fired.items()}
    severity = worst([Verdict.HEALTHY, *(j.severity for j in judged.values())]) if distinct == 1 else Verdict.FAULTY
    observed = checks.outputs_of(*first)
    same = all(r in vt.tensors and torch.equal(int_view(_flat(t)), int_view(vt.tensors[r])) for r, t in observed.items())
    matches = same if all(r in vt.tensors for r in observed) else None
    prov = vt.provenance
    meaning = {"reproduced": "the captured fault shows again here" + (" (the capture had faults injected on purpose)"
                                                                          if prov.get("injected") else ""),
               "not_reproduced": "not seen here: an intermittent fault, a transient, or the capturing device alone"
                                 + (" — the capture had faults injected on purpose: replay with the same --inject"
                                    if prov.get("injected") else ""),
               "inconsistent": "runs of the deterministic kernels gave different bits: corruption on this device"}[outcome]
    out = {"id": vt.id, "kind": "attention", "check": vt.check, "case_id": vt.case_id, "op": vt.op,
           "shape": a.to_json(), "capture_scale": list(vt.scale), "outcome": outcome, "label": _OUTCOMES[outcome],
           "severity": severity.value, "checks_fired": sorted(fired), "captured_check_fired": vt.check in fired,
           "runs": repeat, "distinct_outputs": distinct, "matches_capture": matches, "meaning": meaning,
           "captured_on": prov.get("gpu_uuid", prov.get("device_id", "?"))}
    if outcome == "not_reproduced":
        return out, None
    check = vt.check if vt.check in fired else (sorted(fired)[0] if fired else "replay.nondeterministic")
    sig, tau, n = fired.get(check, (None, None, 0))
    ev = Evidence(check=check, severity=severity, case_id=vt.case_id or vt.id,
                  summary=f"vTask {vt.id} from {bundle}: {out['label']} ({', '.join(sorted(fired)) or 'bits differ between runs'}); "
                          f"{meaning}" + (f"; {judged[check].why}" if check in judged else ""),
                  op="attention", shape=a.to_json(), dist=vt.dist or "", scale=list(vt.scale), seed=vt.seed or 0,
                  threshold=tau, max_value=sig.max_value if sig else None, elements=sig.elements if sig else 0,
                  reruns=repeat - 1, reproduced=max(n - 1, 0), distinct_outputs=distinct, injected=recent_injections(fault))
    return out, ev
