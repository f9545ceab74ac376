"""The GEMM checksum probe (DESIGN §2.1, §2.3, §3).

For each training GEMM × input distribution, the probe draws seeded operands once and
runs them at every power-of-two input scale of the plan. Each run is checked four ways:

  gemm.row_checksum   fp32-accumulator row sums per column tile vs fp64 A·(B·1), |Δ|/s > τ
  gemm.col_checksum   fp32-accumulator column sums per row tile vs fp64 (1ᵀA)·B, |Δ|/s > τ
  gemm.output_rowsum  Σ of the bf16 output vs the accumulator row sums, beyond a rigorous
                      rounding bound (sees store-path faults the fused sums cannot)
  gemm.pow2_exact     C(2^a·A, 2^b·B) must equal 2^(a+b)·C(A, B) bit for bit
  gemm.nonfinite      NaN/Inf in C from finite inputs

A flagged case is re-run; the re-runs decide FAULTY vs SUSPECT (verdict.py).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from aegis_cli.backends.base import Device
from aegis_cli.checks.gemm import CHECKSUM_CHECKS
from aegis_cli.faults.spec import FaultPlan, recent_injections
from aegis_cli.ops import fingerprint, numerics
from aegis_cli.ops.case import CaseId, case_seed
from aegis_cli.ops.errors import ConfigError
from aegis_cli.ops.gemm import GemmOperands, GemmResult, GemmShape, Layout, ReferenceChecksums
from aegis_cli.ops.verdict import Evidence, Verdict

MAX_SAMPLES = 8
MAX_LOCALISED = 16
RIGOROUS = ("gemm.nonfinite", "gemm.output_rowsum", "gemm.pow2_exact")


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
class Signal:
    check: str
    max_value: float  # normalised difference (checksums) or 1.0 (bitwise)
    elements: int
    samples: list[dict] = field(default_factory=list)
    tiles: list[list[int]] = field(default_factory=list)
    sms: list[int] = field(default_factory=list)
    localised: list[list[int]] = field(default_factory=list)


def _sms(tile_sm: torch.Tensor | None, tiles) -> list[int]:
    """The SMs that ran these (row tile, column tile)s, from the host copy of ``tile_sm``."""
    return sorted({int(tile_sm[t]) for t in tiles}) if tile_sm is not None else []


def _bits32(x: float) -> str:
    return f"0x{torch.tensor([x], dtype=torch.float32).view(torch.int32).item() & 0xFFFFFFFF:08x}"


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


def scaled_reference(ref: ReferenceChecksums, e: int) -> ReferenceChecksums:
    f = 2.0**e  # exact in fp64
    return ReferenceChecksums(ref.row * f, ref.col * f, ref.row_scale * f, ref.col_scale * f, ref.floor)


class GemmProbe:
    """Runs GEMM cases on one device and turns what it sees into evidence."""

    def __init__(self, device: Device, thresholds: numerics.Thresholds, *, reruns: int = 5,
                 fault: FaultPlan | None = None, on_case: Callable[[str], None] | None = None, keep_flagged: bool = False):
        self.device = device
        self.th = thresholds
        self.reruns = reruns
        self.fault = fault
        self.on_case = on_case or (lambda _cid: None)
        self.stats = ProbeStats()
        # case id → the flagged run itself (C and fused sums as observed), for vTask capture;
        # kept only on request, in host memory (a 70B-shape C is 128 MiB, and a device with a
        # permanent fault flags every case), up to KEEP_FLAGGED_BYTES: later ones are re-run
        # when the vTasks are saved
        self.keep_flagged = keep_flagged
        self.flagged_runs: dict[str, GemmResult] = {}
        self.kept_bytes = 0

    # -- one group of scale variants -----------------------------------------------
    def run(self, case: GemmCase, scales: list[list[int]], only: str | None = None) -> list[Evidence]:
        t0 = time.perf_counter()
        dev = self.device
        base_ops = case.operands(dev)
        tile = dev.tile
        base_ref = dev.reference_checksums(base_ops, tile)
        tau = self.th.tau_for(dev, case.shape.k)
        med = clean_median(dev, base_ops, base_ref) if self.fault is not None and self.fault.needs_clean_median() else None
        evidence: list[Evidence] = []
        base: GemmResult | None = None
        mag = numerics.magnitudes(base_ops)  # once per case, not per scale
        for ea, eb in sorted(scales, key=lambda s: s != [0, 0]):  # the base runs first
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
            ref = scaled_reference(base_ref, ea + eb)
            expected = numerics.pow2_scale(base.c, ea + eb) if base is not None else None

            def once(ops=ops, ref=ref, expected=expected, cid=cid):
                res = dev.checked_gemm(ops, self.fault, op=cid, clean_median=med)
                return res, self._signals(res, ref, expected, tau)

            res, signals = once()
            self._count(case.shape, res)
            if (ea, eb) == (0, 0):
                base = res
            if signals and (only is None or cid == only):
                evidence += self._confirm(case, ea, eb, res, signals, once, tau)
                if self.keep_flagged:
                    self._keep(cid, res)
            self.on_case(cid)
        self.stats.seconds += time.perf_counter() - t0
        return evidence

    def _keep(self, cid: str, res: GemmResult) -> None:
        size = sum(t.numel() * t.element_size() for t in (res.c, res.row_sums, res.col_sums))
        if self.kept_bytes + size > KEEP_FLAGGED_BYTES:
            return
        host = self.device.to_host
        self.flagged_runs[cid] = dataclasses.replace(
            res, c=host(res.c), row_sums=host(res.row_sums), col_sums=host(res.col_sums),
            tile_sm=None if res.tile_sm is None else host(res.tile_sm))
        self.kept_bytes += size

    def _count(self, shape: GemmShape, res: GemmResult) -> None:
        self.stats.gemms += 1
        self.stats.flops += shape.flops
        self.stats.checksums += res.row_sums.numel() + res.col_sums.numel()

    # -- checks ----------------------------------------------------------------------
    def _signals(self, res: GemmResult, ref: ReferenceChecksums, expected: torch.Tensor | None, tau: float) -> list[Signal]:
        tm, tn = res.tile
        out: list[Signal] = []
        d_row, d_col = numerics.checksum_diffs(res, ref)  # (M, nt_n), (nt_m, N)
        row_flag, col_flag = d_row > tau, d_col > tau
        clean = torch.cat([d_row[~row_flag].reshape(-1), d_col[~col_flag].reshape(-1)])
        if clean.numel():
            worst = float(clean.max())
            self.stats.clean_max = max(self.stats.clean_max, worst)
            self.stats.clean_ratio = max(self.stats.clean_ratio, worst / tau)
        tile_sm = res.tile_sm.cpu() if res.tile_sm is not None else None
        loc = self._localise(row_flag, col_flag, tm, tn)
        for check, d, flag, sums, refv, is_row in (("gemm.row_checksum", d_row, row_flag, res.row_sums, ref.row, True),
                                                   ("gemm.col_checksum", d_col, col_flag, res.col_sums, ref.col, False)):
            n = int(flag.sum())
            if not n:
                continue
            d_h, sums_h, ref_h = d.cpu(), sums.cpu(), refv.cpu()
            top = torch.topk(d_h.reshape(-1), min(MAX_SAMPLES, n)).indices
            samples, tiles = [], set()
            for flat in top.tolist():
                r, c = divmod(flat, d_h.shape[1])
                tile_rc = (r // tm, c) if is_row else (r, c // tn)
                tiles.add(tile_rc)
                obs = float(sums_h[r, c])
                samples.append({("row" if is_row else "row_tile"): r, ("col_tile" if is_row else "col"): c,
                                "tile": list(tile_rc), "observed": obs, "observed_bits": _bits32(obs),
                                "expected": float(ref_h[r, c]), "normalised_diff": float(d_h[r, c]),
                                **({"sm": int(tile_sm[tile_rc])} if tile_sm is not None else {})})
            all_tiles = {((r // tm, c) if is_row else (r, c // tn)) for r, c in flag.nonzero().cpu().tolist()}
            out.append(Signal(check, float(d_h.max()), n, samples, [list(t) for t in sorted(all_tiles)][:MAX_LOCALISED],
                              _sms(tile_sm, all_tiles), loc))
        # rigorous, output-side checks
        c = res.c
        if not bool(torch.isfinite(c).all()) and bool(torch.isfinite(ref.row).all()):
            bad = (~torch.isfinite(c)).nonzero()
            out.append(self._bitwise_signal("gemm.nonfinite", bad.cpu(), None, c, res, tile_sm))
        over, ratio, bound = numerics.output_rowsum_excess(res, tn)
        if bool(over.any()):
            rows = over.nonzero().cpu()
            samples = [{"row": int(r), "col_tile": int(t), "tile": [int(r) // tm, int(t)], "output_sum": float(res.c[r, t * tn:(t + 1) * tn].double().sum()),
                        "accumulator_sum": float(res.row_sums[r, t]), "bound": float(bound[r, t])} for r, t in rows[:MAX_SAMPLES].tolist()]
            tiles = sorted({(int(r) // tm, int(t)) for r, t in rows.tolist()})
            out.append(Signal("gemm.output_rowsum", float(ratio[over].max()), int(over.sum()), samples, [list(t) for t in tiles][:MAX_LOCALISED],
                              _sms(tile_sm, tiles)))
        if expected is not None:
            where = numerics.bf16_mismatches(c, expected)
            if where.numel():
                out.append(self._bitwise_signal("gemm.pow2_exact", where, expected, c, res, tile_sm))
        return out

    def _bitwise_signal(self, check: str, where: torch.Tensor, expected: torch.Tensor | None, c: torch.Tensor, res: GemmResult,
                        tile_sm: torch.Tensor | None) -> Signal:
        tm, tn = res.tile
        samples = []
        for r, col in where[:MAX_SAMPLES].tolist():
            act = int(c[r, col].view(torch.int16).item()) & 0xFFFF
            s = {"row": r, "col": col, "tile": [r // tm, col // tn], "actual": f"0x{act:04x}", "actual_value": float(c[r, col])}
            if expected is not None:
                exp = int(expected[r, col].view(torch.int16).item()) & 0xFFFF
                s.update(expected=f"0x{exp:04x}", expected_value=float(expected[r, col]), xor=f"0x{exp ^ act:04x}")
            samples.append(s)
        tiles = sorted({(r // tm, col // tn) for r, col in where.tolist()})
        return Signal(check, 1.0, int(where.shape[0]), samples, [list(t) for t in tiles][:MAX_LOCALISED], _sms(tile_sm, tiles),
                      [[int(r), int(col)] for r, col in where[:MAX_LOCALISED].tolist()])

    @staticmethod
    def _localise(row_flag: torch.Tensor, col_flag: torch.Tensor, tm: int, tn: int) -> list[list[int]]:
        """Elements where a flagged row (within its column tile) meets a flagged column
        (within its row tile): the candidates for a corrupted accumulator element."""
        out = []
        rows = row_flag.nonzero().cpu().tolist()
        if not rows or len(rows) > 4096:
            return out
        cols = col_flag.nonzero().cpu().tolist()
        by_tile: dict[tuple[int, int], list[int]] = {}
        for ti, j in cols:
            by_tile.setdefault((ti, j // tn), []).append(j)
        for i, t in rows:
            for j in by_tile.get((i // tm, t), []):
                out.append([i, j])
                if len(out) >= MAX_LOCALISED:
                    return out
        return out

    # -- confirmation ------------------------------------------------------------------
    def _confirm(self, case: GemmCase, ea: int, eb: int, res: GemmResult, signals: list[Signal], once, tau: float) -> list[Evidence]:
        fp = lambda r: (fingerprint.fingerprint(r.c), fingerprint.fingerprint(r.row_sums), fingerprint.fingerprint(r.col_sums))
        prints = {fp(res)}
        seen = {s.check: 0 for s in signals}
        for _ in range(self.reruns):
            r2, sig2 = once()
            self._count(case.shape, r2)
            prints.add(fp(r2))
            for s in sig2:
                if s.check in seen:
                    seen[s.check] += 1
        s = case.shape
        evidence = []
        for sig in signals:
            ev = Evidence(check=sig.check, severity=Verdict.SUSPECT, case_id=case.case_id(ea, eb), summary="",
                          op=s.op, layout=s.layout.value, shape={"m": s.m, "n": s.n, "k": s.k}, dist=case.dist,
                          scale=[ea, eb], seed=case.seed, elements=sig.elements, samples=sig.samples, tiles=sig.tiles,
                          sms=sig.sms, localised=sig.localised, reruns=self.reruns, reproduced=seen[sig.check],
                          distinct_outputs=len(prints), kernel=res.kernel,
                          injected=recent_injections(self.fault, case=case.case_id(ea, eb)))
            if sig.check in CHECKSUM_CHECKS:
                ev.threshold, ev.max_value = tau, sig.max_value
                ev.margin = sig.max_value / tau if math.isfinite(sig.max_value) else math.inf
            else:
                ev.max_value = sig.max_value
            ev.severity, why = self._judge(ev, sig.check)
            ev.summary = f"{sig.check}: {sig.elements} element(s) flagged at scale 2^{ea}/2^{eb}; {why}"
            evidence.append(ev)
        return evidence

    def _judge(self, ev: Evidence, check: str) -> tuple[Verdict, str]:
        total = ev.reruns + 1
        failed = ev.reproduced + 1
        rate = f"failed {failed} of {total} runs"
        if ev.distinct_outputs > 1:
            return Verdict.FAULTY, f"{rate}; runs of a deterministic kernel gave {ev.distinct_outputs} different results"
        if check in RIGOROUS:
            return Verdict.FAULTY, f"{rate}; an exact expectation was broken"
        if ev.reproduced == ev.reruns and (ev.margin or 0) >= self.th.confirm_margin:
            return Verdict.FAULTY, f"{rate}; {ev.margin:.3g}× over threshold, bit-identical every run"
        return Verdict.SUSPECT, f"{rate}; only {ev.margin:.3g}× over threshold (confirmation needs {self.th.confirm_margin:g}×)"
