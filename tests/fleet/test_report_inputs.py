"""``aegis report`` on hostile or odd reports: wrong field types, deep nesting, non-finite
noise, the same device in several reports. One line and exit 3 for a bad report; nothing
silently reinterpreted or dropped."""

from __future__ import annotations

import copy
import json
import subprocess

import pytest

from aegis_cli.fleet import compare
from aegis_cli.fleet.merge import merge
from aegis_cli.ops.errors import ConfigError
from tests.fleet_helpers import aegis, env


def report(host: str, uuids: list[str], finished: str = "2025-01-02T00:00:00+00:00", noise: float = 1e-7) -> dict:
    devices = [{"device": {"id": f"cuda:{i}", "uuid": u, "host": host, "name": "H200"}, "verdict": "HEALTHY",
                "workload": "w", "error": None, "evidence": [],
                "stats": {"gemms": 10, "checksums": 20, "flops": 1e9, "skipped_scales": 0},
                "noise": {"threshold": 1e-6, "clean_max": noise, "margin": 10.0},
                "probes": {compare.PROBE_KEY: {"class": "c", "fingerprints": {"case-1": "ab"}}},
                "timings": {"seconds": 1.0, "gemm_tflops": None}} for i, u in enumerate(uuids)]
    return {"schema_version": "1.0", "kind": "sweep", "host": host, "seed": 0, "injected": [], "fault_injected": False,
            "started": "2025-01-01T00:00:00+00:00", "finished": finished, "devices": devices}


def write(tmp_path, name: str, doc: dict, text: str | None = None) -> str:
    p = tmp_path / name
    p.write_text(text if text is not None else json.dumps(doc), encoding="utf-8")
    return str(p)


def run_report(*paths: str) -> subprocess.CompletedProcess:
    return subprocess.run(aegis("report", *paths, "--format", "json"), env=env(1), capture_output=True, text=True, timeout=120)


def one_error_line(p: subprocess.CompletedProcess) -> str:
    assert p.returncode == 3 and "Traceback" not in p.stderr, p.stderr
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error: "), p.stderr
    return lines[0]


@pytest.mark.parametrize(("field", "value", "message"), [
    (("stats", "gemms"), "lots", r"devices\[0\]: stats.gemms must be a number, got \"lots\""),
    (("stats", "flops"), True, r"stats.flops must be a number"),
    (("noise", "clean_max"), "tiny", r"noise.clean_max must be a number"),
    (("timings", "gemm_tflops"), [1], r"timings.gemm_tflops must be a number"),
    (("stats",), 7, r"stats and timings must be objects"),
])
def test_report_with_a_mistyped_device_field_is_refused_naming_it(tmp_path, field, value, message):
    doc = report("n1", ["GPU-a"])
    target = doc["devices"][0]
    for k in field[:-1]:
        target = target[k]
    target[field[-1]] = value
    with pytest.raises(ConfigError, match=message):
        merge([write(tmp_path, "r.json", doc)])


def test_mistyped_field_gives_one_line_and_exit_3_not_a_prometheus_file(tmp_path):
    doc = report("n1", ["GPU-a"])
    doc["devices"][0]["stats"]["gemms"] = "lots"
    p = subprocess.run(aegis("report", write(tmp_path, "r.json", doc), "--format", "prom"), env=env(1),
                       capture_output=True, text=True, timeout=120)
    assert "stats.gemms must be a number" in one_error_line(p) and p.stdout == ""


@pytest.mark.parametrize("value", ["false", "no", 0, [False]])
def test_fault_injected_must_be_a_boolean_not_anything_truthy(tmp_path, value):
    doc = report("n1", ["GPU-a"])
    doc["fault_injected"] = value
    with pytest.raises(ConfigError, match="fault_injected must be true or false"):
        merge([write(tmp_path, "r.json", doc)])
    doc["fault_injected"] = False
    assert merge([write(tmp_path, "r.json", doc)])["fault_injected"] is False


def test_deeply_nested_report_is_a_clear_error_not_a_recursion_error(tmp_path):
    doc = report("n1", ["GPU-a"])
    doc["devices"][0]["probes"]["other"] = "NEST"
    text = json.dumps(doc).replace('"NEST"', "[" * 950 + "]" * 950)
    line = one_error_line(run_report(write(tmp_path, "deep.json", doc, text)))
    assert "nested over" in line and "RecursionError" not in line


def test_infinite_clean_noise_is_no_measurement_and_no_suspect(tmp_path):
    doc = report("n1", ["GPU-a", "GPU-b", "GPU-c"])
    text = json.dumps(doc).replace("1e-07", "Infinity", 1)  # Python's json writes this non-standard literal
    fleet = merge([write(tmp_path, "r.json", doc, text)])
    assert [d["verdict"] for d in fleet["devices"]] == ["HEALTHY"] * 3
    assert fleet["comparison"]["noise_outliers"] == [] and fleet["outcome"] == compare.CONSISTENT
    doc["devices"][0]["noise"]["clean_max"] = "inf"  # as aegis itself writes infinity
    assert [d["verdict"] for d in merge([write(tmp_path, "r.json", doc)])["devices"]] == ["HEALTHY"] * 3


def test_duplicate_devices_across_reports_are_listed_not_silently_dropped(tmp_path):
    old = report("n1", ["GPU-a", "GPU-b"], finished="2025-01-01T00:00:00+00:00")
    old["devices"][1]["verdict"] = "FAULTY"
    new = report("n2", ["GPU-b", "GPU-c"], finished="2025-01-03T00:00:00+00:00")  # GPU-b moved to n2
    p_old, p_new = write(tmp_path, "old.json", old), write(tmp_path, "new.json", new)
    fleet = merge([p_old, p_new])
    assert sorted(d["device"]["uuid"] for d in fleet["devices"]) == ["GPU-a", "GPU-b", "GPU-c"]
    assert next(d for d in fleet["devices"] if d["device"]["uuid"] == "GPU-b")["source"] == p_new
    assert fleet["duplicates"] == [{"uuid": "GPU-b", "kept": p_new, "superseded": [
        {"source": p_old, "finished": "2025-01-01T00:00:00+00:00", "verdict": "FAULTY"}]}]
    # the same report twice: every device is a duplicate of itself, and said to be
    assert len(merge([p_new, p_new])["duplicates"]) == 2
    assert merge([p_old])["duplicates"] == []


def test_valid_reports_still_merge_unchanged(tmp_path):
    doc = report("n1", ["GPU-a", "GPU-b"])
    before = copy.deepcopy(doc)
    fleet = merge([write(tmp_path, "r.json", doc)])
    assert fleet["exit_code"] == 0 and fleet["outcome"] == compare.CONSISTENT and doc == before
