"""probes/__init__.py: every probe registers itself (the gemm probe too) with its own preflight,
and reads a ProbeConfig, not the scan's options."""

from __future__ import annotations

import dataclasses

import pytest

from aegis_cli import probes
from aegis_cli.backends import resolve_devices
from aegis_cli.ops.errors import ConfigError
from aegis_cli.probes import gemm_scan, workload_for
from aegis_cli.scan import ScanOptions, count_cases, preflight
from tests.helpers import TINY


def test_every_probe_registers_itself_with_its_preflight():
    probes.load_all()
    assert {"gemm", "determinism", "pow2", "memory", "golden"} <= set(probes.PROBES) and "crossdevice" in probes.NODE_PROBES
    assert {"gemm", "memory", "crossdevice", "golden"} <= set(probes.PREFLIGHTS)
    assert probes.PROBES["gemm"] is gemm_scan.gemm_probe and set(probes.CASE_COUNTS) == {"gemm", "attention"}


def test_scan_options_hand_the_probes_a_frozen_copy_of_what_they_read():
    opts = ScanOptions(seed=7, reruns=2, case="pow2/x", workload=TINY, probe_options={"memory.mb": "4"}, keep_flagged=True)
    config = opts.probe_config()
    assert (config.seed, config.reruns, config.case, config.workload, config.keep_flagged) == (7, 2, "pow2/x", TINY, True)
    assert config.probe_options == {"memory.mb": "4"} and config.thresholds == opts.thresholds
    opts.probe_options["memory.mb"] = "8"  # the CLI fills the scan's dict; the probes keep what they were given
    assert config.probe_options == {"memory.mb": "4"}
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.seed = 1  # type: ignore[misc]
    ctx = probes.ProbeContext(config=config, fault=None, progress=lambda *a, **k: None)
    assert ctx.option("memory", "mb") == 4 and ctx.case_part("pow2") == "x" and ctx.case_part("memory") is None


def test_preflights_run_in_the_order_of_the_selected_probes(monkeypatch):
    devices = resolve_devices("cpu:0")
    seen = []
    for name in ("gemm", "memory"):
        monkeypatch.setitem(probes.PREFLIGHTS, name, lambda devs, ctx, name=name: seen.append((name, ctx.config.seed, len(devs))))
    preflight(ScanOptions(probes=("memory", "pow2", "gemm"), seed=3), devices)
    assert seen == [("memory", 3, 1), ("gemm", 3, 1)]


def test_gemm_preflight_refuses_a_case_the_workload_lacks_and_counts_cases():
    devices = resolve_devices("cpu:0")
    opts = ScanOptions(workload=TINY, probes=("gemm", "pow2"))
    wl = workload_for(opts.probe_config(), devices[0])
    assert count_cases(opts, devices) == len(gemm_scan.plan_cases(wl, 0)) * len(wl.scan.scales)
    with pytest.raises(ConfigError, match="is not in workload"):
        preflight(dataclasses.replace(opts, case=f"{wl.name}/nope/fwd/normal/1x1x1/s+0+0"), devices)
    assert count_cases(ScanOptions(workload=TINY, probes=("pow2",)), devices) == 0  # only gemm counts cases


def test_workload_for_reads_a_catalog_once_and_gives_each_caller_its_own_copy(monkeypatch, tmp_path):
    from aegis_cli.ops import paths, workloads

    path = tmp_path / "wl.yaml"
    path.write_text((paths.catalog_dir() / "cpu-quick.yaml").read_text().replace("name: cpu-quick", "name: mine"))
    reads = []
    real = workloads.load
    monkeypatch.setattr(workloads, "load", lambda name: reads.append(name) or real(name))
    (dev,) = resolve_devices("cpu:0")
    config = ScanOptions(workload=str(path)).probe_config()
    first = workload_for(config, dev)
    first.scan.distributions.append("uniform")  # a caller's change stays its own
    second = workload_for(config, dev)
    assert reads == [str(path)] and second.name == "mine" and second.scan.distributions == ["normal", "uniform", "heavy"]
    path.write_text(path.read_text().replace("seq_len: 192", "seq_len: 96"))  # an edited file is read again
    assert workload_for(config, dev).model.seq_len == 96 and len(reads) == 2
