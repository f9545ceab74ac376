"""Capture: a scan's flagged GEMM evidence as vTasks in a bundle (DESIGN §3)."""

from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING

import torch

from aegis_cli.checks.gemm import CHECKSUM_CHECKS, GEMM_CHECKS
from aegis_cli.ops.gemm import GemmResult
from aegis_cli.vtask.bundle import BundleWriter
from aegis_cli.vtask.model import MAX_SAMPLES, MAX_STRING, GemmSpec, VTask

if TYPE_CHECKING:
    from aegis_cli.report import Report, RunOptions

FULL_OPERANDS_LIMIT = 16 << 20  # writer policy: full operands up to this many bytes per vTask
MAX_SUBSET = 1024  # writer policy: at most this many flagged rows/columns in a subset vTask


def _flag_sets(res, ref, tau: float) -> tuple[list[int], list[int]]:
    from aegis_cli.ops import numerics

    if res.row_sums.device != ref.row.device:  # a flagged run the scan kept in host memory
        res = dataclasses.replace(res, row_sums=res.row_sums.to(ref.row.device), col_sums=res.col_sums.to(ref.row.device))
    d_row, d_col = numerics.checksum_diffs(res, ref)  # (M, nt_n), (nt_m, N)
    return ((d_row > tau).any(1).nonzero().flatten().cpu().tolist(), (d_col > tau).any(0).nonzero().flatten().cpu().tolist())


def _sample_rows(ev, key: str) -> list[int]:
    out = {int(s[key]) for s in ev.samples if isinstance(s.get(key), int)}
    out |= {int(p[0 if key == "row" else 1]) for p in ev.localised}
    return sorted(out)


def capture_gemm_vtasks(device, case, evidence: list, fault, tau: float, confirm_margin: float, provenance: dict,
                        flagged_run: GemmResult | None = None) -> list[VTask]:
    """vTasks for the flagged evidence of one GEMM case (all at one scale): regenerate the
    case's operands on ``device``; take C and the fused sums from ``flagged_run`` (the
    flagged run itself, as the scan saw it) or, without it, from one re-run (with ``fault``
    when the scan injected one), which an intermittent fault may not repeat; keep the full
    operands when small, else the flagged rows (row checks) or columns (column checks)."""
    from aegis_cli.ops import fingerprint
    from aegis_cli.probes.gemm import clean_median, scaled

    ea, eb = evidence[0].scale
    cid = evidence[0].case_id
    base = case.operands(device)
    ops = scaled(base, ea, eb)
    ref = device.reference_checksums(ops, device.tile)
    if flagged_run is not None:
        res, source = flagged_run, "the flagged scan run, as observed"
    else:
        med = None
        if fault is not None and fault.needs_clean_median():
            med = clean_median(device, base, device.reference_checksums(base, device.tile))
        res = device.checked_gemm(ops, fault, op=cid, clean_median=med)
        source = "re-run at save time on the capturing device"
    frows, fcols = _flag_sets(res, ref, tau)
    m, n, k = ops.mnk
    full_bytes = 2 * (m * k + k * n + m * n) + 4 * (res.row_sums.numel() + res.col_sums.numel())
    a, b = device.to_host(ops.a), device.to_host(ops.b)
    c, rs, cs = device.to_host(res.c), device.to_host(res.row_sums), device.to_host(res.col_sums)
    fps = {"c": fingerprint.hex64(fingerprint.fingerprint(c)), "row_sums": fingerprint.hex64(fingerprint.fingerprint(rs)),
           "col_sums": fingerprint.hex64(fingerprint.fingerprint(cs))}
    s = case.shape
    out = []
    for ev in evidence:
        own_rows, own_cols = _sample_rows(ev, "row"), _sample_rows(ev, "col")
        if ev.check in CHECKSUM_CHECKS:
            rows_flag, cols_flag = frows or own_rows, fcols or own_cols
        else:  # the output checks flag rows of their own, not necessarily the checksums' rows
            rows_flag, cols_flag = own_rows or frows, own_cols or fcols
        spec = GemmSpec(layout=s.layout, m=m, n=n, k=k, tile=tuple(res.tile), flagged_rows=rows_flag[:MAX_SUBSET],
                        flagged_cols=cols_flag[:MAX_SUBSET])
        truncated = False
        use_cols = ev.check == "gemm.col_checksum"
        if full_bytes <= FULL_OPERANDS_LIMIT or not (cols_flag if use_cols else rows_flag):
            tensors = {"a": a, "b": b, "c": c, "row_sums": rs, "col_sums": cs}
        elif use_cols:
            spec.cols = cols_flag[:MAX_SUBSET]
            truncated = len(cols_flag) > MAX_SUBSET
            idx = torch.tensor(spec.cols)
            _, b_sub = spec.sub_operands(a, b)
            tensors = {"a": a, "b": b_sub, "c": c[:, idx].contiguous(), "col_sums": cs[:, idx].contiguous()}
        else:
            spec.rows = rows_flag[:MAX_SUBSET]
            truncated = len(rows_flag) > MAX_SUBSET
            idx = torch.tensor(spec.rows)
            a_sub, _ = spec.sub_operands(a, b)
            tensors = {"a": a_sub, "b": b, "c": c[idx].contiguous(), "row_sums": rs[idx].contiguous()}
        observed = {"severity": ev.severity.value, "summary": ev.summary[:MAX_STRING], "max_normalised_diff": ev.max_value,
                    "margin": ev.margin, "elements": ev.elements, "reruns": ev.reruns, "reproduced": ev.reproduced,
                    "distinct_outputs": ev.distinct_outputs, "samples": [_clean_sample(x) for x in ev.samples[:MAX_SAMPLES]],
                    "fingerprints": fps, "source": source, "truncated": truncated}
        out.append(VTask(id=f"{provenance.get('device_id', 'dev')}/{cid}/{ev.check}", check=ev.check, op=s.op, gemm=spec,
                         tensors=tensors, tau=tau, confirm_margin=confirm_margin, scale=(ea, eb), case_id=cid,
                         seed=case.seed, dist=case.dist, observed={k: v for k, v in observed.items() if v is not None},
                         provenance={**provenance, "kernel": res.kernel}))
    return out


def _clean_sample(s: dict) -> dict:
    out = {}
    for k, v in s.items():
        if isinstance(v, (bool, int, str)) or (isinstance(v, list) and len(v) <= 4 and all(isinstance(e, int) for e in v)):
            out[k] = v[:256] if isinstance(v, str) else v
        elif isinstance(v, float):  # non-finite values are encoded with the whole manifest entry
            out[k] = v
    return out


def check_savable(opts: RunOptions, devices: list) -> None:
    """Refuse, before a scan with --save-vtasks starts, what no bundle could hold: vTask ids
    made from the workload's name and ops that are not valid ids, or a τ outside the range a
    bundle records. Found only when saving, after the scan, they cost the whole run."""
    from aegis_cli.ops.errors import ConfigError
    from aegis_cli.probes.gemm_scan import plan_cases, workload_for
    from aegis_cli.vtask.manifest import ID_RE, entry_problem
    from aegis_cli.vtask.model import TAU_RANGE

    check = max(GEMM_CHECKS, key=len)  # the longest of the ids capture_gemm_vtasks gives a case
    for d in devices:
        wl = workload_for(opts, d)
        for case in plan_cases(wl, opts.seed, opts.case):
            s = case.shape
            tau = opts.thresholds.tau_for(d, s.k)
            if not TAU_RANGE[0] <= tau <= TAU_RANGE[1]:
                raise ConfigError(f"--save-vtasks: τ = {tau:g} for {d.identity.id} at K = {s.k} is outside what a bundle "
                                  f"records ({TAU_RANGE[0]:g}…{TAU_RANGE[1]:g}); choose --threshold within it")
            spec = GemmSpec(layout=s.layout, m=s.m, n=s.n, k=s.k, tile=tuple(d.tile))
            for ea, eb in wl.scan.scales:
                cid = case.case_id(ea, eb)
                vid = f"{d.identity.id}/{cid}/{check}"
                if not ID_RE.fullmatch(vid):
                    raise ConfigError(f"--save-vtasks: workload {wl.name!r} gives vTask ids like {vid[:120]!r} that a bundle "
                                      f"cannot hold (1–256 characters from A-Za-z0-9._:/+=@-); rename the workload or its ops")
                problem = entry_problem(VTask(id=vid, check=check, op=s.op, gemm=spec, tensors={}, tau=tau, scale=(ea, eb),
                                              confirm_margin=opts.thresholds.confirm_margin, case_id=cid, seed=case.seed,
                                              dist=case.dist))
                if problem:
                    raise ConfigError(f"--save-vtasks: this scan's cases could not be saved as vTasks ({problem})")


def save_scan_vtasks(report: Report, opts: RunOptions, path: str | os.PathLike) -> int:
    """Save every flagged GEMM case of a scan as vTasks in one bundle; returns how many.

    Operands are regenerated deterministically (same workload, seed, case) on the device
    that flagged them. The observed C and fused sums are the flagged run's own when the scan
    kept it (``ScanOptions.keep_flagged`` → ``DeviceReport.captured``), else a re-run's.
    Evidence of non-GEMM checks is skipped (no vTask kind for it yet).
    """
    from aegis_cli.backends import resolve_devices
    from aegis_cli.backends.loader import kernel_hashes
    from aegis_cli.faults.spec import FaultPlan
    from aegis_cli.ops.provenance import versions
    from aegis_cli.probes.gemm_scan import plan_cases, workload_for

    plan = FaultPlan.parse(opts.inject) if opts.inject else None
    vers = versions()
    rank = os.environ.get("RANK")
    writer = BundleWriter(path)
    for dr in report.devices:
        ev_gemm = [e for e in dr.evidence if e.check in GEMM_CHECKS]
        if not ev_gemm:
            continue
        device = resolve_devices(dr.identity.id)[0]
        ident = dr.identity
        wl = workload_for(opts, device)  # the catalog the scan loaded (--workload may be a path)
        fault = plan.for_device(ident.id) if plan else None
        prov = {"host": ident.host, "device_id": ident.id, "gpu_name": ident.name, "gpu_uuid": ident.uuid,
                "gpu_serial": ident.serial, "pci_bus_id": ident.pci_bus_id, "rank": int(rank) if rank and rank.isdigit() else None,
                "job": f"aegis scan (workload {wl.name}, seed {opts.seed})", "captured": report.started,
                "command_line": [str(x)[:MAX_STRING] for x in report.command_line][:256],
                "versions": {k: v for k, v in {**vers, "driver": ident.driver, "cuda": vers.get("torch_cuda")}.items() if v},
                "kernel_hashes": kernel_hashes(),
                # this device's flagged cases had faults put in on purpose (not: some device had)
                "injected": any(e.injected for e in ev_gemm)}
        prov = {k: v for k, v in prov.items() if v is not None}
        by_case: dict[str, list] = {}
        for e in ev_gemm:
            by_case.setdefault(e.case_id, []).append(e)
        for cid, evs in by_case.items():
            case = plan_cases(wl, opts.seed, cid)[0]
            for vt in capture_gemm_vtasks(device, case, evs, fault, opts.thresholds.tau_for(device, case.shape.k), opts.thresholds.confirm_margin, prov,
                                          flagged_run=dr.captured.get(cid)):
                writer.add(vt)
    return writer.finalise()
