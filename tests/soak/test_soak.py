"""aegis scan --soak on the CPU: a 10 s burn-in is HEALTHY with every report field, an injected
intermittent fault is caught as "k of n launches", a failing launch replays with --case, and the
pieces (durations, the schedule, the device screen, the record) hold their contracts."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import shlex
from pathlib import Path

import pytest
import torch
from rich.console import Console

from aegis_cli import render
from aegis_cli.backends import resolve_devices
from aegis_cli.backends.nvml import Telemetry, throttle_names
from aegis_cli.checks import gemm as gemm_checks
from aegis_cli.checks import screen
from aegis_cli.cli import main
from aegis_cli.ops import numerics, workloads
from aegis_cli.ops.errors import ConfigError
from aegis_cli.probes.gemm_scan import plan_cases
from aegis_cli.soak.record import MAX_INTERVALS, SoakRecord, parse_duration
from aegis_cli.soak.run import SoakOptions, run_soak
from aegis_cli.soak.schedule import draw_scales, pow2, set_case
from tests.helpers import run_cli

jsonschema = pytest.importorskip("jsonschema")
SCHEMA = json.loads((Path(__file__).resolve().parents[2] / "docs" / "report.schema.json").read_text())


@pytest.fixture(scope="module")
def soak_doc():
    """One 10 s burn-in through the CLI, shared by the tests that read its report."""
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), pytest.raises(SystemExit) as exc:
        main(["scan", "--soak", "10s", "--device", "cpu:0", "-q", "--format", "json"])
    return exc.value.code, json.loads(buf.getvalue())


def test_soak_10s_cpu_healthy_with_every_field(soak_doc):
    code, doc = soak_doc
    jsonschema.validate(doc, SCHEMA)
    assert code == 0 and doc["exit_code"] == 0
    d = doc["devices"][0]
    s = d["soak"]
    assert d["verdict"] == "HEALTHY" and d["evidence"] == []
    assert 9.5 <= s["elapsed"] <= 12 and s["seconds"] == 10
    assert s["launches"] > 0 and s["gemms_checked"] == s["launches"] == d["stats"]["gemms"]
    assert s["failures"] == {"launches": 0, "of": s["launches"], "first": []}
    assert s["flops"] > 0 and s["tflops"] > 0 and s["input_sets"] >= 1
    assert sum(s["coverage"]["launches_by_shape"].values()) == s["launches"]
    assert s["intervals"] and sum(i["launches"] for i in s["intervals"]) == s["launches"]
    assert s["telemetry"]["available"] is False and "no NVML" in s["telemetry"]["reason"]
    assert s["schedule"]["seed"] == 0 and s["schedule"]["workload"] == "cpu-quick"
    assert doc["options"]["soak_seconds"] == 10
    assert d["noise"]["margin"] > 1  # τ sits above every clean checksum the burn-in saw
    # the scales reach far beyond the scan's grid (±16) inside the exact range
    assert s["coverage"]["scales"] > 8 and (s["coverage"]["ea"][1] > 16 or s["coverage"]["ea"][0] < -16)


def test_soak_table_shows_the_burn_in(soak_doc):
    _, doc = soak_doc
    console = Console(file=io.StringIO(), width=200)
    render.soak_table(console, doc)
    text = console.file.getvalue()
    assert "burn-in" in text and f"0 of {doc['devices'][0]['soak']['launches']} launches" in text
    assert "telemetry" in text


def test_injected_intermittent_fault_caught_k_of_n():
    rep = run_soak(SoakOptions(seconds=2, devices="cpu:0", inject="bitflip:target=acc,bit=exp,prob=0.2"))
    doc = rep.to_dict()
    jsonschema.validate(doc, SCHEMA)
    d = doc["devices"][0]
    f = d["soak"]["failures"]
    assert d["verdict"] == "FAULTY" and doc["exit_code"] == 2 and doc["fault_injected"]
    assert 0 < f["launches"] < f["of"] == d["soak"]["launches"]
    first = f["first"][0]
    assert first["flagged_checksums"] > 0 and "--inject" in first["command"] and f"--seed {first['seed']}" in first["command"]
    confirmed = [e for e in d["evidence"] if e["severity"] == "FAULTY"]
    assert confirmed and confirmed[0]["case_id"] == first["case_id"] and confirmed[0]["seed"] == first["seed"]
    assert f"soak: {f['launches']} of {f['of']} launches failed" in confirmed[0]["summary"]
    assert confirmed[0]["distinct_outputs"] == 2  # the re-runs gave the clean bits, the flagged run did not


@pytest.fixture(scope="module")
def half_faulty():
    """A 1 s burn-in with a fault on about half the launches; seed 3 fires on the first (a base
    launch) and not the second."""
    return run_soak(SoakOptions(seconds=1, devices="cpu:0", inject="bitflip:target=acc,bit=exp,prob=0.5,seed=3")).to_dict()


def test_a_failing_base_launch_is_counted_once(half_faulty):
    """The base launch of a set fails and the next gives the clean bits: the base is one failure,
    not a second one when the next launch's bits differ from it."""
    f = half_faulty["devices"][0]["soak"]["failures"]
    listed = [x["launch"] for x in f["first"]]
    assert 0 in listed and len(listed) == len(set(listed))


def test_launch_counts_carry_the_burn_in(half_faulty):
    """The Prometheus export and the sweep history count a burn-in's launches and failures ("k of
    n launches"), beside any probe's."""
    from aegis_cli.fleet.coverage import counts
    from aegis_cli.report import to_prometheus

    doc = half_faulty
    d = doc["devices"][0]
    n, k = d["soak"]["launches"], d["soak"]["failures"]["launches"]
    assert 0 < k < n
    prom = to_prometheus(doc)
    assert 'aegis_device_launches_checked{device="cpu:0",' in prom and f"}} {n}\n" in prom.split("launches_checked{")[1]
    assert f"}} {k}\n" in prom.split("failed_launches{")[1]
    assert counts(d) == (n, k)
    probes = {"launches": 10, "failed_launches": 1}
    assert counts({**d, "confirmation": probes}) == (n + 10, k + 1)  # a sweep's probes, then its burn-in


def test_a_failing_launch_replays_with_its_command(capsys):
    """A permanent fault on one op: the burn-in lists the launch; its command (seed, case) is a scan
    that finds the same fault in the same case."""
    rep = run_soak(SoakOptions(seconds=1, devices="cpu:0", inject="bitflip:target=acc,bit=exp,op=qkv/fwd"))
    first = rep.to_dict()["devices"][0]["soak"]["failures"]["first"][0]
    argv = shlex.split(first["command"])
    assert argv[:2] == ["aegis", "scan"]
    code, out, err = run_cli(capsys, *argv[1:], "-q", "--format", "json")
    assert out, err
    doc = json.loads(out)
    assert code == 2 and doc["devices"][0]["evidence"][0]["case_id"] == first["case_id"]


def _run_command(capsys, monkeypatch, command: str):
    """A listed command as a shell would run it: its leading VAR=VALUE words set the environment."""
    argv = shlex.split(command)
    monkeypatch.delenv("AEGIS_CPU_DEVICES", raising=False)
    while "=" in argv[0]:
        key, value = argv.pop(0).split("=", 1)
        monkeypatch.setenv(key, value)
    assert argv[:2] == ["aegis", "scan"]
    return run_cli(capsys, *argv[1:], "-q", "--format", "json")


def test_a_failing_launch_on_a_simulated_device_replays(capsys, monkeypatch):
    """On cpu:1 of two simulated devices, with a fault aimed at cpu:1 among faults for others,
    the listed command scans devices that exist and accepts the whole --inject spec."""
    monkeypatch.setenv("AEGIS_CPU_DEVICES", "2")
    inject = "bitflip:target=acc,bit=exp,op=qkv/fwd,device=cpu:1;bitflip:target=acc,bit=exp,op=none,device=cpu:0"
    rep = run_soak(SoakOptions(seconds=0.5, devices="cpu:0,cpu:1", inject=inject))
    first = rep.to_dict()["devices"][1]["soak"]["failures"]["first"][0]
    code, out, err = _run_command(capsys, monkeypatch, first["command"])
    assert out, err
    doc = json.loads(out)
    found = {d["device"]["id"]: d["evidence"] for d in doc["devices"]}
    assert code == 2 and found["cpu:1"][0]["case_id"] == first["case_id"]


def test_a_soak_case_draws_the_scans_inputs():
    """Input set i's operands are the scan's own draw of its case id at its seed: --case replays them."""
    (dev,) = resolve_devices("cpu:0")
    wl = workloads.load("cpu-quick")
    for i in (0, 13, 40):
        case = set_case(wl, 7, i)
        (scan_case,) = plan_cases(wl, case.seed, case.case_id(0, 0))
        a, b = case.operands(dev), scan_case.operands(dev)
        assert torch.equal(a.a, b.a) and torch.equal(a.b, b.b)
    assert set_case(wl, 7, 3).seed != set_case(wl, 7, 15).seed  # a set's seed is its own


@pytest.mark.parametrize(("text", "seconds"), [("10s", 10), ("2m", 120), ("1h", 3600), ("1.5m", 90), ("45", 45)])
def test_parse_duration(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "10x", "-5s", "0s", "8d", "1e3s", "s", "nan"])
def test_parse_duration_refuses(text):
    with pytest.raises(ConfigError, match="give a duration like 10s, 2m or 1h"):
        parse_duration(text)


def test_bad_duration_is_one_line_exit_3(capsys):
    code, _, err = run_cli(capsys, "scan", "--soak", "2 minutes")
    assert code == 3 and err.strip().count("\n") == 0 and err.startswith("Error: --soak '2 minutes'")


@pytest.mark.parametrize(("args", "named"), [(("--fail-fast",), "--fail-fast"), (("--probes", "gemm"), "--probes"),
                                             (("--case", "x"), "--case")])
def test_scan_options_the_burn_in_does_not_take_are_refused(capsys, args, named):
    code, out, err = run_cli(capsys, "scan", "--soak", "1s", *args)
    assert code == 3 and out == "" and err.strip().count("\n") == 0 and f"takes no {named}" in err


def test_scales_are_exact_and_reach_beyond_the_grid():
    (dev,) = resolve_devices("cpu:0")
    case = set_case(workloads.load("cpu-quick"), 0, 5)
    mag = numerics.magnitudes(case.operands(dev))
    scales = draw_scales(mag, case.seed)
    assert scales[0] == (0, 0) and len(set(scales)) == len(scales) == 8
    assert all(numerics.pow2_exact_safe(mag, ea, eb) for ea, eb in scales)
    assert max(max(abs(ea), abs(eb)) for ea, eb in scales) > 16
    assert draw_scales(mag, case.seed) == scales  # the schedule is a function of the seed


def test_screen_counts_what_the_checksum_check_flags():
    (dev,) = resolve_devices("cpu:0")
    case = set_case(workloads.load("cpu-quick"), 0, 2)
    ops = case.operands(dev)
    ref = dev.reference_checksums(ops, dev.tile)
    res = dev.checked_gemm(ops)
    tau = numerics.Thresholds().tau  # in units of the device's noise scale, as the scan's checks
    lim = screen.limits(ref, tau)
    rows, cols = res.row_sums.clone(), res.col_sums.clone()
    rows[3, 0] += float(ref.row_scale[3, 0]) * 1e-3  # far over τ
    cols[0, 5] = float("nan")
    counts = screen.flagged([res.row_sums, rows], [res.col_sums, cols], lim).tolist()
    checked = gemm_checks.check_gemm(dataclasses.replace(res, row_sums=rows, col_sums=cols), ref, tau)
    assert counts[0] == 0
    assert counts[1] == sum(s.elements for s in checked.signals if s.check in gemm_checks.CHECKSUM_CHECKS) == 2
    assert float(screen.clean_max(res, ref, tau)) == gemm_checks.check_gemm(res, ref, tau).clean_max()


class _FakeTelemetry:
    reason = None

    def __init__(self, readings):
        self.readings = iter(readings)

    def read(self):
        return next(self.readings, None)


def test_record_summarises_telemetry_and_stays_bounded(monkeypatch):
    clock = iter(float(t) for t in range(0, 100000, 5))
    monkeypatch.setattr("aegis_cli.soak.record.time.monotonic", lambda: next(clock))
    readings = [{"sm_clock_mhz": c, "temperature_c": 40 + i, "power_w": 300.0 + i, "power_limit_w": 700.0,
                 "throttle": ["sw_power_cap"] if i % 2 else []} for i, c in enumerate([1980, 1755, 1830, 1980] * 400)]
    rec = SoakRecord(seconds=600.0, seed=0, rule={})
    rec.start(_FakeTelemetry(readings))
    tel = _FakeTelemetry(readings[1:])
    shape = workloads.load("cpu-quick").gemms()[0]
    for _ in range(1000):
        rec.completed([shape] * 10, 10 * shape.flops)
        rec.tick(tel, lambda *a, **k: None, "cuda:0")
    rec.finish(tel)
    d = rec.to_dict()
    assert len(d["intervals"]) <= MAX_INTERVALS and sum(i["launches"] for i in d["intervals"]) == 10000
    t = d["telemetry"]
    assert t["available"] and t["sm_clock_mhz"]["start"] == 1980 and t["sm_clock_mhz"]["min"] == 1755
    assert t["temperature_c"]["start"] == 40 and t["temperature_c"]["peak"] == t["temperature_c"]["end"]
    assert t["throttle"]["sw_power_cap"] > 0 and t["power_limit_w"] == 700.0


def test_telemetry_off_a_gpu_says_why():
    (dev,) = resolve_devices("cpu:0")
    tel = Telemetry(dev.identity)
    assert not tel.available and tel.read() is None and "no NVML" in tel.reason
    tel.close()
    assert throttle_names(0x4 | 0x40 | 0x10000) == ["sw_power_cap", "hw_thermal_slowdown", "0x10000"]


def test_one_pass_scaling_and_device_magnitudes_match_the_references():
    (dev,) = resolve_devices("cpu:0")
    case = set_case(workloads.load("cpu-quick"), 0, 4)
    ops = case.operands(dev)
    mag = numerics.magnitudes(ops)
    assert screen.magnitudes(ops).tolist() == [mag.amin, mag.amax, mag.bmin, mag.bmax]
    for ea, eb in draw_scales(mag, case.seed):
        for t, e in ((ops.a, ea), (ops.b, eb)):
            assert torch.equal(pow2(t, e).view(torch.int16), numerics.pow2_scale(t, e).view(torch.int16))


def test_progress_bar_follows_the_burn_in():
    from rich.progress import Progress

    with Progress(console=Console(file=io.StringIO()), transient=True) as progress:
        cb = render._progress_callback(progress)
        cb("start", total=20, devices=["cuda:0", "cuda:1"], soak=True)
        cb("soak", device="cuda:0", elapsed=4.0, seconds=10.0, launches=900, failures=0, tflops=571.2)
        cb("device_done", device="cuda:0", verdict="HEALTHY")
        cb("soak", device="cuda:1", elapsed=2.5, seconds=10.0, launches=400, failures=1, tflops=560.0)
        (task,) = progress.tasks
        assert task.completed == 12.5 and task.total == 20
        assert "cuda:1 soak: 400 launches, 560.0 TFLOP/s, 1 failed" in task.description
    # a device that ended before its first progress event (an ERROR at once) still counts its share
    with Progress(console=Console(file=io.StringIO()), transient=True) as progress:
        cb = render._progress_callback(progress)
        cb("start", total=20, devices=["cuda:0", "cuda:1"], soak=True)
        cb("device_done", device="cuda:0", verdict="ERROR")
        cb("soak", device="cuda:1", elapsed=2.5, seconds=10.0, launches=400, failures=0, tflops=560.0)
        assert progress.tasks[0].completed == 12.5


def test_fp32_bounds_decide_as_the_fp64_ones():
    # an fp32 checksum against the inward-rounded fp32 bounds gives the fp64 comparison's answer,
    # also one fp32 ulp either side of each bound and for NaN and infinities
    g = torch.Generator().manual_seed(3)
    ref = torch.randn(4096, generator=g, dtype=torch.float64) * 10.0 ** torch.randint(-30, 30, (4096,), generator=g)
    lim = ref.abs() * torch.rand(4096, generator=g, dtype=torch.float64) * 1e-5
    lo, hi = screen._inward(ref - lim, ref + lim)
    xs = [ref.float(), lo, hi, torch.nextafter(lo, torch.full_like(lo, -1e38)), torch.nextafter(hi, torch.full_like(hi, 1e38)),
          torch.full_like(lo, float("nan")), torch.full_like(lo, float("inf"))]
    for x in xs:
        want = ((x.double() - ref).abs() <= lim)
        assert torch.equal((x >= lo) & (x <= hi), want)
    assert torch.equal(((xs[3] >= lo) & (xs[3] <= hi)), torch.zeros_like(lo, dtype=torch.bool))


def test_every_scale_fingerprints_a_run_after_its_first():
    from aegis_cli.soak.schedule import FINGERPRINT_EVERY, fingerprinted

    for repeats in (2, 3, FINGERPRINT_EVERY, 2 * FINGERPRINT_EVERY + 1, 256):
        picked = [r for r in range(repeats) if fingerprinted(r, repeats)]
        assert picked and picked[0] > 0 and picked[-1] == repeats - 1
        assert len(picked) == repeats // FINGERPRINT_EVERY + (repeats % FINGERPRINT_EVERY != 0)
