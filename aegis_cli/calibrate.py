"""Calibration and sensitivity studies (docs/design.md §3).

- ``clean_distribution``: run clean checked GEMMs and record the distribution of the
  normalised checksum differences; the margin is threshold ÷ largest clean value.
- ``sensitivity``: the AEGIS-style study. Perturb each fp32 accumulator element with
  probability ``rate`` by ±r × the median absolute clean row-checksum difference, and
  measure how often a trial is detected by (a) the fp32-accumulator checksums at the
  production threshold and (b) a bf16-output checksum (Σ of the rounded output against the
  same fp64 reference) at its own zero-false-positive threshold with the same margin.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from aegis_cli.backends.base import Device
from aegis_cli.faults.spec import FaultPlan
from aegis_cli.ops import numerics
from aegis_cli.ops.gemm import GemmOperands, Layout
from aegis_cli.ops.workloads import Workload
from aegis_cli.probes.gemm import GemmCase, GemmProbe


@dataclass
class CleanStats:
    gemms: int = 0
    checksums: int = 0
    values: list[float] = field(default_factory=list)  # per seed: largest normalised difference
    ratios: list[float] = field(default_factory=list)  # per seed: largest (difference ÷ the case's τ)
    flagged: int = 0

    @property
    def clean_max(self) -> float:
        return max(self.values, default=0.0)

    @property
    def margin(self) -> float:
        """τ ÷ the largest clean value, taken case by case (τ may depend on K and device)."""
        worst = max(self.ratios, default=0.0)
        return 1.0 / worst if worst > 0 else math.inf


def clean_distribution(device: Device, wl: Workload, seeds: list[int], th: numerics.Thresholds) -> CleanStats:
    """Every case × scale of ``wl`` for each seed, no faults; count flags (false positives)."""
    out = CleanStats()
    for seed in seeds:
        probe = GemmProbe(device, th, reruns=1)
        for shape in wl.gemms():
            for dist in wl.scan.distributions:
                out.flagged += len(probe.run(GemmCase(wl.name, shape, dist, seed), wl.scan.scales))
        out.gemms += probe.stats.gemms
        out.checksums += probe.stats.checksums
        out.values.append(probe.stats.clean_max)
        out.ratios.append(probe.stats.clean_ratio)
    return out


@dataclass
class SensitivityResult:
    rs: list[float]
    rate_fp32: list[float]
    rate_bf16: list[float]
    tau_fp32: float
    tau_bf16: float
    clean_max_fp32: float
    clean_max_bf16: float
    trials: int
    shape: tuple[int, int, int]

    @staticmethod
    def r_at(rs: list[float], rates: list[float], target: float = 0.99) -> float:
        """Smallest r on the grid from which detection stays ≥ target (inf if never)."""
        for i, r in enumerate(rs):
            if all(x >= target for x in rates[i:]):
                return r
        return math.inf

    @property
    def r99_fp32(self) -> float:
        return self.r_at(self.rs, self.rate_fp32)

    @property
    def r99_bf16(self) -> float:
        return self.r_at(self.rs, self.rate_bf16)


def _bf16_row_diff(c: torch.Tensor, ref_row: torch.Tensor, scale: torch.Tensor, tn: int) -> torch.Tensor:
    return numerics.normalised_diff(numerics.sum_col_tiles(c.double(), tn), ref_row, scale)


def sensitivity(device: Device, rs: list[float], *, trials: int = 100, m: int = 256, n: int = 256, k: int = 1024,
                rate: float = 2e-4, n_inputs: int = 4, th: numerics.Thresholds | None = None, seed: int = 0) -> SensitivityResult:
    th = th or numerics.Thresholds()
    tau = th.tau_for(device, k)
    _tm, tn = device.tile
    inputs = []
    clean32, clean16, medians = 0.0, 0.0, []
    for i in range(n_inputs):  # clean runs: per-input median |Δ| and both clean maxima
        ops = GemmOperands(device.generate((m, k), "normal", seed * 1000 + 2 * i),
                           device.generate((k, n), "normal", seed * 1000 + 2 * i + 1), Layout.DGRAD)
        ref = device.reference_checksums(ops, device.tile)
        res = device.checked_gemm(ops)
        d_row, d_col = numerics.checksum_diffs(res, ref)
        clean32 = max(clean32, float(d_row.max()), float(d_col.max()))
        clean16 = max(clean16, float(_bf16_row_diff(res.c, ref.row, ref.row_scale, tn).max()))
        medians.append(numerics.median_row_diff(res, ref))
        inputs.append((ops, ref))
    # the bf16 mode gets the same margin over its own clean maximum as the fp32 mode has
    tau16 = clean16 * (tau / clean32) if clean32 > 0 else th.tau_bf16
    rate32, rate16 = [], []
    for r in rs:
        hit32 = hit16 = 0
        plan = FaultPlan.parse(f"perturb:r={r!r},rate={rate!r},seed={seed}")
        for t in range(trials):
            ops, ref = inputs[t % n_inputs]
            res = device.checked_gemm(ops, plan, op=f"sensitivity/{t}", clean_median=medians[t % n_inputs])
            d_row, d_col = numerics.checksum_diffs(res, ref)
            hit32 += bool((d_row > tau).any() or (d_col > tau).any())
            hit16 += bool((_bf16_row_diff(res.c, ref.row, ref.row_scale, tn) > tau16).any())
        rate32.append(hit32 / trials)
        rate16.append(hit16 / trials)
    return SensitivityResult(list(rs), rate32, rate16, tau, tau16, clean32, clean16, trials, (m, n, k))
