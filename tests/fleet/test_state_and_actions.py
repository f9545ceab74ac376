"""A self-test leaves real state alone; actions are retried until they succeed, bounded in time
and stoppable (docs/fleet.md, "Actions and exports" and "Self-tests")."""

from __future__ import annotations

import csv
import io
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from aegis_cli.fleet.actions import ActionsConfig, run_actions
from aegis_cli.fleet.config import load_config
from aegis_cli.fleet.history import History
from aegis_cli.fleet.logs import SweepInterrupted
from aegis_cli.fleet.policy import DeviceState
from aegis_cli.fleet.record import apply_policy
from aegis_cli.fleet.sweep import run_sweep
from tests.fleet.test_history import doc
from tests.fleet.test_sweep import alive
from tests.fleet_helpers import aegis, env, wait_for, write_config

QUIET = lambda *a, **k: None


def _apply(cfg_path, verdicts, **kw):
    cfg = load_config(cfg_path)
    with History(cfg.history.path) as h:
        return apply_policy(cfg, h, doc(verdicts), QUIET, export=False, **kw)


def test_self_test_sweep_leaves_history_quarantine_list_and_metrics_as_they_were(tmp_path, monkeypatch):
    monkeypatch.setenv("AEGIS_CPU_DEVICES", "1")
    marker = tmp_path / "drained"
    actions = {"enabled": True, "on_quarantine": [sys.executable, "-c", f"open({str(marker)!r}, 'w')"]}
    run_sweep(load_config(write_config(tmp_path, actions=actions)))  # a real, clean sweep first
    exports = [tmp_path / "quarantine.tsv", tmp_path / "aegis.prom"]
    before = [(p.read_bytes(), p.stat().st_mtime_ns) for p in exports]
    with History(tmp_path / "history.sqlite") as h:
        counts, results = h.counts(), h.results()
    out = run_sweep(load_config(write_config(tmp_path, actions=actions, inject="bitflip:bit=exp")))
    assert out.exit_code == 2, [(d["verdict"], d["error"]) for d in out.doc["devices"]]
    assert out.doc["fault_injected"] is True and out.actions == []
    assert json.loads((tmp_path / "report.json").read_text())["fault_injected"] is True  # its own report, marked
    assert [(p.read_bytes(), p.stat().st_mtime_ns) for p in exports] == before
    with History(tmp_path / "history.sqlite") as h:
        assert h.counts() == counts and h.results() == results
    assert not marker.exists()


def test_csv_of_an_injected_scan_says_so(tmp_path):
    p = subprocess.run(aegis("scan", "--device", "cpu", "--workload", str(write_config(tmp_path).parent / "wl.yaml"),
                             "--inject", "bitflip:bit=exp", "--format", "csv"), env=env(1), capture_output=True, text=True, timeout=120)
    (row,) = csv.DictReader(io.StringIO(p.stdout))
    assert row["verdict"] == "FAULTY" and row["fault_injected"] == "true"


def test_failed_or_dry_run_action_is_retried_until_it_succeeds(tmp_path):
    status, calls = tmp_path / "status", tmp_path / "calls"
    script = f"import sys; open({str(calls)!r}, 'a').write('x'); sys.exit(int(open({str(status)!r}).read()))"
    acts = {"on_quarantine": [sys.executable, "-c", script]}
    status.write_text("1")
    _, a = _apply(write_config(tmp_path, actions=acts), {"GPU-a": "FAULTY"})  # dry run
    assert [(x.event, x.executed) for x in a] == [("quarantine", False)]
    cfg = write_config(tmp_path, actions={**acts, "enabled": True})
    _, a = _apply(cfg, {"GPU-a": "FAULTY"})  # enabled later: runs, fails
    assert [(x.event, x.executed, x.returncode) for x in a] == [("quarantine", True, 1)]
    status.write_text("0")
    _, a = _apply(cfg, {"GPU-a": "HEALTHY"})  # the failed drain runs again, and succeeds
    assert [(x.event, x.returncode) for x in a] == [("quarantine", 0)]
    _, a = _apply(cfg, {"GPU-a": "HEALTHY"})
    assert a == [] and calls.read_text() == "xx"  # done: never again


def test_timed_out_action_is_killed_with_its_process_group(tmp_path):
    pidfile = tmp_path / "child.pid"
    cfg = ActionsConfig(enabled=True, timeout_seconds=1, on_quarantine=["sh", "-c", f"sleep 60 & echo $! > {pidfile}; wait"])
    t0 = time.time()
    (rec,) = run_actions(cfg, [({"uuid": "GPU-1", "id": "cuda:0", "host": "n1"}, DeviceState("GPU-1", state="QUARANTINED"), "quarantine")])
    assert time.time() - t0 < 10 and rec.returncode is None and "timed out" in rec.output and not rec.done
    child = int(pidfile.read_text())
    assert wait_for(lambda: not alive(child), 5), "the action's child outlived it"


def test_actions_count_against_the_sweep_budget(tmp_path):
    cfg = ActionsConfig(enabled=True, timeout_seconds=60, on_quarantine=["sleep", "30"])
    changes = [({"uuid": u, "id": "cuda:0", "host": "n1"}, DeviceState(u, state="QUARANTINED"), "quarantine") for u in ("A", "B")]
    t0 = time.time()
    first, second = run_actions(cfg, changes, deadline=time.time() + 1)
    assert time.time() - t0 < 10
    assert "timed out" in first.output and not second.executed and "budget" in second.output
    assert not first.done and not second.done  # both run again at the next sweep
    sweep = load_config(write_config(tmp_path, budget_seconds=100, actions={"enabled": True, "on_quarantine": ["x"], "timeout_seconds": 20}))
    assert sweep.worker_budget() == 80  # the workers leave the commands their time


def test_sigterm_during_the_history_write_records_nothing(tmp_path, monkeypatch):
    seen: list[str] = []  # as the CLI: a flag the sweep reads
    old = signal.signal(signal.SIGTERM, lambda *a: seen.append("SIGTERM"))
    try:
        cfg = load_config(write_config(tmp_path))
        with History(cfg.history.path) as h:
            def record_then_signal(*a):
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(0.5)
            monkeypatch.setattr(h, "_record_device", record_then_signal)
            with pytest.raises(SweepInterrupted, match="SIGTERM"):
                apply_policy(cfg, h, doc({"GPU-a": "FAULTY"}), QUIET, export=False, stop=lambda: seen[0] if seen else None)
            assert h.counts() == {"devices": 0, "sweeps": 0, "results": 0, "actions": 0}
    finally:
        signal.signal(signal.SIGTERM, old)


def test_sigterm_during_actions_kills_them_exits_3_and_records_nothing(tmp_path):
    started, pidfile = tmp_path / "started", tmp_path / "child.pid"
    drain = ["sh", "-c", f"sleep 60 & echo $! > {pidfile}; touch {started}; wait"]
    cfg = write_config(tmp_path, inject="bitflip:bit=exp", drill=True, actions={"enabled": True, "on_quarantine": drain})
    p = subprocess.Popen(aegis("sweep", "--config", str(cfg)), env=env(1), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert wait_for(started.exists, 60)
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=20)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 3 and "stopped by SIGTERM" in err
    assert wait_for(lambda: not alive(int(pidfile.read_text())), 5)
    with History(tmp_path / "history.sqlite") as h:
        assert h.counts()["results"] == 0 and h.counts()["actions"] == 0
