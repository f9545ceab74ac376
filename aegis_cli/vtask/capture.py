"""Capture: one observed GEMM and its flagged evidence as vTasks (docs/design.md §8).

The caller hands over what ran — the operands as fed, C and the fused sums as observed,
the evidence a check gave, τ and where it ran — so anything that runs checked GEMMs can
capture: a scan (vtask/from_scan.py) or a training loop. Nothing here knows a device::

    run = ObservedGemm(GemmOperands(a, b, Layout.FWD), result, case_id="train/step12/qkv", op="qkv")
    with BundleWriter("flagged.aegis") as w:
        for vt in capture_gemm(run, evidence, tau=1e-6, confirm_margin=1.0, provenance={"host": ...}):
            w.add(vt)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from aegis_cli.checks.gemm import CHECKSUM_CHECKS, GEMM_CHECKS
from aegis_cli.ops import fingerprint, numerics
from aegis_cli.ops.case import CaseId
from aegis_cli.ops.errors import ConfigError
from aegis_cli.ops.gemm import GemmOperands, GemmResult, ReferenceChecksums
from aegis_cli.ops.verdict import Evidence
from aegis_cli.vtask.manifest import ID_CHARS, ID_RE, entry_problem
from aegis_cli.vtask.model import MAX_SAMPLES, MAX_STRING, TAU_RANGE, GemmSpec, VTask

FULL_OPERANDS_LIMIT = 16 << 20  # writer policy: full operands up to this many bytes per vTask
MAX_SUBSET = 1024  # writer policy: at most this many flagged rows/columns in a subset vTask
LONGEST_CHECK = max(GEMM_CHECKS, key=len)  # the longest check name a vTask id ends in


@dataclass
class ObservedGemm:
    """One checked GEMM as it ran: the operands as fed (after any input scaling) and C and
    the fused sums as observed. Tensors may live on any device; they are copied to the host."""

    operands: GemmOperands
    result: GemmResult
    case_id: str  # names the run in vTask ids; a replay's injected faults land by it (op_site)
    op: str  # the operator (qkv, mlp_down, a training loop's layer name)
    scale: tuple[int, int] = (0, 0)  # the operands are 2^ea·A, 2^eb·B of the case
    # the seeded draw the case's operands came from (numerics.DISTRIBUTIONS, the scan seed): replay
    # re-draws them to trust ``dist``; None where the inputs are no such draw (a training step)
    seed: int | None = None
    dist: str | None = None
    source: str = "observed"  # how C and the sums were obtained, said in each vTask


def _flag_sets(res: GemmResult, ref: ReferenceChecksums, tau: float) -> tuple[list[int], list[int]]:
    if res.row_sums.device != ref.row.device:  # a flagged run kept in host memory, operands on the device
        res = dataclasses.replace(res, row_sums=res.row_sums.to(ref.row.device), col_sums=res.col_sums.to(ref.row.device))
    d_row, d_col = numerics.checksum_diffs(res, ref)  # (M, nt_n), (nt_m, N)
    return ((d_row > tau).any(1).nonzero().flatten().cpu().tolist(), (d_col > tau).any(0).nonzero().flatten().cpu().tolist())


def _sample_rows(ev: Evidence, key: str) -> list[int]:
    out = {int(s[key]) for s in ev.samples if isinstance(s.get(key), int)}
    out |= {int(p[0 if key == "row" else 1]) for p in ev.localised}
    return sorted(out)


def _host(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu")


def capture_gemm(run: ObservedGemm, evidence: list[Evidence], *, tau: float, confirm_margin: float, provenance: dict,
                 reference: ReferenceChecksums | None = None) -> list[VTask]:
    """One vTask per piece of ``evidence`` (checks on ``run``): the full operands when small,
    else the flagged rows (row checks) or columns (column checks) and their outputs. ``tau``
    and ``confirm_margin`` are the thresholds the checks used; ``provenance`` says where it
    ran (``device_id`` starts each vTask id). ``reference``: the fp64 checksums of the
    operands, when the caller has them (else computed here, beside the operands); with a
    device's noise scales (Device.reference_checksums) τ is in those units ("device-noise"),
    without them in units of Σ|A||B| ("abs-product")."""
    ops, res = run.operands, run.result
    ref = reference if reference is not None else numerics.reference_checksums(ops, res.tile)
    frows, fcols = _flag_sets(res, ref, tau)
    m, n, k = ops.mnk
    full_bytes = 2 * (m * k + k * n + m * n) + 4 * (res.row_sums.numel() + res.col_sums.numel())
    a, b = _host(ops.a), _host(ops.b)
    c, rs, cs = _host(res.c), _host(res.row_sums), _host(res.col_sums)
    fps = {"c": fingerprint.hex64(fingerprint.fingerprint(c)), "row_sums": fingerprint.hex64(fingerprint.fingerprint(rs)),
           "col_sums": fingerprint.hex64(fingerprint.fingerprint(cs))}
    out = []
    for ev in evidence:
        own_rows, own_cols = _sample_rows(ev, "row"), _sample_rows(ev, "col")
        if ev.check in CHECKSUM_CHECKS:
            rows_flag, cols_flag = frows or own_rows, fcols or own_cols
        else:  # the output checks flag rows of their own, not necessarily the checksums' rows
            rows_flag, cols_flag = own_rows or frows, own_cols or fcols
        spec = GemmSpec(layout=ops.layout, m=m, n=n, k=k, tile=tuple(res.tile), flagged_rows=rows_flag[:MAX_SUBSET],
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
                    "fingerprints": fps, "source": run.source, "truncated": truncated}
        out.append(VTask(id=vtask_id(provenance, run.case_id, ev.check), check=ev.check, op=run.op, gemm=spec,
                         tensors=tensors, tau=tau, confirm_margin=confirm_margin, scale=tuple(run.scale), case_id=run.case_id,
                         normalisation="abs-product" if ref.row_noise is None else "device-noise",
                         seed=run.seed, dist=run.dist, observed={k: v for k, v in observed.items() if v is not None},
                         provenance={**provenance, "kernel": res.kernel}))
    return out


def vtask_id(provenance: dict, case_id: str, check: str) -> str:
    return f"{provenance.get('device_id', 'dev')}/{case_id}/{check}"


def _clean_sample(s: dict) -> dict:
    out = {}
    for k, v in s.items():
        if isinstance(v, (bool, int, str)) or (isinstance(v, list) and len(v) <= 4 and all(isinstance(e, int) for e in v)):
            out[k] = v[:256] if isinstance(v, str) else v
        elif isinstance(v, float):  # non-finite values are encoded with the whole manifest entry
            out[k] = v
    return out


def check_savable(device_id: str, spec: GemmSpec, op: str, case_ids: list[str], *, tau: float, confirm_margin: float,
                  seed: int | None = None, dist: str | None = None) -> None:
    """Refuse (ConfigError), before the work that would flag them, GEMM runs no bundle could
    hold as vTasks: ids (device, case id, check) that are not valid vTask ids, or a τ outside
    the range a bundle records. Found only when saving, they would cost the whole run."""
    if not TAU_RANGE[0] <= tau <= TAU_RANGE[1]:
        raise ConfigError(f"--save-vtasks: τ = {tau:g} for {device_id} at K = {spec.k} is outside what a bundle "
                          f"records ({TAU_RANGE[0]:g}…{TAU_RANGE[1]:g}); choose --threshold within it")
    for cid in case_ids:
        vid = vtask_id({"device_id": device_id}, cid, LONGEST_CHECK)
        if not ID_RE.fullmatch(vid):
            raise ConfigError(f"--save-vtasks: workload {CaseId.parse(cid).prefix!r} gives vTask ids like {vid[:120]!r} that a "
                              f"bundle cannot hold (1–256 characters from {ID_CHARS}); rename the workload or its ops")
        scale = CaseId.parse(cid).scale or (0, 0)
        problem = entry_problem(VTask(id=vid, check=LONGEST_CHECK, op=op, gemm=spec, tensors={}, tau=tau, scale=scale,
                                      confirm_margin=confirm_margin, case_id=cid, seed=seed, dist=dist,
                                      normalisation="device-noise"))  # a scan's τ is in its device's noise units
        if problem:
            raise ConfigError(f"--save-vtasks: this scan's cases could not be saved as vTasks ({problem})")
