"""Calibration of the clean noise (docs/design.md §3).

- ``clean_distribution``: run clean checked GEMMs and record the distribution of the
  normalised checksum differences (in units of each device's noise scale σ, whose calibrated
  clean maximum is 1: Device.noise_model, docs/calibration.md); the margin is τ ÷ the largest
  clean value.

The constants of each device's noise model come from ``benchmarks/noise_profile.py`` (the
largest clean |Δ|/(K^power·ρ), rounded up) and are checked by ``benchmarks/false_positives.py``.

The sensitivity study (perturbations near the noise, thresholds set on held-out clean runs)
is aegis_cli.sensitivity.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from aegis_cli.backends.base import Device
from aegis_cli.ops import numerics
from aegis_cli.ops.workloads import Workload
from aegis_cli.probes.gemm import GemmCase, GemmProbe


@dataclass
class CleanStats:
    gemms: int = 0
    checksums: int = 0
    values: list[float] = field(default_factory=list)  # per seed: largest normalised difference (·σ)
    ratios: list[float] = field(default_factory=list)  # per seed: largest (difference ÷ the case's τ)
    flagged: int = 0

    @property
    def clean_max(self) -> float:
        return max(self.values, default=0.0)

    @property
    def margin(self) -> float:
        """τ ÷ the largest clean value, taken case by case (a scan's ``noise.margin``)."""
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
