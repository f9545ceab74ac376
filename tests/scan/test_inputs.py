"""Scan inputs are checked before any work and outputs land as an ordinary write would put
them: exact re-run commands, case ids, probe-option ranges, --inject devices, output targets
and modes, YAML values (the CLI review's findings)."""

from __future__ import annotations

import json
import os
import shlex
import stat

import pytest

from aegis_cli import scan as scan_mod
from aegis_cli.backends.cpu import CpuDevice
from aegis_cli.ops import files
from aegis_cli.ops.errors import ConfigError, ExitCode, OutputError
from tests.helpers import TINY, run_cli


def _one_error_line(code: int, out: str, err: str) -> str:
    lines = [x for x in err.strip().splitlines() if x.strip()]
    assert code == ExitCode.UNKNOWN and out == "" and len(lines) == 1, err
    assert lines[0].startswith("Error:") and "internal error" not in lines[0], err
    return lines[0]


def _no_work(monkeypatch) -> None:
    def no_work(*_a, **_k):
        raise AssertionError("work started before the input was checked")

    monkeypatch.setattr(scan_mod, "resolve_devices", no_work)


def _rerun_lines(out: str) -> list[list[str]]:
    """The printed re-run commands, as argv (env assignments first)."""
    return [shlex.split(line.split("Re-run one case:", 1)[1]) for line in out.splitlines() if "Re-run one case:" in line]


# -- A: the re-run command reproduces the run ----------------------------------------------
def test_rerun_command_reproduces_the_case_exactly(capsys):
    """It left out --device, probe options and --inject, printed a CASE_ID placeholder and
    rounded --threshold with :g (1.2345678e-06 came back as 1.23457e-06)."""
    argv = ["--workload", TINY, "--seed", "7", "--threshold", "1.2345678e-06", "--confirm-margin", "1.0000001",
            "--reruns", "2", "--probes", "gemm", "--inject", "bitflip:bit=exp,seed=3"]
    code, table, _ = run_cli(capsys, "scan", *argv)
    assert code == ExitCode.FAULTY
    code, out, _ = run_cli(capsys, "scan", "-q", *argv, "--format", "json")
    doc = json.loads(out)
    first = doc["devices"][0]["evidence"][0]
    (cmd,) = _rerun_lines(table)
    assert cmd[:2] == ["aegis", "scan"] and cmd[cmd.index("--case") + 1] == first["case_id"]
    for opt, value in (("--seed", "7"), ("--device", "cpu:0"), ("--threshold", "1.2345678e-06"),
                       ("--confirm-margin", "1.0000001"), ("--reruns", "2"), ("--inject", "bitflip:bit=exp,seed=3")):
        assert cmd[cmd.index(opt) + 1] == value, cmd
    code, out, _ = run_cli(capsys, *cmd[1:], "-q", "--format", "json")
    again = json.loads(out)
    assert code == ExitCode.FAULTY
    assert again["options"]["threshold"] == doc["options"]["threshold"] == 1.2345678e-06
    (ev,) = [e for e in again["devices"][0]["evidence"] if e["check"] == first["check"]]
    assert (ev["case_id"], ev["localised"], ev["max_value"]) == (first["case_id"], first["localised"], first["max_value"])


def test_rerun_command_keeps_probe_options_and_simulated_devices(capsys, monkeypatch):
    """A determinism case on the third simulated CPU: the command needs AEGIS_CPU_DEVICES, the
    device and the probe's options, and the report records the probe options."""
    monkeypatch.setenv("AEGIS_CPU_DEVICES", "3")
    argv = ["--device", "cpu", "--probes", "determinism", "--probe-option", "determinism.only=gelu",
            "--probe-option", "determinism.runs=5", "--inject", "memflip:op=gelu/run1,device=cpu:2"]
    code, table, _ = run_cli(capsys, "scan", *argv)
    assert code == ExitCode.FAULTY
    (cmd,) = _rerun_lines(table)
    assert cmd[0] == "AEGIS_CPU_DEVICES=3" and cmd[cmd.index("--device") + 1] == "cpu:2"
    assert cmd[cmd.index("--case") + 1] == "determinism/gelu/64x384"
    assert {cmd[i + 1] for i, a in enumerate(cmd) if a == "--probe-option"} == {"determinism.only=gelu", "determinism.runs=5"}
    code, out, _ = run_cli(capsys, *cmd[2:], "-q", "--format", "json")
    doc = json.loads(out)
    assert code == ExitCode.FAULTY and doc["options"]["probe_options"] == {"determinism.only": "gelu", "determinism.runs": "5"}
    (dev,) = doc["devices"]
    assert dev["device"]["id"] == "cpu:2" and dev["probes"]["determinism"]["runs"] == 5
    assert [e["case_id"] for e in dev["evidence"]] == ["determinism/gelu/64x384"]


# -- B: case ids the probe does not have ----------------------------------------------------
@pytest.mark.parametrize(("case", "needle"), [
    ("memory/pass999", "the memory probe makes 1 pass(es) here (memory/pass0)"),
    ("memory/pass0/extra", "its cases: memory/passN, one per pass, and memory/nvml"),
    ("pow2/checked_gemm/garbage", "its cases: pow2/checked_gemm/64x96x128, pow2/matmul/64x96x128"),
    ("determinism/matmul/4096x4096x4096", "determinism/matmul/128x192x256"),  # a GPU shape on the CPU
    ("determinism/matmul", "the determinism probe has no such case on cpu:0"),
])
def test_unknown_probe_case_is_refused(capsys, case, needle):
    """These ran nothing (or all of a probe) and exited 0 HEALTHY."""
    code, out, err = run_cli(capsys, "scan", "-q", "--case", case)
    assert needle in _one_error_line(code, out, err)


def test_known_probe_cases_still_run(capsys):
    for case in ("pow2/matmul/64x96x128", "memory/pass0"):
        code, out, _ = run_cli(capsys, "scan", "-q", "--case", case, "--format", "json")
        assert code == ExitCode.HEALTHY, out
        probe = case.split("/")[0]
        assert set(json.loads(out)["devices"][0]["probes"]) == {probe}


# -- G, H: probe options and re-runs, range-checked before any work ------------------------
@pytest.mark.parametrize(("option", "needle"), [
    ("pow2.step=1000", "pow2.step='1000' must lie in 1…56"),
    ("memory.fraction=5", "memory.fraction='5' must lie in 0.01…0.99"),
    ("memory.fraction=1e-9", "must lie in 0.01…0.99"),  # covered 0 bytes and said HEALTHY
    ("determinism.runs=1", "determinism.runs='1' must lie in 2…1000"),
    ("determinism.runs=100000", "determinism.runs='100000' must lie in 2…1000"),
    ("determinism.only=bogus", "unknown: bogus"),
    ("crossdevice.only=,", "must name at least one computation"),
])
def test_probe_option_ranges_checked_before_any_work(capsys, monkeypatch, option, needle):
    """pow2.step=1000 failed only when pow2's turn came, after the GEMM probe had run."""
    _no_work(monkeypatch)
    code, out, err = run_cli(capsys, "scan", "-q", "--probe-option", option)
    assert needle in _one_error_line(code, out, err)


def test_reruns_capped(capsys, monkeypatch):
    _no_work(monkeypatch)
    code, out, err = run_cli(capsys, "scan", "-q", "--reruns", "1001")
    assert "--reruns must lie in 1…1000, got 1001" in _one_error_line(code, out, err)
    from aegis_cli.fleet.config import SweepConfig

    with pytest.raises(ConfigError, match="reruns must lie in 1…1000"):
        SweepConfig(reruns=10**6)


# -- I: --inject aimed at nothing -------------------------------------------------------------
@pytest.mark.parametrize("target", ["cuda:9", "cpu:5"])
def test_inject_at_a_device_not_scanned_is_refused(capsys, monkeypatch, target):
    """It was a silent no-op: HEALTHY with fault_injected true."""
    code, out, err = run_cli(capsys, "scan", "-q", "--probes", "gemm", "--workload", TINY, "--inject", f"bitflip:device={target}")
    line = _one_error_line(code, out, err)
    assert f"device={target} is not scanned (scanned: cpu:0)" in line


def test_inject_that_never_fires_is_reported(capsys):
    code, out, err = run_cli(capsys, "scan", "-q", "--probes", "gemm", "--workload", TINY, "--format", "json",
                             "--inject", "bitflip:op=no-such-op")
    doc = json.loads(out)
    assert code == ExitCode.HEALTHY and doc["injected_never_fired"] == ["bitflip:op=no-such-op"]
    assert "never fired" in err
    code, out, err = run_cli(capsys, "scan", "-q", "--probes", "gemm", "--workload", TINY, "--format", "json", "--reruns", "1",
                             "--inject", "bitflip:op=no-such-op;bitflip:bit=exp")
    assert code == ExitCode.FAULTY and json.loads(out)["injected_never_fired"] == ["bitflip:op=no-such-op"]


# -- J: AEGIS_CPU_DEVICES ---------------------------------------------------------------------
@pytest.mark.parametrize("value", ["0", "-3", "abc"])
def test_cpu_devices_must_be_positive(capsys, monkeypatch, value):
    monkeypatch.setenv("AEGIS_CPU_DEVICES", value)
    code, out, err = run_cli(capsys, "scan", "-q", "--workload", TINY)
    assert f"AEGIS_CPU_DEVICES='{value}' is not a positive integer" in _one_error_line(code, out, err)


# -- K: memory.mb against the memory available -------------------------------------------------
def test_memory_buffer_larger_than_available_is_refused_before_any_work(capsys, monkeypatch):
    """memory.mb took up to 1 TiB unchecked: the allocation failed (device ERROR) or the OOM
    killer ended the scan."""
    monkeypatch.setattr(CpuDevice, "memory_free", lambda self: 16 << 20)
    from aegis_cli import probes

    probes.load_all()
    gemm_ran = []
    monkeypatch.setitem(probes.PROBES, "gemm", lambda *a: gemm_ran.append(1) or [])
    code, out, err = run_cli(capsys, "scan", "-q", "--workload", TINY, "--probes", "gemm,memory")
    assert "a 32 MiB buffer (memory.mb) does not fit in the 16 MiB available on cpu:0" in _one_error_line(code, out, err)
    assert not gemm_ran
    monkeypatch.setattr(CpuDevice, "memory_free", lambda self: 64 << 20)
    code, _, _ = run_cli(capsys, "scan", "-q", "--probes", "memory", "--probe-option", "memory.hold=0")
    assert code == ExitCode.HEALTHY


# -- L: --save-vtasks checks the cases that will run --------------------------------------------
@pytest.mark.parametrize("extra", [("--probe-option", "gemm.shift=-2,2"), ("--case", "/mlp_down/fwd/normal/160x256x512/s-10+10")])
def test_save_vtasks_checks_the_scales_that_will_run(extra, tmp_path, monkeypatch, capsys):
    """It checked the workload's own scales: ids at a scale moved by gemm.shift, or at a --case's
    scale outside the grid, that no bundle could hold were found only when saving, after the scan."""
    from pathlib import Path

    from aegis_cli.vtask.capture import LONGEST_CHECK
    from tests.helpers import TINY

    # the longest vTask id at tiny's scales (s-8+8) is 256 characters, the most a bundle holds;
    # at s-10+10 it is two more
    name = "w" * (256 - len(f"cpu:0//mlp_down/fwd/normal/160x256x512/s-8+8/{LONGEST_CHECK}"))
    (tmp_path / "wl.yaml").write_text(Path(TINY).read_text().replace("name: tiny", f"name: {name}"))
    started: list[str] = []

    def no_scan(device, *_a):
        started.append(device.identity.id)
        raise RuntimeError("stop here")

    monkeypatch.setattr(scan_mod, "scan_device", no_scan)
    scan = ["scan", "-q", "--device", "cpu", "--probes", "gemm", "--workload", str(tmp_path / "wl.yaml"), "--save-vtasks",
            str(tmp_path / "b.aegis"), "--format", "json"]
    code, out, err = run_cli(capsys, *scan, extra[0], name + extra[1] if extra[0] == "--case" else extra[1])
    assert "gives vTask ids like" in _one_error_line(code, out, err) and not started
    run_cli(capsys, *scan)
    assert started == ["cpu:0"]  # at the workload's own scales its ids fit: the scan starts


# -- C, D: output targets and modes ------------------------------------------------------------
@pytest.mark.parametrize("kind", ["symlink", "fifo"])
def test_output_over_a_symlink_or_special_file_is_refused(capsys, monkeypatch, tmp_path, kind):
    """-o replaced whatever was there with a regular file: as root, -o /dev/null broke /dev/null."""
    _no_work(monkeypatch)
    target = tmp_path / "out.json"
    real = tmp_path / "real.json"
    if kind == "symlink":
        real.write_text("keep")
        target.symlink_to(real)
    else:
        os.mkfifo(target)
    code, out, err = run_cli(capsys, "scan", "-q", "--format", "json", "-o", str(target))
    line = _one_error_line(code, out, err)
    assert line.startswith(f"Error: cannot write {target}:")
    if kind == "symlink":
        assert "symbolic link" in line and target.is_symlink() and real.read_text() == "keep"
    else:
        assert "not a regular file" in line and stat.S_ISFIFO(target.lstat().st_mode)
    with pytest.raises(OutputError):  # and the writer itself, which other outputs use directly
        files.atomic_write(target, "x")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["out.json"] + (["real.json"] if kind == "symlink" else []))


def test_output_mode_is_that_of_an_ordinary_write(tmp_path):
    """Every output came out 0600 (mkstemp's mode), even replacing a 0644 file."""
    old = os.umask(0o022)
    try:
        fresh = tmp_path / "new.prom"
        files.atomic_write(fresh, "a\n")
        assert stat.S_IMODE(fresh.stat().st_mode) == 0o644
        kept = tmp_path / "kept.prom"
        for mode in (0o644, 0o640):
            kept.write_text("old\n")
            kept.chmod(mode)
            files.atomic_write(kept, b"new\n")
            assert stat.S_IMODE(kept.stat().st_mode) == mode and kept.read_text() == "new\n"
        os.umask(0o077)
        private = tmp_path / "private.json"
        files.atomic_write(private, "{}")
        assert stat.S_IMODE(private.stat().st_mode) == 0o600
    finally:
        os.umask(old)


# -- E, F: YAML values -------------------------------------------------------------------------
BASE = "name: t\nmodel: {hidden: 256, ffn: 512, heads: 4, kv_heads: 2, seq_len: 64}\n"


def test_empty_yaml_value_reads_as_null(tmp_path):
    """`key:` with no value gave "malformed YAML: while parsing a block node", no key, no line."""
    from aegis_cli.ops import workloads

    p = tmp_path / "w.yaml"
    p.write_text(BASE + "description:\n")
    with pytest.raises(ConfigError, match=r"line 3: description must be str, got null$"):
        workloads.load(str(p))
    p.write_text(BASE + "scan:\n  max_tokens:\n")  # an optional key: empty is null, accepted
    assert workloads.load(str(p)).scan.max_tokens is None


def test_type_errors_name_yaml_types(tmp_path):
    from aegis_cli.ops import workloads

    p = tmp_path / "w.yaml"
    for text, msg in ((BASE + "scan: {scales: [{a: 1}]}\n", "scales must be a list, got a mapping"),
                      (BASE + "scan: {scales: {a: 1}}\n", "scales must be a list, got a mapping"),
                      (BASE + "description: [a]\n", "description must be str, got a list"),
                      (BASE + "scan: [1]\n", "expected a mapping for ScanPlan, got a list")):
        p.write_text(text)
        with pytest.raises(ConfigError, match=msg) as exc:
            workloads.load(str(p))
        assert "Located" not in str(exc.value)
