"""Tier 2 (GPU): the CUDA checked GEMMs against fp64 references, their checksums against the
calibrated threshold, determinism, and every in-kernel fault model."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from aegis_cli.faults.spec import FaultPlan
from aegis_cli.ops import numerics
from aegis_cli.ops.gemm import GemmOperands, Layout

pytestmark = pytest.mark.gpu
TAU = numerics.Thresholds().tau
LAYOUTS = list(Layout)


def _ops(dev, layout: Layout, m: int, n: int, k: int, seed: int, dist: str = "normal", scale=(0, 0)) -> GemmOperands:
    a = dev.generate(layout.a_stored_shape(m, k), dist, seed)
    b = dev.generate(layout.b_stored_shape(k, n), dist, seed + 7919)
    return GemmOperands(numerics.pow2_scale(a, scale[0]), numerics.pow2_scale(b, scale[1]), layout)


def _diffs(dev, ops, res):
    ref = dev.reference_checksums(ops, res.tile)
    return numerics.checksum_diffs(res, ref)


def _flagged_tiles(dev, ops, res) -> set[tuple[int, int]]:
    dr, dc = _diffs(dev, ops, res)
    tm, tn = res.tile
    rows = {(int(i) // tm, int(t)) for i, t in torch.nonzero(dr > TAU).tolist()}
    cols = {(int(t), int(j) // tn) for t, j in torch.nonzero(dc > TAU).tolist()}
    return rows | cols


SHAPES = [(128, 128, 64), (256, 512, 320), (300, 200, 136), (129, 257, 72), (77, 1000, 264), (640, 768, 520),
          (1, 8, 8), (513, 129, 1000), (200, 300, 517), (64, 40, 13), (96, 250, 200)]


@pytest.mark.parametrize("layout", LAYOUTS, ids=[x.value for x in LAYOUTS])
@pytest.mark.parametrize("shape", SHAPES, ids=["x".join(map(str, s)) for s in SHAPES])
def test_matches_fp64_reference(dev, layout, shape):
    m, n, k = shape
    ops = _ops(dev, layout, m, n, k, seed=m * 31 + n * 7 + k)
    dev.poison = True
    try:
        res = dev.checked_gemm(ops)
    finally:
        dev.poison = False
    assert res.c.shape == (m, n) and res.tile == dev.tile
    for name, t in (("C", res.c), ("row_sums", res.row_sums), ("col_sums", res.col_sums)):
        assert not torch.isnan(t.float()).any(), f"{name} has unwritten (poisoned) elements"
    assert int(res.tile_sm.min()) >= 0
    ref = ops.a_mk.double() @ ops.b_kn.double()
    rel = (res.c.double() - ref).norm() / ref.norm()
    assert rel < 4e-3, f"relative error {rel:.2e}"
    dr, dc = _diffs(dev, ops, res)
    assert float(dr.max()) <= TAU and float(dc.max()) <= TAU, (float(dr.max()), float(dc.max()))


@pytest.mark.parametrize("layout", LAYOUTS, ids=[x.value for x in LAYOUTS])
def test_repeat_is_bit_identical(dev, layout):
    ops = _ops(dev, layout, 1000, 1500, 1024, seed=5)
    first = dev.checked_gemm(ops)
    for _ in range(3):
        again = dev.checked_gemm(ops)
        for x, y in ((first.c, again.c), (first.row_sums, again.row_sums), (first.col_sums, again.col_sums)):
            assert torch.equal(x.view(torch.int16) if x.dtype == torch.bfloat16 else x.view(torch.int32),
                               y.view(torch.int16) if y.dtype == torch.bfloat16 else y.view(torch.int32))


@pytest.mark.slow
def test_no_false_positives_over_1000_gemms(dev):
    """1008 clean GEMMs across layouts, distributions and power-of-two scales: no checksum over tau."""
    rng = np.random.default_rng(2024)
    worst, count, where = 0.0, 0, ""  # worst = largest normalised difference ÷ that GEMM's τ
    scales = [(0, 0), (-16, -16), (12, 12), (-8, 8)]
    for i in range(28):
        for layout in LAYOUTS:
            for dist in numerics.DISTRIBUTIONS:
                m, n = (int(x) for x in rng.integers(64, 700, 2))
                k = int(rng.integers(8, 600)) // 8 * 8
                base = _ops(dev, layout, m, n, k, seed=10_000 + i * 97 + count, dist=dist)
                for ea, eb in scales:
                    ops = GemmOperands(numerics.pow2_scale(base.a, ea), numerics.pow2_scale(base.b, eb), layout)
                    if not numerics.pow2_exact_safe(base, ea, eb):
                        ops = base
                    dr, dc = _diffs(dev, ops, dev.checked_gemm(ops))
                    w = max(float(dr.max()), float(dc.max())) / numerics.Thresholds().tau
                    if w > worst:
                        worst, where = w, f"{layout.value} {m}x{n}x{k} {dist} scale 2^({ea},{eb}) {'row' if dr.max() >= dc.max() else 'col'}"
                    count += 1
    assert count >= 1000
    assert worst <= 1.0, f"false positive: worst normalised difference is {worst:.3g}× tau at {where}"
    print(f"\n{dev.kernel}: {count} clean GEMMs, worst normalised checksum difference {worst:.3e} of tau "
          f"(margin {1 / max(worst, 1e-300):.1f}x under tau) at {where}")


def _clean_median(dev, ops) -> float:
    res = dev.checked_gemm(ops)
    ref = dev.reference_checksums(ops, res.tile)
    return float((res.row_sums.double() - ref.row).abs().median())


ACC_FAULTS = [
    "bitflip:bit=exp,seed=1", "bitflip:bit=sign,count=3,seed=2", "mask:mask=0x00c00000,seed=3",
    "stuck-lane:mask=0x00800000,stride=32,offset=5", "replace:span=16,value=random,seed=4",
    "replace:span=64,value=zero,seed=5", "replace:span=64,value=flip,seed=9", "replace:span=16,value=copy,seed=8",
    "replace:span=random,value=copy,seed=10", "perturb:r=1e4,rate=1e-3,seed=6",
    "row:row=77", "row:mode=stuck,value=2.5", "tile:mode=zero,tile=1.1", "tile:mode=stuck,value=3.0,tile=0.2",
    "tile:mode=shift,tile=1.0", "tile:mode=skipk,tile=2.1,kstep=2", "tile:mode=zero,every=5", "tile:mode=skipk",
]


@pytest.mark.parametrize("spec", ACC_FAULTS)
@pytest.mark.parametrize("layout", LAYOUTS, ids=[x.value for x in LAYOUTS])
def test_acc_fault_detected_where_injected(dev, spec, layout):
    ops = _ops(dev, layout, 640, 768, 520, seed=11)
    plan = FaultPlan.parse(spec)
    med = _clean_median(dev, ops) if plan.needs_clean_median() else None
    res = dev.checked_gemm(ops, plan, op="test", clean_median=med)
    assert res.injected and res.kernel.endswith("+inject")
    flagged = _flagged_tiles(dev, ops, res)
    assert flagged, f"{spec}: nothing flagged"
    rec = plan.injected[-1]
    tm, tn = res.tile
    if "tiles" in rec:
        assert set(map(tuple, rec["tiles"])) <= flagged, (rec, flagged)
        assert rec["sms"] == sorted({int(res.tile_sm[i, j]) for i, j in rec["tiles"]})
    else:
        hit = {(r // tm, c // tn) for r, c in rec["positions"]}
        assert hit & flagged, (rec, flagged)


def test_shift_with_one_row_of_cta_tiles_is_not_claimed(dev):
    """With M ≤ 128 the next CTA tile's A block is the tile's own: a shift would change nothing,
    so it is neither injected nor recorded as injected (a miss would otherwise be counted)."""
    ops = _ops(dev, Layout.FWD, 100, 384, 256, seed=13)
    plan = FaultPlan.parse("tile:mode=shift,tile=1.0")
    res = dev.checked_gemm(ops, plan, op="shift")
    assert not plan.injected and not _flagged_tiles(dev, ops, res)


def test_dimensions_beyond_32_bit_indexing_are_refused(dev):
    from aegis_cli.backends.cuda import MAX_DIM
    from aegis_cli.ops.errors import ConfigError

    k = MAX_DIM + 64  # 4 GiB per operand, never filled: prepare refuses before any launch
    a = torch.empty((1, k), dtype=torch.bfloat16, device=dev.torch_device)
    b = torch.empty((1, k), dtype=torch.bfloat16, device=dev.torch_device)
    with pytest.raises(ConfigError, match="take dimensions up to"):
        dev.prepare(a, b, Layout.FWD)
    del a, b
    torch.cuda.empty_cache()


@pytest.mark.parametrize("layout", LAYOUTS, ids=[x.value for x in LAYOUTS])
def test_several_stuck_lanes_in_one_launch(dev, layout):
    """Two dense sign-bit lanes in one launch, overlapping every 96th element: C is the clean C
    negated exactly where one lane hits (bf16 rounding commutes with the sign), unchanged where
    both or neither do; the checksums flag it."""
    m, n = 640, 768
    ops = _ops(dev, layout, m, n, 520, seed=12)
    clean = dev.checked_gemm(ops)
    plan = FaultPlan.parse("stuck-lane:mask=0x80000000,stride=32,offset=5; stuck-lane:mask=0x80000000,stride=48,offset=5")
    res = dev.checked_gemm(ops, plan, op="lanes")
    flat = torch.arange(m * n, device=res.c.device).reshape(m, n)
    one = ((flat % 32) == 5) ^ ((flat % 48) == 5)
    assert torch.equal(res.c.view(torch.int16), torch.where(one, -clean.c, clean.c).view(torch.int16))
    assert len(plan.injected) == 2 and _flagged_tiles(dev, ops, res)


def test_sm_pinned_fault(dev):
    """Every tile run on one SM is corrupted; the record names exactly those tiles and that SM."""
    ops = _ops(dev, Layout.FWD, 4096, 4096, 256, seed=3)
    plan = FaultPlan.parse("tile:mode=stuck,value=1.5,sm=3")
    res = dev.checked_gemm(ops, plan, op="sm")
    rec = plan.injected[-1]
    on_sm = {(int(i), int(j)) for i, j in torch.nonzero(res.tile_sm == 3).tolist()}
    assert on_sm, "no tile ran on SM 3"
    assert rec["sms"] == [3] and rec["n_tiles"] == len(on_sm)
    assert on_sm <= _flagged_tiles(dev, ops, res)


@pytest.mark.parametrize("spec", ["bitflip:target=a,bit=exp,seed=7", "mask:target=b,mask=0x4000,seed=8",
                                  "replace:target=a,span=16,value=zero,seed=2"])
def test_operand_fault_detected(dev, spec):
    ops = _ops(dev, Layout.DGRAD, 384, 512, 256, seed=21)
    plan = FaultPlan.parse(spec)
    res = dev.checked_gemm(ops, plan, op="operand")
    assert plan.injected and _flagged_tiles(dev, ops, res)


def test_output_fault_changes_c_not_checksums(dev):
    ops = _ops(dev, Layout.FWD, 384, 512, 256, seed=22)
    clean = dev.checked_gemm(ops)
    plan = FaultPlan.parse("bitflip:target=out,bit=exp,seed=3")
    res = dev.checked_gemm(ops, plan, op="out")
    r, c = plan.injected[-1]["positions"][0]
    assert not torch.equal(res.c[r, c].view(torch.int16), clean.c[r, c].view(torch.int16))
    assert not _flagged_tiles(dev, ops, res)  # store-path faults are for fingerprints, not checksums


def test_identity_and_describe(dev):
    ident = dev.identity
    assert ident.backend == "cuda" and ident.uuid and ident.name
    info = dev.describe()
    assert "kernel_cache" in info and info["kernel"].startswith("gemm_")
    assert not math.isnan(float(dev.fingerprint(torch.ones(4, device=dev.torch_device))))


def test_launch_geometry(dev):
    """One CTA per output tile of the kernel (a grid sized by checksum tiles would redo work)."""
    m, n, k = 1000, 700, 256
    ops = _ops(dev, Layout.FWD, m, n, k, seed=4)
    launch = dev.prepare(ops.a, ops.b, Layout.FWD)
    if launch.kernel == "mma":
        assert launch.grid == (-(-n // 128), -(-m // 128))
    else:
        assert launch.grid[0] == min(dev.sms, -(-m // 128) * -(-n // 256))


@pytest.mark.parametrize("case", ["subnormal products", "subnormal inputs"])
def test_bottom_of_the_range_is_not_a_fault(dev, case):
    """Clean GEMMs at the bottom of fp32's range must not be flagged: the kernels compile with
    FTZ, so subnormal products (case 1) flush to zero; whether the tensor cores also flush bf16
    subnormal *inputs* (case 2: |A| < 2^-126, products normal) is what this test finds out.
    ReferenceChecksums.floor forgives < 2^-126 per product, partial sum and output."""
    ea, eb = (-66, -66) if case == "subnormal products" else (-130, 20)
    ops = _ops(dev, Layout.FWD, 192, 256, 128, seed=41, scale=(ea, eb))
    if case == "subnormal inputs":
        assert bool((ops.a.float().abs() < 2.0**-126).all()) and bool((ops.a != 0).any())
    res, ref = dev.checked_gemm(ops), dev.reference_checksums(ops, dev.tile)
    d_row, d_col = numerics.checksum_diffs(res, ref)
    assert float(d_row.max()) <= TAU and float(d_col.max()) <= TAU, (float(d_row.max()), float(d_col.max()))
    assert not bool(numerics.output_rowsum_excess(res, dev.tile[1])[0].any())


def test_memory_free_and_flagged_runs_kept_on_the_host(tmp_path):
    """The preflight's free memory is at most the total; flagged runs kept for --save-vtasks
    leave the GPU (a permanent fault would otherwise hold every case's C there), and saving
    them still finds their flagged rows against the on-device fp64 reference."""
    from aegis_cli.backends.cuda import CudaDevice
    from aegis_cli.scan import ScanOptions, run_scan
    from aegis_cli.vtask import from_scan
    from aegis_cli.vtask.bundle import read_bundle
    from tests.helpers import TINY

    d = CudaDevice(0)
    assert 0 < d.memory_free() <= d.memory_bytes()
    opts = ScanOptions(devices="cuda:0", workload=TINY, reruns=2, probes=("gemm",), inject="bitflip:bit=exp,seed=3",
                       keep_flagged=True)
    rep = run_scan(opts)
    dr = rep.devices[0]
    assert dr.verdict.value == "FAULTY" and dr.captured
    assert all(t.device.type == "cpu" for r in dr.captured.values() for t in (r.c, r.row_sums, r.col_sums))
    path = tmp_path / "gpu.aegis"
    assert from_scan.save_scan_vtasks(rep, path) == len(dr.evidence)
    vts = read_bundle(path).vtasks
    assert all(vt.observed["source"] == "the flagged scan run, as observed" for vt in vts)
    assert all(vt.gemm.flagged_rows or vt.gemm.flagged_cols for vt in vts)


def test_gpu_capture_is_recognised_as_the_scans_draw_on_gpu_and_cpu(tmp_path):
    """Replay's rounding guard trusts a vTask's ``dist`` only when its inputs regenerate bit for
    bit: a GPU scan's capture must regenerate on the GPU that drew it (and, where the CPU draws
    the same bits, on the CPU), and a flipped input bit must not."""
    import dataclasses

    from aegis_cli.backends import resolve_devices
    from aegis_cli.ops.verdict import Evidence, Verdict
    from aegis_cli.ops.workloads import load
    from aegis_cli.probes.gemm import ProbeStats, scaled
    from aegis_cli.probes.gemm_scan import plan_cases
    from aegis_cli.vtask import capture
    from aegis_cli.vtask.replay import ReplayOptions, _VTaskReplay

    dev = resolve_devices("cuda:0")[0]
    case = plan_cases(load("cpu-quick"), 7)[3]
    cid = case.case_id(-8, 8)
    ops = scaled(case.operands(dev), -8, 8)
    run = capture.ObservedGemm(ops, dev.checked_gemm(ops), case_id=cid, op=case.shape.op, scale=(-8, 8), seed=case.seed,
                               dist=case.dist)
    ev = Evidence(check="gemm.row_checksum", severity=Verdict.FAULTY, case_id=cid, summary="x", scale=[-8, 8],
                  samples=[{"row": 1, "col_tile": 0, "col": 2}])
    (vt,) = capture.capture_gemm(run, [ev], tau=1e-6, confirm_margin=1.0, provenance={"device_id": "cuda:0"})
    ok, why = _VTaskReplay(dev, vt, ReplayOptions(bundles=[]), None, ProbeStats()).calibrated()
    assert ok, why
    a = vt.tensors["a"].clone()
    a.view(torch.int16).view(-1)[5] ^= 1
    bad = dataclasses.replace(vt, tensors={**vt.tensors, "a": a})
    ok, why = _VTaskReplay(dev, bad, ReplayOptions(bundles=[]), None, ProbeStats()).calibrated()
    assert not ok and "not the scan's draw" in why
