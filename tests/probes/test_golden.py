"""Golden fingerprints: record, compare, refuse a foreign key, catch a device that is wrong
the same way every time."""

from __future__ import annotations

import json

import pytest

from aegis_cli.backends.cpu import CpuDevice
from aegis_cli.cli import main
from aegis_cli.ops.errors import GoldenError
from aegis_cli.probes import golden_file as golden
from aegis_cli.scan import ScanOptions, run_scan


@pytest.fixture(scope="module")
def golden_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("golden") / "cpu.json"
    golden.save(golden.record([CpuDevice(0)], seed=11), path)
    return path


def test_record_format(golden_file):
    doc = golden.load(golden_file)
    assert doc["format"] == "aegis-golden" and doc["format_version"] == 1 and doc["seed"] == 11
    (rec,) = doc["records"]
    assert rec["key"] == golden.device_key(CpuDevice(0))
    assert {"checked_gemm", "matmul", "sdpa_fwd", "rmsnorm"} <= set(rec["computations"])
    out = rec["computations"]["checked_gemm"]["outputs"]
    assert {"input:a", "input:b", "c", "row_sums", "col_sums"} == set(out) and len(out["c"]["fingerprint"]) == 16


def test_scan_against_golden_is_healthy(golden_file):
    rep = run_scan(ScanOptions(devices="cpu:0", probes=("golden",), golden=str(golden_file)))
    d = rep.devices[0]
    assert d.verdict.value == "HEALTHY" and d.probe_stats["golden"]["outputs_checked"] > 20


def test_wrong_the_same_way_every_time_is_faulty(golden_file):
    # a permanent fault: every run repeats the same wrong bits, so determinism cannot see it
    rep = run_scan(ScanOptions(devices="cpu:0", probes=("golden", "determinism"), golden=str(golden_file),
                               inject="bitflip:target=out,bit=exp,op=golden/checked_gemm", reruns=2,
                               probe_options={"determinism.only": "checked_gemm"}))
    d = rep.devices[0]
    assert d.verdict.value == "FAULTY"
    (ev,) = d.evidence
    assert ev.check == "golden.mismatch" and "same way every time" in ev.summary
    assert ev.samples[0]["output"] == "c" and ev.tiles


def test_runs_that_differ_among_themselves_are_faulty(golden_file):
    # an intermittent fault: the first run misses the golden bits, the re-runs return to them.
    # Runs of a recorded (deterministic) computation that disagree are a confirmed corruption.
    import numpy as np

    coin = lambda s, launch: np.random.default_rng([s, 0, launch, 0xC01]).random()  # inject.py's coin
    seed = next(s for s in range(1000) if coin(s, 0) < 0.5 and all(coin(s, n) >= 0.5 for n in (1, 2, 3)))
    rep = run_scan(ScanOptions(devices="cpu:0", probes=("golden",), golden=str(golden_file), reruns=3,
                               inject=f"bitflip:bit=30,target=out,prob=0.5,seed={seed},op=golden/checked_gemm"))
    d = rep.devices[0]
    (ev,) = d.evidence
    assert ev.check == "golden.mismatch" and ev.severity.value == "FAULTY" and ev.distinct_outputs == 2
    assert "wrong in 1 of 4 runs" in ev.summary and rep.exit_code == 2


def test_unknown_golden_case_is_refused(golden_file):
    from aegis_cli.ops.errors import ConfigError

    with pytest.raises(ConfigError, match=r"has no computation 'nosuch'"):
        run_scan(ScanOptions(devices="cpu:0", golden=str(golden_file), case="golden/nosuch/x"))


def test_key_mismatch_refuses_with_clear_message(golden_file, tmp_path):
    doc = json.loads(golden_file.read_text())
    doc["records"][0]["key"]["torch"] = "0.0.1"
    doc["records"][0]["key"]["model"] = "NVIDIA H200"
    bad = tmp_path / "other.json"
    bad.write_text(json.dumps(doc))
    with pytest.raises(GoldenError, match=r"torch: recorded '0.0.1'") as exc:
        run_scan(ScanOptions(devices="cpu:0", probes=("gemm",), golden=str(bad)))
    assert "model: recorded 'NVIDIA H200'" in str(exc.value)


@pytest.mark.parametrize("content,match", [("{", "not readable JSON"), ('{"format": "x"}', "not an aegis golden"),
                                           ('{"format": "aegis-golden", "format_version": 9}', "format_version"),
                                           ('{"format": "aegis-golden", "format_version": 1, "seed": 1}', "malformed")])
def test_bad_files(tmp_path, content, match):
    p = tmp_path / "g.json"
    p.write_text(content)
    with pytest.raises(GoldenError, match=match):
        golden.load(p)
    with pytest.raises(GoldenError, match="not found"):
        golden.load(tmp_path / "missing.json")


def test_cli_record_and_refusal(tmp_path, capsys, monkeypatch):
    out = tmp_path / "g.json"
    with pytest.raises(SystemExit) as e:
        main(["golden", "record", "--device", "cpu:0", "-o", str(out)])
    assert e.value.code == 0 and golden.load(out)["records"]
    doc = json.loads(out.read_text())
    doc["records"][0]["key"]["kernels"] = "0000"
    out.write_text(json.dumps(doc))
    with pytest.raises(SystemExit) as e:
        main(["scan", "--device", "cpu:0", "--probes", "memory", "--golden", str(out), "-q"])
    assert e.value.code == 3 and "kernels: recorded '0000'" in capsys.readouterr().err


def test_devices_that_disagree_cannot_record(monkeypatch):
    monkeypatch.setenv("AEGIS_CPU_DEVICES", "2")

    class Odd(CpuDevice):
        def generate(self, shape, dist, seed):
            return super().generate(shape, dist, seed + 1)

    with pytest.raises(GoldenError, match="disagree"):
        golden.record([CpuDevice(0), Odd(1)], seed=1)


def _edited(golden_file, tmp_path, edit) -> str:
    doc = json.loads(golden_file.read_text())
    edit(doc)
    p = tmp_path / "edited.json"
    p.write_text(json.dumps(doc))
    return str(p)


def _out(doc, comp="checked_gemm", out="c"):
    return doc["records"][0]["computations"][comp]["outputs"][out]


@pytest.mark.parametrize(("edit", "needle"), [
    # int(x, 16) took these, then the text comparison called a healthy device FAULTY
    (lambda d: _out(d).update(fingerprint=_out(d)["fingerprint"].upper()), "fingerprint must be 16 lower-case hex digits"),
    (lambda d: _out(d).update(fingerprint="0x" + _out(d)["fingerprint"][2:]), "fingerprint must be 16 lower-case hex digits"),
    (lambda d: _out(d).update(fingerprint="-1"), "fingerprint must be 16 lower-case hex digits"),
    (lambda d: _out(d).update(blocks=[]), "blocks must be a list"),
    (lambda d: _out(d).update(shape="64x64"), "needs a shape"),
    # nothing to compare: HEALTHY with outputs_checked 0
    (lambda d: d["records"][0].update(computations={}), "holds no computations"),
    (lambda d: d["records"][0]["computations"]["gelu"].update(outputs={}), "gelu holds no outputs"),
    # a later ValueError in the probe made the device ERROR, losing a FAULTY
    (lambda d: d.update(block=3), "block must be a whole multiple of 8"),
    (lambda d: d.update(block=0.5), "block must be a whole multiple of 8"),
    (lambda d: d.update(block=True), "block must be a whole multiple of 8"),
    # dict() of a list of pairs passed, then .get() was an internal error
    (lambda d: d["records"][0].update(key=list(d["records"][0]["key"].items())), "key must map names"),
])
def test_malformed_records_are_refused_at_load(golden_file, tmp_path, edit, needle):
    with pytest.raises(GoldenError, match=needle):
        golden.load(_edited(golden_file, tmp_path, edit))


@pytest.mark.parametrize(("edit", "needle"), [
    (lambda d: d["records"][0]["computations"].pop("gelu"), "lacks gelu"),  # gelu went unchecked under HEALTHY
    (lambda d: d["records"][0]["computations"].update(zz=d["records"][0]["computations"]["gelu"]), "has unknown zz"),
    (lambda d: d["records"][0]["computations"]["gelu"]["outputs"].update(zz=_out(d, "gelu", "y")), r"gelu.zz was recorded as"),
    (lambda d: _out(d, "gelu", "y").update(dtype="int8"), r"gelu.y was recorded as int8"),
])
def test_records_that_do_not_describe_this_aegis_are_refused(golden_file, tmp_path, capsys, edit, needle):
    """A record missing a computation, or with outputs, shapes or dtypes this aegis does not
    compute, is a problem of the file (exit 3), not evidence against the device (it was ERROR)."""
    path = _edited(golden_file, tmp_path, edit)
    with pytest.raises(SystemExit) as e:
        main(["scan", "--device", "cpu:0", "--probes", "golden", "--golden", path, "-q"])
    err = capsys.readouterr().err
    assert e.value.code == 3 and needle in err, err
    assert len(err.strip().splitlines()) == 1


def test_key_names_what_the_bits_depend_on(golden_file, tmp_path):
    """The CPU's vector width (AVX-512 or not) changes its float kernels' bits: a record from a
    host of another capability is refused by name, not compared (it read as FAULTY everywhere)."""
    key = golden.device_key(CpuDevice(0))
    assert key["cpu_capability"] and "gemm_kernel" not in key
    path = _edited(golden_file, tmp_path, lambda d: d["records"][0]["key"].update(cpu_capability="other"))
    with pytest.raises(GoldenError, match=r"cpu_capability: recorded 'other'"):
        run_scan(ScanOptions(devices="cpu:0", probes=("golden",), golden=path))


def test_golden_probe_without_a_file_is_refused(capsys):
    with pytest.raises(SystemExit) as e:
        main(["scan", "--device", "cpu:0", "--probes", "golden", "-q"])
    assert e.value.code == 3 and "give it with --golden FILE" in capsys.readouterr().err


def test_mismatch_summary_counts_blocks(golden_file):
    rep = run_scan(ScanOptions(devices="cpu:0", probes=("golden",), golden=str(golden_file), reruns=1,
                               inject="memflip:op=golden/gelu,index=5,bit=3"))
    (ev,) = rep.devices[0].evidence
    assert "in 1 block(s) of 65536 elements" in ev.summary and "an upper bound" in ev.summary
