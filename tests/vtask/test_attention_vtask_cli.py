"""The attention vTask round trip through the CLI, on the CPU and (GPU tier) on a GPU: `aegis
scan --probes attention --inject … --save-vtasks` saves the flagged case, and `aegis replay`
on the same device reproduces it with the same injection and not without."""

from __future__ import annotations

import json

import pytest

from tests.helpers import TINY, run_cli

FAULT = "perturb:target=attn.dv,r=1000,index=70"
CASE = "attention/normal/b1h4k2s160d64c/s+0+0"


def _replay(capsys, bundle, device: str, out, *inject: str) -> tuple[int, dict]:
    code, _, err = run_cli(capsys, "replay", "-q", str(bundle), "--device", device, "--repeat", "2", *inject,
                           "--format", "json", "-o", str(out))
    assert code in (0, 2), err
    return code, json.loads(out.read_text())["devices"][0]


def _round_trip(capsys, tmp_path, device: str) -> None:
    bundle = tmp_path / "att.aegis"
    code, _, err = run_cli(capsys, "scan", "-q", "--device", device, "--workload", TINY, "--probes", "attention",
                           "--case", CASE, "--reruns", "1", "--inject", FAULT, "--save-vtasks", str(bundle),
                           "--format", "json", "--output", str(tmp_path / "scan.json"))
    assert code == 2, err  # FAULTY: the injected dV accumulator fault, confirmed
    scan = json.loads((tmp_path / "scan.json").read_text())["devices"][0]
    assert {e["check"] for e in scan["evidence"]} >= {"attention.dv_colsum"}
    ev = scan["evidence"][0]
    assert ev["injected"] and ev["injected"][-1]["stage"] == "dv"
    if device.startswith("cuda"):
        assert ev["kernel"].endswith("attention_bwd+inject")  # the kernels' AEGIS_INJECT build did it

    code, dev = _replay(capsys, bundle, device, tmp_path / "with.json", "--inject", FAULT)
    assert code == 2 and dev["verdict"] == "FAULTY"
    (out,) = dev["probes"]["replay"]["outcomes"]
    assert out["kind"] == "attention" and out["outcome"] == "reproduced" and out["matches_capture"] is True
    assert "attention.dv_colsum" in out["checks_fired"]

    code, dev = _replay(capsys, bundle, device, tmp_path / "without.json")
    assert code == 0 and dev["verdict"] == "HEALTHY"
    (out,) = dev["probes"]["replay"]["outcomes"]
    assert out["outcome"] == "not_reproduced" and out["matches_capture"] is False and out["checks_fired"] == []


def test_scan_saves_and_replay_reproduces_on_the_cpu(capsys, tmp_path):
    _round_trip(capsys, tmp_path, "cpu:0")


@pytest.mark.gpu
def test_scan_saves_and_replay_reproduces_on_the_gpu(capsys, tmp_path):
    _round_trip(capsys, tmp_path, "cuda:0")
