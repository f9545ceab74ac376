"""Tier 2 (GPU): the fp64 recomputation of flagged checksums (checks/recompute.py) on the CUDA
kernels' own results: tensor-core accumulation stays within the rigorous bound on every shape,
layout and input family; a too-tight threshold ends SUSPECT naming numerics; an injected
accumulator fault is still FAULTY."""

from __future__ import annotations

import json

import pytest
import torch

from aegis_cli.checks import recompute as recheck
from aegis_cli.checks.gemm import CHECKSUM_CHECKS
from aegis_cli.faults.spec import FaultPlan
from aegis_cli.ops import numerics, workloads
from aegis_cli.ops.gemm import GemmOperands, Layout
from aegis_cli.ops.verdict import Verdict
from aegis_cli.probes.gemm import GemmCase, GemmProbe
from tests.helpers import run_cli

pytestmark = pytest.mark.gpu
NUMERICS = "numerics: threshold too tight for this input?"


def _all(res, axes: str) -> torch.Tensor:
    sums = res.row_sums if axes == "row" else res.col_sums
    return torch.ones(tuple(sums.shape), dtype=torch.bool).nonzero()


@pytest.mark.parametrize("dist", numerics.DISTRIBUTIONS)
@pytest.mark.parametrize("layout", list(Layout), ids=[x.value for x in Layout])
@pytest.mark.parametrize("k", [1024, 8192])
def test_tensor_core_results_are_within_the_rigorous_bound(dev, dist, layout, k):
    m, n = 256, 384
    a = dev.generate(layout.a_stored_shape(m, k), dist, 17 + k)
    b = dev.generate(layout.b_stored_shape(k, n), dist, 29 + k)
    ops = GemmOperands(a, b, layout)
    res = dev.checked_gemm(ops)
    for axes in ("row", "col"):
        rc = recheck.recompute(ops, res, axes, _all(res, axes))
        assert rc is not None and not rc.wrong, (axes, rc)
        # a fused sum moved by three times its bound, C untouched, is wrong beyond any rounding
        ref = numerics.reference_checksums(ops, res.tile)
        sums, scale, span = ((res.row_sums, ref.row_scale, res.tile[1]) if axes == "row"
                             else (res.col_sums, ref.col_scale, res.tile[0]))
        keep = sums[0, 0].clone()
        sums[0, 0] += 3 * numerics.accumulation_ceiling(k, span) * float(scale[0, 0])
        bad = recheck.recompute(ops, res, axes, torch.tensor([[0, 0]]))
        sums[0, 0] = keep
        assert bad.wrong and bad.beyond_bound == 1


def test_a_threshold_below_rounding_is_suspect_and_a_fault_is_faulty(dev):
    # an explicit τ = 1e-10 means what it says on a GPU too: it flags the tensor cores' own rounding
    # everywhere, reproducibly
    wl = workloads.load("cpu-quick")
    shape = max(wl.gemms(), key=lambda s: s.k)
    case = GemmCase(wl.name, shape, "heavy", 5)
    ev = GemmProbe(dev, numerics.Thresholds(tau=1e-10), reruns=2).run(case, [[0, 0]])
    assert ev and all(e.severity is Verdict.SUSPECT and NUMERICS in e.summary for e in ev)
    assert all(e.recompute["beyond_bound"] == 0 and e.reproduced == e.reruns for e in ev)
    plan = FaultPlan.parse("bitflip:target=acc,bit=exp,seed=3")
    ev = GemmProbe(dev, numerics.Thresholds(tau=1e-10), reruns=2, fault=plan).run(case, [[0, 0]])
    sums = [e for e in ev if e.check in CHECKSUM_CHECKS]
    assert sums and all(e.severity is Verdict.FAULTY and e.recompute["beyond_bound"] >= 1 for e in sums)


def test_scan_with_a_tiny_threshold_is_suspect_naming_numerics_on_a_healthy_gpu(capsys, tmp_path):
    out = tmp_path / "scan.json"
    code, _, _ = run_cli(capsys, "scan", "--device", "cuda:0", "--workload", "cpu-quick", "--threshold", "1e-10",
                         "--format", "json", "-o", str(out), "-q")
    ev = json.loads(out.read_text())["devices"][0]["evidence"]
    assert code == 1 and ev and all(e["severity"] == "SUSPECT" and NUMERICS in e["summary"] for e in ev)
