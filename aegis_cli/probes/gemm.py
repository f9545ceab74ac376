"""The GEMM checksum probe (docs/design.md §2, §5, §7).

For each training GEMM × input distribution, the probe draws seeded operands once and
runs them at every power-of-two input scale of the plan. Each run goes through the GEMM
checks (checks/gemm.py: row and column checksums, output row sums, NaN/Inf, and from the
second scale on the power-of-two exact expectation). A flagged case is re-run; the re-runs
decide FAULTY vs SUSPECT (checks/judge.py)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from aegis_cli.backends.base import Device
from aegis_cli.checks import gemm as checks
from aegis_cli.checks import judge, vote
from aegis_cli.checks import recompute as recheck
from aegis_cli.checks.gemm import CHECKSUM_CHECKS
from aegis_cli.faults.spec import FaultPlan, recent_injections
from aegis_cli.ops import numerics
from aegis_cli.ops.case import CaseId, case_seed
from aegis_cli.ops.errors import ConfigError
from aegis_cli.ops.gemm import GemmOperands, GemmResult, GemmShape, Layout, ReferenceChecksums
from aegis_cli.ops.verdict import Evidence, Verdict
from aegis_cli.ops.verdict import worst as worst_severity
from aegis_cli.probes.confirmation import Tally
from aegis_cli.probes.gemm_runs import GroupRuns, on_host

PROBE = "gemm"  # the probe's name in a device's tally
MAX_SAMPLES = 8
MAX_LOCALISED = 16


@dataclass(frozen=True)
class GemmCase:
    """One shape × distribution; its scale variants share operands."""

    workload: str
    shape: GemmShape
    dist: str
    seed: int  # the scan seed; operand seeds derive from it and the case identity

    @property
    def group_id(self) -> CaseId:
        s = self.shape
        return CaseId(self.workload, (s.op, s.layout.value, self.dist, f"{s.m}x{s.n}x{s.k}"))

    def case_id(self, ea: int, eb: int) -> str:
        return str(self.group_id.with_scale(ea, eb))

    def operands(self, device: Device) -> GemmOperands:
        s = self.shape
        return draw_operands(device.generate, s.layout, s.m, s.n, s.k, self.dist, self.seed, str(self.group_id))


def draw_operands(generate, layout: Layout, m: int, n: int, k: int, dist: str, seed: int, group_id: str) -> GemmOperands:
    """A case's operands as stored, from ``generate(shape, dist, seed)``: the scan's draw, which
    replay regenerates to tell a scan's own inputs from anyone else's."""
    a = generate(layout.a_stored_shape(m, k), dist, case_seed(seed, group_id, "A"))
    b = generate(layout.b_stored_shape(k, n), dist, case_seed(seed, group_id, "B"))
    return GemmOperands(a, b, layout)


@dataclass
class ProbeStats:
    gemms: int = 0
    flops: int = 0
    checksums: int = 0
    skipped_scales: int = 0
    clean_max: float = 0.0  # largest normalised difference among unflagged checksums
    clean_ratio: float = 0.0  # largest (normalised difference ÷ that case's τ) among unflagged checksums
    seconds: float = 0.0


@dataclass
class Finding:
    """A check that fired on one run, as evidence shows it."""

    check: str
    max_value: float  # as checks.Signal.max_value
    elements: int
    samples: list[dict] = field(default_factory=list)
    tiles: list[list[int]] = field(default_factory=list)
    sms: list[int] = field(default_factory=list)
    localised: list[list[int]] = field(default_factory=list)
    axes: str = ""  # as checks.Signal.axes


def _sms(tile_sm: torch.Tensor | None, tiles) -> list[int]:
    """The SMs that ran these (row tile, column tile)s, from the host copy of ``tile_sm``."""
    return sorted({int(tile_sm[t]) for t in tiles}) if tile_sm is not None else []


def _bits32(x: float) -> str:
    return f"0x{torch.tensor([x], dtype=torch.float32).view(torch.int32).item() & 0xFFFFFFFF:08x}"


def _samples(s: checks.Signal, res: GemmResult, tile_sm: torch.Tensor | None) -> list[dict]:
    """Evidence samples of one signal: the largest checksum differences, else the first
    positions, each with its tile (and SM, for checksums) and the values as observed."""
    tm, tn = res.tile
    out = []
    if s.check in CHECKSUM_CHECKS:
        # the largest differences picked where they lie; only those few values come to the host
        top = torch.topk(s.diff.reshape(-1), min(MAX_SAMPLES, s.elements)).indices
        d, obs, ref = (t.reshape(-1)[top].cpu() for t in (s.diff, s.observed, s.expected))
        for i, flat in enumerate(top.tolist()):
            r, c = divmod(flat, s.diff.shape[1])
            tile, o = s.tile(r, c, tm, tn), float(obs[i])
            out.append({**s.position(r, c), "tile": list(tile), "observed": o, "observed_bits": _bits32(o),
                        "expected": float(ref[i]), "normalised_diff": float(d[i]),
                        **({"sm": int(tile_sm[tile])} if tile_sm is not None else {})})
        return out
    for r, c in s.where[:MAX_SAMPLES].tolist():
        sample = {**s.position(r, c), "tile": list(s.tile(r, c, tm, tn))}
        if s.check == "gemm.output_rowsum":
            sample.update(output_sum=float(res.c[r, c * tn:(c + 1) * tn].double().sum()),
                          accumulator_sum=float(res.row_sums[r, c]), bound=float(s.bound[r, c]))
        else:  # C's bits, against the exact expectation where there is one
            act = checks.bf16_bits(res.c, r, c)
            sample.update(actual=f"0x{act:04x}", actual_value=float(res.c[r, c]))
            if s.expected is not None:
                exp = checks.bf16_bits(s.expected, r, c)
                sample.update(expected=f"0x{exp:04x}", expected_value=float(s.expected[r, c]), xor=f"0x{exp ^ act:04x}")
        out.append(sample)
    return out


KEEP_FLAGGED_BYTES = 2 << 30  # host memory for flagged runs kept as observed (--save-vtasks)


def case_bytes(m: int, n: int, k: int) -> int:
    """Upper estimate of the memory one GEMM case holds at its peak, on either backend: bf16
    A and B and their scaled copies (4 B per operand element); the fp64 reference's A, B, |A|
    and |B| (32 B); bf16 C of the base, the current and the expected run (6 B per output),
    the output check's fp64 C and |C| (16 B) and the CPU backend's fp32 and fp64
    accumulators (12 B)."""
    return 36 * (m * k + k * n) + 34 * m * n


def scaled(ops: GemmOperands, ea: int, eb: int) -> GemmOperands:
    return GemmOperands(numerics.pow2_scale(ops.a, ea), numerics.pow2_scale(ops.b, eb), ops.layout)


def clean_median(device: Device, ops: GemmOperands, ref: ReferenceChecksums) -> float:
    """Median |row checksum − reference| of one clean run: the unit of a ``perturb`` fault."""
    return numerics.median_row_diff(device.checked_gemm(ops), ref)


class GemmProbe:
    """Runs GEMM cases on one device and turns what it sees into evidence."""

    def __init__(self, device: Device, thresholds: numerics.Thresholds, *, reruns: int = 5,
                 fault: FaultPlan | None = None, on_case: Callable[[str], None] | None = None, keep_flagged: bool = False,
                 tally: Tally | None = None):
        self.device = device
        self.th = thresholds
        self.reruns = reruns
        self.fault = fault
        self.on_case = on_case or (lambda _cid: None)
        self.stats = ProbeStats()
        # what this probe checked and how much it keeps (probes/confirmation.py); alone (no
        # tally: calibration, benchmarks, tests) every case is confirmed and kept in full
        self.tally = tally if tally is not None else Tally(in_full=None)
        self.counts = self.tally.probe(PROBE)
        # case id → the flagged run itself (C and fused sums as observed), for vTask capture;
        # kept only on request, in host memory (a 70B-shape C is 128 MiB, and a device with a
        # permanent fault flags every case), up to KEEP_FLAGGED_BYTES: later ones are re-run
        # when the vTasks are saved
        self.keep_flagged = keep_flagged
        self.flagged_runs: dict[str, GemmResult] = {}
        self.kept_bytes = 0
        self._group_reran = False  # a flagged case of the current group was re-run (_reruns_now)

    # -- one group of scale variants -----------------------------------------------
    def run(self, case: GemmCase, scales: list[list[int]], only: str | None = None) -> list[Evidence]:
        t0 = time.perf_counter()
        dev = self.device
        base_ops = case.operands(dev)
        tile = dev.tile
        base_ref = dev.reference_checksums(base_ops, tile)
        tau = self.th.tau
        med = clean_median(dev, base_ops, base_ref) if self.fault is not None and self.fault.needs_clean_median() else None
        evidence: list[Evidence] = []
        base: GemmResult | None = None
        # runs are kept (host copies) only where their evidence can still be shown in full
        runs, onces = GroupRuns(dev, keep=self.tally.may_keep(PROBE)), {}
        self._group_reran = False
        mag = numerics.magnitudes(base_ops)  # once per case, not per scale
        order = sorted(scales, key=lambda s: s != [0, 0])  # the base runs first
        for i, (ea, eb) in enumerate(order):
            cid = case.case_id(ea, eb)
            if only is not None and cid != only and (ea, eb) != (0, 0):
                continue
            if (ea, eb) != (0, 0) and not numerics.pow2_exact_safe(mag, ea, eb):
                if cid == only:  # the one case asked for cannot run: say so, never HEALTHY
                    raise ConfigError(f"case {cid!r} cannot run with seed {case.seed}: scale {ea:+d}{eb:+d} would take "
                                      "these inputs out of the range where power-of-two scaling is exact")
                self.stats.skipped_scales += 1
                self.on_case(cid)  # counted in the progress total all the same
                continue
            ops = scaled(base_ops, ea, eb) if (ea, eb) != (0, 0) else base_ops
            ref = base_ref.scaled(ea + eb)
            expected = numerics.pow2_scale(base.c, ea + eb) if base is not None else None

            def once(ops=ops, ref=ref, expected=expected, cid=cid):
                res = dev.checked_gemm(ops, self.fault, op=cid, clean_median=med)
                return res, self._signals(res, ref, expected, tau)

            res, signals = once()
            self._count(case.shape, res, signals)
            if (ea, eb) == (0, 0):
                base = res
            # a broken pow2 expectation says the base run or this one is wrong, not which: the
            # vote below decides, once every scale has run; the other checks are this run's own
            runs.first((ea, eb), res, mismatched=any(s.check == checks.POW2_CHECK for s in signals))
            onces[(ea, eb)] = once
            signals = [s for s in signals if s.check != checks.POW2_CHECK]
            if signals and (only is None or cid == only):
                found = self._confirm(case, ea, eb, res, signals, runs.recording((ea, eb), once), tau, ops)
                evidence += found
                if self.keep_flagged and found:
                    self._keep(cid, res)
            self.on_case(cid)
            if self._stops(evidence, cid):  # fail-fast: the rest of the group is skipped, no vote
                rest = [case.case_id(a, b) for a, b in order[i + 1:]]
                self.skip([r for r in rest if only is None or r == only])  # what a --case would not run is not skipped
                break
        else:
            if runs.mismatched:
                evidence += self._vote(case, runs, onces)
                self._stops(evidence, case.case_id(0, 0))
        self.stats.seconds += time.perf_counter() - t0
        return evidence

    def _stops(self, evidence: list[Evidence], cid: str) -> bool:
        """Whether, with fail-fast, the device stops at ``cid``: ``evidence`` confirms FAULTY."""
        return any(e.severity is Verdict.FAULTY for e in evidence) and self.tally.stop(cid)

    def skip(self, case_ids: list[str]) -> None:
        """Cases fail-fast leaves unrun, named in the report (the scan counts them as progress)."""
        self.counts.skipped += case_ids

    def _reruns_now(self) -> int:
        """Re-runs of a flagged case: all of them until the probe has confirmed FAULTY; then one
        for a case still shown in full and for the first flagged case of each group (does this
        input reproduce?), none for the group's other flagged scales, which are counted."""
        if not self.tally.cheap(PROBE):
            n = self.reruns
        else:
            n = min(1, self.reruns) if self.tally.room(PROBE) or not self._group_reran else 0
        self._group_reran = True
        return n

    # -- the power-of-two vote (docs/design.md §5) ---------------------------------------
    def _vote(self, case: GemmCase, runs: GroupRuns, onces: dict) -> list[Evidence]:
        """Evidence of the runs a broken pow2 expectation implicates (checks/vote.py): the base
        is re-run up to ``reruns`` times, the scales vote, and each scale with runs off the
        majority, re-run as often, gets one finding counting its own runs that are off.
        Undecided: each mismatched scale against the base run, as the check compared them.
        Once the probe has confirmed FAULTY, the scales vote with the runs already made."""
        n = 1 if self.tally.cheap(PROBE) else 1 + self.reruns

        def again(key):
            def run():
                res, signals = onces[key]()
                self._count(case.shape, res, signals)
                return res
            return run

        runs.top_up((0, 0), again((0, 0)), n)
        v = runs.vote()
        if v.decided:
            scales = list(runs.scales)
            reference, keys = v.majority, [scales[i] for i in sorted({i for i, _ in v.odd})]
            how = f"differ from the result {v.votes} of {v.scales} scales agree on (scaled back)"
        else:
            reference, keys = runs.prints((0, 0))[0], runs.mismatched
            how = (f"differ from the base run's; no result was shared by more than half the {v.scales} scales "
                   "(each scale's runs agreeing), so the vote could not say which run is wrong")
        evidence = []
        for key in keys:
            if vote.failures(runs.prints(key), reference):
                runs.top_up(key, again(key), n)  # off the reference: how often does it fail?
            prints = runs.prints(key)
            k = vote.failures(prints, reference)
            if not k:
                continue
            self.counts.flagged(case.case_id(*key), checks.POW2_CHECK, len(prints), k)
            j = judge.judge((checks.POW2_CHECK,), distinct_outputs=len(set(prints)), reproducible=k == len(prints),
                            margin=None, confirm_margin=self.th.confirm_margin)
            if self.tally.keep(PROBE, case.case_id(*key), j.severity):
                evidence.append(self._vote_evidence(case, key, runs, prints, reference, k, how, j))
        return evidence

    def _vote_evidence(self, case: GemmCase, key, runs: GroupRuns, prints: list, reference, k: int, how: str,
                       j: judge.Judgement) -> Evidence:
        """One scale's finding: its first run off ``reference`` against a run that gave it, both
        brought to this scale (exactly), and how many of its runs were off."""
        (ea, eb), s, host = key, case.shape, self.device.to_host
        cid = case.case_id(ea, eb)
        odd, ref = runs.result(next(p for p in prints if p != reference), key), runs.result(reference, key)
        ev = Evidence(check=checks.POW2_CHECK, severity=j.severity, case_id=cid, summary="", op=s.op,
                      layout=s.layout.value, shape={"m": s.m, "n": s.n, "k": s.k}, dist=case.dist, scale=[ea, eb],
                      seed=case.seed, max_value=1.0, reruns=len(prints) - 1, reproduced=k - 1,
                      distinct_outputs=len(set(prints)), kernel=odd[1].kernel if odd else "",
                      injected=recent_injections(self.fault, case=cid))
        if odd is not None and ref is not None:
            at_scale = lambda kept: numerics.pow2_scale(host(kept[1].c), ea + eb - sum(kept[0]))
            shown = dataclasses.replace(odd[1], c=at_scale(odd), tile_sm=None if odd[1].tile_sm is None else host(odd[1].tile_sm))
            found = checks.pow2_signal(shown.c, at_scale(ref))
            if found is not None:
                tiles = found.tiles(*shown.tile)
                ev.elements, ev.samples = found.elements, _samples(found, shown, shown.tile_sm)
                ev.tiles, ev.sms = [list(t) for t in tiles][:MAX_LOCALISED], _sms(shown.tile_sm, tiles)
                ev.localised = found.where[:MAX_LOCALISED].tolist()
        ev.summary = (f"{checks.POW2_CHECK}: {ev.elements} element(s) at scale 2^{ea}/2^{eb} {how}; "
                      f"failed {k} of {len(prints)} runs; {j.why}")
        if self.keep_flagged and cid not in self.flagged_runs and odd is not None and odd[0] == key:
            self._keep(cid, odd[1])
        return ev

    def _keep(self, cid: str, res: GemmResult) -> None:
        size = sum(t.numel() * t.element_size() for t in (res.c, res.row_sums, res.col_sums))
        if self.kept_bytes + size > KEEP_FLAGGED_BYTES:
            return
        self.flagged_runs[cid] = on_host(self.device, res)
        self.kept_bytes += size

    def _count(self, shape: GemmShape, res: GemmResult, signals: list) -> None:
        self.stats.gemms += 1
        self.counts.launches += 1
        self.counts.failed += bool(signals)
        self.stats.flops += shape.flops
        self.stats.checksums += res.row_sums.numel() + res.col_sums.numel()

    # -- checks ----------------------------------------------------------------------
    def _signals(self, res: GemmResult, ref: ReferenceChecksums, expected: torch.Tensor | None, tau: float) -> list[checks.Signal]:
        checked = checks.check_gemm(res, ref, tau, expected=expected)
        worst = checked.clean_max()
        if worst is not None:
            self.stats.clean_max = max(self.stats.clean_max, worst)
            self.stats.clean_ratio = max(self.stats.clean_ratio, worst / tau)
        return checked.signals

    def _findings(self, signals: list[checks.Signal], res: GemmResult) -> list[Finding]:
        """What evidence shows of a flagged run's signals: samples, tiles, SMs, localised
        elements. Only for evidence given in full:
        a device that fails every launch must not copy and sort every run's checksums."""
        tm, tn = res.tile
        tile_sm = res.tile_sm.cpu() if res.tile_sm is not None else None
        by_check = {s.check: s for s in signals}
        loc = checks.localise(by_check.get("gemm.row_checksum"), by_check.get("gemm.col_checksum"), tm, tn, MAX_LOCALISED)
        out = []
        for s in signals:
            tiles = s.tiles(tm, tn)
            if s.check in CHECKSUM_CHECKS:
                localised = loc
            elif s.axes == "element":
                localised = s.where[:MAX_LOCALISED].tolist()
            else:
                localised = []
            out.append(Finding(s.check, s.max_value, s.elements, _samples(s, res, tile_sm), [list(t) for t in tiles][:MAX_LOCALISED],
                              _sms(tile_sm, tiles), localised, s.axes))
        return out

    # -- confirmation ------------------------------------------------------------------
    def confirm_run(self, case: GemmCase, ea: int, eb: int, res: GemmResult, ops: GemmOperands, ref: ReferenceChecksums,
                    expected: torch.Tensor | None, tau: float, rerun: Callable[[], GemmResult]) -> list[Evidence]:
        """Check a run made outside the probe (a burn-in launch its screen flagged) as the probe
        checks its own at scale (ea, eb): the GEMM checks against ``ref`` and, where given, the
        exact bits ``expected``; if any fires, re-runs through ``rerun`` and the judgement, as in
        ``run``. The run itself is not counted (its caller did); the re-runs are."""
        def once():
            r = rerun()
            return r, self._signals(r, ref, expected, tau)

        signals = self._signals(res, ref, expected, tau)
        return self._confirm(case, ea, eb, res, signals, once, tau, ops) if signals else []

    def _confirm(self, case: GemmCase, ea: int, eb: int, res: GemmResult, signals: list[checks.Signal], once, tau: float,
                 ops: GemmOperands) -> list[Evidence]:
        """Re-run a flagged case (as often as ``_reruns_now`` says) and count it; judge each
        signal by its reproduction and, for a checksum, by recomputing its worst flagged entries
        in fp64 from ``ops`` (checks/recompute.py). A case only counted (the probe confirmed
        FAULTY and showed its first cases in full) is not judged: the device's verdict already
        rests on FAULTY evidence in full, and what matters of it is "failed k of n"."""
        counted = self.tally.cheap(PROBE) and not self.tally.room(PROBE)
        # fingerprinted where the result lives (the GPU kernel on CUDA): copying every re-run's C
        # to the host made a device that fails every launch take minutes to diagnose
        fp = lambda r: (self.device.fingerprint(r.c), self.device.fingerprint(r.row_sums), self.device.fingerprint(r.col_sums))
        prints = set() if counted else {fp(res)}
        seen = {s.check: 0 for s in signals}
        reruns = self._reruns_now()
        for _ in range(reruns):
            r2, sig2 = once()
            self._count(case.shape, r2, sig2)
            if not counted:
                prints.add(fp(r2))
            for s in sig2:
                if s.check in seen:
                    seen[s.check] += 1
        cid = case.case_id(ea, eb)
        for sig in signals:
            self.counts.flagged(cid, sig.check, reruns + 1, seen[sig.check] + 1)
        if counted:
            return []
        shape, judged = case.shape, []
        for sig in signals:
            ev = Evidence(check=sig.check, severity=Verdict.SUSPECT, case_id=cid, summary="", op=shape.op,
                          layout=shape.layout.value, shape={"m": shape.m, "n": shape.n, "k": shape.k}, dist=case.dist,
                          scale=[ea, eb], seed=case.seed, elements=sig.elements, reruns=reruns, reproduced=seen[sig.check],
                          distinct_outputs=len(prints), kernel=res.kernel, max_value=sig.max_value)
            rc = None
            if sig.check in CHECKSUM_CHECKS:
                ev.threshold, ev.margin = tau, judge.margin(sig.max_value, tau)
                rc = recheck.recompute(ops, res, sig.axes, recheck.worst_positions(sig))
                ev.recompute = rc.to_dict() if rc is not None else None
            j = judge.judge((sig.check,), distinct_outputs=len(prints), reproducible=ev.reproduced == ev.reruns,
                            margin=ev.margin, confirm_margin=self.th.confirm_margin, recompute=rc)
            ev.severity = j.severity
            ev.summary = (f"{sig.check}: {sig.elements} element(s) flagged at scale 2^{ea}/2^{eb}; "
                          f"failed {ev.reproduced + 1} of {ev.reruns + 1} runs; {j.why}")
            judged.append(ev)
        if not self.tally.keep(PROBE, cid, worst_severity(e.severity for e in judged)):
            return []
        for ev, f in zip(judged, self._findings(signals, res), strict=True):  # in full: where, and what was injected
            ev.samples, ev.tiles, ev.sms, ev.localised = f.samples, f.tiles, f.sms, f.localised
            ev.injected = recent_injections(self.fault, case=cid)
        return judged
