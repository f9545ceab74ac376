"""The sweep's ``soak:`` option: each worker runs the burn-in after its probes, and its section
and verdict join the device's report; a bad or too long duration is refused before any work."""

from __future__ import annotations

import json
import subprocess

import pytest

from aegis_cli.fleet.config import load_config
from aegis_cli.ops.errors import ConfigError
from tests.fleet_helpers import aegis, env, write_config


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
    cfg = write_config(tmp_path, soak="1s", fail_fast=True, inject="bitflip:target=acc,bit=exp,device=cpu:1")
    p = subprocess.run(aegis("sweep", "--config", str(cfg), "--format", "json"), env=env(2), capture_output=True, text=True,
                       timeout=120, cwd=tmp_path)
    by = {d["device"]["id"]: d for d in json.loads(p.stdout)["devices"]}
    assert p.returncode == 2, p.stderr
    assert by["cpu:0"]["soak"]["launches"] > 0
    assert by["cpu:1"]["verdict"] == "FAULTY" and not by["cpu:1"].get("soak")
    assert "soak" in by["cpu:1"]["confirmation"]["fail_fast"]["skipped_probes"]


@pytest.mark.parametrize(("soak", "needle"), [("soon", "soak: 'soon': give a duration"), ("30s", "leaves no time for the probes")])
def test_sweep_refuses_a_bad_soak(tmp_path, soak, needle):
    with pytest.raises(ConfigError, match=needle):
        load_config(write_config(tmp_path, soak=soak))
