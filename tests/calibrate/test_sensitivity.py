"""The sensitivity study in small, built so that it can fail (issue 17; the full study is
benchmarks/sensitivity.py → docs/sensitivity.md).

256×256×1024 GEMMs, normal and heavy-tailed inputs, 20 perturbed launches per r, each fp32
accumulator element moved with probability 2e-4 (≈ 13 per launch) by ±r × the median clean
row-checksum difference.

- At the production τ (3.5 on the CPU's noise scale σ, docs/calibration.md) the
  fp32-accumulator checks must catch ≥ 99 % of launches from r = 100 on: an absolute bound.
  Measured: 0 % at r = 10, 10 % (normal) and 25 % (heavy) at 31.6, 100 % from 100. A τ 10×
  looser (35·σ) shifts the whole curve a decade up (r99 = 1e3; at r = 100 it catches nothing)
  and fails this test; so did the former τ = 1e-6·s (r99 3.16e3…1e4).
- At thresholds calibrated on other, held-out clean inputs (3× their clean maximum), no clean
  trial input is flagged, the fp32-accumulator checks reach 99 % by r = 100, and a bf16-output
  checksum at the same margin over its own clean maximum catches fewer than half of the launches
  at any r up to 10^4.5. Neither threshold depends on τ.
"""

from __future__ import annotations

import math

import pytest

from aegis_cli.backends.cpu import CpuDevice
from aegis_cli.sensitivity import DETECTORS, Setup, half_decades, sensitivity

RS = half_decades(10, 10**4.5)
R99_AT_TAU = 100  # absolute: r99 of the fp32-accumulator checks at the production τ
R99_HELDOUT = 1e2


@pytest.fixture(scope="module", params=["normal", "heavy"])
def study(request):
    res = sensitivity(CpuDevice(), Setup(256, 256, 1024, request.param, trials=20), RS)
    print(f"\n{request.param}: τ {res.tau:g}·σ = {res.tau_over_clean:.2g}× the clean max; "
          + "; ".join(f"{d} {res.detection[d]} r99 {res.r99(d):g}" for d in DETECTORS))
    return res


def test_fp32_checks_at_the_production_tau_catch_r_100(study):
    assert study.detection["fp32_tau"][0] == 0.0  # r = 10: inside the threshold, never flagged
    r99 = study.r99("fp32_tau")
    curve = ", ".join(f"{r:.3g}: {100 * x:.0f} %" for r, x in zip(RS, study.detection["fp32_tau"], strict=True))
    reach = f"from r = {r99:.3g}" if math.isfinite(r99) else "at no r on the grid"
    assert r99 <= R99_AT_TAU, (f"{study.setup.dist}: at τ = {study.tau:g}·σ the fp32-accumulator checks reach 99 % "
                               f"{reach}, not by the bound r = {R99_AT_TAU:g} (detection per r: {curve})")


def test_heldout_thresholds_fp32_against_bf16_output(study):
    assert study.false_positives == dict.fromkeys(DETECTORS, 0)  # no clean held-out input flagged
    assert study.r99("fp32_heldout") <= R99_HELDOUT
    assert max(study.detection["bf16_heldout"]) < 0.5
