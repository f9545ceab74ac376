"""Verifying a flagged GEMM off the critical path (docs/sensors.md §3), with the scan's own checks
and judgement: every GEMM check of the observed run against the full fp64 reference
(checks/gemm.py), re-runs of the same operands on the same device compared bit for bit, the
flagged checksums recomputed in fp64 from the operands (checks/recompute.py), and the verdict of
checks/judge.py. FAULTY confirms the suspicion; SUSPECT or HEALTHY clears it."""

from __future__ import annotations

from dataclasses import dataclass

from aegis_cli.checks import gemm as checks
from aegis_cli.checks import judge
from aegis_cli.checks import recompute as recheck
from aegis_cli.checks.gemm import CHECKSUM_CHECKS
from aegis_cli.faults.spec import recent_injections
from aegis_cli.ops.gemm import GemmResult, ReferenceChecksums
from aegis_cli.ops.verdict import Evidence, Verdict, worst
from aegis_cli.sensors.sense import GemmContext

MAX_SAMPLES = 8
MAX_LOCALISED = 16


@dataclass
class GemmOutcome:
    severity: Verdict
    evidence: list[Evidence]
    reference: ReferenceChecksums
    doubted: bool = False  # cleared because rounding of these inputs can reach the flag
    summary: str = ""


def _samples(sig: checks.Signal) -> list[dict]:
    """The worst flagged positions of a checksum signal (the first ones of any other) with the
    values the check compared."""
    if sig.check in CHECKSUM_CHECKS:
        out = []
        for r, c in recheck.worst_positions(sig, MAX_SAMPLES).tolist():
            out.append({**sig.position(r, c), "observed": float(sig.observed[r, c]), "expected": float(sig.expected[r, c]),
                        "normalised_diff": float(sig.diff[r, c])})
        return out
    return [sig.position(r, c) for r, c in sig.where[:MAX_SAMPLES].tolist()]


def verify_gemm(ctx: GemmContext, site: str, reruns: int, confirm_margin: float) -> GemmOutcome:
    """Judge one flagged launch (``site``: its op id) by ``reruns`` re-runs and fp64 recomputation."""
    dev, ops, res = ctx.device, ctx.operands, ctx.result
    ref = dev.reference_checksums(ops, res.tile)
    first = checks.check_gemm(res, ref, ctx.tau)

    def prints(r: GemmResult) -> tuple[int, int, int]:
        return dev.fingerprint(r.c), dev.fingerprint(r.row_sums), dev.fingerprint(r.col_sums)

    seen_prints = {prints(res)}
    fired = {s.check: 0 for s in first.signals}
    for _ in range(reruns):
        again = dev.checked_gemm(ops, ctx.fault, op=site)
        seen_prints.add(prints(again))
        for s in checks.check_gemm(again, ref, ctx.tau).signals:
            if s.check in fired:
                fired[s.check] += 1
    m, n, k = ops.mnk
    tm, tn = res.tile
    by_check = {s.check: s for s in first.signals}
    loc = checks.localise(by_check.get("gemm.row_checksum"), by_check.get("gemm.col_checksum"), tm, tn, MAX_LOCALISED)
    tile_sm = res.tile_sm.cpu() if res.tile_sm is not None else None
    evidence, doubted = [], False
    for sig in first.signals:
        tiles = sig.tiles(tm, tn)
        ev = Evidence(check=sig.check, severity=Verdict.SUSPECT, case_id=site, summary="", op=ctx.layer, layout=ops.layout.value,
                      shape={"m": m, "n": n, "k": k}, elements=sig.elements, samples=_samples(sig),
                      tiles=[list(t) for t in tiles][:MAX_LOCALISED],
                      sms=sorted({int(tile_sm[t]) for t in tiles}) if tile_sm is not None else [],
                      localised=loc if sig.check in CHECKSUM_CHECKS else sig.where[:MAX_LOCALISED].tolist() if sig.axes == "element" else [],
                      reruns=reruns, reproduced=fired[sig.check], distinct_outputs=len(seen_prints), kernel=res.kernel,
                      injected=recent_injections(ctx.fault, case=site), max_value=sig.max_value)
        rc = None
        if sig.check in CHECKSUM_CHECKS:
            ev.threshold, ev.margin = ctx.tau, judge.margin(sig.max_value, ctx.tau)
            rc = recheck.recompute(ops, res, sig.axes, recheck.worst_positions(sig))
            ev.recompute = rc.to_dict() if rc is not None else None
        j = judge.judge((sig.check,), distinct_outputs=len(seen_prints), reproducible=fired[sig.check] == reruns,
                        margin=ev.margin, confirm_margin=confirm_margin, recompute=rc)
        doubted |= j.doubted
        ev.severity = j.severity
        ev.summary = (f"{sig.check}: {sig.elements} element(s) flagged in training; failed {fired[sig.check] + 1} of "
                      f"{reruns + 1} runs; {j.why}")
        evidence.append(ev)
    if not evidence:  # flagged at a τ since raised, or by a sum that no longer reads over it: nothing to confirm
        return GemmOutcome(Verdict.HEALTHY, [], ref, summary="no check fires on the observed run at its τ")
    severity = worst(e.severity for e in evidence)
    lead = max(evidence, key=lambda e: e.severity.rank)
    return GemmOutcome(severity, evidence, ref, doubted=doubted and severity is not Verdict.FAULTY, summary=lead.summary)
