"""The sweep's ``soak:`` option: each worker runs the burn-in after its probes, and its section
and verdict join the device's report; a bad or too long duration is refused before any work."""

from __future__ import annotations

import json
import subprocess

import pytest

from aegis_cli.fleet.config import load_config
from aegis_cli.ops.errors import ConfigError
from tests.fleet_helpers import WORKLOAD, aegis, env, write_config


def test_sweep_soaks_each_device_after_its_probes(tmp_path):
    cfg = write_config(tmp_path, soak="1s", inject="bitflip:target=acc,bit=exp,device=cpu:1")
    p = subprocess.run(aegis("sweep", "--config", str(cfg), "--format", "json"), env=env(2), capture_output=True, text=True,
                       timeout=120, cwd=tmp_path)
    doc = json.loads(p.stdout)
    assert p.returncode == 2, p.stderr
    assert doc["sweep"]["soak"] == "1s"
    by = {d["device"]["id"]: d for d in doc["devices"]}
    assert by["cpu:0"]["verdict"] == "HEALTHY" and by["cpu:0"]["soak"]["launches"] > 0
    bad = by["cpu:1"]["soak"]["failures"]
    assert by["cpu:1"]["verdict"] == "FAULTY" and bad["launches"] == bad["of"] > 0  # a permanent fault fails every launch


def test_fail_fast_skips_the_burn_in_of_a_stopped_device(tmp_path):
    """A sweep worker with fail_fast: a device its probes stopped at a confirmed FAULTY runs no
    burn-in after them, and says so; a healthy one does."""
    from aegis_cli.fleet import worker

    (tmp_path / "wl.yaml").write_text(WORKLOAD, encoding="utf-8")
    spec = {"device": "cpu:0", "workload": str(tmp_path / "wl.yaml"), "seed": 0, "reruns": 2, "probes": ["gemm"], "fail_fast": True,
            "soak": "1s", "fingerprint_cases": 0, "output": str(tmp_path / "w.json")}
    bad = worker.run({**spec, "inject": "bitflip:target=acc,bit=exp"})
    assert bad["verdict"] == "FAULTY" and not bad.get("soak")
    assert bad["confirmation"]["fail_fast"]["skipped_probes"] == ["soak"]
    good = worker.run(spec)
    assert good["verdict"] == "HEALTHY" and good["soak"]["launches"] > 0


@pytest.mark.parametrize(("soak", "needle"), [("soon", "soak: 'soon': give a duration"), ("30s", "leaves no time for the probes")])
def test_sweep_refuses_a_bad_soak(tmp_path, soak, needle):
    with pytest.raises(ConfigError, match=needle):
        load_config(write_config(tmp_path, soak=soak))
