"""Confirmation tells numerics from faults (docs/design.md §7.2): a flag that only repeats the
kernel's own rounding is SUSPECT, however often it reproduces; bits beyond any rounding are FAULTY."""

from __future__ import annotations

import json
import random

from aegis_cli.backends.cpu import CpuDevice
from aegis_cli.checks.gemm import CHECKSUM_CHECKS
from aegis_cli.faults.spec import FaultPlan
from aegis_cli.ops import workloads
from aegis_cli.ops.numerics import Thresholds
from aegis_cli.ops.verdict import Verdict
from aegis_cli.probes.gemm import GemmCase, GemmProbe
from tests.helpers import TINY, run_cli

NUMERICS = "numerics: threshold too tight for this input?"


def _scan(capsys, tmp_path, *argv: str) -> tuple[int, list[dict]]:
    out = tmp_path / "scan.json"
    code, _, _ = run_cli(capsys, "scan", "--device", "cpu:0", "--format", "json", "-o", str(out), "-q", *argv)
    return code, json.loads(out.read_text())["devices"][0]["evidence"]


def test_a_threshold_below_rounding_on_a_healthy_device_is_suspect_naming_numerics(capsys, tmp_path):
    # every checksum is flagged and every flag reproduces bit for bit (a deterministic kernel repeats
    # its rounding): before the fp64 recomputation this said FAULTY "failed 6 of 6 runs"
    code, ev = _scan(capsys, tmp_path, "--threshold", "1e-10")
    assert code == 1 and ev
    for e in ev:
        assert e["severity"] == "SUSPECT" and e["check"] in CHECKSUM_CHECKS and e["reproduced"] == e["reruns"]
        assert NUMERICS in e["summary"] and e["margin"] > 1
        rc = e["recompute"]
        assert rc["beyond_bound"] == 0 and 0 < rc["entries"] <= 64 and rc["elements"] >= rc["entries"] and rc["worst_ratio"] <= 1


def test_a_permanent_accumulator_fault_is_still_faulty_under_the_same_threshold(capsys, tmp_path):
    # every fault seed but 150 puts a flip beyond the rigorous bound in some gemm case (all 1,000
    # tried); seed 150's stay within it there (SUSPECT; the device is FAULTY through other probes)
    seed = random.choice([s for s in range(1000) if s != 150])
    code, ev = _scan(capsys, tmp_path, "--workload", TINY, "--threshold", "1e-10", "--reruns", "2",
                     "--inject", f"bitflip:target=acc,bit=exp,seed={seed}")
    assert code == 2
    faulty = [e for e in ev if e["severity"] == "FAULTY" and e["check"] in CHECKSUM_CHECKS]
    assert faulty and all(e["recompute"]["beyond_bound"] >= 1 and e["distinct_outputs"] == 1 for e in faulty)
    # flags in cases the fault left alone are the threshold's, and say so
    assert all(NUMERICS in e["summary"] for e in ev if e["severity"] == "SUSPECT")


def test_a_small_perturbation_beyond_the_rigorous_bound_is_faulty():
    # r = 10⁴ × the clean median moves a few accumulator elements by ≈ 4 τ·s (0.15 on values of
    # ≈ 20): small, yet farther from their fp64 values than rounding can reach. No re-runs (a
    # perturbation is drawn afresh per launch): nothing but the recomputation confirms.
    wl = workloads.load(TINY)
    seed = random.randrange(2**31)
    probe = GemmProbe(CpuDevice(), Thresholds(), reruns=0, fault=FaultPlan.parse(f"perturb:r=1e4,seed={seed % 1000}"))
    ev = [e for shape in wl.gemms() for e in probe.run(GemmCase(wl.name, shape, "normal", seed), [[0, 0]])]
    sums = [e for e in ev if e.check in CHECKSUM_CHECKS]
    assert sums and all(e.severity is Verdict.FAULTY and e.recompute["beyond_bound"] >= 1 for e in sums)
