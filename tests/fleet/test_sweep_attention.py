"""`aegis sweep` with its default probes (no `probes:` key) runs the attention probe and stays
HEALTHY: on the CPU with a tiny workload, and (GPU tier) on a GPU with the default GPU workload
(llama3-70b TP=8 shapes, attention at sequence 8192)."""

from __future__ import annotations

import json
import subprocess

import pytest

from aegis_cli.fleet.config import SweepConfig
from tests.fleet_helpers import aegis, env, write_config


def _sweep(tmp, timeout: float, **over) -> dict:
    cfg = write_config(tmp, fingerprint_cases=0, **over)
    p = subprocess.run(aegis("sweep", "--config", str(cfg), "--format", "none"), env=env(1), capture_output=True,
                       text=True, timeout=timeout, cwd=tmp)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads((tmp / "report.json").read_text())


def _healthy_with_attention(doc: dict) -> dict:
    (dev,) = doc["devices"]
    assert dev["verdict"] == "HEALTHY" and not dev["evidence"]
    att = dev["probes"]["attention"]
    assert att["cases"] >= 1 and att["runs"] >= att["cases"] and att["clean_ratio"] < 1.0
    return att


def test_default_probes_include_attention():
    assert "attention" in SweepConfig().probes


def test_cpu_sweep_runs_attention_by_default(tmp_path):
    att = _healthy_with_attention(_sweep(tmp_path, 120))
    assert att["shape"]["workload"] == "fleet-tiny"


@pytest.mark.gpu
def test_gpu_sweep_runs_attention_by_default(tmp_path):
    doc = _sweep(tmp_path, 400, devices="cuda:0", workload=None, budget_seconds=360, device_timeout_seconds=300)
    att = _healthy_with_attention(doc)
    assert att["shape"]["workload"] == "llama3-70b" and att["shape"]["token"] == "b1h8k1s8192d128c"
