"""The CLI contract: exit codes, one-line errors, formats, atomic output."""

from __future__ import annotations

import csv
import io
import json
import os
import subprocess
import sys

import pytest

from aegis_cli import scan as scan_mod
from aegis_cli.backends.cpu import CpuDevice
from aegis_cli.ops.errors import ExitCode
from tests.helpers import DATA, TINY, run_cli

REPO = DATA.parent.parent


def _one_error_line(code: int, out: str, err: str) -> str:
    """Bad input: exit 3, nothing on stdout, exactly one line on stderr (returned)."""
    lines = [x for x in err.strip().splitlines() if x.strip()]
    assert code == ExitCode.UNKNOWN and out == "" and len(lines) == 1, err
    return lines[0]


def test_scan_default_is_healthy(capsys):
    code, out, _ = run_cli(capsys, "scan", "-q")
    assert code == ExitCode.HEALTHY
    assert "HEALTHY" in out and "cpu:0" in out


def test_python_dash_m_entry_point():
    r = subprocess.run([sys.executable, "-m", "aegis_cli", "scan", "-q", "--workload", TINY, "--format", "json"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["devices"][0]["verdict"] == "HEALTHY"


def test_injected_fault_exits_faulty_and_says_so(capsys):
    code, out, err = run_cli(capsys, "scan", "-q", "--workload", TINY, "--inject", "bitflip:bit=exp")
    assert code == ExitCode.FAULTY
    assert "FAULTY" in out
    assert "FAULT INJECTION ACTIVE" in err
    assert "FAULTS INJECTED ON PURPOSE" in out


def test_suspect_exit_code(capsys):
    # a reproducible flag below the confirmation margin is SUSPECT: make every flag "small"
    code, _, _ = run_cli(capsys, "scan", "-q", "--workload", TINY, "--inject", "bitflip:bit=exp", "--confirm-margin", "1e12")
    # nonfinite/pow2 checks are rigorous and stay FAULTY; use a finite, checksum-only fault instead
    assert code in (ExitCode.FAULTY, ExitCode.SUSPECT)
    code, out, _ = run_cli(capsys, "scan", "-q", "--workload", TINY, "--inject", "tile:mode=skipk,tile=0.0", "--confirm-margin", "1e12", "--probes", "gemm")
    assert code == ExitCode.SUSPECT, out
    assert "SUSPECT" in out


def test_device_error_is_error_verdict_exit_3(capsys, monkeypatch):
    class Broken(CpuDevice):
        def checked_gemm(self, *a, **k):
            raise RuntimeError("simulated driver failure: illegal memory access")

    monkeypatch.setattr(scan_mod, "resolve_devices", lambda spec: [Broken(0)])
    code, out, _ = run_cli(capsys, "scan", "-q", "--workload", TINY, "--format", "json")
    assert code == ExitCode.UNKNOWN
    dev = json.loads(out)["devices"][0]
    assert dev["verdict"] == "ERROR" and "illegal memory access" in dev["error"]


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["scan", "--inject", "nonsense"], "unknown fault model"),
        (["scan", "--inject", "bitflip:bit=99"], "bit=99"),
        (["scan", "--inject", "tile:mode=melt"], "mode must be one of"),
        # an empty spec (an unset $SPEC in a script) ran without faults, no banner, HEALTHY, exit 0
        (["scan", "--inject", ""], "empty fault spec"),
        (["replay", "/nonexistent.aegis", "--inject", ""], "empty fault spec"),
        (["scan", "--workload", "no-such-model"], "unknown workload 'no-such-model'"),
        (["scan", "--workload", str(DATA / "bad_unknown_key.yaml")], "unknown key 'hiden'"),
        (["scan", "--workload", str(DATA / "bad_syntax.yaml")], "malformed YAML"),
        (["scan", "--workload", str(DATA / "too_big.yaml")], "GiB on cpu:0, which has"),
        (["scan", "--workload", "/dev/zero"], "/dev/zero: is not a regular file"),  # read forever, before
        (["scan", "--golden", "/dev/zero"], "golden file /dev/zero: is not a regular file"),
        (["report", "/dev/zero"], "/dev/zero: is not a regular file"),
        (["sweep", "--config", "/dev/zero"], "/dev/zero: is not a regular file"),
        (["scan", "--device", "gpu7"], "unknown device 'gpu7'"),
        (["scan", "--device", "cpu:\u00b2"], "unknown device 'cpu:\u00b2'"),  # isdigit() but not int(): was a traceback, exit 1
        (["scan", "--device", "cpu:9"], "no device cpu:9"),
        (["scan", "--device", "cuda:0"], "cuda"),
        (["scan", "--no-such-option"], "No such option"),
        (["scan", "--reruns", "0"], "--reruns"),
        (["scan", "--format", "xml"], "xml"),
        (["scan", "--probes", "bogus"], "unknown probe"),
        (["scan", "--case", "cpu-quick/nope/fwd/normal/1x1x1/s+0+0"], "is not in workload"),
        # a case at a scale beyond the catalog's runs (a burn-in launch, aegis scan --soak), unless
        # scaling is not exact there; one without a scale ran nothing and said HEALTHY
        (["scan", "--case", "cpu-quick/qkv/fwd/normal/192x384x256/s+300+0"], "out of the range where power-of-two scaling is exact"),
        (["scan", "--case", "cpu-quick/qkv/fwd/normal/192x384x256/sXYZ"], "names no scale"),
        (["scan", "--case", "pow2/nosuchimpl/64x96x128"], "the pow2 probe has no such case on cpu:0"),
        (["scan", "--case", "memory/bogus"], "the memory probe has no such case"),
        (["scan", "--probes", ""], "no probes to run"),  # was HEALTHY with nothing checked
        (["scan", "--probes", ","], "no probes to run"),
        (["scan", "--case", "golden/checked_gemm"], "give it with --golden FILE"),
        # a seed a vTask bundle cannot record, or one that aliases another seed's inputs
        (["scan", "--seed", "-1"], "seed must be an integer in 0…2147483647, got -1"),
        (["scan", "--seed", "2147483648"], "got 2147483648"),
        (["golden", "record", "--seed", "-5", "-o", "/tmp/never-written.json"], "seed must be an integer"),
        (["scan", "--confirm-margin", "0.5"], "confirm margin must lie in 1…1e12"),
        (["scan", "--confirm-margin", "nan"], "confirm margin must lie in 1…1e12"),
        # probe options that would check nothing (HEALTHY over 0 bytes) or never finish
        (["scan", "--probes", "memory", "--probe-option", "memory.passes=-1"], "memory.passes='-1' must lie in 0…1000"),
        (["scan", "--probes", "memory", "--probe-option", "memory.mb=-1"], "must lie in 0…1048576"),
        (["scan", "--probes", "memory", "--probe-option", "memory.hold=inf"], "must lie in -1…3600"),
        (["frobnicate"], "No such command"),
    ],
)
def test_bad_input_one_line_exit_3(capsys, argv, needle):
    code, out, err = run_cli(capsys, *argv)
    assert code == ExitCode.UNKNOWN
    lines = [x for x in err.strip().splitlines() if x.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("Error:")
    assert needle in err
    assert "Traceback" not in err and out == ""


def test_fault_survives_a_later_probe_error(capsys, monkeypatch):
    """Confirmed corruption found by one probe is kept (FAULTY, exit 2, its evidence) when a later
    probe on the same device fails; the failure is recorded beside it."""
    from aegis_cli import probes
    from aegis_cli.ops.errors import DeviceError

    probes.load_all()

    def broken(device, ctx):
        raise DeviceError("simulated driver failure in a later probe")

    monkeypatch.setitem(probes.PROBES, "memory", broken)
    code, out, _ = run_cli(capsys, "scan", "-q", "--workload", TINY, "--probes", "gemm,memory", "--reruns", "1",
                           "--inject", "bitflip:bit=30,row=3,col=5", "--format", "json")
    dev = json.loads(out)["devices"][0]
    assert code == ExitCode.FAULTY and dev["verdict"] == "FAULTY"
    assert dev["evidence"] and "simulated driver failure" in dev["error"]


def test_unexpected_exception_is_one_line_exit_3(capsys, monkeypatch):
    """A bug of ours must not exit 1 (SUSPECT) with a traceback: one line, exit 3; --debug shows it."""
    def boom(*_a, **_k):
        raise ValueError("simulated bug\nsecond line")

    monkeypatch.setattr(scan_mod, "resolve_devices", boom)
    code, out, err = run_cli(capsys, "scan", "-q", "--workload", TINY)
    assert code == ExitCode.UNKNOWN and out == ""
    lines = [x for x in err.strip().splitlines() if x.strip()]
    assert len(lines) == 1 and "internal error: ValueError: simulated bug second line" in lines[0], err
    code, _, err = run_cli(capsys, "--debug", "scan", "-q", "--workload", TINY)
    assert code == ExitCode.UNKNOWN and "Traceback" in err


def test_debug_shows_traceback(capsys):
    code, _, err = run_cli(capsys, "--debug", "scan", "--workload", "no-such-model")
    assert code == ExitCode.UNKNOWN
    assert "Traceback" in err


@pytest.mark.parametrize("fmt", ["json", "csv", "prom", "table"])
def test_output_formats_written_atomically(capsys, tmp_path, fmt):
    target = tmp_path / f"report.{fmt}"
    code, out, _ = run_cli(capsys, "scan", "-q", "--workload", TINY, "--format", fmt, "--output", str(target))
    assert code == 0 and out == ""
    text = target.read_text()
    assert [p.name for p in tmp_path.iterdir()] == [target.name]  # no temp file left behind
    if fmt == "json":
        assert json.loads(text)["exit_code"] == 0
    elif fmt == "csv":
        rows = list(csv.DictReader(io.StringIO(text)))
        assert rows[0]["verdict"] == "HEALTHY" and rows[0]["device"] == "cpu:0"
    elif fmt == "prom":
        assert 'aegis_device_verdict{device="cpu:0"' in text
    else:
        assert "HEALTHY" in text


def test_bad_output_path_is_one_line(capsys, tmp_path):
    code, _, err = run_cli(capsys, "scan", "-q", "--workload", TINY, "--format", "json", "--output", str(tmp_path / "no" / "such" / "dir.json"))
    assert code == ExitCode.UNKNOWN
    assert err.startswith("Error:") and "cannot write" in err


def test_case_rerun_from_report(capsys):
    code, out, _ = run_cli(capsys, "scan", "-q", "--workload", TINY, "--inject", "bitflip:bit=exp,seed=3", "--format", "json")
    assert code == ExitCode.FAULTY
    ev = json.loads(out)["devices"][0]["evidence"][0]
    code, out, _ = run_cli(capsys, "scan", "-q", "--workload", TINY, "--inject", "bitflip:bit=exp,seed=3", "--format", "json",
                           "--seed", str(ev["seed"]), "--case", ev["case_id"])
    assert code == ExitCode.FAULTY
    again = json.loads(out)["devices"][0]["evidence"]
    assert {e["case_id"] for e in again} == {ev["case_id"]}
    assert again[0]["localised"] == ev["localised"]


def test_info_lists_backends_and_paths(capsys):
    code, out, _ = run_cli(capsys, "info", "--format", "json")
    assert code == 0
    doc = json.loads(out)
    assert {b["name"] for b in doc["backends"]} == {"cpu", "cuda"}
    assert "cpu-quick" in doc["workloads"]
    assert doc["paths"]["cupy kernel cache"]
    probes = {p["name"]: p for p in doc["probes"]}  # what --probes takes
    assert {"gemm", "memory", "pow2", "determinism", "crossdevice", "golden"} <= set(probes)
    assert probes["gemm"]["default"] and not probes["golden"]["default"] and "passes" in probes["memory"]["options"]
    code, out, _ = run_cli(capsys, "info")
    assert code == 0 and "backend cpu" in out and "probe gemm" in out


def test_import_touches_no_cuda():
    # counted beyond what `import torch` loads itself: a CUDA build of torch imports cuda.bindings
    code = ("import sys, torch; before = set(sys.modules); "
            "import aegis_cli, aegis_cli.cli, aegis_cli.scan, aegis_cli.backends, aegis_cli.backends.loader; "
            "import aegis_cli.probes; aegis_cli.probes.load_all(); "
            "bad = [m for m in set(sys.modules) - before if m.split('.')[0] in ('cupy', 'cuda', 'pynvml')]; "
            "assert not torch.cuda.is_initialized(); print(bad)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


def test_installed_package_reads_its_own_kernels_and_workloads(tmp_path):
    """Installed, the package's parent is site-packages, where another distribution may own a
    top-level ``kernels/`` (Hugging Face's ``kernels``) or ``workloads/``: aegis must read its
    own ``_data`` copies, and a checkout (recognised by pyproject.toml) its own folders."""
    import shutil

    site = tmp_path / "site-packages"
    shutil.copytree(REPO / "aegis_cli", site / "aegis_cli", ignore=shutil.ignore_patterns("__pycache__", "_data"))
    shutil.copytree(REPO / "kernels", site / "aegis_cli" / "_data" / "kernels")
    shutil.copytree(REPO / "workloads", site / "aegis_cli" / "_data" / "workloads")
    (site / "kernels").mkdir()
    (site / "kernels" / "__init__.py").write_text("")
    (site / "workloads").mkdir()
    code = ("from aegis_cli.backends import loader; from aegis_cli.ops import paths; "
            "print(paths.kernel_dir()); print(paths.catalog_dir()); print(sorted(loader.kernel_hashes()))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path,
                       env={**os.environ, "PYTHONPATH": str(site)})
    assert r.returncode == 0, r.stderr
    kdir, wdir, names = r.stdout.strip().splitlines()
    assert kdir == str(site / "aegis_cli" / "_data" / "kernels") and wdir == str(site / "aegis_cli" / "_data" / "workloads")
    assert "gemm_wgmma.cu" in names
    from aegis_cli.ops import paths

    assert paths.kernel_dir() == REPO / "kernels" and paths.catalog_dir() == REPO / "workloads"


def test_memory_preflight_names_the_largest_gemm(monkeypatch, capsys):
    """The estimate is compared with what the device reports: a device 'smaller' than one
    TINY case refuses it (and names it), one large enough runs it."""
    from aegis_cli.ops.workloads import load
    from aegis_cli.probes.gemm import case_bytes

    big = max(load(TINY).gemms(), key=lambda s: case_bytes(s.m, s.n, s.k))
    need = case_bytes(big.m, big.n, big.k)
    monkeypatch.setattr(CpuDevice, "memory_bytes", lambda self: need - 1)
    code, out, err = run_cli(capsys, "scan", "-q", "--workload", TINY, "--probes", "gemm")
    assert code == ExitCode.UNKNOWN and out == ""
    assert f"({big.op} {big.layout.value} {big.m}x{big.n}x{big.k}) needs about" in err
    monkeypatch.setattr(CpuDevice, "memory_bytes", lambda self: need)
    code, _, _ = run_cli(capsys, "scan", "-q", "--workload", TINY, "--probes", "gemm")
    assert code == ExitCode.HEALTHY


def test_memory_preflight_tells_busy_from_too_small(monkeypatch, capsys):
    """Memory other processes hold is not the device's fault: a scan that would not fit in what
    is free now says so (and what to do) instead of running out half-way and calling it ERROR."""
    from aegis_cli.ops.workloads import load
    from aegis_cli.probes.gemm import case_bytes

    big = max(load(TINY).gemms(), key=lambda s: case_bytes(s.m, s.n, s.k))
    need = case_bytes(big.m, big.n, big.k)
    monkeypatch.setattr(CpuDevice, "memory_bytes", lambda self: 64 * need)
    monkeypatch.setattr(CpuDevice, "memory_free", lambda self: need - 1)
    code, out, err = run_cli(capsys, "scan", "-q", "--workload", TINY, "--probes", "gemm")
    assert code == ExitCode.UNKNOWN and out == ""
    assert "free now (other processes hold the rest); run the scan when the device is idle" in err
    assert "lower scan.max_tokens" not in err and len(err.strip().splitlines()) == 1
    monkeypatch.setattr(CpuDevice, "memory_free", lambda self: need)
    code, _, _ = run_cli(capsys, "scan", "-q", "--workload", TINY, "--probes", "gemm")
    assert code == ExitCode.HEALTHY


def test_meminfo_available(tmp_path):
    from aegis_cli.backends.cpu import meminfo_available

    f = tmp_path / "meminfo"
    f.write_text("MemTotal:       16384000 kB\nMemFree:         1000 kB\nMemAvailable:    8192000 kB\n")
    assert meminfo_available(str(f)) == 8192000 * 1024
    f.write_text("MemTotal:       16384000 kB\n")  # a kernel before MemAvailable
    assert meminfo_available(str(f)) is None
    f.write_text("MemAvailable: lots kB\n")
    assert meminfo_available(str(f)) is None
    assert meminfo_available(str(tmp_path / "absent")) is None


@pytest.mark.parametrize(("kind", "needle"), [
    ("yaml", "malformed YAML: nested too deeply"),  # was "internal error: RecursionError"
    ("json", "not a JSON report (nested too deeply)"),
    ("fifo", "is not a regular file"),  # would block forever on open
    ("dir", "is a directory, not a file"),
])
def test_hostile_input_files_one_line_exit_3(tmp_path, capsys, kind, needle):
    import os

    path = tmp_path / f"input.{kind}"
    if kind == "yaml":
        path.write_text("a: " + "[" * 5000 + "]" * 5000 + "\n")
    elif kind == "json":
        path.write_text("[" * 100_000 + "]" * 100_000)
    elif kind == "fifo":
        os.mkfifo(path)
    else:
        path.mkdir()
    argv = ("scan", "-q", "--workload", str(path)) if kind in ("yaml", "dir") else ("report", str(path))
    code, out, err = run_cli(capsys, *argv)
    line = _one_error_line(code, out, err)
    assert needle in line and "internal error" not in line


@pytest.mark.parametrize("argv", [
    ("scan", "-q", "--output", "{bad}"),
    ("scan", "-q", "--save-vtasks", "{bad}"),
    ("replay", "{bundle}", "--output", "{bad}"),
    ("report", "{bundle}", "--output", "{bad}"),
    ("golden", "record", "--output", "{bad}"),
    ("scan", "-q", "--output", "{dir}"),
])
def test_unwritable_output_refused_before_any_work(tmp_path, capsys, monkeypatch, argv):
    """A typo in -o must not cost a finished scan: the path is checked before devices are touched."""
    def no_work(*_a, **_k):
        raise AssertionError("work started before the output path was checked")

    monkeypatch.setattr(scan_mod, "resolve_devices", no_work)
    monkeypatch.setattr("aegis_cli.backends.resolve_devices", no_work)
    bad = tmp_path / "missing" / "out.json"
    args = [a.format(bad=bad, dir=tmp_path, bundle=tmp_path / "unread.aegis") for a in argv]
    code, out, err = run_cli(capsys, *args)
    line = _one_error_line(code, out, err)
    assert line.startswith("Error: cannot write") and "internal error" not in line


_DEV = {"device": {"id": "cuda:0", "uuid": "GPU-1"}, "verdict": "HEALTHY"}


@pytest.mark.parametrize(("change", "needle"), [
    (lambda d: d["devices"][0]["device"].update(uuid=123), "device.uuid must be a non-empty string"),
    (lambda d: d["devices"][0].update(verdict="BOGUS"), "verdict 'BOGUS' is not one of"),
    (lambda d: d["devices"][0].update(evidence="notalist"), "evidence must be a list of objects"),
    (lambda d: d["devices"][0].update(evidence=[{"severity": "BAD"}]), "evidence severity 'BAD' is not a verdict"),
    (lambda d: d["devices"][0].update(probes=[1, 2]), "probes and noise must be objects"),
    (lambda d: d["devices"][0].update(probes={"fleet_fingerprint": {"fingerprints": {"c": [1]}}}), "must hold a class string"),
    (lambda d: d.update(finished=5), "finished must be a string, got int"),
])
def test_report_merge_refuses_malformed_device_entries(tmp_path, capsys, change, needle):
    """Valid JSON with wrong types used to crash inside the merge ("internal error")."""
    doc = {"schema_version": "1.0", "kind": "scan", "devices": [json.loads(json.dumps(_DEV))]}
    change(doc)
    path = tmp_path / "r.json"
    path.write_text(json.dumps(doc))
    code, out, err = run_cli(capsys, "report", str(path))
    line = _one_error_line(code, out, err)
    assert needle in line and "internal error" not in line


def test_mig_slices_are_keyed_by_their_own_uuid(monkeypatch):
    """NVML's handle by PCI bus id is the whole GPU: under MIG every slice would get the parent's
    UUID and share one history. The slice's own UUID keys it; the parent's is kept beside."""
    import types

    from aegis_cli.backends import cuda_identity

    props = types.SimpleNamespace(pci_domain_id=0, pci_bus_id=6, pci_device_id=0, uuid="1a2b3c4d-0000-1111-2222-333344445555",
                                  name="NVIDIA H200 MIG 1g.18gb", major=9, minor=0, multi_processor_count=16, total_memory=18 << 30)
    monkeypatch.setattr(cuda_identity.torch.cuda, "get_device_properties", lambda i: props)
    monkeypatch.setattr(cuda_identity, "nvml_identity", lambda i, pci: {"uuid": "GPU-parent", "name": "NVIDIA H200", "mig": True})
    ident = cuda_identity.device_identity(0)
    assert ident.uuid == "MIG-1a2b3c4d-0000-1111-2222-333344445555" and ident.extra["parent_uuid"] == "GPU-parent"
    monkeypatch.setattr(cuda_identity, "nvml_identity", lambda i, pci: {"uuid": "GPU-whole", "name": "NVIDIA H200"})
    assert cuda_identity.device_identity(0).uuid == "GPU-whole" and "parent_uuid" not in cuda_identity.device_identity(0).extra


def test_mig_slices_are_not_named_as_the_whole_gpu(monkeypatch):
    """The name keys golden records, fleet fingerprint classes and cross-device groups. NVML's name
    under MIG is the parent's: a slice (fewer SMs, so torch's RNG and cuBLAS give other bits) matched
    whole-GPU records and was called FAULTY against them."""
    import types

    from aegis_cli.backends import cuda_identity

    props = types.SimpleNamespace(pci_domain_id=0, pci_bus_id=6, pci_device_id=0, uuid="1a2b3c4d-0000-1111-2222-333344445555",
                                  name="NVIDIA H200", major=9, minor=0, multi_processor_count=16, total_memory=18 << 30)
    monkeypatch.setattr(cuda_identity.torch.cuda, "get_device_properties", lambda i: props)
    monkeypatch.setattr(cuda_identity, "nvml_identity", lambda i, pci: {"uuid": "GPU-parent", "name": "NVIDIA H200", "mig": True})
    assert cuda_identity.device_identity(0).name == "NVIDIA H200 MIG 16 SMs"  # CUDA's name need not say MIG
    props.name = "NVIDIA H200 MIG 1g.18gb"
    assert cuda_identity.device_identity(0).name == "NVIDIA H200 MIG 1g.18gb"
    monkeypatch.setattr(cuda_identity, "nvml_identity", lambda i, pci: {"uuid": "GPU-whole", "name": "NVIDIA H200"})
    props.name, props.multi_processor_count = "NVIDIA H200", 132
    assert cuda_identity.device_identity(0).name == "NVIDIA H200"


def test_csv_keeps_an_infinite_margin(capsys):
    code, out, _ = run_cli(capsys, "scan", "-q", "--workload", TINY, "--probes", "gemm", "--reruns", "1", "--format", "csv",
                           "--inject", "tile:mode=stuck,value=3e38")
    (row,) = list(csv.DictReader(io.StringIO(out)))
    assert code == ExitCode.FAULTY and row["max_margin"] == "inf"


def test_repeated_probe_runs_once(capsys):
    code, out, _ = run_cli(capsys, "scan", "-q", "--workload", TINY, "--probes", "gemm,gemm", "--reruns", "1",
                           "--inject", "bitflip:bit=exp", "--format", "json")
    doc = json.loads(out)
    ev = doc["devices"][0]["evidence"]
    assert code == ExitCode.FAULTY and doc["options"]["probes"] == ["gemm"]
    assert len({(e["case_id"], e["check"]) for e in ev}) == len(ev)  # no finding reported twice


def test_perturb_fault_on_one_device_leaves_the_others_alone(capsys, monkeypatch):
    # the crossdevice and determinism probes run the checked GEMM too: a perturb fault needs a
    # clean median there as well (it raised, and the node probe's failure made every device ERROR)
    monkeypatch.setenv("AEGIS_CPU_DEVICES", "2")
    _, out, _ = run_cli(capsys, "scan", "-q", "--device", "cpu", "--workload", TINY, "--probes", "determinism,crossdevice",
                           "--probe-option", "determinism.only=checked_gemm", "--probe-option", "crossdevice.only=checked_gemm",
                           "--inject", "perturb:r=1e4,rate=1e-3,device=cpu:1", "--format", "json")
    v = {d["device"]["id"]: (d["verdict"], d["error"]) for d in json.loads(out)["devices"]}
    assert v["cpu:0"] == ("HEALTHY", None) and v["cpu:1"][1] is None, v


def test_shipped_catalog_wins_over_a_folder_of_that_name(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "cpu-quick").mkdir()  # a checkpoint folder, say
    code, _, err = run_cli(capsys, "scan", "-q", "--probes", "gemm", "--format", "csv")
    assert code == ExitCode.HEALTHY, err


def test_catalog_lists_without_repeats_and_names_unlike_probes(tmp_path):
    from aegis_cli.ops import workloads
    from aegis_cli.ops.errors import ConfigError

    text = (DATA / "tiny.yaml").read_text()
    dup = tmp_path / "dup.yaml"
    dup.write_text(text.replace("distributions: [normal]", "distributions: [normal, normal]"))
    assert "distributions: [normal, normal]" in dup.read_text()
    with pytest.raises(ConfigError, match=r"scan\.distributions: 'normal' is listed twice"):
        workloads.load(str(dup))
    probe = tmp_path / "memory.yaml"
    probe.write_text(text.replace("name: tiny", "name: memory"))
    with pytest.raises(ConfigError, match="also a probe's"):
        scan_mod.run_scan(scan_mod.ScanOptions(devices="cpu:0", workload=str(probe), probes=("gemm",)))


def test_rerun_hint_names_the_workload_and_thresholds(capsys):
    code, out, _ = run_cli(capsys, "scan", "--workload", TINY, "--seed", "5", "--threshold", "2e-6", "--probes", "gemm",
                           "--reruns", "1", "--inject", "bitflip:bit=exp")
    assert code == ExitCode.FAULTY
    assert (f"aegis scan --seed 5 --device cpu:0 --workload {TINY} --threshold 2e-06 --reruns 1 --inject bitflip:bit=exp "
            "--case tiny/mlp_down/fwd/normal/160x256x512/s+0+0") in " ".join(out.split())


def test_cpu_uuid_tells_cloned_hosts_apart(tmp_path, monkeypatch):
    """Two hosts cloned from one VM image share /etc/machine-id; their CPU devices must not
    share a UUID (the fleet history is keyed by it). Same host, same id, every time."""
    from aegis_cli.backends import cpu

    mid = tmp_path / "machine-id"
    mid.write_text("0123456789abcdef0123456789abcdef\n")
    ids = {}
    for host in ("node-a", "node-b"):
        monkeypatch.setattr(cpu.socket, "gethostname", lambda host=host: host)
        ids[host] = cpu._machine_id.__wrapped__((str(mid),))
        assert cpu._machine_id.__wrapped__((str(mid),)) == ids[host]
    assert ids["node-a"] != ids["node-b"] and all(len(v) == 32 for v in ids.values())
    # no machine-id file: the hostname alone still gives a stable id
    assert cpu._machine_id.__wrapped__((str(tmp_path / "absent"),)) == cpu._machine_id.__wrapped__((str(tmp_path / "absent"),))


def _fake_nvml(known: dict[str, str]):
    """A pynvml stand-in that knows GPUs by PCI bus id or UUID (``known``: key → handle) and,
    like NVML, counts every GPU of the node by index: index 0 is always some other card."""
    import types

    def lookup(key):
        if key not in known:
            raise RuntimeError("NVML_ERROR_NOT_FOUND")
        return known[key]

    return types.SimpleNamespace(
        nvmlInit=lambda: None, nvmlShutdown=lambda: None, nvmlDeviceGetHandleByPciBusId_v2=lookup,
        nvmlDeviceGetHandleByUUID=lookup, nvmlDeviceGetHandleByIndex=lambda i: "other-card",
        nvmlDeviceGetName=lambda h: f"name of {h}", nvmlDeviceGetUUID=lambda h: f"GPU-{h}",
        nvmlDeviceGetSerial=lambda h: f"serial of {h}", nvmlSystemGetDriverVersion=lambda: "580",
        nvmlDeviceGetMigMode=lambda h: (0, 0), nvmlDeviceGetPciInfo=lambda h: types.SimpleNamespace(busId=b"0000:06:00.0"))


def test_nvml_identity_never_falls_back_to_another_cards_index(monkeypatch):
    """CUDA's index is not NVML's (CUDA_VISIBLE_DEVICES, fastest-first order): when the bus id is
    unknown to NVML the UUID finds the card, and when neither is known the identity comes from
    torch alone, not from whatever NVML numbers like this one (its history, its serial)."""
    import sys

    from aegis_cli.backends import cuda_identity

    monkeypatch.setitem(sys.modules, "pynvml", _fake_nvml({"GPU-abc": "this-card"}))
    assert cuda_identity.nvml_identity("0000:06:00.0", "GPU-abc")["uuid"] == "GPU-this-card"
    fake = _fake_nvml({"0000:06:00.0": "by-bus"})
    fake.nvmlDeviceGetHandleByPciBusId = fake.nvmlDeviceGetHandleByPciBusId_v2
    del fake.nvmlDeviceGetHandleByPciBusId_v2  # pynvml without _v2 (the H200 image's)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    assert cuda_identity.nvml_identity("0000:06:00.0", "GPU-abc")["uuid"] == "GPU-by-bus"
    monkeypatch.setitem(sys.modules, "pynvml", _fake_nvml({}))
    assert cuda_identity.nvml_identity("0000:06:00.0", "GPU-abc") == {}


def test_nvml_counters_are_never_read_from_another_card_and_a_reset_is_no_error(monkeypatch):
    import sys

    from aegis_cli.backends import nvml
    from aegis_cli.backends.base import DeviceIdentity

    monkeypatch.setitem(sys.modules, "pynvml", _fake_nvml({}))
    ident = DeviceIdentity(backend="cuda", index=0, name="NVIDIA H200", uuid="GPU-abc", host="h", pci_bus_id="0000:06:00.0")
    snap = nvml.snapshot(ident)
    assert snap["available"] is False and "neither its UUID nor its PCI bus id" in snap["reason"]
    # volatile counters restart at 0 after a GPU reset: that is not a new error
    before = {"available": True, "ecc_volatile_uncorrected": 5, "ecc_aggregate_uncorrected": 7}
    after = {"available": True, "ecc_volatile_uncorrected": 0, "ecc_aggregate_uncorrected": 8}
    assert nvml.delta(before, after) == {"ecc_aggregate_uncorrected": 1}


def test_identity_without_pci_properties_from_torch(monkeypatch):
    """torch before the PCI fields of device properties: the identity still resolves (NVML by
    UUID), instead of an internal error on every GPU scan."""
    import types

    from aegis_cli.backends import cuda_identity

    props = types.SimpleNamespace(uuid="1a2b", name="NVIDIA H100", major=9, minor=0, multi_processor_count=132,
                                  total_memory=80 << 30)
    monkeypatch.setattr(cuda_identity.torch.cuda, "get_device_properties", lambda i: props)
    seen = []
    monkeypatch.setattr(cuda_identity, "nvml_identity", lambda pci, uuid: seen.append((pci, uuid)) or {"uuid": "GPU-1a2b"})
    ident = cuda_identity.device_identity(0)
    assert seen == [("", "GPU-1a2b")] and ident.uuid == "GPU-1a2b" and ident.pci_bus_id is None
