"""No false positives: ≥ 500 clean checked GEMMs across every scale, distribution and layout
of the cpu-quick and (shrunk) 1B presets flag nothing, with a clean margin ≥ 3 (τ = 3.5 on the
noise scale, whose unit is the calibrated clean maximum: a real margin, not hundreds)."""

from __future__ import annotations

import dataclasses

from aegis_cli.backends.cpu import CpuDevice
from aegis_cli.calibrate import clean_distribution
from aegis_cli.ops import workloads
from aegis_cli.ops.numerics import Thresholds


def test_no_false_positives_and_a_real_margin(record_property):
    th = Thresholds()
    dev = CpuDevice()
    quick = clean_distribution(dev, workloads.load("cpu-quick"), seeds=[0, 1, 2], th=th)
    b1 = workloads.load("llama3-1b")
    b1 = dataclasses.replace(b1, scan=dataclasses.replace(b1.scan, max_tokens=64))  # 1B shapes, fewer tokens
    big = clean_distribution(dev, b1, seeds=[0], th=th)
    gemms = quick.gemms + big.gemms
    clean_max = max(quick.clean_max, big.clean_max)
    margin = min(quick.margin, big.margin)
    record_property("clean_gemms", gemms)
    record_property("clean_margin", margin)
    print(f"\nclean GEMMs {gemms}, checksums {quick.checksums + big.checksums}, largest clean |Δ|/σ {clean_max:.3g}, "
          f"threshold {th.tau:g}, margin {margin:.1f}×")
    assert gemms >= 500
    assert quick.flagged == 0 and big.flagged == 0
    assert 3 <= margin <= 30  # above 3×, and not the hundreds of a threshold that ignores the noise
