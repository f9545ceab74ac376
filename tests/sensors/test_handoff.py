"""Fleet hand-off: the classification table, its exit codes, and both re-run paths on CPU.

What is simulated: "another GPU" is a second CPU device label (``AEGIS_CPU_DEVICES=2`` for
vTask replay; a copy of the model labelled ``cpu:1`` for the guard), and a persistent
hardware fault is an injected fault pinned to ``device=cpu:0``. A fault without ``device=``
fires on both, as a software or numerics problem would.
"""

from __future__ import annotations

import pytest

from aegis_cli import cli
from aegis_cli.ops.errors import ExitCode
from aegis_cli.sensors.guards import TrainingGuard, TrainingStateError
from aegis_cli.sensors.handoff import CLEAN, INCONSISTENT, REPRODUCED, Cause, HandoffExit, classify, classify_bundles, classify_guard
from tests.sensors.test_guards import batches, make, step_fn

CASE = "cpu-quick/qkv/fwd/normal/192x384x256/s+0+0"
ACC_FAULT = "bitflip:target=acc,bit=exp"


def test_table():
    assert classify(REPRODUCED, CLEAN)[0] is Cause.HARDWARE
    assert classify(REPRODUCED, REPRODUCED)[0] is Cause.SOFTWARE
    assert classify(REPRODUCED, None)[0] is Cause.UNRESOLVED
    assert classify(REPRODUCED, INCONSISTENT)[0] is Cause.UNRESOLVED  # a misbehaving other device says nothing
    assert classify(CLEAN, CLEAN)[0] is Cause.TRANSIENT
    assert classify(CLEAN, None)[0] is Cause.TRANSIENT
    assert classify(INCONSISTENT, CLEAN)[0] is Cause.HARDWARE
    assert classify(CLEAN, REPRODUCED)[0] is Cause.UNRESOLVED


def test_exit_codes_are_distinct_and_clash_with_nothing():
    codes = [int(c) for c in HandoffExit]
    assert len(set(codes)) == len(Cause) == len(codes)
    assert not set(codes) & {int(c) for c in ExitCode}
    assert all(not 64 <= c <= 78 and c < 126 for c in codes)  # sysexits.h; shell and signal codes
    assert {c.name for c in HandoffExit} == {c.name for c in Cause}


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    """A confirmed GEMM event saved as vTasks (a scan with an accumulator fault)."""
    d = tmp_path_factory.mktemp("handoff")
    path = d / "event.aegis"
    with pytest.raises(SystemExit) as exc:
        cli.main(["scan", "--device", "cpu", "--case", CASE, "--reruns", "1", "--probes", "gemm", "--inject", ACC_FAULT,
                  "--save-vtasks", str(path), "-q", "--format", "json", "-o", str(d / "scan.json")])
    assert exc.value.code == 2
    return str(path)


@pytest.mark.parametrize("inject,there,cause,code", [
    (f"{ACC_FAULT},device=cpu:0", "cpu:1", Cause.HARDWARE, 81),  # a broken unit on this device only
    (ACC_FAULT, "cpu:1", Cause.SOFTWARE, 82),  # reproduces wherever it runs
    (None, "cpu:1", Cause.TRANSIENT, 80),  # the fault is gone: reproduces nowhere
    (f"{ACC_FAULT},device=cpu:0", None, Cause.UNRESOLVED, 83),  # nothing to compare with
])
def test_vtask_events_are_classified_by_replay(bundle, monkeypatch, inject, there, cause, code):
    monkeypatch.setenv("AEGIS_CPU_DEVICES", "2")
    c = classify_bundles([bundle], "cpu:0", there, inject=inject)
    assert c.cause is cause and int(c.exit_code) == code, c
    assert c.to_dict()["exit_code"] == code and c.here_device == "cpu:0" and c.there_device == there


def _reproduced(inject: str) -> tuple[TrainingGuard, object]:
    model, opt = make()
    guard = TrainingGuard(model, opt, step_fn, inject=inject, device_id="cpu:0")
    with pytest.raises(TrainingStateError) as exc:
        for b in batches():
            guard.step(b)
    return guard, exc.value.event


def test_guard_event_on_this_device_only_is_hardware():
    guard, ev = _reproduced("stateflip:target=exp_avg_sq,step=5,bit=30,persist=1,device=cpu:0")
    c = classify_guard(guard, ev, "cpu", "cpu:1")
    assert (c.cause, c.here, c.there, c.exit_code) == (Cause.HARDWARE, REPRODUCED, CLEAN, HandoffExit.HARDWARE)
    assert guard.check(ev.restored_to) == []  # the guarded model is left at the last clean state


def test_guard_event_everywhere_is_software_and_recovered_is_transient():
    guard, ev = _reproduced("stateflip:target=exp_avg,step=5,bit=30,persist=1")
    assert classify_guard(guard, ev, "cpu", "cpu:1").cause is Cause.SOFTWARE
    model, opt = make()
    guard = TrainingGuard(model, opt, step_fn, inject="stateflip:target=exp_avg,step=5,bit=30")
    for b in batches(6):
        guard.step(b)
    c = classify_guard(guard, guard.events[0], "cpu", "cpu:1")
    assert (c.cause, c.there) == (Cause.TRANSIENT, None)  # clean on re-execution: nothing to compare


def test_rerun_on_another_device_makes_no_collective(monkeypatch):
    """The copy runs outside the process group: a collective there would wait for ranks that never join it."""
    import torch.distributed as dist

    model, opt = make()  # with a BatchNorm, whose hulls a synchronised guard all-reduces at every check
    guard = TrainingGuard(model, opt, step_fn, sync=False)
    for b in batches(3):
        guard.step(b)

    def collective(*args, **kwargs):
        raise AssertionError("a collective in rerun_on")

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "all_reduce", collective)
    assert guard.rerun_on("cpu", "cpu:1", 3) == []
