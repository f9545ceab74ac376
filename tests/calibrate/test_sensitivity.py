"""The AEGIS sensitivity study, in small: fp32-accumulator checksums need a perturbation at
least 10³× smaller than a bf16-output checksum for ≥ 99% detection (docs/sensitivity.md has
the full curves from benchmarks/sensitivity.py)."""

from __future__ import annotations

from aegis_cli.backends.cpu import CpuDevice
from aegis_cli.calibrate import sensitivity


def test_fp32_accumulator_checks_are_1000x_more_sensitive():
    rs = [10.0**e for e in range(-1, 10)]
    res = sensitivity(CpuDevice(), rs, trials=100, m=256, n=256, k=512)
    print(f"\nr99 fp32-acc {res.r99_fp32:g}, r99 bf16-out {res.r99_bf16:g}; fp32 {res.rate_fp32}; bf16 {res.rate_bf16}")
    assert res.rate_fp32[0] == 0.0 and res.rate_bf16[0] == 0.0  # r = 0.1: inside the noise, never flagged
    assert res.r99_fp32 < float("inf") and res.r99_bf16 < float("inf")
    assert res.r99_bf16 / res.r99_fp32 >= 1e3
