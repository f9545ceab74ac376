"""Self-tests (docs/design.md §9): every GEMM fault model is caught when it changes a result beyond
the calibrated noise, and the evidence points at the injected element, row, tile or SM."""

from __future__ import annotations

import pytest
import torch

from aegis_cli.backends.cpu import CpuDevice
from aegis_cli.checks.gemm import element_bound
from aegis_cli.faults.spec import FaultPlan
from aegis_cli.ops import workloads
from aegis_cli.ops.numerics import Thresholds
from aegis_cli.ops.verdict import Verdict, worst
from aegis_cli.probes.gemm import GemmCase, GemmProbe
from tests.helpers import TINY

WL = workloads.load(TINY)  # mlp_down fwd: M=160, N=256, K=512 → 2×2 tiles of 128


def run_fault(spec: str, seed: int = 0, reruns: int = 2):
    dev = CpuDevice()
    plan = FaultPlan.parse(spec)
    probe = GemmProbe(dev, Thresholds(), reruns=reruns, fault=plan)
    ev = []
    for shape in WL.gemms():
        ev += probe.run(GemmCase(WL.name, shape, "normal", seed), WL.scan.scales)
    return ev, plan


def injected_positions(plan: FaultPlan) -> set[tuple[int, int]]:
    return {tuple(p) for rec in plan.injected for p in rec.get("positions", [])}


def injected_rows(plan: FaultPlan, n: int) -> set[int]:
    """Every row an element fault touched (from its flat range, not only the sampled positions)."""
    rows = set()
    for rec in plan.injected:
        lo, hi = rec["flat_range"]
        rows |= set(range(lo // n, (hi - 1) // n + 1))
    return rows


def change_over_tau(plan: FaultPlan, seed: int = 0) -> dict[tuple[int, int], tuple[float, float]]:
    """For each recorded accumulator element fault: the checksum change it caused in units of τ·σ
    (σ the noise scale of the more sensitive of its row and column checksums), and how far the
    faulty output element lies from its fp64 value in units of the rigorous element bound (> 1:
    the fp64 recomputation of a flag can confirm it). Both scale-invariant, so the base run's
    operands serve every scale."""
    (shape,) = WL.gemms()
    dev = CpuDevice()
    ops = GemmCase(WL.name, shape, "normal", seed).operands(dev)
    ref = dev.reference_checksums(ops, dev.tile)
    a, b = ops.a_mk.double(), ops.b_kn.double()
    tm, tn = dev.tile
    out = {}
    for rec in plan.injected:
        for (r, c), (before, after) in zip(rec["positions"], rec["values"], strict=True):
            if rec["launch"] == 0:  # the smaller of the two scales is the more sensitive check
                scale = min(float(ref.row_noise[r, c // tn]), float(ref.col_noise[r // tm, c]))
                exact, mag = a[r] @ b[:, c], a[r].abs() @ b[:, c].abs()
                wrong = abs(float(torch.tensor(after).to(torch.bfloat16)) - float(exact))
                wrong = wrong if wrong == wrong else float("inf")  # a NaN output is infinitely wrong
                out[(r, c)] = (abs(after - before) / scale / Thresholds().tau,
                               wrong / float(element_bound(exact, mag, ops.mnk[2])))
    return out


@pytest.mark.parametrize("bit", ["sign", "exp", "hi-mant", "30", "22", "mant"])
@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_accumulator_bitflip_caught_and_localised(bit, seed):
    ev, plan = run_fault(f"bitflip:bit={bit},seed={seed}")
    ((pos, (ratio, beyond)),) = change_over_tau(plan).items()
    if ratio < 0.5:  # below the calibrated noise: must not be called corruption
        assert not ev
        return
    if ratio < 2:
        return  # at the threshold either outcome is honest
    # flagged; FAULTY where the recomputation can tell the bits are wrong, else SUSPECT (§7.2)
    assert worst(e.severity for e in ev) is (Verdict.FAULTY if beyond > 1.01 else Verdict.SUSPECT) or 0.99 < beyond <= 1.01
    for e in ev:
        assert e.reruns == 2 and e.reproduced == 2  # a permanent fault reproduces every time
        if e.check == "gemm.row_checksum":
            assert e.samples[0]["row"] == pos[0]
        if e.check == "gemm.col_checksum":
            assert e.samples[0]["col"] == pos[1]
        if {x.check for x in ev} >= {"gemm.row_checksum", "gemm.col_checksum"}:
            assert list(pos) in e.localised, (pos, e.localised)


@pytest.mark.parametrize("seed", [1, 2])
def test_multi_bit_mask_and_stuck_lane(seed):
    ev, plan = run_fault(f"mask:mask=0x40c00000,count=3,seed={seed}")  # exponent MSB: always far above noise
    assert worst(e.severity for e in ev) is Verdict.FAULTY
    loc = {tuple(p) for e in ev for p in e.localised}
    assert injected_positions(plan) <= loc
    ev, plan = run_fault(f"stuck-lane:mask=0x00400000,stride=32,offset={seed}")
    assert worst(e.severity for e in ev) is Verdict.FAULTY
    rows = {s["row"] for e in ev if e.check == "gemm.row_checksum" for s in e.samples}
    assert rows <= injected_rows(plan, 256)


@pytest.mark.parametrize("value", ["flip", "random", "zero", "copy"])
@pytest.mark.parametrize("span", ["1", "16", "64", "random"])
def test_replace_families_on_accumulator(span, value):
    ev, plan = run_fault(f"replace:span={span},value={value},seed=5")
    if max(beyond for _, beyond in change_over_tau(plan).values()) > 2:
        assert worst(e.severity for e in ev) is Verdict.FAULTY
    flagged = {s["row"] for e in ev if e.check == "gemm.row_checksum" for s in e.samples}
    assert flagged <= injected_rows(plan, 256)


@pytest.mark.parametrize("target", ["a", "b"])
@pytest.mark.parametrize("value", ["random", "zero", "flip"])
def test_operand_faults_spread_along_row_or_column(target, value):
    ev, plan = run_fault(f"replace:span=16,value={value},target={target},seed=7")
    assert worst(e.severity for e in ev) is Verdict.FAULTY
    (rec,) = {(r["target"],) for r in plan.injected}
    assert rec == (target,)
    pos = injected_positions(plan)  # a 16-run along a row of A (M×K) or of B (K×N)
    if target == "a":  # A[i, k] corrupted → row i of C wrong, seen by the row check
        rows = {s["row"] for e in ev if e.check == "gemm.row_checksum" for s in e.samples}
        assert rows == {p[0] for p in pos}
    else:  # B[k, j] corrupted → columns j of C wrong, seen by the column check
        cols = {s["col"] for e in ev if e.check == "gemm.col_checksum" for s in e.samples}
        assert cols <= {p[1] for p in pos}


@pytest.mark.parametrize("bit", ["14", "13", "sign"])
def test_output_store_faults_caught_by_output_checks(bit):
    ev, plan = run_fault(f"bitflip:target=out,bit={bit},seed=11")
    assert worst(e.severity for e in ev) is Verdict.FAULTY
    (pos,) = injected_positions(plan)
    checks = {e.check for e in ev}
    assert checks & {"gemm.output_rowsum", "gemm.pow2_exact", "gemm.nonfinite"}
    assert not checks & {"gemm.row_checksum", "gemm.col_checksum"}  # fused sums never see a store fault
    out = [e for e in ev if e.check in ("gemm.pow2_exact", "gemm.nonfinite")]
    assert all(list(pos) in e.localised for e in out)
    rowsum = [e for e in ev if e.check == "gemm.output_rowsum"]
    assert all(e.samples[0]["row"] == pos[0] for e in rowsum)


@pytest.mark.parametrize("mode", ["zero", "stuck", "shift", "skipk"])
def test_tile_faults_name_the_tile(mode):
    ev, _plan = run_fault(f"tile:mode={mode},tile=1.0")
    assert worst(e.severity for e in ev) is Verdict.FAULTY
    for e in ev:
        assert e.tiles and all(t[0] == 1 for t in e.tiles if e.check == "gemm.row_checksum"), e.tiles
        assert [1, 0] in e.tiles


def test_shift_with_one_row_of_tiles_is_not_claimed():
    """With M ≤ 128 the A block "one tile further down" wraps to the tile's own: a shift would
    change nothing, so it is neither injected nor recorded as injected (as on CUDA): a self-test
    must not count a miss for a fault that never changed a bit."""
    dev = CpuDevice()
    ops = GemmCase(WL.name, WL.gemms()[0], "normal", 5).operands(dev)
    small = type(ops)(ops.a[:128].contiguous(), ops.b, ops.layout)  # fwd: A is (M, K)
    plan = FaultPlan.parse("tile:mode=shift,tile=0.0")
    res = dev.checked_gemm(small, plan, op="shift")
    assert not plan.injected
    assert res.c.equal(dev.checked_gemm(small).c)


def test_sm_pinned_fault_names_that_sm():
    ev, plan = run_fault("tile:mode=zero,sm=2")
    assert worst(e.severity for e in ev) is Verdict.FAULTY
    assert all(e.sms == [2] for e in ev)
    assert all(sm == 2 for rec in plan.injected for sm in rec["sms"])


def test_every_nth_tile_and_row_faults():
    ev, _ = run_fault("tile:mode=stuck,value=3,every=3")
    assert worst(e.severity for e in ev) is Verdict.FAULTY
    assert {tuple(t) for e in ev for t in e.tiles} >= {(0, 0), (1, 1)}
    ev, _plan = run_fault("row:mode=zero,row=17")
    assert worst(e.severity for e in ev) is Verdict.FAULTY
    assert {s["row"] for e in ev if e.check == "gemm.row_checksum" for s in e.samples} == {17}


def test_two_perturb_faults_with_one_seed_hit_different_elements():
    # the draw was seeded by (seed, launch) alone: a repeated fault added to the same elements
    _, plan = run_fault("perturb:r=1e5,rate=2e-3,seed=4;perturb:r=1e5,rate=2e-3,seed=4", reruns=1)
    first = [r for r in plan.injected if r["launch"] == plan.injected[0]["launch"]]
    assert len(first) == 2 and all(r["elements"] > 0 for r in first)
    assert first[0]["positions"] != first[1]["positions"]


def test_perturbation_far_above_noise_is_faulty():
    ev, _ = run_fault("perturb:r=1e5,rate=2e-3,seed=4")
    assert worst(e.severity for e in ev) is Verdict.FAULTY
    assert any(e.distinct_outputs > 1 for e in ev)  # a fresh draw per launch: runs disagree


def test_intermittent_fault_reports_how_often_it_reproduced():
    ev, _plan = run_fault("bitflip:bit=exp,prob=0.5,seed=3", reruns=8)
    assert ev, "with 2 scales × (1 + 8 re-runs) launches a 50% fault fires"
    assert worst(e.severity for e in ev) is Verdict.FAULTY
    e = ev[0]
    assert 0 <= e.reproduced <= e.reruns == 8
    assert f"failed {e.reproduced + 1} of 9 runs" in e.summary


def test_below_noise_faults_are_not_flagged_as_faulty():
    # a flip of the lowest mantissa bit of one accumulator element is far below rounding noise
    ev, plan = run_fault("bitflip:bit=0,seed=1")
    assert plan.injected  # it was applied
    assert not ev


@pytest.mark.parametrize("spec", ["tile:mode=zero,sm=7",  # TINY has 2×2 tiles on simulated SMs 0…3
                                  "perturb:r=1e5,rate=0",
                                  "stuck-lane:mask=0x400000,stride=0x100000000,offset=0xfffffff"])  # past the 160×256 output
def test_fault_that_changes_nothing_is_reported_never_fired(spec):
    """A fault active on every case that touched no element left the scan HEALTHY, exit 0, with
    no never-fired warning: a self-test that tested nothing and said so nowhere."""
    from aegis_cli.scan import ScanOptions, run_scan

    real = "bitflip:bit=exp"
    rep = run_scan(ScanOptions(workload=TINY, probes=("gemm",), reruns=1, inject=f"{spec}; {real}"))
    assert rep.never_fired == [str(FaultPlan.parse(spec).faults[0])]
    assert rep.devices[0].verdict is Verdict.FAULTY  # the other fault did fire


@pytest.mark.parametrize(("m", "shifted"), [(64, False), (128, False), (160, True), (256, True)])
def test_cpu_shift_with_nothing_to_shift_is_not_recorded(m, shifted):
    """On the CPU a shift reads the A block 128 rows down, wrapping: with M dividing 128 that is
    the same block, so the output did not change, yet the fault was recorded as injected."""
    import torch

    from aegis_cli.ops.gemm import GemmOperands, Layout

    gen = torch.Generator().manual_seed(m)
    a, b = torch.randn(m, 96, generator=gen).to(torch.bfloat16), torch.randn(160, 96, generator=gen).to(torch.bfloat16)
    ops = GemmOperands(a, b, Layout.FWD)
    plan = FaultPlan.parse("tile:mode=shift,tile=0.0")
    res = CpuDevice().checked_gemm(ops, plan, op="w/op/fwd/normal/x/s+0+0")
    changed = not torch.equal(res.c.view(torch.int16), CpuDevice().checked_gemm(ops).c.view(torch.int16))
    assert changed is shifted
    assert bool(plan.injected) is shifted and (plan.never_fired() == []) is shifted


@pytest.mark.parametrize(("k", "kstep", "dropped"), [(96, 2, (0, 64)), (96, 1, (64, 96)), (200, 5, (64, 128))])
def test_cpu_skipk_drops_the_k_block_cuda_drops(k, kstep, dropped):
    """kstep is a k-block number taken modulo the k-blocks, as in the CUDA kernels: on the CPU
    kstep=2 with K=96 dropped k 32…95, not a k-step at all (CUDA drops block 0, k 0…63)."""
    import numpy as np
    import torch

    from aegis_cli.faults import tensor as corrupt
    from aegis_cli.faults.spec import LaunchContext

    gen = torch.Generator().manual_seed(k)
    a, b = torch.randn(96, k, generator=gen).to(torch.bfloat16), torch.randn(k, 160, generator=gen).to(torch.bfloat16)
    acc = a.float() @ b.float()
    plan = FaultPlan.parse(f"tile:mode=skipk,kstep={kstep},tile=0.0")
    corrupt.apply_acc(plan, LaunchContext("cpu:0", "t", (128, 128), np.zeros((1, 2), dtype=np.int32)), acc, a, b)
    lo, hi = dropped
    expect = a.float() @ b.float()
    expect[:, :128] -= a[:, lo:hi].float() @ b[lo:hi, :128].float()
    assert torch.equal(acc, expect)
    assert plan.injected[0]["kstep"] == lo // 64


def test_evidence_names_only_its_own_cases_injections():
    """A flagged case's evidence listed the plan's last four injection records, mostly other
    cases' (another distribution, another op) when an intermittent fault skipped its last runs."""
    import re

    from aegis_cli.scan import ScanOptions, run_scan

    group = lambda cid: re.sub(r"/s[+-]\d+[+-]\d+$", "", cid)
    rep = run_scan(ScanOptions(probes=("gemm",), reruns=2, inject="bitflip:bit=exp,prob=0.3,op=mlp_down"))
    ev = rep.devices[0].evidence
    assert ev and all(e.injected for e in ev)
    assert all({group(r["op"]) for r in e.injected} == {group(e.case_id)} for e in ev)
