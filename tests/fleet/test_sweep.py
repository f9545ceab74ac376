"""aegis sweep on a simulated node (several CPU "devices"): history, policy, exports,
dry-run commands, worker timeouts, the lock, and being killed midway."""

from __future__ import annotations

import csv
import io
import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from aegis_cli.fleet.config import load_config
from aegis_cli.fleet.history import History, ResultRow
from aegis_cli.fleet.plan import plan_devices
from aegis_cli.ops.errors import ConfigError
from tests.fleet_helpers import aegis, env, start_sweep, wait_for, write_config


def children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(x) for x in out.split()]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture(scope="module")
def node_sweep(tmp_path_factory):
    """One sweep of 3 simulated devices: cpu:1 has a permanent exponent bit flip, cpu:2's
    worker hangs past its 15 s timeout (loose enough for the healthy workers on a busy 2-core machine)."""
    tmp = tmp_path_factory.mktemp("node")
    cfg = write_config(tmp, budget_seconds=40, device_timeout_seconds=15, drill=True,
                       inject="bitflip:bit=exp,device=cpu:1;hang:seconds=300,device=cpu:2",
                       actions={"on_quarantine": ["scontrol", "update", "nodename={host_short}", "state=drain", "reason=AEGIS: {reason}"],
                                "on_readmit": ["true"]})
    t0 = time.time()
    p = subprocess.run(aegis("sweep", "--config", str(cfg)), env=env(3), capture_output=True, text=True, timeout=120)
    return tmp, p, time.time() - t0


def test_sweep_verdicts_exit_code_and_budget(node_sweep):
    tmp, p, took = node_sweep
    assert p.returncode == 2, p.stderr
    doc = json.loads((tmp / "report.json").read_text())
    verdicts = {d["device"]["id"]: d["verdict"] for d in doc["devices"]}
    assert verdicts == {"cpu:0": "HEALTHY", "cpu:1": "FAULTY", "cpu:2": "ERROR"}
    err = next(d for d in doc["devices"] if d["device"]["id"] == "cpu:2")["error"]
    assert "timed out after" in err and "device timeout" in err
    assert took < 40, f"sweep took {took:.1f} s, over its 40 s budget"
    assert doc["kind"] == "sweep" and doc["fault_injected"] is True
    # structured log lines, no colour codes without a TTY
    lines = p.stderr.strip().splitlines()
    assert all(ln.startswith("ts=") and " event=" in ln for ln in lines), lines[:3]
    # every device ends with one device_done line, the timed-out one too, saying why
    done = {ln.split(" device=")[1].split()[0]: ln for ln in lines if " event=device_done " in ln}
    assert set(done) == {"cpu:0", "cpu:1", "cpu:2"} and "timed out after" in done["cpu:2"]
    assert "\x1b[" not in p.stderr and p.stdout == ""


def test_sweep_records_history_per_uuid(node_sweep):
    tmp, _, _ = node_sweep
    with History(tmp / "history.sqlite") as h:
        rows = h.results()
        assert len(rows) == 3 and len({r.uuid for r in rows}) == 3
        faulty = next(r for r in rows if r.device_id == "cpu:1")
        assert faulty.verdict == "FAULTY" and "gemm.row_checksum" in faulty.checks and faulty.cases
        assert h.counts()["sweeps"] == 1
        assert h.conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_sweep_policy_quarantine_list_and_prometheus(node_sweep):
    tmp, _, _ = node_sweep
    doc = json.loads((tmp / "report.json").read_text())
    uuid1 = next(d["device"]["uuid"] for d in doc["devices"] if d["device"]["id"] == "cpu:1")
    states = {u: s["state"] for u, s in doc["policy"].items()}
    assert states[uuid1] == "QUARANTINED" and sorted(states.values()).count("ACTIVE") == 2
    qlines = [ln for ln in (tmp / "quarantine.tsv").read_text().splitlines() if not ln.startswith("#")]
    assert len(qlines) == 1 and qlines[0].split("\t")[0] == uuid1 and "\tQUARANTINED\t" in qlines[0]
    fams = {f.name: f for f in text_string_to_metric_families((tmp / "aegis.prom").read_text())}
    verdict = {s.labels["device"]: s.value for s in fams["aegis_device_verdict"].samples}
    assert verdict == {"cpu:0": 0, "cpu:1": 2, "cpu:2": 3}
    quarantined = {s.labels["uuid"]: s.value for s in fams["aegis_device_quarantined"].samples}
    assert quarantined[uuid1] == 1 and sum(quarantined.values()) == 1
    assert abs(fams["aegis_last_sweep_timestamp_seconds"].samples[0].value - time.time()) < 300
    faulty_counts = {s.labels["device"]: s.value for s in fams["aegis_device_results"].samples if s.labels["verdict"] == "FAULTY"}
    assert faulty_counts == {"cpu:0": 0, "cpu:1": 1, "cpu:2": 0}


def test_sweep_dry_run_command_template(node_sweep):
    tmp, p, _ = node_sweep
    doc = json.loads((tmp / "report.json").read_text())
    (act,) = doc["actions"]
    host = doc["host"].split(".")[0]
    assert act["executed"] is False and act["event"] == "quarantine"
    assert act["argv"][:4] == ["scontrol", "update", f"nodename={host}", "state=drain"]
    assert act["argv"][4].startswith("reason=AEGIS: FAULTY 1×") and "gemm.row_checksum" in act["argv"][4]
    assert "event=action action=quarantine" in p.stderr and "executed=False" in p.stderr
    with History(tmp / "history.sqlite") as h:
        (rec,) = h.actions()
        assert rec["argv"] == act["argv"] and rec["executed"] is False


def test_history_and_report_commands(node_sweep):
    tmp, _, _ = node_sweep
    p = subprocess.run(aegis("history", "--config", str(tmp / "sweep.yaml"), "--device", "cpu:1", "--since", "30d", "--format", "json"),
                       env=env(3), capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    (dev,) = json.loads(p.stdout)["devices"]
    assert dev["summary"].startswith("failed 1 of 1 sweeps (95% CI 20.7–100.0%)") and dev["state"] == "QUARANTINED"
    assert [r["verdict"] for r in dev["results"]] == ["FAULTY"]
    # every device as CSV (the failure-rate interval is a list of numbers: it was a crash)
    p = subprocess.run(aegis("history", "--config", str(tmp / "sweep.yaml"), "--format", "csv"),
                       env=env(3), capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    rows = list(csv.DictReader(io.StringIO(p.stdout)))
    assert len(rows) == 3 and {r["state"] for r in rows} >= {"QUARANTINED"}
    p = subprocess.run(aegis("report", str(tmp / "report.json"), "--format", "json"), env=env(3), capture_output=True, text=True, timeout=60)
    assert p.returncode == 2
    fleet = json.loads(p.stdout)
    assert fleet["kind"] == "fleet" and len(fleet["devices"]) == 3
    source_seed = json.loads((tmp / "report.json").read_text())["seed"]  # derived by the sweep: no seed in its config
    assert fleet["seed"] == source_seed and fleet["command_line"][:2] == ["aegis", "report"]  # the sources' common seed
    # two fingerprinted devices that differ and no third: a software cause cannot be ruled out
    assert fleet["outcome"] == "INCONCLUSIVE"


def test_enabled_action_runs_argv_without_shell(tmp_path):
    from aegis_cli.fleet.actions import ActionsConfig, run_actions
    from aegis_cli.fleet.policy import DeviceState

    out = tmp_path / "argv.json"
    script = "import json, sys; json.dump(sys.argv[1:], open(sys.argv[1], 'w'))"
    cfg = ActionsConfig(enabled=True, on_quarantine=[sys.executable, "-c", script, str(out), "{uuid}", "{reason}; rm -rf /"])
    st = DeviceState("GPU-1", state="QUARANTINED", reason="FAULTY 1×  (gemm.row_checksum)")
    (rec,) = run_actions(cfg, [({"uuid": "GPU-1", "id": "cuda:0", "host": "n1"}, st, "quarantine")])
    assert rec.executed and rec.returncode == 0
    assert json.loads(out.read_text()) == [str(out), "GPU-1", "FAULTY 1× (gemm.row_checksum); rm -rf /"]
    with pytest.raises(ConfigError, match=r"unknown placeholder \{hostname\}"):
        ActionsConfig(on_quarantine=["scontrol", "{hostname}"])


def test_overlapping_sweeps_and_sigterm_leave_db_consistent(tmp_path):
    # both workers hang, so both are still running when SIGTERM comes, however slow the machine
    cfg = write_config(tmp_path, budget_seconds=60, device_timeout_seconds=50, inject="hang:seconds=300")
    first = start_sweep(cfg, n_devices=2)
    try:
        assert wait_for(lambda: len(children(first.pid)) == 2, 30)  # both workers running
        second = subprocess.run(aegis("sweep", "--config", str(cfg)), env=env(2), capture_output=True, text=True, timeout=60)
        assert second.returncode == 3
        assert "Error: another aegis sweep holds the lock" in second.stderr and f"pid {first.pid}" in second.stderr
        first.send_signal(signal.SIGTERM)
        _, err = first.communicate(timeout=30)
        assert first.returncode == 3 and "Error: sweep stopped by SIGTERM: 2 worker(s) killed" in err
    finally:
        if first.poll() is None:
            first.kill()
    # no worker survives its sweep, the database is readable
    assert children(first.pid) == []
    with History(tmp_path / "history.sqlite") as h:
        assert h.conn.execute("PRAGMA quick_check").fetchone()[0] == "ok" and h.counts()["results"] == 0


def test_sigkill_midway_leaves_db_consistent(tmp_path):
    cfg = write_config(tmp_path, device_timeout_seconds=50, inject="hang:seconds=300,device=cpu:0")
    p = start_sweep(cfg, n_devices=1)
    try:
        assert wait_for(lambda: len(children(p.pid)) == 1, 30)
        (worker,) = children(p.pid)
        p.kill()
        p.wait(timeout=10)
    finally:
        if p.poll() is None:
            p.kill()
    # the worker dies with its parent (PR_SET_PDEATHSIG) and the lock goes with the process
    assert wait_for(lambda: not alive(worker), 10)
    with History(tmp_path / "history.sqlite") as h:
        assert h.counts()["sweeps"] == 0
    from aegis_cli.fleet.lock import SweepLock

    with SweepLock(tmp_path / "sweep.lock"):
        pass


def test_crashing_worker_is_error_for_its_device_only(tmp_path):
    cfg = write_config(tmp_path, inject="crash:signal=9,device=cpu:1")
    p = subprocess.run(aegis("sweep", "--config", str(cfg), "--format", "json"), env=env(2), capture_output=True, text=True, timeout=120)
    assert p.returncode == 3, p.stderr
    doc = json.loads(p.stdout)
    v = {d["device"]["id"]: (d["verdict"], d["error"]) for d in doc["devices"]}
    assert v["cpu:0"] == ("HEALTHY", None)
    assert v["cpu:1"][0] == "ERROR" and "killed by signal 9" in v["cpu:1"][1]


def test_workload_too_big_for_memory_is_error_with_the_reason(tmp_path):
    """The scan's memory preflight runs in each worker: ERROR with the reason in the report and
    in the device_done log line, no allocation attempted."""
    from tests.helpers import DATA

    cfg = write_config(tmp_path, workload=str(DATA / "too_big.yaml"))
    p = subprocess.run(aegis("sweep", "--config", str(cfg), "--format", "json"), env=env(1), capture_output=True, text=True, timeout=120)
    assert p.returncode == 3, p.stderr
    (dev,) = json.loads(p.stdout)["devices"]
    assert dev["verdict"] == "ERROR" and "needs about" in dev["error"] and "GiB on cpu:0" in dev["error"]
    assert "ts=" not in dev["error"]  # the worker's own log lines are left out of the reason
    done = [ln for ln in p.stderr.splitlines() if "event=device_done" in ln]
    assert len(done) == 1 and "verdict=ERROR" in done[0] and "needs about" in done[0]


def test_unwritable_export_fails_before_any_device_runs(tmp_path):
    cfg = write_config(tmp_path, exports={"prometheus_textfile": str(tmp_path / "missing" / "aegis.prom")})
    p = subprocess.run(aegis("sweep", "--config", str(cfg)), env=env(1), capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert p.returncode == 3
    assert "cannot write" in p.stderr and "no directory" in p.stderr
    assert "event=device_start" not in p.stderr and not (tmp_path / "history.sqlite").exists()


def test_plan_prioritises_failed_devices_and_cases_when_budget_short(tmp_path):
    cfg = load_config(write_config(tmp_path, budget_seconds=10, device_timeout_seconds=10))
    now = time.time()
    ids = [{"id": f"cpu:{i}", "uuid": f"U{i}"} for i in range(3)]
    rows = [ResultRow("U0", now - 100, "HEALTHY", seconds=30.0), ResultRow("U2", now - 100, "HEALTHY", seconds=30.0),
            ResultRow("U2", now - 50, "FAULTY", seconds=30.0, checks=["gemm.row_checksum"], cases=["wl/a/s+0+0", "wl/b/s+0+0"]),
            ResultRow("U1", now - 50, "SUSPECT", seconds=5.0, checks=["gemm.col_checksum"], cases=["wl/c/s+0+0"])]
    plans = plan_devices(cfg, ids, rows, now)
    assert [p.device_id for p in plans][:2] in (["cpu:2", "cpu:1"], ["cpu:1", "cpu:2"]) and plans[-1].device_id == "cpu:0"
    by = {p.device_id: p for p in plans}
    assert by["cpu:2"].priority_cases == ["wl/a/s+0+0", "wl/b/s+0+0"]  # 30 s past scans > 10 s allowed
    assert by["cpu:1"].priority_cases == []  # its full scan fits: no need to split it
    assert by["cpu:0"].priority_cases == []


def test_priority_cases_run_first_and_survive_a_timeout(tmp_path):
    """A budget too short for the full scan: the previously failing case runs first, its
    FAULTY finding stands although the worker is then killed."""
    from aegis_cli.fleet import plan as plan_mod
    from aegis_cli.fleet import workers as workers_mod

    cfg = load_config(write_config(tmp_path, devices="cpu:1", device_timeout_seconds=30, inject="bitflip:bit=exp,device=cpu:1",
                                   seed=0))  # workers take a sweep's chosen seed (fleet/coverage.py)
    case = "fleet-tiny/mlp_down/fwd/normal/64x64x128/s+0+0"
    ident = {"id": "cpu:1", "uuid": "U1", "host": "h", "backend": "cpu", "index": 1, "name": "cpu"}
    plan = plan_mod.DevicePlan("cpu:1", "U1", [case], ["gemm"], 1, 99.0)
    os.environ["AEGIS_CPU_DEVICES"] = "2"
    try:
        cfg.inject = "bitflip:bit=exp,device=cpu:1"
        docs = workers_mod.run_workers(cfg, [plan], {"cpu:1": ident}, time.time() + 60, lambda *a, **k: None)
    finally:
        del os.environ["AEGIS_CPU_DEVICES"]
    (doc,) = docs
    assert doc["verdict"] == "FAULTY"
    assert doc["probes"]["sweep"]["priority"]["verdicts"] == {case: "FAULTY"}


def test_config_errors_name_file_and_line(tmp_path):
    p = tmp_path / "sweep.yaml"
    p.write_text("devices: cpu\npolicy:\n  faulty_count: 1\n  suspect_cont: 3\n", encoding="utf-8")
    with pytest.raises(ConfigError, match=r"sweep\.yaml: line 4: unknown key 'suspect_cont'"):
        load_config(p)
    p.write_text("devices: cpu\ninject: 'hang:seconds=abc'\n", encoding="utf-8")
    with pytest.raises(Exception, match="seconds='abc' is not a number"):
        load_config(p)


@pytest.mark.parametrize("probes, message", [
    (["gemm", "bogus"], "unknown probe"),  # a typo must not record ERROR for every GPU of the fleet
    (["crossdevice"], "node probe"),  # workers scan one device each: it would check nothing, yet HEALTHY
    (["golden"], "golden"),  # a sweep has no golden file to compare against
    ([], "no probes"),
])
def test_sweep_probes_are_checked_when_the_config_loads(tmp_path, probes, message):
    with pytest.raises(ConfigError, match=rf"sweep\.yaml: .*{message}"):
        load_config(write_config(tmp_path, probes=probes))


@pytest.mark.parametrize("over, name", [
    ({"policy": {"window_days": float("nan")}}, "policy.window_days"),  # NaN: no FAULTY result was ever "within" it
    ({"device_timeout_seconds": float("nan")}, "device_timeout_seconds"),  # every worker timed out at once: all ERROR
    ({"budget_seconds": float("inf")}, "budget_seconds"),
    ({"history": {"busy_timeout_seconds": float("nan")}}, "history.busy_timeout_seconds"),  # a locked database: retried forever
    ({"history": {"busy_timeout_seconds": -1}}, "history.busy_timeout_seconds"),
    ({"actions": {"timeout_seconds": float("inf")}}, "actions.timeout_seconds"),
    ({"distributed": {"timeout_seconds": -5}}, "distributed.timeout_seconds"),
])
def test_non_finite_or_negative_durations_are_config_errors(tmp_path, over, name):
    with pytest.raises(ConfigError, match=rf"sweep\.yaml: (line \d+: )?{re.escape(name)} must be a finite number"):
        load_config(write_config(tmp_path, **over))


def test_sweep_workload_is_checked_when_the_config_loads(tmp_path):
    """A misspelt workload is one config error, not ERROR recorded in the history of every device."""
    with pytest.raises(ConfigError, match=r"sweep\.yaml: workload: unknown workload 'llama3-80b'"):
        load_config(write_config(tmp_path, workload="llama3-80b"))
    (tmp_path / "bad.yaml").write_text("name: bad\nmodle: {}\n", encoding="utf-8")
    with pytest.raises(ConfigError, match=r"bad\.yaml: line 2: unknown key 'modle'"):
        load_config(write_config(tmp_path, workload="bad.yaml"))


def test_scan_rejects_worker_hooks():
    p = subprocess.run(aegis("scan", "--device", "cpu", "--inject", "hang:seconds=1"), env=env(1), capture_output=True, text=True, timeout=60)
    assert p.returncode == 3 and "test hook of sweep workers" in p.stderr


def test_locked_database_is_a_clear_error(tmp_path):
    from aegis_cli.ops.errors import HistoryError

    db = tmp_path / "h.sqlite"
    History(db).close()
    other = sqlite3.connect(db, isolation_level=None)
    other.execute("BEGIN EXCLUSIVE")
    try:
        with pytest.raises(HistoryError, match="is locked by another process"), History(db, busy_timeout=0.2) as h:
            h.record_sweep({"devices": [], "duration_seconds": 0})
    finally:
        other.execute("ROLLBACK")
        other.close()


@pytest.mark.parametrize("content", [b"SQLite format 3\x00" + b"\x01" * 200, b"# my notes\nkeep me\n", b'{"pid": 1}\n'])
def test_lock_file_pointing_at_another_file_never_truncates_it(tmp_path, content):
    """A lock_file typo (the history database, a report, notes) used to truncate that file."""
    from aegis_cli.fleet.lock import SweepLock
    from aegis_cli.ops.errors import LockError

    victim = tmp_path / "victim"
    victim.write_bytes(content)
    with pytest.raises(LockError, match=r"is not an aegis lock file .* left untouched"), SweepLock(victim):
        pass
    assert victim.read_bytes() == content
    # a lock file of ours, empty or holding a dead holder's record, is taken as before
    for ours in (b"", b'{"pid": 4242, "host": "gpu17", "started": 1.0, "command": ["aegis", "sweep"]}\n'):
        victim.write_bytes(ours)
        with SweepLock(victim):
            assert b'"pid"' in victim.read_bytes()
        assert victim.read_bytes() == b""


def test_priority_case_caught_again_is_not_lost(tmp_path):
    """A priority case (failed before) that fails again must reach the device's final report even
    when the full scan after it happens to miss the intermittent fault; stale cases are skipped."""
    import numpy as np

    from aegis_cli.fleet import worker

    wl = tmp_path / "two.yaml"
    wl.write_text("name: two\nmodel: {hidden: 256, ffn: 512, heads: 4, kv_heads: 2, seq_len: 160, micro_batch: 1, tp: 1}\n"
                  "scan:\n  ops: [attn_out, mlp_down]\n  layouts: [fwd]\n  distributions: [normal]\n  scales: [[0, 0]]\n")
    cid = "two/mlp_down/fwd/normal/160x256x512/s+0+0"
    coin = lambda s, launch: np.random.default_rng([s, 0, launch, 0xC01]).random()  # inject.py's coin
    seed = next(s for s in range(1000) if coin(s, 0) < 0.5 <= coin(s, 1))  # fires in the priority run only
    spec = {"device": "cpu:0", "workload": str(wl), "seed": 0, "reruns": 3, "probes": ["gemm"],
            "inject": f"bitflip:bit=30,prob=0.5,seed={seed},op=mlp_down", "fingerprint_cases": 0,
            "priority_cases": [cid, "two/qkv/fwd/normal/160x384x256/s+0+0"], "output": str(tmp_path / "w.json")}
    doc = worker.run(spec)
    assert json.loads((tmp_path / "w.json.partial.json").read_text())["verdict"] == "FAULTY"
    assert doc["verdict"] == "FAULTY"
    assert {e["case_id"] for e in doc["evidence"]} == {cid}
    verdicts = doc["probes"]["sweep"]["priority"]["verdicts"]
    assert verdicts[cid] == "FAULTY" and verdicts["two/qkv/fwd/normal/160x384x256/s+0+0"].startswith("not run:")


def _apply(tmp_path, cfg_path, verdicts: dict[str, str], logs: list | None = None):
    """One sweep's worth of results through the policy, as apply_policy records them."""
    from aegis_cli.fleet.record import apply_policy
    from tests.fleet.test_history import doc

    cfg = load_config(cfg_path)
    with History(cfg.history.path) as h:
        states, acts = apply_policy(cfg, h, doc(verdicts), (lambda *a, **k: logs.append((a, k))) if logs is not None else
                                    (lambda *a, **k: None), export=False)
    return states, acts


def test_policy_change_still_runs_the_readmit_action(tmp_path):
    # quarantined for FAULTY (permanent by default), two clean sweeps, then readmit_faulty turned
    # on: the device leaves quarantine, and its readmit command must run (it keyed on the old
    # results re-read under the new config, saw no change and left the node drained)
    acts_on = {"enabled": True, "on_quarantine": ["true"], "on_readmit": ["true", "{host_quarantined}"]}
    cfg = write_config(tmp_path, actions=acts_on, policy={"probation_sweeps": 2})
    _, acts = _apply(tmp_path, cfg, {"GPU-a": "FAULTY"})
    assert [a.event for a in acts] == ["quarantine"]
    for _ in range(2):
        _apply(tmp_path, cfg, {"GPU-a": "HEALTHY"})
    cfg = write_config(tmp_path, actions=acts_on, policy={"probation_sweeps": 2, "readmit_faulty": True})
    states, acts = _apply(tmp_path, cfg, {"GPU-a": "HEALTHY"})
    assert states["GPU-a"].state == "ACTIVE" and [a.event for a in acts] == ["readmit"]
    assert acts[0].argv == ["true", "0"]


def test_quarantine_action_runs_after_a_sweep_killed_before_its_actions(tmp_path, monkeypatch):
    # the killed sweep's transaction landed (FAULTY recorded) but its drain never ran: the next
    # sweep read the device as already quarantined and never announced it
    (tmp_path / "drain").write_text("#!/bin/sh\nexit 0\n")
    (tmp_path / "drain").chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    cfg = write_config(tmp_path, actions={"enabled": True, "on_quarantine": ["drain", "{uuid}"]})
    from tests.fleet.test_history import doc

    with History(load_config(cfg).history.path) as h:
        h.record_sweep(doc({"GPU-a": "FAULTY"}))
    states, acts = _apply(tmp_path, cfg, {"GPU-a": "FAULTY"})
    assert states["GPU-a"].state == "QUARANTINED" and [(a.event, a.argv) for a in acts] == [("quarantine", ["drain", "GPU-a"])]
    _, acts = _apply(tmp_path, cfg, {"GPU-a": "FAULTY"})
    assert acts == []  # announced once


def test_readmit_tells_how_many_of_the_nodes_gpus_are_still_quarantined(tmp_path):
    cfg = write_config(tmp_path, actions={"on_readmit": ["resume", "{host_short}", "{host_quarantined}"]},
                       policy={"probation_sweeps": 1, "readmit_faulty": True})
    _apply(tmp_path, cfg, {"GPU-a": "FAULTY", "GPU-b": "FAULTY"})
    states, acts = _apply(tmp_path, cfg, {"GPU-a": "HEALTHY", "GPU-b": "FAULTY"})
    assert states["GPU-a"].state == "ACTIVE" and states["GPU-b"].state == "QUARANTINED"
    (a,) = acts
    assert a.event == "readmit" and a.argv == ["resume", "n1", "1"]  # the example scripts keep the node drained


def test_readmit_counts_quarantined_gpus_of_the_node_this_doc_does_not_hold(tmp_path):
    # a distributed rank records only its own device: GPU-b, quarantined on the same node, must
    # still keep the node drained (it counted 0, and the resume script resumed the node)
    cfg = write_config(tmp_path, actions={"on_readmit": ["resume", "{host_short}", "{host_quarantined}"]},
                       policy={"probation_sweeps": 1, "readmit_faulty": True})
    _apply(tmp_path, cfg, {"GPU-a": "FAULTY", "GPU-b": "FAULTY"})
    states, acts = _apply(tmp_path, cfg, {"GPU-a": "HEALTHY"})
    assert states["GPU-a"].state == "ACTIVE"
    (a,) = acts
    assert a.event == "readmit" and a.argv == ["resume", "n1", "1"]


def test_failed_action_is_logged_as_an_error(tmp_path):
    logs: list = []
    cfg = write_config(tmp_path, actions={"enabled": True, "on_quarantine": [sys.executable, "-c", "import sys; sys.exit('drain failed')"]})
    _apply(tmp_path, cfg, {"GPU-a": "FAULTY"}, logs)
    (line,) = [kw for a, kw in logs if a and a[0] == "action"]
    assert line["level"] == "error" and line["returncode"] == 1 and "drain failed" in line["output"]


def test_export_over_the_history_is_refused(tmp_path):
    from aegis_cli.fleet.sweep import run_sweep

    cfg = load_config(write_config(tmp_path, exports={"report": "history.sqlite"}))
    with pytest.raises(ConfigError, match=r"history\.sqlite is also the sweep's history\.path"):
        run_sweep(cfg)


def test_timed_out_device_gets_its_failed_cases_first(tmp_path):
    cfg = load_config(write_config(tmp_path, device_timeout_seconds=4))
    now = time.time()
    rows = [ResultRow("GPU-x", now - 300, "FAULTY", seconds=0.2, cases=["wl/a/s+0+0"], checks=["gemm.row_checksum"]),
            ResultRow("GPU-x", now - 200, "ERROR", seconds=4.0, error="worker timed out after 4 s (device timeout); killed"),
            ResultRow("GPU-x", now - 100, "ERROR", seconds=4.0, error="worker timed out after 4 s (device timeout); killed")]
    (plan,) = plan_devices(cfg, [{"id": "cpu:0", "uuid": "GPU-x"}], rows, now)
    assert plan.priority_cases == ["wl/a/s+0+0"]


def test_node_name_comes_from_aegis_host(monkeypatch):
    from aegis_cli.backends.cpu import CpuDevice

    monkeypatch.setenv("AEGIS_HOST", "gpu-node-17")
    assert CpuDevice(0).identity.host == "gpu-node-17"


def test_worker_exits_when_its_sweep_is_gone():
    code = "from aegis_cli.fleet.worker import _die_with_parent; _die_with_parent(); print('alive')"
    mine = subprocess.run([sys.executable, "-c", code], env={**os.environ, "AEGIS_SWEEP_PID": str(os.getpid())},
                          capture_output=True, text=True, timeout=60)
    assert mine.returncode == 0 and mine.stdout.strip() == "alive"  # started by its sweep (even one that is pid 1)
    other = subprocess.run([sys.executable, "-c", code], env={**os.environ, "AEGIS_SWEEP_PID": "1"},
                           capture_output=True, text=True, timeout=60)
    assert other.returncode == 3 and other.stdout == ""  # its sweep died before the death signal was armed


def test_fingerprint_class_separates_aegis_versions():
    from aegis_cli.fleet.compare import fingerprint_class

    ident = {"backend": "cuda", "name": "NVIDIA H200"}
    old = fingerprint_class(ident, {"aegis": "0.1.0", "torch": "2.11"}, {"k": "h"}, "w", 0)
    assert old != fingerprint_class(ident, {"aegis": "0.2.0", "torch": "2.11"}, {"k": "h"}, "w", 0)  # rolling upgrade
    assert old == fingerprint_class(ident, {"aegis": "0.1.0", "torch": "2.11", "python": "3.13"}, {"k": "h"}, "w", 0)


def test_retired_gpu_leaves_the_quarantine_list_until_it_reports_again(tmp_path):
    from aegis_cli.fleet.record import write_exports

    cfg_path = write_config(tmp_path)
    _apply(tmp_path, cfg_path, {"GPU-a": "FAULTY", "GPU-b": "HEALTHY"})
    cfg = load_config(cfg_path)

    def listed() -> list[str]:
        with History(cfg.history.path) as h:
            write_exports(cfg, h, {"devices": []}, lambda *a, **k: None)
        return [ln.split("\t")[0] for ln in (tmp_path / "quarantine.tsv").read_text().splitlines() if not ln.startswith("#")]

    assert listed() == ["GPU-a"]
    p = subprocess.run(aegis("history", "--config", str(cfg_path), "--device", "GPU-a", "--retire", "RMA 1234", "--format", "json"),
                       env=env(1), capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["devices"][0]["state"] == "RETIRED" and "retired GPU-a" in p.stderr
    assert listed() == []
    time.sleep(0.01)
    _apply(tmp_path, cfg_path, {"GPU-a": "HEALTHY"})  # the same board is back: its history counts again
    assert listed() == ["GPU-a"]
    p = subprocess.run(aegis("history", "--config", str(cfg_path), "--retire", "x"), env=env(1), capture_output=True, text=True, timeout=60)
    assert p.returncode == 3 and "--retire needs --device" in p.stderr


def test_rank_gpu_with_one_gpu_per_task():
    from aegis_cli.fleet.distributed import gpu_index

    assert gpu_index(3, 8) == 3 and gpu_index(3, 1) == 0  # srun --gpus-per-task=1: every task sees cuda:0
    with pytest.raises(ConfigError, match="local rank 3 has no GPU"):
        gpu_index(3, 2)


def test_workers_run_the_sweeps_aegis_and_leave_no_temp_folder(tmp_path):
    """Workers started with ``python -m`` imported an ``aegis_cli/`` in the sweep's working
    directory (an old checkout) before the one the sweep runs; and every sweep left its worker
    folder in the temp directory."""
    cfg = write_config(tmp_path)
    shadow = tmp_path / "shadow"
    (shadow / "aegis_cli").mkdir(parents=True)
    (shadow / "aegis_cli" / "__init__.py").write_text("raise SystemExit('a stale aegis_cli was imported')\n")
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    # the parent runs the checkout's aegis as an installed console script would: without the
    # working directory on sys.path
    launcher = "import runpy, sys; del sys.path[0]; runpy.run_module('aegis_cli', run_name='__main__')"
    p = subprocess.run([sys.executable, "-c", launcher, "sweep", "--config", str(cfg), "--format", "json"],
                       env=env(2, TMPDIR=str(tmpdir)), cwd=shadow, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert [d["verdict"] for d in json.loads(p.stdout)["devices"]] == ["HEALTHY", "HEALTHY"]
    assert list(tmpdir.iterdir()) == []


@pytest.mark.parametrize("over, clash", [
    ({"distributed": {"fleet_report": "history.sqlite"}}, r"distributed\.fleet_report: .*history\.sqlite is also the sweep's history\.path"),
    ({"exports": {"report": "quarantine.tsv"}}, r"exports\.quarantine_list: .*quarantine\.tsv is also the sweep's exports\.report"),
])
def test_exports_that_clash_are_refused_before_any_work(tmp_path, over, clash):
    from aegis_cli.fleet.sweep import run_sweep

    cfg = load_config(write_config(tmp_path, **over))
    with pytest.raises(ConfigError, match=clash):
        run_sweep(cfg, environ={})
    assert not (tmp_path / "history.sqlite").exists()


def test_unwritable_fleet_report_fails_before_any_work(tmp_path):
    from aegis_cli.fleet.sweep import run_sweep
    from aegis_cli.ops.errors import OutputError

    cfg = load_config(write_config(tmp_path, distributed={"fleet_report": "nodir/fleet.json"}))
    with pytest.raises(OutputError, match="nodir"):
        run_sweep(cfg, environ={})
    assert not (tmp_path / "history.sqlite").exists()
