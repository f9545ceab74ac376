"""``aegis scan --save-vtasks`` and ``aegis replay``: where does a fault lie?"""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path

import pytest
import torch

from aegis_cli import cli
from aegis_cli.backends import resolve_devices
from aegis_cli.ops.errors import ConfigError
from aegis_cli.ops.gemm import Layout
from aegis_cli.ops.numerics import Thresholds
from aegis_cli.scan import ScanOptions, run_scan
from aegis_cli.vtask import capture, from_scan
from aegis_cli.vtask.bundle import BundleWriter, read_bundle
from aegis_cli.vtask.replay import ReplayOptions, parse_scales, run_replay
from tests.helpers import TINY
from tests.vtask.test_model import make_vtask

CASE = "cpu-quick/qkv/fwd/normal/192x384x256/s+0+0"
FAULT = "bitflip:target=acc,bit=exp"


def run_cli(argv: list[str]) -> int:
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    return exc.value.code


@pytest.fixture(scope="module")
def captured(tmp_path_factory) -> Path:
    """One scanned case with an exponent bit flip injected in the accumulator, saved as vTasks."""
    d = tmp_path_factory.mktemp("capture")
    bundle = d / "b.aegis"
    code = run_cli(["scan", "--device", "cpu", "--case", CASE, "--reruns", "1", "--probes", "gemm", "--inject", FAULT,
                    "--save-vtasks", str(bundle), "--format", "json", "-o", str(d / "scan.json"), "-q"])
    assert code == 2  # the scan caught it
    return bundle


def replay_json(bundle: Path, tmp_path: Path, *extra: str) -> tuple[int, dict]:
    out = tmp_path / "replay.json"
    code = run_cli(["replay", str(bundle), "--device", "cpu", "--format", "json", "-o", str(out), "-q", *extra])
    return code, json.loads(out.read_text())


def outcomes(doc: dict, device: int = 0) -> list[dict]:
    return doc["devices"][device]["probes"]["replay"]["outcomes"]


def test_scan_saves_the_flagged_case_as_vtasks(captured):
    b = read_bundle(captured)
    assert sorted(v.check for v in b.vtasks) == ["gemm.col_checksum", "gemm.row_checksum"]
    for v in b.vtasks:
        assert v.case_id == CASE and v.gemm.subset == "full" and (v.gemm.m, v.gemm.n, v.gemm.k) == (192, 384, 256)
        assert v.gemm.flagged_rows and v.gemm.flagged_cols
        assert v.provenance["injected"] is True and v.provenance["device_id"] == "cpu:0"
        assert v.provenance["gpu_uuid"].startswith("CPU-") and "torch" in v.provenance["versions"]
        assert v.observed["severity"] == "FAULTY" and v.observed["elements"] >= 1
        assert v.observed["source"] == "the flagged scan run, as observed"  # --save-vtasks keeps flagged runs
        assert set(v.tensors) == {"a", "b", "c", "row_sums", "col_sums"}
        assert v.normalisation == "device-noise" and v.tau == Thresholds().tau  # the scan's τ, in its units
    assert b.format_version == 2 and b.vtasks[0].tensors["a"] is b.vtasks[1].tensors["a"]  # stored once


def test_clean_device_does_not_reproduce(captured, tmp_path):
    code, doc = replay_json(captured, tmp_path)
    assert code == 0 and doc["kind"] == "replay" and doc["devices"][0]["verdict"] == "HEALTHY"
    for o in outcomes(doc):
        assert o["outcome"] == "not_reproduced" and o["label"] == "not reproduced here"
        assert o["checks_fired"] == [] and o["distinct_outputs"] == 1
        assert o["matches_capture"] is False and "differ from the capture" in o["capture_comparison"]
        assert "does not reproduce on the capturing device" in o["meaning"] and "injected on purpose" in o["meaning"]
        assert o["scales_run"] == [[0, 0], [-8, 8], [8, -8]] and o["runs"] == 9


def test_same_injection_reproduces(captured, tmp_path):
    code, doc = replay_json(captured, tmp_path, "--inject", FAULT)
    assert code == 2 and doc["devices"][0]["verdict"] == "FAULTY" and doc["fault_injected"]
    for o in outcomes(doc):
        assert o["outcome"] == "reproduced" and o["label"] == "reproduced here" and o["tau"] == Thresholds().tau
        assert o["captured_check_fired"] and o["matches_capture"] is True
        assert o["capture_comparison"].startswith("output bit-identical to the capture")
        assert "likely this GPU" in o["meaning"]
    ev = doc["devices"][0]["evidence"]
    assert {e["check"] for e in ev} == {"gemm.row_checksum", "gemm.col_checksum"}
    assert all(e["severity"] == "FAULTY" and e["case_id"] == CASE for e in ev)
    row = next(e for e in ev if e["check"] == "gemm.row_checksum")
    flagged = read_bundle(captured).vtasks[0].gemm.flagged_rows
    assert {s["row"] for s in row["samples"]} <= set(flagged)


def test_replay_on_another_device_points_at_the_capturing_gpu(captured, tmp_path, monkeypatch):
    monkeypatch.setenv("AEGIS_CPU_DEVICES", "2")
    out = tmp_path / "r.json"
    assert run_cli(["replay", str(captured), "--device", "cpu:1", "--format", "json", "-o", str(out), "-q", "--repeat", "1"]) == 0
    o = outcomes(json.loads(out.read_text()))[0]
    assert o["same_device"] is False and "points at the capturing GPU CPU-" in o["meaning"]


def test_reproducing_elsewhere_points_at_data_or_software(captured, monkeypatch):
    monkeypatch.setenv("AEGIS_CPU_DEVICES", "2")
    rep = run_replay(ReplayOptions(bundles=[str(captured)], devices="cpu:1", repeat=1, inject=FAULT))
    o = rep.devices[0].probe_stats["replay"]["outcomes"][0]
    assert o["outcome"] == "reproduced" and "data or the software" in o["meaning"]


def test_intermittent_fault_is_inconsistent_between_runs(captured):
    rep = run_replay(ReplayOptions(bundles=[str(captured)], devices="cpu", repeat=4, inject=FAULT + ",prob=0.5"))
    assert rep.exit_code == 2
    for o in rep.devices[0].probe_stats["replay"]["outcomes"]:
        assert o["outcome"] == "inconsistent" and o["distinct_outputs"] == 2 and o["severity"] == "FAULTY"
        assert "different results on this device" in o["meaning"]


def test_large_operands_are_saved_as_row_and_column_subsets(tmp_path, monkeypatch):
    monkeypatch.setattr(capture, "FULL_OPERANDS_LIMIT", 0)
    opts = ScanOptions(devices="cpu", case=CASE, reruns=1, probes=("gemm",), inject=FAULT)
    rep = run_scan(opts)
    assert rep.devices[0].captured == {}  # not asked to keep the flagged runs: saving re-runs the case
    path = tmp_path / "sub.aegis"
    assert from_scan.save_scan_vtasks(rep, path) == 2
    by_check = {v.check: v for v in read_bundle(path).vtasks}
    row, col = by_check["gemm.row_checksum"], by_check["gemm.col_checksum"]
    assert row.observed["source"] == col.observed["source"] == "re-run at save time on the capturing device"
    assert row.gemm.subset == "rows" and row.tensors["a"].shape == (len(row.gemm.rows), 256) and "col_sums" not in row.tensors
    assert col.gemm.subset == "cols" and col.tensors["b"].shape == (len(col.gemm.cols), 256) and "row_sums" not in col.tensors
    clean = run_replay(ReplayOptions(bundles=[str(path)], devices="cpu", repeat=2))
    outs = {o["check"]: o for o in clean.devices[0].probe_stats["replay"]["outcomes"]}
    assert all(o["outcome"] == "not_reproduced" for o in outs.values())
    # the CPU's BLAS sums a sub-GEMM in another order than the full one, so only totals compare
    # (within tolerance): the captured, corrupted ones differ
    cmp_ = outs["gemm.row_checksum"]["capture_comparison"]
    assert "row_sums totals differ from the capture (a subset)" in cmp_ and "not compared bit for bit" in cmp_
    assert outs["gemm.row_checksum"]["replayed_shape"] == {"m": len(row.gemm.rows), "n": 384, "k": 256}


def test_vtasks_of_a_scan_of_a_workload_file(tmp_path):
    """``--workload PATH``: the saved cases come from that file, not from a catalog of its name."""
    opts = ScanOptions(devices="cpu", workload=TINY, reruns=1, probes=("gemm",), inject=FAULT)
    path = tmp_path / "tiny.aegis"
    assert from_scan.save_scan_vtasks(run_scan(opts), path) >= 2
    assert {v.case_id.split("/")[0] for v in read_bundle(path).vtasks} == {"tiny"}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32)


def test_intermittent_fault_saves_the_flagged_run_as_observed(tmp_path):
    """An intermittent fault need not strike again when the vTask is saved: the observed
    outputs are the flagged run's own, corruption included, and a clean replay says so."""
    fault = "bitflip:bit=exp,prob=0.3,seed=5"  # seed 5: the s+0+0 run is clean, its s-8+8 variant is hit
    opts = ScanOptions(devices="cpu", workload=TINY, reruns=3, probes=("gemm",), inject=fault, keep_flagged=True)
    rep = run_scan(opts)
    dr = rep.devices[0]
    assert dr.verdict.value == "FAULTY" and set(dr.captured) == {e.case_id for e in dr.evidence}
    assert all(cid.endswith("/s-8+8") for cid in dr.captured)
    assert "captured" not in rep.to_dict()["devices"][0]  # tensors stay out of the report
    path = tmp_path / "flagged.aegis"
    assert from_scan.save_scan_vtasks(rep, path) == len(dr.evidence)
    cpu = resolve_devices("cpu")[0]
    for vt in read_bundle(path).vtasks:
        run = dr.captured[vt.case_id]
        assert vt.observed["source"] == "the flagged scan run, as observed"
        for role in ("c", "row_sums", "col_sums"):
            assert torch.equal(_bits(vt.tensors[role]), _bits(getattr(run, role))), role
        clean = cpu.checked_gemm(vt.operands())
        assert not torch.equal(_bits(vt.tensors["c"]), _bits(clean.c))  # the corruption was captured
    # without the kept run, saving re-runs the case, and this fault's next launch is clean
    dr.captured = {}
    rerun = tmp_path / "rerun.aegis"
    from_scan.save_scan_vtasks(rep, rerun)
    vt = read_bundle(rerun).vtasks[0]
    assert vt.observed["source"] == "re-run at save time on the capturing device"
    assert torch.equal(_bits(vt.tensors["c"]), _bits(cpu.checked_gemm(vt.operands()).c))
    # replayed without the fault: not reproduced, and the capture's corrupted outputs differ
    outs = run_replay(ReplayOptions(bundles=[str(path)], devices="cpu", repeat=2)).devices[0].probe_stats["replay"]["outcomes"]
    assert outs and all(o["outcome"] == "not_reproduced" and o["label"] == "not reproduced here" for o in outs)
    assert all(o["matches_capture"] is False and "differ from the capture" in o["capture_comparison"] for o in outs)


def test_flagged_runs_kept_in_host_memory_up_to_a_budget(tmp_path, monkeypatch):
    """A permanent fault flags every case; the scan keeps flagged runs (in host memory) only up to
    KEEP_FLAGGED_BYTES, and saving re-runs the rest, saying so in each vTask."""
    from aegis_cli.probes import gemm as gemm_probe

    opts = ScanOptions(devices="cpu", workload=TINY, reruns=2, probes=("gemm",), inject="bitflip:bit=exp,seed=3", keep_flagged=True)
    full = run_scan(opts).devices[0]
    flagged = {e.case_id for e in full.evidence}
    assert len(flagged) >= 2 and set(full.captured) == flagged
    assert all(r.c.device.type == "cpu" and r.row_sums.device.type == "cpu" for r in full.captured.values())
    one = next(iter(full.captured.values()))
    size = sum(t.numel() * t.element_size() for t in (one.c, one.row_sums, one.col_sums))
    monkeypatch.setattr(gemm_probe, "KEEP_FLAGGED_BYTES", size)
    rep = run_scan(opts)
    dr = rep.devices[0]
    assert dr.verdict.value == "FAULTY" and len(dr.captured) == 1 and set(dr.captured) < flagged
    path = tmp_path / "budget.aegis"
    assert from_scan.save_scan_vtasks(rep, path) == len(dr.evidence)
    sources = {vt.case_id: vt.observed["source"] for vt in read_bundle(path).vtasks}
    assert {c for c, s in sources.items() if s == "the flagged scan run, as observed"} == set(dr.captured)
    assert {s for c, s in sources.items() if c not in dr.captured} == {"re-run at save time on the capturing device"}


def test_subset_vtask_matching_its_capture(tmp_path):
    path = tmp_path / "b.aegis"
    with BundleWriter(path) as w:
        w.add(make_vtask("rows", Layout.WGRAD, 40, 24, 32, rows=[3, 17, 39], tile=(8, 8)))
        w.add(make_vtask("cols", Layout.FWD, 20, 30, 16, cols=[0, 29], tile=(8, 8), check="gemm.col_checksum"))
    rep = run_replay(ReplayOptions(bundles=[str(path)], devices="cpu", repeat=2))
    assert rep.exit_code == 0
    for o in rep.devices[0].probe_stats["replay"]["outcomes"]:
        assert o["outcome"] == "not_reproduced" and o["matches_capture"] is True
        assert "totals agree with the capture (tiles [128, 128] vs [8, 8])" in o["capture_comparison"]
        assert "points at the capturing GPU" in o["meaning"]


def test_subset_on_a_shape_dependent_device_is_not_compared_bit_for_bit(tmp_path):
    # a clean capture of the full GEMM, saved as a row subset: the CPU's BLAS sums the sub-GEMM in
    # another order, so a bitwise comparison would say "differ" on a healthy device
    full = make_vtask("full", Layout.DGRAD, 300, 96, 200, tile=(128, 128))
    rows = [5, 130, 299]
    vt = make_vtask("rows", Layout.DGRAD, 300, 96, 200, rows=rows, tile=(128, 128))
    vt.tensors["a"] = full.tensors["a"][rows].contiguous()  # dgrad: A stored (M, K)
    vt.tensors["b"] = full.tensors["b"]
    vt.tensors["c"] = full.tensors["c"][rows].contiguous()
    vt.tensors["row_sums"] = full.tensors["row_sums"][rows].contiguous()
    path = tmp_path / "b.aegis"
    with BundleWriter(path) as w:
        w.add(vt)
    (o,) = run_replay(ReplayOptions(bundles=[str(path)], devices="cpu", repeat=1)).devices[0].probe_stats["replay"]["outcomes"]
    assert o["outcome"] == "not_reproduced" and o["matches_capture"] is True
    assert "row_sums totals agree with the capture (a subset)" in o["capture_comparison"]


def test_corrupted_stored_output_is_seen_as_a_capture_mismatch(tmp_path):
    vt = make_vtask("v", Layout.DGRAD, 16, 16, 16, tile=(128, 128))
    vt.tensors["c"] = vt.tensors["c"].clone()
    vt.tensors["c"].view(torch.int16)[2, 5] ^= 0x0040
    path = tmp_path / "b.aegis"
    with BundleWriter(path) as w:
        w.add(vt)
    o = run_replay(ReplayOptions(bundles=[str(path)], devices="cpu", repeat=1)).devices[0].probe_stats["replay"]["outcomes"][0]
    assert o["outcome"] == "not_reproduced" and o["matches_capture"] is False
    assert o["capture_comparison"].startswith("1 of 256 output elements differ from the capture")
    assert "row_sums bit-identical to the capture" in o["capture_comparison"]


def test_unsafe_scales_are_skipped_and_reported(tmp_path):
    path = tmp_path / "b.aegis"
    with BundleWriter(path) as w:
        w.add(make_vtask("v"))
    rep = run_replay(ReplayOptions(bundles=[str(path)], devices="cpu", repeat=1, scales=parse_scales("0,0;64,64;-4,4")))
    o = rep.devices[0].probe_stats["replay"]["outcomes"][0]
    assert o["scales_skipped"] == [[64, 64]] and o["scales_run"] == [[0, 0], [-4, 4]]


def test_parse_scales():
    assert parse_scales("-8,8; 8,-8") == ((0, 0), (-8, 8), (8, -8))
    assert parse_scales("") == ((0, 0),)
    for bad in ("8", "a,b", "1,2,3", "100,0"):
        with pytest.raises(ConfigError, match="--scales"):
            parse_scales(bad)


def test_bad_options_exit_3(captured, capsys):
    assert run_cli(["replay", str(captured), "--device", "cpu", "--repeat", "0"]) == 3
    assert "--repeat must lie in" in capsys.readouterr().err
    assert run_cli(["replay", str(captured), "--device", "cpu", "--scales", "x"]) == 3
    assert run_cli(["replay", str(captured), "--device", "cpu:7"]) == 3
    assert run_cli(["replay"]) == 3


def test_injection_that_cannot_fire_in_a_replay_is_refused_or_reported(captured, tmp_path, capsys):
    """A replay --inject aimed at a device not replayed on, or whose op= matches no vTask, changed
    nothing and the replay said HEALTHY, exit 0: scan refuses the first and warns of the second."""
    assert run_cli(["replay", str(captured), "--device", "cpu:0", "-q", "--inject", FAULT + ",device=cpu:3"]) == 3
    err = capsys.readouterr().err
    assert "device=cpu:3 is not scanned (scanned: cpu:0)" in err and len(err.strip().splitlines()) == 1
    code, doc = replay_json(captured, tmp_path, "--repeat", "1", "--inject", FAULT + ",op=no-such-op")
    assert code == 0 and doc["injected_never_fired"] == [FAULT + ",op=no-such-op"]
    assert "never fired" in capsys.readouterr().err
    code, doc = replay_json(captured, tmp_path, "--repeat", "1", "--inject", FAULT)
    assert code == 2 and doc["injected_never_fired"] == []


def test_table_and_machine_formats(captured, capsys):
    assert run_cli(["replay", str(captured), "--device", "cpu", "--repeat", "1", "-q"]) == 0
    out = capsys.readouterr().out
    assert "not reproduced here" in out and "What it means" in out
    assert run_cli(["replay", str(captured), "--device", "cpu", "--repeat", "1", "-q", "--format", "prom"]) == 0
    assert 'aegis_device_verdict{device="cpu:0"' in capsys.readouterr().out


def test_inputs_whose_products_are_subnormal_are_not_faults(tmp_path):
    """Products below fp32's normal range are flushed (FTZ, our CUDA kernels) or rounded with an
    absolute, not relative, error: replaying such a vTask on a healthy device must not say FAULTY."""
    vt = make_vtask("tiny", Layout.FWD, 8, 8, 64, observed=False)
    for role in ("a", "b"):
        vt.tensors[role] = (vt.tensors[role].float() * 2.0**-66).to(torch.bfloat16)  # products ~2^-132
    path = tmp_path / "b.aegis"
    with BundleWriter(path) as w:
        w.add(vt)
    rep = run_replay(ReplayOptions(bundles=[str(path)], devices="cpu", repeat=2))
    o = rep.devices[0].probe_stats["replay"]["outcomes"][0]
    assert rep.exit_code == 0 and o["outcome"] == "not_reproduced" and o["checks_fired"] == []


def test_scales_summing_to_128_stay_exact(tmp_path):
    # small operands (as captured at scale -32) replayed at --scales 64,64: the expected C is the
    # base C times 2^128, which one fp32 factor cannot carry (it made a healthy device FAULTY)
    vt = make_vtask("small", m=8, n=8, k=64, tile=(4, 4), observed=False)
    for role in ("a", "b"):
        vt.tensors[role] = (vt.tensors[role].float() * 2.0**-32).to(torch.bfloat16)
    path = tmp_path / "small.aegis"
    with BundleWriter(path) as w:
        w.add(vt)
    rep = run_replay(ReplayOptions(bundles=[str(path)], devices="cpu", repeat=1, scales=parse_scales("64,64")))
    (o,) = rep.devices[0].probe_stats["replay"]["outcomes"]
    assert o["scales_run"] == [[0, 0], [64, 64]] and o["outcome"] == "not_reproduced"
    assert o["checks_fired"] == [] and rep.exit_code == 0


def test_replay_judges_by_the_replaying_devices_noise(tmp_path, monkeypatch):
    # a vTask whose τ is in units of Σ|A||B| ("abs-product"), replayed on a device whose matrix unit
    # truncates: its ceiling at this K (the accumulation bound), not the capture's τ, is the
    # threshold (else clean noise reads as "reproduced")
    from aegis_cli.backends.cpu import CpuDevice

    vt = make_vtask("clean", m=8, n=8, k=64, tile=(4, 4), observed=False)
    path = tmp_path / "clean.aegis"
    with BundleWriter(path) as w:
        w.add(vt)
    monkeypatch.setattr(CpuDevice, "accumulation_bound", lambda self, k: 1e-3)
    rep = run_replay(ReplayOptions(bundles=[str(path)], devices="cpu", repeat=1))
    (o,) = rep.devices[0].probe_stats["replay"]["outcomes"]
    assert o["tau"] == 1e-3 > vt.tau and any("τ raised" in n for n in o["notes"])
    assert o["outcome"] == "not_reproduced"


def test_flags_within_rounding_of_unusual_data_stay_suspect(tmp_path):
    # a vTask from another producer whose data makes fp32 rounding exceed the calibrated τ on a
    # healthy device: reproducible, but no evidence of corruption, so SUSPECT, not FAULTY
    vt = make_vtask("adv", m=16, n=16, k=1024, tile=(128, 128), observed=False)
    vt.dist = None  # not one of the scan's calibrated input distributions
    a = torch.full((16, 1024), 1.5 * 2.0**-25, dtype=torch.bfloat16)
    a[:, 0] = 1.0
    vt.tensors["a"] = a if tuple(vt.tensors["a"].shape) == (16, 1024) else a.t().contiguous()
    vt.tensors["b"] = torch.ones(tuple(vt.tensors["b"].shape), dtype=torch.bfloat16)
    path = tmp_path / "adv.aegis"
    with BundleWriter(path) as w:
        w.add(vt)
    rep = run_replay(ReplayOptions(bundles=[str(path)], devices="cpu", repeat=2))
    (o,) = rep.devices[0].probe_stats["replay"]["outcomes"]
    assert o["outcome"] == "reproduced" and o["margin"] > 1 and o["severity"] == "SUSPECT"
    assert any("within what fp32 rounding" in n for n in o["notes"]) and rep.exit_code == 1


def test_output_check_vtask_keeps_its_own_rows(monkeypatch):
    # the checksums flag row 2 (an accumulator fault), the output check row 7 (an output fault):
    # the output check's vTask must keep row 7, not the checksums' row
    from aegis_cli.ops.verdict import Evidence, Verdict
    from aegis_cli.ops.workloads import load
    from aegis_cli.probes.gemm_scan import plan_cases

    monkeypatch.setattr(capture, "FULL_OPERANDS_LIMIT", 0)
    dev = resolve_devices("cpu:0")[0]
    case = next(c for c in plan_cases(load("cpu-quick"), 0) if c.case_id(0, 0) == CASE)
    ops = case.operands(dev)
    res = dev.checked_gemm(ops)
    res.row_sums[2, 0] += 1000.0
    ev = Evidence(check="gemm.output_rowsum", severity=Verdict.FAULTY, case_id=CASE, summary="x", scale=[0, 0],
                  samples=[{"row": 7, "col_tile": 0}])
    run = capture.ObservedGemm(ops, res, case_id=CASE, op=case.shape.op, seed=case.seed, dist=case.dist)
    (vt,) = capture.capture_gemm(run, [ev], tau=1e-6, confirm_margin=1.0, provenance={"device_id": "cpu:0"})
    assert vt.gemm.rows == [7]


def test_provenance_says_injected_only_for_the_device_that_was(tmp_path, monkeypatch):
    monkeypatch.setenv("AEGIS_CPU_DEVICES", "2")
    opts = ScanOptions(devices="cpu:0,cpu:1", case=CASE, reruns=1, probes=("gemm",), inject=FAULT + ",device=cpu:1",
                       thresholds=dataclasses.replace(ScanOptions().thresholds, tau=1e-12))
    rep = run_scan(opts)
    path = tmp_path / "two.aegis"
    from_scan.save_scan_vtasks(rep, path)
    by_dev: dict[str, set] = {}
    for v in read_bundle(path).vtasks:
        by_dev.setdefault(v.provenance["device_id"], set()).add(v.provenance["injected"])
    assert by_dev["cpu:1"] == {True} and by_dev.get("cpu:0", {False}) == {False}


# -- review fixes ------------------------------------------------------------------------------------
def _write(path: Path, *vts) -> Path:
    with BundleWriter(path) as w:
        for vt in vts:
            w.add(vt)
    return path


def test_a_bundles_own_tiny_tau_cannot_make_a_healthy_device_faulty(tmp_path):
    # τ is the producer's word: at 1e-12 a healthy CPU's clean rounding (≈1e-9·s) read as FAULTY
    vt = make_vtask("tiny-tau", m=64, n=64, k=512, tile=(4, 4), seed=random.randrange(2**31), tau=1e-12)
    rep = run_replay(ReplayOptions(bundles=[str(_write(tmp_path / "t.aegis", vt))], devices="cpu", repeat=1))
    (o,) = rep.devices[0].probe_stats["replay"]["outcomes"]
    assert rep.exit_code == 0 and o["outcome"] == "not_reproduced" and o["tau"] == 1e-6
    assert "τ raised from the captured 1e-12 to 1e-06, this device's calibrated ceiling" in " ".join(o["notes"])


def test_a_tau_in_noise_units_is_judged_on_the_replaying_devices_noise(tmp_path):
    # a scan's vTask records τ in units of its device's calibrated noise ("device-noise"): replayed,
    # the replaying device's own noise scale divides the differences, and a tiny τ is raised to the
    # default (3.5× the calibrated clean maximum), so a clean replay stays clean
    vt = make_vtask("noise-tau", m=64, n=64, k=512, tile=(4, 4), seed=random.randrange(2**31), tau=1e-12)
    vt.normalisation = "device-noise"
    rep = run_replay(ReplayOptions(bundles=[str(_write(tmp_path / "n.aegis", vt))], devices="cpu", repeat=1))
    (o,) = rep.devices[0].probe_stats["replay"]["outcomes"]
    assert rep.exit_code == 0 and o["outcome"] == "not_reproduced" and o["tau"] == Thresholds().tau
    assert "τ raised from the captured 1e-12 to 3.5, the default τ in units of this device's calibrated noise" in " ".join(o["notes"])


def test_a_dist_label_alone_does_not_confirm_a_flag_within_rounding(tmp_path):
    # inputs whose fp32 rounding on a healthy CPU crosses τ, labelled as a scan distribution: the
    # label made the rounding guard step aside (FAULTY); they are no scan draw, so SUSPECT
    m, n, k = 8, 8, 8192
    vt = make_vtask("labelled", m=m, n=n, k=k, tile=(4, 4), seed=random.randrange(2**31), tau=1e-6, observed=False)
    f = 2.0 ** random.randint(-4, 4)  # exact: the rounding pattern does not change
    w = torch.full((n, k), 2.0**-20 * f)
    w[:, ::64] = f
    vt.tensors["a"], vt.tensors["b"] = torch.ones(m, k).bfloat16(), w.bfloat16()  # fwd: B stored as W (N, K)
    vt.dist = random.choice(("normal", "uniform", "heavy"))
    rep = run_replay(ReplayOptions(bundles=[str(_write(tmp_path / "l.aegis", vt))], devices="cpu", repeat=1))
    (o,) = rep.devices[0].probe_stats["replay"]["outcomes"]
    assert o["outcome"] == "reproduced" and o["severity"] == "SUSPECT" and rep.exit_code == 1
    assert f"dist {vt.dist!r} is claimed, but its inputs are not the scan's draw from it" in " ".join(o["notes"])


def test_the_scans_own_inputs_are_recognised_as_its_draw(tmp_path, monkeypatch):
    """Full and subset vTasks of a scan case, at a scaled variant, regenerate bit for bit from
    (dist, seed, case id); one flipped bit, or another distribution's label, does not."""
    from aegis_cli.ops.verdict import Evidence, Verdict
    from aegis_cli.ops.workloads import load
    from aegis_cli.probes.gemm import ProbeStats, scaled
    from aegis_cli.probes.gemm_scan import plan_cases
    from aegis_cli.vtask.replay import _VTaskReplay

    dev = resolve_devices("cpu:0")[0]
    case = random.choice(plan_cases(load("cpu-quick"), random.randrange(2**31)))
    ea, eb = random.choice(((0, 0), (-8, 8), (16, 16)))
    cid = case.case_id(ea, eb)
    ops = scaled(case.operands(dev), ea, eb)
    run = capture.ObservedGemm(ops, dev.checked_gemm(ops), case_id=cid, op=case.shape.op, scale=(ea, eb), seed=case.seed,
                               dist=case.dist)
    evs = [Evidence(check=c, severity=Verdict.FAULTY, case_id=cid, summary="x", scale=[ea, eb],
                    samples=[{"row": 1, "col_tile": 0, "col": 2}]) for c in ("gemm.row_checksum", "gemm.col_checksum")]
    vts = capture.capture_gemm(run, evs, tau=1e-6, confirm_margin=1.0, provenance={"device_id": "cpu:0"})
    monkeypatch.setattr(capture, "FULL_OPERANDS_LIMIT", 0)
    subs = capture.capture_gemm(run, evs, tau=1e-6, confirm_margin=1.0, provenance={"device_id": "cpu:0"})
    assert {v.gemm.subset for v in vts} == {"full"} and {v.gemm.subset for v in subs} == {"rows", "cols"}
    back = read_bundle(_write(tmp_path / "s.aegis", *[dataclasses.replace(v, id=f"{v.id}/{i}") for i, v in enumerate(vts + subs)]))

    def calibrated(vt):
        return _VTaskReplay(dev, vt, ReplayOptions(bundles=[]), None, ProbeStats()).calibrated()

    for vt in back.vtasks:
        assert calibrated(vt) == (True, ""), vt.id
        other = dataclasses.replace(vt, dist=next(d for d in ("normal", "uniform", "heavy") if d != vt.dist))
        assert calibrated(other)[0] is False
        a = vt.tensors["a"].clone()
        a.view(torch.int16).view(-1)[random.randrange(a.numel())] ^= 1
        ok, why = calibrated(dataclasses.replace(vt, tensors={**vt.tensors, "a": a}))
        assert not ok and "its inputs are not the scan's draw from it" in why


def _huge_output_bundle(path: Path) -> Path:
    # 65536 rows of A and of W with K = 1: a 256 KiB file, a 65536x65536 output
    from aegis_cli.ops.gemm import Layout as L
    from aegis_cli.vtask.model import GemmSpec, VTask

    d = 1 << 16
    spec = GemmSpec(layout=L.FWD, m=d, n=d, k=1, tile=(128, 128))
    ts = {r: (torch.rand(d, 1) + 0.5).bfloat16() for r in ("a", "b")}
    return _write(path, VTask(id="big", check="gemm.row_checksum", op="qkv", gemm=spec, tau=1e-6, dist="normal", tensors=ts))


def test_replay_refuses_a_vtask_too_big_for_the_device(tmp_path, monkeypatch, capsys):
    from aegis_cli.backends.cpu import CpuDevice
    from tests.helpers import run_cli as run

    path = _huge_output_bundle(tmp_path / "huge.aegis")
    monkeypatch.setattr(CpuDevice, "memory_bytes", lambda self: 32 << 30)
    monkeypatch.setattr(CpuDevice, "memory_free", lambda self: 16 << 30)
    code, out, err = run(capsys, "replay", str(path), "--device", "cpu", "-q", "-o", str(tmp_path / "r.json"))
    assert code == 3 and out == "" and not (tmp_path / "r.json").exists()
    (line,) = err.strip().splitlines()
    assert line.startswith(f"Error: bundle {path}: vTask 'big' replays a 65536x65536x1 GEMM that needs about ")
    assert line.endswith("on cpu:0, which has 32.0 GiB")


def test_replay_tells_a_busy_device_from_a_small_one(tmp_path, monkeypatch, capsys):
    from aegis_cli.backends.cpu import CpuDevice
    from aegis_cli.vtask.replay import replay_bytes
    from tests.helpers import run_cli as run

    vt = make_vtask("v0", m=24, n=40, k=16, tile=(8, 8), seed=random.randrange(2**31))
    path = _write(tmp_path / "b.aegis", vt)
    need = replay_bytes(vt)
    monkeypatch.setattr(CpuDevice, "memory_bytes", lambda self: 64 * need)
    monkeypatch.setattr(CpuDevice, "memory_free", lambda self: need - 1)
    code, _, err = run(capsys, "replay", str(path), "--device", "cpu", "-q")
    assert code == 3 and len(err.strip().splitlines()) == 1
    assert "free now (other processes hold the rest); replay when the device is idle" in err
    monkeypatch.setattr(CpuDevice, "memory_free", lambda self: need)
    code, _, _ = run(capsys, "replay", str(path), "--device", "cpu", "-q", "--repeat", "1")
    assert code == 0


def _renamed_tiny(tmp_path: Path, name: str) -> str:
    text = Path(TINY).read_text().replace("name: tiny", f"name: {name}")
    (tmp_path / "wl.yaml").write_text(text)
    return str(tmp_path / "wl.yaml")


@pytest.mark.parametrize(("extra", "needle"), [
    (("--workload", "my tiny"), "--save-vtasks: workload 'my tiny' gives vTask ids like 'cpu:0/my tiny/mlp_down/"),
    (("--threshold", "1e-310"), "--save-vtasks: τ = 1e-310 for cpu:0 at K = "),
])
def test_save_vtasks_refuses_what_it_could_not_save_before_the_scan(extra, needle, tmp_path, monkeypatch, capsys):
    from aegis_cli import scan as scan_mod
    from tests.helpers import run_cli as run

    def no_scan(*a, **k):
        raise AssertionError("the scan ran")

    monkeypatch.setattr(scan_mod, "scan_device", no_scan)
    args = list(extra)
    if args[0] == "--workload":
        args[1] = _renamed_tiny(tmp_path, args[1])
    else:
        args += ["--workload", TINY]
    code, out, err = run(capsys, "scan", "--device", "cpu", "-q", "--probes", "gemm", *args, "--save-vtasks",
                         str(tmp_path / "b.aegis"), "--format", "json", "-o", str(tmp_path / "r.json"))
    assert code == 3 and out == "" and len(err.strip().splitlines()) == 1 and needle in err
    assert sorted(p.name for p in tmp_path.iterdir()) == (["wl.yaml"] if extra[0] == "--workload" else [])


def test_a_failed_save_keeps_the_scan_report(tmp_path, monkeypatch, capsys):
    from aegis_cli.ops.errors import BundleError
    from tests.helpers import run_cli as run

    def fail(rep, path):
        raise BundleError(f"bundle {path}: cannot write (No space left on device)")

    monkeypatch.setattr(from_scan, "save_scan_vtasks", fail)
    report, bundle = tmp_path / "r.json", tmp_path / "b.aegis"
    code, out, err = run(capsys, "scan", "--device", "cpu", "-q", "--workload", TINY, "--reruns", "1", "--probes", "gemm",
                         "--seed", str(random.randrange(2**31)), "--inject", "bitflip:bit=exp", "--save-vtasks", str(bundle),
                         "--format", "json", "-o", str(report))
    # the report is out with the scan's verdict: FAULTY, or (about 1 seed in 1,000: a flip whose
    # change stays within the rigorous fp32 bound, which no re-run can tell from rounding) SUSPECT
    assert code == 3 and out == "" and json.loads(report.read_text())["devices"][0]["verdict"] in ("FAULTY", "SUSPECT")
    assert err.strip().splitlines()[-1] == (f"Error: --save-vtasks: the report is out, but the vTasks were not saved: "
                                            f"bundle {bundle}: cannot write (No space left on device)")
