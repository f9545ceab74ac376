"""A scan's flagged GEMM cases as vTasks in one bundle (``aegis scan --save-vtasks``).

The report hands over everything: each flagged case's evidence names its draw (layout,
shape, distribution, seed, case id), the runs the scan kept as observed sit in
``DeviceReport.captured``, and the report holds τ, the confirm margin and the injected
faults. Only what the scan did not keep is made again here: the operands always (the scan's
draw, bit for bit on the device that drew them), and C and the fused sums of a case the scan
could not keep within its memory budget (one re-run, which an intermittent fault may not repeat).
"""

from __future__ import annotations

import os

from aegis_cli.backends import resolve_devices
from aegis_cli.backends.base import Device, DeviceIdentity
from aegis_cli.checks.attention import ATTENTION_CHECKS
from aegis_cli.checks.gemm import GEMM_CHECKS
from aegis_cli.faults.spec import FaultPlan
from aegis_cli.ops.case import CaseId
from aegis_cli.ops.gemm import GemmOperands, GemmResult, Layout
from aegis_cli.ops.numerics import Thresholds
from aegis_cli.ops.verdict import Evidence
from aegis_cli.probes.gemm import clean_median, draw_operands, scaled
from aegis_cli.report import Report
from aegis_cli.vtask import attention
from aegis_cli.vtask.bundle import BundleWriter
from aegis_cli.vtask.capture import ObservedGemm, capture_gemm
from aegis_cli.vtask.provenance import device_provenance

KEPT = "the flagged scan run, as observed"
RERUN = "re-run at save time on the capturing device"


def scan_operands(device: Device, ev: Evidence) -> GemmOperands:
    """The base operands of the evidence's case group, drawn as the scan drew them."""
    s = ev.shape
    return draw_operands(device.generate, Layout(ev.layout), s["m"], s["n"], s["k"], ev.dist, ev.seed,
                         str(CaseId.parse(ev.case_id).group))


def observed_run(device: Device, evidence: list[Evidence], base: GemmOperands, kept: GemmResult | None,
                 fault: FaultPlan | None) -> ObservedGemm:
    """One flagged case (``evidence``, all at one scale; ``base``: its group's operands) as it
    ran: ``kept`` when the scan kept the flagged run, else one re-run (with ``fault`` when the
    scan injected one)."""
    ev = evidence[0]
    ops = scaled(base, *ev.scale)
    if kept is not None:
        res, source = kept, KEPT
    else:
        med = None
        if fault is not None and fault.needs_clean_median():
            med = clean_median(device, base, device.reference_checksums(base, device.tile))
        res, source = device.checked_gemm(ops, fault, op=ev.case_id, clean_median=med), RERUN
    return ObservedGemm(ops, res, case_id=ev.case_id, op=ev.op, scale=(ev.scale[0], ev.scale[1]), seed=ev.seed,
                        dist=ev.dist, source=source)


def scan_provenance(report: Report, ident: DeviceIdentity, workload: str, injected: bool) -> dict:
    """Where and how a scan ran on one device, for its vTasks (None values left out)."""
    rank = os.environ.get("RANK")
    # injected: this device's flagged cases had faults put in on purpose (not: some device had)
    return device_provenance(ident, rank=int(rank) if rank and rank.isdigit() else None,
                             job=f"aegis scan (workload {workload}, seed {report.seed})", captured=report.started,
                             command_line=report.command_line, injected=injected)


def _flagged(dr, report: Report, plan: FaultPlan | None, checks) -> tuple | None:
    """One device's findings of ``checks`` by case id, with the device, its faults and the
    provenance of its vTasks; None where it has none."""
    found = [e for e in dr.evidence if e.check in checks]
    if not found:
        return None
    by_case: dict[str, list[Evidence]] = {}
    for e in found:
        by_case.setdefault(e.case_id, []).append(e)
    return (resolve_devices(dr.identity.id)[0], plan.for_device(dr.identity.id) if plan else None,
            scan_provenance(report, dr.identity, dr.workload, any(e.injected for e in found)), by_case)


def save_scan_vtasks(report: Report, path: str | os.PathLike) -> int:
    """Save every flagged GEMM case of a scan as vTasks in one bundle; returns how many.
    Attention findings become vTasks of kind attention (vtask/attention.py); evidence of other
    checks is skipped (no vTask kind for it yet)."""
    thresholds = Thresholds(tau=report.tau, confirm_margin=report.options["confirm_margin"])
    plan = FaultPlan.parse(report.injected[0]) if report.injected else None  # a scan's one --inject spec
    writer = BundleWriter(path)
    for dr in report.devices:
        flagged = _flagged(dr, report, plan, ATTENTION_CHECKS)
        if flagged is not None:  # one vTask per finding, a re-run's outputs (vtask/attention.py)
            device, fault, prov, by_case = flagged
            for evs in by_case.values():
                for vt in attention.capture_scan_case(device, evs, fault, prov):
                    writer.add(vt)
        flagged = _flagged(dr, report, plan, GEMM_CHECKS)
        if flagged is None:
            continue
        device, fault, prov, by_case = flagged
        # a group's flagged scales come one after another and share its draw: drawn once for them all
        drawn: tuple[tuple, GemmOperands] | None = None  # ((group, seed), base operands)
        for cid, evs in by_case.items():
            key = (str(CaseId.parse(cid).group), evs[0].seed)
            if drawn is None or drawn[0] != key:
                drawn = key, scan_operands(device, evs[0])
            run = observed_run(device, evs, drawn[1], dr.captured.get(cid), fault)
            # τ as the checksum checks used it; an exact check's evidence carries none
            tau = next((e.threshold for e in evs if e.threshold is not None), None)
            tau = tau if tau is not None else thresholds.tau
            ref = device.reference_checksums(run.operands, run.result.tile)  # τ is in units of this device's noise
            for vt in capture_gemm(run, evs, tau=tau, confirm_margin=thresholds.confirm_margin, provenance=prov, reference=ref):
                writer.add(vt)
    return writer.finalise()
