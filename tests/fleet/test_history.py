"""History database: schema migrations, corrupt/garbage/truncated files refused and never
overwritten, SIGKILL during writes, and the quarantine policy's state machine."""

from __future__ import annotations

import hashlib
import sqlite3
import subprocess
import sys
import textwrap
import time

import pytest

from aegis_cli.fleet import history as hist_mod
from aegis_cli.fleet.history import History, ResultRow
from aegis_cli.fleet.policy import ACTIVE, PROBATION, QUARANTINED, PolicyConfig, evaluate, parse_since, rate_text, wilson
from aegis_cli.ops.errors import HistoryError


def doc(verdicts: dict[str, str]) -> dict:
    return {"kind": "sweep", "host": "n1", "duration_seconds": 1.0, "exit_code": 0, "command_line": ["aegis"],
            "devices": [{"device": {"id": f"cuda:{i}", "uuid": u, "serial": f"S{i}", "name": "H200", "backend": "cuda", "host": "n1"},
                         "verdict": v, "workload": "w", "error": None, "timings": {"seconds": 2.0},
                         "evidence": [{"check": "gemm.row_checksum", "case_id": "w/a/s+0+0", "severity": v}] if v in ("SUSPECT", "FAULTY") else []}
                        for i, (u, v) in enumerate(verdicts.items())]}


def sha(p) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def test_new_database_wal_and_schema_version(tmp_path):
    with History(tmp_path / "h.sqlite") as h:
        assert h.conn.execute("PRAGMA user_version").fetchone()[0] == hist_mod.SCHEMA_VERSION
        assert h.conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        h.record_sweep(doc({"GPU-a": "HEALTHY", "GPU-b": "FAULTY"}))
        assert h.resolve("S1") == ["GPU-b"] and h.resolve("GPU-") == ["GPU-a", "GPU-b"] and h.resolve("cuda:0", "n1") == ["GPU-a"]
        (b,) = h.results(["GPU-b"])
        assert b.verdict == "FAULTY" and b.checks == ["gemm.row_checksum"] and b.cases == ["w/a/s+0+0"]


def test_v1_database_is_migrated_keeping_rows(tmp_path):
    db = tmp_path / "h.sqlite"
    c = sqlite3.connect(db)
    c.executescript(hist_mod.MIGRATIONS[0])
    c.execute("INSERT INTO devices VALUES ('GPU-old', NULL, 'A100', 'cuda', 1.0, 1.0, 'n0', 'cuda:0')")
    c.execute("INSERT INTO sweeps(id, started) VALUES (1, 1.0)")
    c.execute("INSERT INTO results(sweep_id, uuid, ts, verdict) VALUES (1, 'GPU-old', 1.0, 'SUSPECT')")
    c.execute("PRAGMA user_version = 1")
    c.commit()
    c.close()
    with History(db) as h:
        assert h.version == hist_mod.SCHEMA_VERSION
        (old,) = h.results(["GPU-old"])
        assert old.verdict == "SUSPECT" and old.seed is None and old.coverage == {} and old.vtasks == []  # v3 columns, empty
        h.record_action("GPU-old", "quarantine", QUARANTINED, "x", ["true"], False, None, None)  # v2 table exists
        assert h.counts() == {"devices": 1, "sweeps": 1, "results": 1, "actions": 1}


def test_newer_schema_is_refused(tmp_path):
    db = tmp_path / "h.sqlite"
    History(db).close()
    c = sqlite3.connect(db)
    c.execute("PRAGMA user_version = 99")
    c.close()
    with pytest.raises(HistoryError, match="schema version 99, newer than this aegis understands"):
        History(db)


@pytest.mark.parametrize("content", [b"this is not a database\n" * 10, b"\x00\xff" * 3000])
def test_garbage_file_is_reported_and_not_overwritten(tmp_path, content):
    db = tmp_path / "h.sqlite"
    db.write_bytes(content)
    before = sha(db)
    with pytest.raises(HistoryError, match=r"is not an SQLite database .* left untouched"):
        History(db)
    assert sha(db) == before and not (tmp_path / "h.sqlite-wal").exists()


def test_another_programs_database_is_left_untouched(tmp_path):
    """A valid SQLite file of another program (schema version 0, tables of its own): opening
    it, even to read, used to add our tables and set user_version = 2."""
    path = tmp_path / "other.sqlite"
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE inventory(host TEXT)")
    conn.commit()
    conn.close()
    before = hashlib.sha256(path.read_bytes()).hexdigest()
    for create in (True, False):
        with pytest.raises(HistoryError, match=r"SQLite database of something else \(it holds inventory\)"):
            History(path, create=create)
    assert hashlib.sha256(path.read_bytes()).hexdigest() == before
    conn = sqlite3.connect(path)
    assert [r[0] for r in conn.execute("SELECT name FROM sqlite_master")] == ["inventory"]
    assert conn.execute("PRAGMA user_version").fetchone()[0] == 0
    conn.close()


def test_truncated_database_is_reported_and_not_overwritten(tmp_path):
    db = tmp_path / "h.sqlite"
    with History(db) as h:
        for _ in range(30):
            h.record_sweep(doc({f"GPU-{i}": "HEALTHY" for i in range(8)}))
        h.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    data = db.read_bytes()
    for cut in (50, len(data) // 2):
        db.write_bytes(data[:cut])
        before = sha(db)
        with pytest.raises(HistoryError, match=r"truncated|corrupt|integrity"), History(db) as h:
            h.results()
        assert sha(db) == before


def test_history_cli_reports_garbage_clearly(tmp_path):
    db = tmp_path / "h.sqlite"
    db.write_text("garbage")
    p = subprocess.run([sys.executable, "-m", "aegis_cli", "history", "--db", str(db)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 3 and "Error: history database" in p.stderr and "not an SQLite database" in p.stderr
    assert db.read_text() == "garbage"


def test_sigkill_during_writes_keeps_whole_sweeps(tmp_path):
    """A writer killed at a random moment leaves every sweep either whole or absent."""
    db = tmp_path / "h.sqlite"
    script = textwrap.dedent(f"""
        import sys; sys.path.insert(0, {str(hist_mod.__file__.rsplit('/aegis_cli/', 1)[0])!r})
        from aegis_cli.fleet.history import History
        from tests.fleet.test_history import doc
        h = History({str(db)!r})
        print("ready", flush=True)
        while True:
            h.record_sweep(doc({{f"GPU-{{i}}": "SUSPECT" for i in range(16)}}))
    """)
    p = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, cwd=str(tmp_path))
    assert p.stdout.readline().strip() == b"ready"
    time.sleep(1.0)
    p.kill()
    p.wait()
    with History(db) as h:
        counts = h.counts()
        per_sweep = h.conn.execute("SELECT count(*) FROM results GROUP BY sweep_id").fetchall()
    assert counts["sweeps"] > 0 and {n for (n,) in per_sweep} == {16} and len(per_sweep) == counts["sweeps"]


def rows(*verdicts: str, start: float = 0.0, step: float = 3600.0) -> list[ResultRow]:
    return [ResultRow("U", start + i * step, v) for i, v in enumerate(verdicts)]


def test_policy_faulty_once_quarantines_for_good_by_default():
    cfg = PolicyConfig(probation_sweeps=2)
    st = evaluate("U", rows("HEALTHY", "FAULTY", *["HEALTHY"] * 10), cfg)
    assert st.state == QUARANTINED and st.permanent and st.clean_streak == 10 and "FAULTY 1×" in st.reason
    st = evaluate("U", rows("FAULTY", "HEALTHY", "HEALTHY"), PolicyConfig(probation_sweeps=2, readmit_faulty=True))
    assert st.state == ACTIVE


def test_policy_suspects_within_window_then_probation():
    cfg = PolicyConfig(suspect_count=3, window_days=1, probation_sweeps=3)
    # three SUSPECTs spread over three days never meet within one day
    assert evaluate("U", rows("SUSPECT", "SUSPECT", "SUSPECT", step=86400 * 1.1), cfg).state == ACTIVE
    st = evaluate("U", rows("SUSPECT", "HEALTHY", "SUSPECT", "SUSPECT"), cfg)
    assert st.state == QUARANTINED and st.reason.startswith("SUSPECT 3× within 1 days")
    st = evaluate("U", rows("SUSPECT", "SUSPECT", "SUSPECT", "HEALTHY", "ERROR", "HEALTHY"), cfg)
    assert st.state == PROBATION and st.clean_streak == 2  # ERROR neither counts nor resets
    st = evaluate("U", rows("SUSPECT", "SUSPECT", "SUSPECT", "HEALTHY", "HEALTHY", "SUSPECT", "HEALTHY"), cfg)
    assert st.state == PROBATION and st.clean_streak == 1  # a bad result restarts probation
    st = evaluate("U", rows("SUSPECT", "SUSPECT", "SUSPECT", "HEALTHY", "HEALTHY", "HEALTHY", "SUSPECT"), cfg)
    assert st.state == ACTIVE  # re-admitted; earlier SUSPECTs no longer count


def test_policy_counts_a_faulty_result_towards_suspect_count():
    # with one FAULTY tolerated (faulty_count 2), FAULTY + 2 SUSPECT must quarantine as 3 SUSPECT do:
    # turning a SUSPECT into a FAULTY result kept the device in service
    cfg = PolicyConfig(faulty_count=2, suspect_count=3)
    st = evaluate("U", rows("FAULTY", "SUSPECT", "SUSPECT"), cfg)
    assert st.state == QUARANTINED and st.reason.startswith("SUSPECT 2×, FAULTY 1×") and not st.permanent
    assert evaluate("U", rows("SUSPECT", "FAULTY", "HEALTHY"), cfg).state == ACTIVE


def test_wilson_bounds_and_rate_text():
    assert wilson(0, 0) == (0.0, 1.0)
    lo, hi = wilson(3, 40)
    assert 0.02 < lo < 0.03 and 0.19 < hi < 0.21
    assert rate_text(3, 40) == "failed 3 of 40 sweeps (95% CI 2.6–19.9%)"
    assert wilson(0, 300)[1] < wilson(0, 3)[1]


def test_parse_since():
    now = 1_000_000.0
    assert parse_since("30d", now) == now - 30 * 86400 and parse_since("12h", now) == now - 43200
    assert parse_since("2025-01-31", now) == 1738281600.0
    with pytest.raises(Exception, match="use a duration like 30d"):
        parse_since("yesterday", now)


def test_results_keep_recording_order_when_the_clock_steps_back(tmp_path, monkeypatch):
    t = [time.time()]
    monkeypatch.setattr(hist_mod.time, "time", lambda: t[0])
    cfg = PolicyConfig(probation_sweeps=5)
    with History(tmp_path / "h.sqlite") as h:
        for v in ["SUSPECT"] * 3 + ["HEALTHY"] * 4:
            t[0] += 3600
            h.record_sweep(doc({"GPU-a": v}))
        assert evaluate("GPU-a", h.results(["GPU-a"]), cfg).state == PROBATION
        t[0] -= 86400  # NTP steps the clock back a day; a new failure must still count
        h.record_sweep(doc({"GPU-a": "SUSPECT"}))
        st = evaluate("GPU-a", h.results(["GPU-a"]), cfg)
        assert st.state == QUARANTINED and st.clean_streak == 0 and st.last.verdict == "SUSPECT"


def test_ranks_opening_a_new_database_at_once_all_get_it(tmp_path):
    # torchrun's ranks on a fresh node all create the history together: switching it to WAL made
    # SQLite answer "locked" at once to all but one, and that rank's sweep died (its peers then
    # waited in all_gather until the timeout)
    code = textwrap.dedent("""
        import sys, time
        from aegis_cli.fleet.history import History
        while time.time() < float(sys.argv[2]):
            pass
        with History(sys.argv[1]) as h:
            print(h.version)
    """)
    for trial in range(3):
        db = tmp_path / f"h{trial}.sqlite"
        start = time.time() + 2.0
        procs = [subprocess.Popen([sys.executable, "-c", code, str(db), str(start)], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True) for _ in range(4)]
        outs = [p.communicate(timeout=120) for p in procs]
        assert all(p.returncode == 0 for p in procs), [e for _, e in outs]
        assert [o.strip() for o, _ in outs] == [str(hist_mod.SCHEMA_VERSION)] * 4


def test_quarantine_reason_says_what_it_is():
    cfg = PolicyConfig(suspect_count=3, error_counts_as_suspect=True)
    t = time.time()
    rows = [ResultRow("G", t + i, v) for i, v in enumerate(["SUSPECT", "ERROR", "ERROR"])]
    st = evaluate("G", rows, cfg)
    assert st.state == QUARANTINED and st.reason.startswith("SUSPECT 1×, ERROR 2×")
    st = evaluate("G", [*rows, ResultRow("G", t + 9, "FAULTY", checks=["gemm.row_checksum"])], cfg)
    assert st.permanent and st.reason == "FAULTY while quarantined (gemm.row_checksum)" and st.since == t + 9


def test_fleet_wide_queries_take_thousands_of_devices(tmp_path):
    """A fleet's history names more devices than SQLite binds parameters in one statement
    (999 before 3.32): results and last events for long uuid lists are filtered in Python, in
    recording order, and ``aegis history``'s summary covers every device with its own rows."""
    from aegis_cli.fleet.summary import history_summary

    n = 2 * hist_mod.MAX_BOUND_UUIDS + 7
    uuids = [f"GPU-{i:05d}" for i in range(n)]
    with History(tmp_path / "h.sqlite") as h:
        for chunk in range(0, n, 8):  # one sweep per 8-GPU node, twice
            part = uuids[chunk:chunk + 8]
            h.record_sweep(doc(dict.fromkeys(part, "HEALTHY")))
            h.record_sweep(doc({u: ("FAULTY" if u == "GPU-00003" else "HEALTHY") for u in part}))
        h.retire("GPU-00005", "RMA")
        wanted = uuids[:: 3]
        rows = h.results(wanted)
        assert len(rows) == 2 * len(wanted) and {r.uuid for r in rows} == set(wanted)
        assert [r.verdict for r in rows if r.uuid == "GPU-00003"] == ["HEALTHY", "FAULTY"]
        assert h.last_events(uuids) == {"GPU-00005": ("retire", h.last_events(["GPU-00005"])["GPU-00005"][1])}
        summary = history_summary(h, PolicyConfig())
    by = {d["uuid"]: d for d in summary["devices"]}
    assert len(by) == n and all(d["sweeps"] == 2 for d in by.values())
    assert by["GPU-00003"]["state"] == QUARANTINED and by["GPU-00005"]["state"] == "RETIRED"
    assert sum(d["failures"] for d in by.values()) == 1
