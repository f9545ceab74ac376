"""JSON reports validate against docs/report.schema.json, on real pass and fail output."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import TINY, run_cli

jsonschema = pytest.importorskip("jsonschema")
SCHEMA = json.loads((Path(__file__).resolve().parents[2] / "docs" / "report.schema.json").read_text())


@pytest.mark.parametrize(
    ("argv", "verdict"),
    [
        ([], "HEALTHY"),
        (["--inject", "bitflip:bit=exp"], "FAULTY"),
        (["--inject", "tile:mode=skipk", "--confirm-margin", "1e12", "--probes", "gemm"], "SUSPECT"),
        (["--inject", "bitflip:target=out,bit=14"], "FAULTY"),
        (["--inject", "bitflip:bit=exp", "--fail-fast"], "FAULTY"),
        (["--inject", "bitflip:bit=exp", "--evidence-in-full", "1"], "FAULTY"),
    ],
)
def test_scan_json_validates(capsys, argv, verdict):
    code, out, _ = run_cli(capsys, "scan", "-q", "--workload", TINY, "--format", "json", *argv)
    doc = json.loads(out)
    jsonschema.validate(doc, SCHEMA)
    assert doc["devices"][0]["verdict"] == verdict
    assert doc["exit_code"] == code
    assert doc["fault_injected"] == bool(argv)
    assert doc["versions"]["torch"]
    c = doc["devices"][0]["confirmation"]
    assert c["launches"] > 0 and (c["failed_launches"] > 0) == (verdict != "HEALTHY")
    for ev in doc["devices"][0]["evidence"]:
        if ev["check"].startswith("gemm."):
            assert ev["case_id"].startswith("tiny/") and "reproduced in" in ev["reproduction"]
        else:  # the bitwise probes' checked GEMMs meet the same injected fault; their ids start with the probe
            assert ev["case_id"].startswith(ev["check"].split(".")[0] + "/")


def test_multi_device_report_validates(capsys, monkeypatch):
    monkeypatch.setenv("AEGIS_CPU_DEVICES", "3")
    code, out, _ = run_cli(capsys, "scan", "-q", "--workload", TINY, "--device", "cpu", "--format", "json",
                           "--inject", "bitflip:bit=exp,device=cpu:1")
    doc = json.loads(out)
    jsonschema.validate(doc, SCHEMA)
    assert [d["verdict"] for d in doc["devices"]] == ["HEALTHY", "FAULTY", "HEALTHY"]
    assert len({d["device"]["uuid"] for d in doc["devices"]}) == 3
    assert code == 2


def test_schema_rejects_a_broken_report(capsys):
    _, out, _ = run_cli(capsys, "scan", "-q", "--workload", TINY, "--format", "json")
    doc = json.loads(out)
    doc["devices"][0]["verdict"] = "FINE"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(doc, SCHEMA)


def test_replay_and_fleet_reports_validate(capsys, tmp_path):
    bundle, scan_json = tmp_path / "b.aegis", tmp_path / "scan.json"
    code, _, _ = run_cli(capsys, "scan", "-q", "--workload", TINY, "--probes", "gemm", "--inject", "bitflip:bit=exp",
                         "--save-vtasks", str(bundle), "--format", "json", "--output", str(scan_json))
    assert code == 2
    code, out, _ = run_cli(capsys, "replay", str(bundle), "--format", "json")
    replay = json.loads(out)
    jsonschema.validate(replay, SCHEMA)
    assert replay["kind"] == "replay" and code == 0
    code, out, _ = run_cli(capsys, "report", str(scan_json), "--format", "json")
    fleet = json.loads(out)
    jsonschema.validate(fleet, SCHEMA)
    assert fleet["kind"] == "fleet" and code == 2


def test_prometheus_export_carries_launches_checked_and_failed(capsys):
    code, out, _ = run_cli(capsys, "scan", "-q", "--workload", TINY, "--probes", "gemm", "--format", "json",
                           "--inject", "bitflip:bit=exp")
    doc = json.loads(out)
    from aegis_cli.report import to_prometheus

    prom = to_prometheus(doc)
    c, uuid = doc["devices"][0]["confirmation"], doc["devices"][0]["device"]["uuid"]
    assert f'aegis_device_launches_checked{{device="cpu:0",uuid="{uuid}"}} {c["launches"]}' in prom
    assert f'aegis_device_failed_launches{{device="cpu:0",uuid="{uuid}"}} {c["failed_launches"]}' in prom
    assert code == 2 and 0 < c["failed_launches"] <= c["launches"]
