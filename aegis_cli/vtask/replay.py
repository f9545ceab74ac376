"""``aegis replay`` as a library call: bundles in, a Report (kind="replay") out. Never prints.

Each vTask is replayed ``repeat`` times on each chosen device, at the captured input
scale and at extra power-of-two scales (exact expectations, docs/design.md §5), and compared
with
  (a) the fp64 reference, by the scan's own GEMM checks (checks/gemm.py) with the replaying
      device's own tile and noise model and the vTask's τ in its normalisation (never below the
      default τ, or for a τ in units of Σ|A||B| this device's ceiling at that K), plus every
      element against the fp64 product where affordable;
  (b) what was observed at capture (checks/observed.py);
  (c) its own re-runs, bit for bit, and C(2^x·A, 2^y·B) = 2^(x+y)·C(A, B).
A row-check vTask holding only the flagged rows replays the sub-GEMM A[rows,:]·B: its row
checksums are those rows' checksums of the full GEMM (a row sum only involves its own
row), so they are compared directly; its column checksums check the sub-GEMM only.

Outcome per vTask: ``reproduced`` (a check fired here, the same way every run),
``not_reproduced`` (every run clean and bit-identical), ``inconsistent`` (runs of the
same inputs gave different bits: this device is faulty). A checksum-only flag that fp32
rounding of these inputs could reach is SUSPECT unless the inputs are verifiably a scan's
own draw; one whose flagged checksums, recomputed in fp64, lie within a rigorous rounding bound
is SUSPECT in any case (checks/recompute.py; checks/judge.py decides). See docs/bundle-format.md.
"""

from __future__ import annotations

import contextlib
import math
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone

import torch

from aegis_cli.backends import resolve_devices
from aegis_cli.backends.base import Device, memory_shortfall
from aegis_cli.checks import gemm as checks
from aegis_cli.checks import judge
from aegis_cli.checks import recompute as recheck
from aegis_cli.checks.gemm import CHECKSUM_CHECKS, ElementReference
from aegis_cli.checks.observed import compare_with_capture, result_bits_equal
from aegis_cli.faults.spec import FaultPlan, recent_injections
from aegis_cli.ops import numerics
from aegis_cli.ops.case import rescaled, split_scale
from aegis_cli.ops.errors import BundleError, ConfigError
from aegis_cli.ops.gemm import GemmResult
from aegis_cli.ops.verdict import Evidence, Verdict, worst
from aegis_cli.probes.gemm import ProbeStats, case_bytes, scaled
from aegis_cli.probes.gemm import clean_median as clean_median_of
from aegis_cli.report import DeviceReport, Report, device_failures
from aegis_cli.vtask import attention
from aegis_cli.vtask import model as vtask
from aegis_cli.vtask.bundle import read_bundle
from aegis_cli.vtask.manifest import error as bundle_error
from aegis_cli.vtask.scan_draw import is_scan_draw

DEFAULT_SCALES = ((0, 0), (-8, 8), (8, -8))
FLOOR = numerics.Thresholds()  # the calibrated τ (docs/calibration.md): replay never judges below it
ELEMENT_BUDGET = 1 << 28  # multiply-adds up to which every element is checked against fp64
MAX_SAMPLES = 8
SMALL_CPU_GEMM = 1 << 22  # multiply-adds below which a CPU replay uses one thread
OUTCOMES = {"reproduced": "reproduced here", "not_reproduced": "not reproduced here",
            "inconsistent": "inconsistent between runs"}

Progress = Callable[..., None]  # progress("start", total=…), progress("case", device=…, case=vTask id)


@dataclass
class ReplayOptions:
    bundles: list[str]
    devices: str = "auto"
    repeat: int = 3
    scales: tuple[tuple[int, int], ...] = DEFAULT_SCALES  # relative to the captured inputs
    inject: str | None = None
    max_bundle_bytes: int | None = None
    command_line: list[str] = field(default_factory=list)


def parse_scales(text: str) -> tuple[tuple[int, int], ...]:
    """``"0,0;-8,8"`` → ((0, 0), (-8, 8)); (0, 0) always runs first."""
    out: list[tuple[int, int]] = [(0, 0)]
    for part in filter(None, (p.strip() for p in re.split(r"[;\s]+", text))):
        try:
            ea, eb = (int(x) for x in part.split(","))
        except ValueError:
            raise ConfigError(f"--scales: {part!r} is not EA,EB (two integers, e.g. -8,8)") from None
        if not (-64 <= ea <= 64 and -64 <= eb <= 64):
            raise ConfigError(f"--scales: exponents must lie in -64…64, got {part!r}")
        if (ea, eb) not in out:
            out.append((ea, eb))
    return tuple(out)


def _op_id(vt: vtask.VTask, x: int, y: int) -> str:
    """The op id the replayed launch carries: the capture's case id with the scale it now
    runs at, so an injected fault lands where it landed at capture (inject.FaultPlan.active)."""
    base = vt.case_id or vt.id  # any producer's id: it need not be a valid CaseId
    if (x, y) == (0, 0) and split_scale(base)[1] is None:
        return base
    return rescaled(base, vt.scale[0] + x, vt.scale[1] + y)


@dataclass
class _Fired:
    elements: int = 0
    max_value: float = 0.0
    rows: set[int] = field(default_factory=set)  # full-GEMM indices
    cols: set[int] = field(default_factory=set)
    samples: list[dict] = field(default_factory=list)
    runs: int = 0  # runs in which it fired


class _VTaskReplay:
    """Replays one vTask on one device."""

    def __init__(self, device: Device, vt: vtask.VTask, opts: ReplayOptions, fault: FaultPlan | None, stats: ProbeStats):
        self.dev, self.vt, self.opts, self.fault, self.stats = device, vt, opts, fault, stats
        self.row_map, self.col_map = vt.gemm.rows, vt.gemm.cols
        self.fired: dict[str, _Fired] = {}
        self._this_run: set[str] = set()
        self.notes: list[str] = []
        # the capture's τ, never below what this device's own noise allows: the default τ in units of
        # this device's calibrated noise ("device-noise" bundles: a vTask captured on a CPU, replayed on a
        # GPU, is judged by the GPU's noise), or, for a τ in units of Σ|A||B| ("abs-product"), the
        # device's cap at this K (NoiseModel.cap, the former calibrated τ). A bundle's τ is the
        # producer's word: a tiny one would make every clean checksum a flag.
        self.by_noise = vt.normalisation == "device-noise"
        floor = FLOOR.tau if self.by_noise else device.noise_model(vt.gemm.k).cap
        self.tau = max(vt.tau, floor)
        if self.tau > vt.tau:
            why = ("the default τ in units of this device's calibrated noise (docs/calibration.md)" if self.by_noise
                   else f"this device's calibrated ceiling in units of Σ|A||B| at K = {vt.gemm.k} (docs/calibration.md)")
            self.notes.append(f"τ raised from the captured {vt.tau:.3g} to {self.tau:.3g}, {why}: below it clean rounding "
                              "can cross τ")
        self._calibrated: tuple[bool, str] | None = None
        self.recomputed: dict[str, recheck.Recompute] = {}  # check → its flagged checksums recomputed in fp64
        self._rechecked: set[tuple] = set()  # (scale, check) already recomputed

    def _full_row(self, i: int) -> int:
        return self.row_map[i] if self.row_map is not None else i

    def _full_col(self, j: int) -> int:
        return self.col_map[j] if self.col_map is not None else j

    def _fire(self, s: checks.Signal, scale: tuple[int, int]) -> None:
        f = self.fired.setdefault(s.check, _Fired())
        self._this_run.add(s.check)
        value = math.inf if s.check == "gemm.nonfinite" else s.max_value  # replay records NaN/Inf as infinitely far
        f.elements = max(f.elements, s.elements)
        f.max_value = max(f.max_value, value)  # signals' values are never NaN: inf stays inf
        f.rows |= {self._full_row(r) for r in s.rows}
        f.cols |= {self._full_col(c) for c in s.cols}
        for r, c in s.where[:MAX_SAMPLES - len(f.samples)].tolist():
            f.samples.append(self._sample(s, r, c, scale))

    def _sample(self, s: checks.Signal, r: int, c: int, scale: tuple[int, int]) -> dict:
        """One evidence sample: where in the full GEMM, at which scale, and the values (bits for
        the exact expectation) where the check compares any."""
        out = {**s.position(r, c, self._full_row, self._full_col), "scale": list(scale)}
        if s.check in CHECKSUM_CHECKS:
            out.update(observed=float(s.observed[r, c]), expected=float(s.expected[r, c]), normalised_diff=float(s.diff[r, c]))
        elif s.check == checks.ELEMENT_CHECK:
            out.update(actual=float(s.observed[r, c]), expected=float(s.expected[r, c]))
        elif s.check == "gemm.pow2_exact":
            act, exp = checks.bf16_bits(s.observed, r, c), checks.bf16_bits(s.expected, r, c)
            out.update(actual=f"0x{act:04x}", expected=f"0x{exp:04x}", xor=f"0x{act ^ exp:04x}")
        return out

    def run(self) -> dict:
        t0 = time.perf_counter()
        vt, dev = self.vt, self.dev
        ops0 = vt.operands(dev.torch_device)
        tile = dev.tile
        m, n, k = ops0.mnk
        # τ in units of Σ|A||B| ("abs-product"): the checks divide by it, so no noise scale is computed
        ref0 = numerics.reference_checksums(ops0, tile, dev.noise_model(k) if self.by_noise else None)
        element_ref = None
        if checks.checks_elements(m, n, k, ELEMENT_BUDGET):
            element_ref = ElementReference.of(ops0)
        else:
            why = "is above the budget" if m * n * k > ELEMENT_BUDGET else "has K too deep for a finite rounding bound"
            self.notes.append(f"element-level fp64 comparison skipped ({m}x{n}x{k} {why})")
        clean_median = None
        if self.fault is not None and self.fault.needs_clean_median():  # in units of the unscaled case
            clean_median = clean_median_of(dev, ops0, ref0) / 2.0 ** (vt.scale[0] + vt.scale[1])
        distinct_max, base_c, first0 = 1, None, None
        scales_run, skipped = [], []
        ranges = numerics.magnitudes(ops0)
        for x, y in self.opts.scales:
            if (x, y) != (0, 0) and not numerics.pow2_exact_safe(ranges, x, y):
                skipped.append([x, y])
                continue
            scales_run.append([x, y])
            ops = scaled(ops0, x, y) if (x, y) != (0, 0) else ops0
            ref = ref0.scaled(x + y)
            scaled_ref = element_ref.at_scale(x + y) if element_ref is not None else None
            expected = numerics.pow2_scale(base_c, x + y) if base_c is not None else None
            reps: list[GemmResult] = []
            for _ in range(self.opts.repeat):
                res = dev.checked_gemm(ops, self.fault, op=_op_id(vt, x, y), clean_median=clean_median)
                self.stats.gemms += 1
                self.stats.flops += 2 * m * n * k
                self.stats.checksums += res.row_sums.numel() + res.col_sums.numel()
                self._this_run = set()
                for s in checks.check_gemm(res, ref, self.tau, expected=expected, element_ref=scaled_ref).signals:
                    self._fire(s, (x, y))
                    self._recheck(s, (x, y), ops, res)
                for check in self._this_run:
                    self.fired[check].runs += 1
                if not any(result_bits_equal(res, r) for r in reps):
                    reps.append(res)
            distinct_max = max(distinct_max, len(reps))
            if (x, y) == (0, 0):
                first0, base_c = reps[0], reps[0].c
        self.stats.seconds += time.perf_counter() - t0
        capture = self._compare_capture(first0) if first0 is not None else {"matches": None, "detail": "not run"}
        return self._outcome(distinct_max, scales_run, skipped, capture, time.perf_counter() - t0)

    def _recheck(self, s: checks.Signal, scale: tuple[int, int], ops, res: GemmResult) -> None:
        """Recompute a checksum signal's worst flagged entries in fp64 (checks/recompute.py), once
        per scale: the repeats of one scale are bit-identical, or the device is inconsistent anyway."""
        if s.check not in CHECKSUM_CHECKS or (scale, s.check) in self._rechecked:
            return
        self._rechecked.add((scale, s.check))
        rc = recheck.recompute(ops, res, s.axes, recheck.worst_positions(s))
        if rc is not None:
            self.recomputed[s.check] = rc.merge(self.recomputed.get(s.check))

    def _compare_capture(self, res: GemmResult) -> dict:
        # the CPU backend's BLAS picks its summation order by the GEMM's shape: a sub-GEMM's bits need
        # not be the full GEMM's even on a healthy device, so there only tolerant comparisons hold
        exact = self.vt.gemm.subset == "full" or self.dev.shape_independent_sums
        return compare_with_capture(res, self.vt.tensors, self.vt.gemm.tile, exact)

    # -- were these the scan's own inputs? ---------------------------------------------------------
    def calibrated(self) -> tuple[bool, str]:
        """(whether τ's calibration holds for this vTask's inputs, why not): whether they are a
        scan's own draw (vtask/scan_draw.py). Computed once, and only when a verdict depends on it."""
        if self._calibrated is None:
            self._calibrated = is_scan_draw(self.dev, self.vt)
        return self._calibrated

    # -- outcome and what it means ---------------------------------------------------------------
    def _rounding_doubt(self, cs: list[float], rc: recheck.Recompute | None) -> str | None:
        """τ is calibrated for the scan's input distributions; a vTask of other data (another
        producer's) may round past it: there a checksum flag that fp32 rounding of these inputs
        could explain (its recomputation ``rc`` found nothing beyond the rigorous bound, or K is too
        deep for a finite one) confirms nothing on its own, and the note says why τ does not hold."""
        if not cs or (rc is not None and rc.wrong) or self.calibrated()[0]:
            return None
        found = rc.describe() if rc is not None else f"no finite rounding bound at K = {self.vt.gemm.k}"
        return (f"checksum differences (≤ {max(cs):.3g}·{'σ' if self.by_noise else 's'}) are within what fp32 rounding of these inputs "
                f"can reach ({found}){self.calibrated()[1]}: SUSPECT, not FAULTY")

    def _outcome(self, distinct: int, scales_run, skipped, capture: dict, seconds: float) -> dict:
        vt, dev = self.vt, self.dev
        fired = sorted(self.fired)
        own = vt.check in CHECKSUM_CHECKS and vt.check in self.fired  # the margin of the check it was saved for
        names = [c for c in ((vt.check,) if own else CHECKSUM_CHECKS) if c in self.fired]
        cs, rc = [self.fired[c].max_value for c in names], recheck.merged(self.recomputed.get(c) for c in names)
        margin = judge.margin(max(cs), self.tau) if cs else None
        runs_total = self.opts.repeat * len(scales_run)
        outcome = "inconsistent" if distinct > 1 else "reproduced" if fired else "not_reproduced"
        # with one distinct result per scale, every run of the same inputs fired the same checks
        j = judge.judge(fired, distinct_outputs=distinct, reproducible=True, margin=margin,
                        confirm_margin=vt.confirm_margin, rounding_doubt=lambda: self._rounding_doubt(cs, rc), recompute=rc)
        severity = j.severity
        if j.doubted:
            self.notes.append(j.why)
        prov = vt.provenance
        same_device = bool(prov.get("gpu_uuid")) and prov.get("gpu_uuid") == dev.identity.uuid
        where = f"{prov.get('gpu_uuid', 'unknown device')} on {prov.get('host', 'unknown host')}"
        if outcome == "inconsistent":
            meaning = (f"identical inputs gave {distinct} different results on this device: a deterministic GEMM must not "
                       "differ between runs, so this device is faulty")
        elif outcome == "reproduced" and same_device:
            meaning = ("reproduces on the capturing device" + (" with the captured bits" if capture["matches"] else "")
                       + ": likely this GPU; replay on a healthy GPU — if it does not reproduce there, the GPU is faulty; "
                       "if it reproduces everywhere, suspect the data or the software")
        elif outcome == "reproduced":
            meaning = (f"reproduces on this device too, not only on {where}: a computation that fails on every device points "
                       "at the data or the software, not at one GPU (unless this device is faulty as well)")
        elif same_device and prov.get("injected"):  # a self-test's capture: its fault was put there, not found
            meaning = ("does not reproduce on the capturing device without its injection: the capture had faults injected on "
                       "purpose (a self-test), so this says nothing about the device; replay with the same --inject")
        elif same_device:
            meaning = ("does not reproduce on the capturing device now: an intermittent fault or a transient; "
                       "replay with more --repeat, or keep the device under watch")
        else:
            meaning = f"does not reproduce here: if this device is healthy, this points at the capturing GPU {where}" + (
                " — but the capture had faults injected on purpose (a self-test)" if prov.get("injected") else "")
        return {"id": vt.id, "check": vt.check, "case_id": vt.case_id, "op": vt.op, "layout": vt.gemm.layout.value,
                "shape": {"m": vt.gemm.m, "n": vt.gemm.n, "k": vt.gemm.k}, "subset": vt.gemm.subset,
                "replayed_shape": {"m": vt.gemm.m_sub, "n": vt.gemm.n_sub, "k": vt.gemm.k}, "capture_scale": list(vt.scale),
                "outcome": outcome, "label": OUTCOMES[outcome], "severity": severity.value, "checks_fired": fired,
                "captured_check_fired": vt.check in self.fired, "tau": self.tau, "margin": margin, "runs": runs_total,
                "distinct_outputs": distinct, "recompute": rc.to_dict() if rc else None, "scales_run": scales_run, "scales_skipped": skipped,
                "matches_capture": capture["matches"], "capture_comparison": capture["detail"],
                "same_device": same_device, "captured_on": where, "meaning": meaning, "notes": self.notes,
                "seconds": round(seconds, 4)}


def _evidence(vt: vtask.VTask, out: dict, fired: dict[str, _Fired], bundle: str, fault: FaultPlan | None) -> Evidence:
    check = vt.check if vt.check in fired else (out["checks_fired"][0] if fired else "replay.nondeterministic")
    f = fired.get(check, _Fired())
    g = vt.gemm
    ev = Evidence(check=check, severity=Verdict(out["severity"]), case_id=vt.case_id or vt.id,
                  summary=f"vTask {vt.id} from {bundle}: {out['label']} ({', '.join(out['checks_fired']) or 'bits differ between runs'}); "
                          f"{out['meaning']}",
                  op=vt.op, layout=g.layout.value, shape={"m": g.m, "n": g.n, "k": g.k}, dist=vt.dist or "",
                  scale=list(vt.scale), seed=vt.seed or 0, elements=f.elements, samples=f.samples,
                  localised=[[r, c] for r in sorted(f.rows)[:4] for c in sorted(f.cols)[:4]][:16],
                  reruns=max(out["runs"] - 1, 0), reproduced=max(min(f.runs, out['runs']) - 1, 0), distinct_outputs=out["distinct_outputs"],
                  injected=recent_injections(fault))
    if check in CHECKSUM_CHECKS:
        ev.threshold, ev.max_value, ev.margin, ev.recompute = out["tau"], f.max_value, out["margin"], out["recompute"]
    else:
        ev.max_value = f.max_value
    return ev


@contextlib.contextmanager
def _cpu_threads(device: Device, macs: int):
    """One intra-op thread for small CPU GEMMs: thousands of tiny multi-threaded launches
    spend their time in thread hand-offs (20-40x slower on a busy 2-core host)."""
    if device.identity.backend != "cpu" or macs > SMALL_CPU_GEMM or torch.get_num_threads() == 1:
        yield
        return
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def replay_device(device: Device, bundles: list[vtask.Bundle], opts: ReplayOptions, fault: FaultPlan | None,
                  progress: Progress) -> DeviceReport:
    """Every vTask of every bundle on one device; a device failure → ERROR, never HEALTHY."""
    t0 = time.time()
    dr = DeviceReport(identity=device.identity, verdict=Verdict.ERROR, workload="replay")
    stats = ProbeStats()
    outcomes: list[dict] = []
    with device_failures(dr):
        for b in bundles:
            for vt in b.vtasks:
                if vt.kind == "attention":  # vtask/attention.py
                    out, ev = attention.replay(device, vt, opts.repeat, fault, b.path)
                    dr.evidence += [ev] if ev is not None else []
                else:
                    replay = _VTaskReplay(device, vt, opts, fault, stats)
                    with _cpu_threads(device, vt.gemm.m_sub * vt.gemm.n_sub * vt.gemm.k):
                        out = replay.run()
                    if out["outcome"] != "not_reproduced":
                        dr.evidence.append(_evidence(vt, out, replay.fired, b.path, fault))
                out["bundle"] = b.path
                outcomes.append(out)
                progress("case", device=device.identity.id, case=vt.id)
        dr.verdict = worst([Verdict.HEALTHY, *(Verdict(o["severity"]) for o in outcomes)])
    dr.stats = stats
    counts = {k: sum(o["outcome"] == k for o in outcomes) for k in OUTCOMES}
    dr.probe_stats = {"replay": {"vtasks": len(outcomes), **counts, "repeat": opts.repeat,
                                 "scales": [list(s) for s in opts.scales], "outcomes": outcomes}}
    dr.seconds = time.time() - t0
    progress("device_done", device=device.identity.id, verdict=dr.verdict.value)
    return dr


def load_bundles(paths: list[str], max_bytes: int | None = None) -> list[vtask.Bundle]:
    """Read and validate every bundle before anything runs (no partial work on bad input)."""
    if not paths:
        raise BundleError("no bundle given")
    limits = vtask.Limits.from_env(max_bytes)
    return replayable([read_bundle(p, limits) for p in paths], ", ".join(paths))


def replayable(bundles: list[vtask.Bundle], label: str) -> list[vtask.Bundle]:
    """``bundles`` if they hold a vTask between them; else BundleError naming ``label``."""
    if not any(b.vtasks for b in bundles):
        raise bundle_error(label, "holds no vTasks, nothing to replay")
    return bundles


def replay_bytes(vt: vtask.VTask) -> int:
    """Upper estimate of the memory replaying ``vt`` holds at its peak: a scan case of its
    (sub-)GEMM (probes.gemm.case_bytes), plus, where every element is checked, the fp64 exact
    product, magnitudes and bound and one scale's fp64 error terms (12 fp64 values per output)."""
    if vt.kind == "attention":
        return attention.replay_bytes(vt)
    m, n, k = vt.gemm.m_sub, vt.gemm.n_sub, vt.gemm.k
    elements = 96 * m * n if checks.checks_elements(m, n, k, ELEMENT_BUDGET) else 0
    return case_bytes(m, n, k) + elements


def check_memory(bundles: list[vtask.Bundle], devices: list[Device]) -> None:
    """Refuse, before any work, a vTask that could not fit in a device's memory. A bundle is tiny
    next to what it asks for (M'·N' outputs from M'+N' rows of inputs: 65536x65536 with K = 1 is
    a 256 KiB file and tens of GiB to replay), and running out half-way would be blamed on the
    device (ERROR) or end the process with no report at all."""
    worst = [(b, big, replay_bytes(big)) for b in bundles if (big := max(b.vtasks, key=replay_bytes, default=None))]
    for d in devices:
        for b, big, need in worst:
            g = big.gemm
            short = memory_shortfall(d, need)
            if short is not None:
                what = f"a {g.m_sub}x{g.n_sub}x{g.k} GEMM" if g is not None else "an attention"
                raise bundle_error(b.path, f"vTask {big.id!r} replays {what} that needs about "
                                           f"{need / 2**30:.1f} GiB on {d.identity.id}, {short[1]}"
                                           + ("; replay when the device is idle" if short[0] == "busy" else ""))


def run_replay(opts: ReplayOptions, progress: Progress | None = None) -> Report:
    progress = progress or (lambda *a, **k: None)
    if not 1 <= opts.repeat <= 100_000:
        raise ConfigError(f"--repeat must lie in 1…100000, got {opts.repeat}")
    plan = FaultPlan.parse(opts.inject) if opts.inject else None
    bundles = load_bundles(opts.bundles, opts.max_bundle_bytes)
    devices = resolve_devices(opts.devices)
    if plan is not None:  # as scan: a fault for a device not replayed on would never fire
        plan.check_devices([d.identity.id for d in devices])
    check_memory(bundles, devices)
    total = sum(len(b.vtasks) for b in bundles)
    threshold = ("per vTask: the τ in force at capture, in its normalisation (device-noise or abs-product), never below "
                 "the default τ or the device's ceiling")
    report = Report(kind="replay", command_line=list(opts.command_line) or list(sys.argv), seed=0,
                    options={"devices": opts.devices, "bundles": list(opts.bundles), "vtasks": total, "repeat": opts.repeat,
                             "scales": [list(s) for s in opts.scales], "threshold": threshold},
                    started=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                    injected=[opts.inject] if opts.inject else [], tau=FLOOR.tau)
    progress("start", total=total * len(devices), devices=[d.identity.id for d in devices])
    for device in devices:
        fault = plan.for_device(device.identity.id) if plan else None
        report.devices.append(replay_device(device, bundles, opts, fault, progress))
    if plan is not None:
        report.never_fired = plan.never_fired()
    report.finish()
    return report

