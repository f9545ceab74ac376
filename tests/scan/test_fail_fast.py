"""``aegis scan --fail-fast``: a device stops at its first confirmed FAULTY, the others go on;
the report names what was skipped, and the progress total still adds up."""

from __future__ import annotations

import json

import pytest

from aegis_cli.ops.verdict import Verdict
from aegis_cli.scan import ScanOptions, run_scan
from tests.helpers import TINY, run_cli

FAULT = "bitflip:target=acc,bit=exp"


def test_fail_fast_stops_at_the_first_confirmed_faulty_and_names_what_it_skipped(capsys):
    code, out, _ = run_cli(capsys, "scan", "-q", "--fail-fast", "--format", "json", "--inject", FAULT)
    d = json.loads(out)["devices"][0]
    assert code == 2 and d["verdict"] == "FAULTY"
    c = d["confirmation"]
    first = d["evidence"][0]["case_id"]
    assert c["fail_fast"] == {"stopped_at": first, "skipped_probes": ["determinism", "pow2", "memory", "crossdevice", "attention"]}
    gemm = c["probes"]["gemm"]
    assert gemm["launches"] == 1 + 5  # the first case and its confirmation, nothing after
    assert len(gemm["skipped_cases"]) == 143 and first not in gemm["skipped_cases"]
    assert {e["case_id"] for e in d["evidence"]} == {first}


def test_fail_fast_changes_nothing_on_a_healthy_device():
    plain = run_scan(ScanOptions(devices="cpu", workload=TINY)).devices[0]
    fast = run_scan(ScanOptions(devices="cpu", workload=TINY, fail_fast=True)).devices[0]
    assert fast.verdict is plain.verdict is Verdict.HEALTHY
    c = fast.tally.to_dict()
    assert c["fail_fast"] == {"stopped_at": None, "skipped_probes": []}
    assert c["launches"] == plain.tally.to_dict()["launches"] and not c["probes"]["gemm"]["skipped_cases"]


def test_other_devices_go_on_and_the_progress_total_adds_up(monkeypatch):
    monkeypatch.setenv("AEGIS_CPU_DEVICES", "2")
    events: list[tuple[str, dict]] = []
    rep = run_scan(ScanOptions(devices="cpu:0,cpu:1", workload=TINY, fail_fast=True, inject=f"{FAULT},device=cpu:0"),
                   progress=lambda event, **info: events.append((event, info)))
    bad, good = rep.devices
    assert (bad.verdict, good.verdict) == (Verdict.FAULTY, Verdict.HEALTHY)
    assert bad.tally.stopped and not good.tally.stopped
    assert good.stats.gemms == sum(1 for e, i in events if e == "case" and i["device"] == "cpu:1" and i["case"].startswith("tiny/"))
    assert bad.tally.probe("gemm").skipped and not good.tally.probe("gemm").skipped
    # the node probe has one device left to compare: skipped, and said so on the device that ran on
    assert good.tally.skipped_probes == ["crossdevice"] and "crossdevice" not in good.probe_stats
    total = next(i["total"] for e, i in events if e == "start")
    assert total == sum(1 for e, _ in events if e == "case")


def test_fail_fast_with_a_case_skips_nothing_it_was_not_asked_for():
    """--case at a scale runs that scale and its base: stopping there skips no other scale, and
    the progress total adds up."""
    events: list[tuple[str, dict]] = []
    case = "cpu-quick/qkv/fwd/normal/192x384x256/s-16-16"  # two scales of cpu-quick's grid come after it
    rep = run_scan(ScanOptions(devices="cpu:0", case=case, fail_fast=True, inject=FAULT),
                   progress=lambda event, **info: events.append((event, info)))
    d = rep.devices[0]
    assert d.verdict is Verdict.FAULTY and d.tally.stopped_at == case and d.tally.probe("gemm").skipped == []
    assert next(i["total"] for e, i in events if e == "start") == sum(e == "case" for e, _ in events) == 2


def test_a_device_that_fails_half_way_still_completes_the_progress_total(monkeypatch):
    """The cases a failure leaves unrun count as progress too, when the device is done: the bar
    of a scan whose first device fails does not stop short."""
    from aegis_cli.backends.cpu import CpuDevice
    from aegis_cli.ops.errors import DeviceError

    real, launches = CpuDevice.checked_gemm, []

    def fails_second(self, *a, **k):
        launches.append(1)
        if len(launches) == 2:
            raise DeviceError("cpu:0: launch failed")
        return real(self, *a, **k)

    monkeypatch.setattr(CpuDevice, "checked_gemm", fails_second)
    events: list[tuple[str, dict]] = []
    rep = run_scan(ScanOptions(devices="cpu:0", workload=TINY, probes=("gemm", "attention")),
                   progress=lambda event, **info: events.append((event, info)))
    assert rep.devices[0].verdict is Verdict.ERROR and "launch failed" in rep.devices[0].error
    cases = [i["case"] for e, i in events if e == "case"]
    assert next(i["total"] for e, i in events if e == "start") == len(cases) and cases[-1] == "skipped"
    assert [e for e, _ in events][-1] == "device_done"


def test_fail_fast_in_the_table(capsys):
    code, out, _ = run_cli(capsys, "scan", "--fail-fast", "--workload", TINY, "--inject", FAULT)
    assert code == 2 and "--fail-fast: stopped at tiny/" in out and "skipped" in out


@pytest.mark.parametrize("n", [0, 1001])
def test_evidence_in_full_out_of_range_is_refused(capsys, n):
    code, out, err = run_cli(capsys, "scan", "-q", "--evidence-in-full", str(n))
    assert code == 3 and out == "" and "evidence in full" in err
