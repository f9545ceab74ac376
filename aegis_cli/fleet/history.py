"""Per-device history in an embedded SQLite database (docs/design.md §1: track per physical GPU).

Rows are keyed by the device UUID (and serial where the backend knows it), never by the
hostname: a GPU moved to another node keeps its record. One sweep is one transaction, so
a sweep killed at any point (SIGTERM, SIGKILL, power loss) leaves either all of its rows
or none; WAL mode lets ``aegis history`` read while a sweep writes.

Opening is careful: a file that is not SQLite (bad header), fails ``PRAGMA quick_check``,
or carries a schema newer than this aegis raises HistoryError and is never written to; so
does a path that is a link, a FIFO, empty or read-only (fleet/statefiles.py). A new
database is created complete beside its path and linked into place, so no process ever
sees it half made.

Schema (``PRAGMA user_version`` = len(MIGRATIONS)):
  devices(uuid PK, serial, name, backend, first_seen, last_seen, last_host, last_id)
  sweeps(id PK, started, finished, host, kind, command, exit_code, duration, rank, world_size)
  results(id PK, sweep_id → sweeps, uuid → devices, ts, host, device_id, verdict, workload,
          error, seconds, evidence, checks JSON, cases JSON, noise_max)
  actions(id PK, ts, uuid, event, state, reason, argv JSON, executed, returncode, output)   [v2]
  v3: sweeps += seed, seed_derived, dither (the sweep's scale-dithering index);
      results += seed, coverage JSON (dithering run), launches, failures, vtasks JSON (replays)
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from aegis_cli.fleet import statefiles
from aegis_cli.ops.errors import HistoryError

# uuids bound as statement parameters at most; longer lists are filtered in Python (SQLite caps a
# statement's variables: 999 before 3.32, and a fleet-wide list is thousands of devices long)
MAX_BOUND_UUIDS = 500

MIGRATIONS: list[str] = [
    # v1: devices, sweeps, results
    """
    CREATE TABLE devices (
        uuid TEXT PRIMARY KEY, serial TEXT, name TEXT, backend TEXT,
        first_seen REAL NOT NULL, last_seen REAL NOT NULL, last_host TEXT, last_id TEXT);
    CREATE TABLE sweeps (
        id INTEGER PRIMARY KEY, started REAL NOT NULL, finished REAL, host TEXT, kind TEXT,
        command TEXT, exit_code INTEGER, duration REAL);
    CREATE TABLE results (
        id INTEGER PRIMARY KEY, sweep_id INTEGER NOT NULL REFERENCES sweeps(id),
        uuid TEXT NOT NULL REFERENCES devices(uuid), ts REAL NOT NULL, host TEXT, device_id TEXT,
        verdict TEXT NOT NULL CHECK (verdict IN ('HEALTHY', 'SUSPECT', 'FAULTY', 'ERROR')),
        workload TEXT, error TEXT, seconds REAL, evidence INTEGER, checks TEXT, cases TEXT);
    CREATE INDEX results_by_device ON results(uuid, ts);
    """,
    # v2: actions taken by the policy; distributed sweeps; checksum noise per result
    """
    CREATE TABLE actions (
        id INTEGER PRIMARY KEY, ts REAL NOT NULL, uuid TEXT NOT NULL, event TEXT NOT NULL,
        state TEXT, reason TEXT, argv TEXT, executed INTEGER NOT NULL DEFAULT 0,
        returncode INTEGER, output TEXT);
    ALTER TABLE sweeps ADD COLUMN rank INTEGER;
    ALTER TABLE sweeps ADD COLUMN world_size INTEGER;
    ALTER TABLE results ADD COLUMN noise_max REAL;
    """,
    # v3: seeds and scale dithering (coverage), launch counts, vTask replays
    """
    ALTER TABLE sweeps ADD COLUMN seed INTEGER;
    ALTER TABLE sweeps ADD COLUMN seed_derived INTEGER;
    ALTER TABLE sweeps ADD COLUMN dither INTEGER;
    ALTER TABLE results ADD COLUMN seed INTEGER;
    ALTER TABLE results ADD COLUMN coverage TEXT;
    ALTER TABLE results ADD COLUMN launches INTEGER;
    ALTER TABLE results ADD COLUMN failures INTEGER;
    ALTER TABLE results ADD COLUMN vtasks TEXT;
    """,
]
SCHEMA_VERSION = len(MIGRATIONS)


def _initialise(conn: sqlite3.Connection) -> None:
    """A new database: every migration, then WAL (kept in the file's header)."""
    conn.execute("BEGIN")
    for migration in MIGRATIONS:
        for stmt in filter(str.strip, migration.split(";")):
            conn.execute(stmt)
    conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
    conn.execute("COMMIT")
    conn.execute("PRAGMA journal_mode=WAL")


def _uuid_filter(uuids: list[str] | None) -> tuple[str, list[str], set[str] | None]:
    """(SQL condition or "", its arguments, uuids to keep in Python or None) selecting ``uuids``
    (None: every device). Long lists are filtered in Python, not bound (MAX_BOUND_UUIDS)."""
    if uuids is None:
        return "", [], None
    if len(uuids) > MAX_BOUND_UUIDS:
        return "", [], set(uuids)
    return f"uuid IN ({', '.join('?' * len(uuids))})", list(uuids), None


def _is_locked(exc: sqlite3.Error) -> bool:
    return "locked" in str(exc) or "busy" in str(exc)


class _Locked(Exception):
    """Opening met a lock held by another process (retried by History._open)."""

    def __init__(self, what: str, error: sqlite3.Error):
        super().__init__(what)
        self.what, self.error = what, error


@dataclass
class ResultRow:
    uuid: str
    ts: float
    verdict: str
    host: str = ""
    device_id: str = ""
    workload: str = ""
    error: str | None = None
    seconds: float = 0.0
    evidence: int = 0
    checks: list[str] = field(default_factory=list)  # check ids that flagged (e.g. gemm.row_checksum)
    cases: list[str] = field(default_factory=list)  # case ids that flagged, for prioritising
    sweep_id: int = 0
    seed: int | None = None  # the sweep's seed (None: recorded before schema v3)
    coverage: dict = field(default_factory=dict)  # the scale dithering it ran (fleet/coverage.py)
    launches: int | None = None  # GEMM launches checked
    failures: int | None = None  # failing runs among them
    vtasks: list[dict] = field(default_factory=list)  # replayed bundles and their outcomes (fleet/vtasks.py)

    def to_dict(self) -> dict:
        return {"uuid": self.uuid, "ts": self.ts, "verdict": self.verdict, "host": self.host, "device": self.device_id,
                "workload": self.workload, "error": self.error, "seconds": self.seconds, "evidence": self.evidence,
                "checks": self.checks, "cases": self.cases, "sweep_id": self.sweep_id, "seed": self.seed,
                "coverage": self.coverage, "launches": self.launches, "failures": self.failures, "vtasks": self.vtasks}


def _replays(vt: dict) -> list[dict]:
    """A device's vTask replays as the history keeps them: per bundle, or the one error that
    stopped them all (a directory that could not be listed, a worker killed while replaying)."""
    return vt.get("bundles") or ([{"bundle": None, "sha256": None, "outcome": "error", "error": vt["error"]}] if vt.get("error") else [])


class History:
    """The history database. Use as a context manager; every method raises HistoryError."""

    def __init__(self, path: str | Path, *, busy_timeout: float = 30.0, create: bool = True):
        """``create``: the sweep's writer, which makes a missing database and refuses one it
        could not write; without it (``aegis history``) a missing database is an error."""
        self.path = Path(path)
        if statefiles.lstat(self.path) is None:
            if not create:
                raise HistoryError(f"history database {self.path} does not exist (no sweep has recorded anything yet)")
            statefiles.create_database(self.path, _initialise)
        statefiles.check_database(self.path, write=create)
        try:
            self.conn = sqlite3.connect(self.path, timeout=busy_timeout, isolation_level=None)
        except sqlite3.Error as exc:
            raise HistoryError(f"history database {self.path}: cannot open ({exc})") from None
        try:
            self._open(busy_timeout)
            if create:  # what the checks above cannot see (a read-only mount SQLite fell back to): ask SQLite
                self._probe_write()
        except BaseException:
            self.conn.close()
            raise

    # -- opening -----------------------------------------------------------------------
    def _open(self, busy_timeout: float) -> None:
        """Check, then migrate. Several processes may open a new database at once (the ranks of a
        node under torchrun): switching it to WAL needs it to itself, and SQLite then answers
        "locked" at once instead of waiting; so a locked check or migration is retried until the
        busy timeout."""
        deadline = time.monotonic() + busy_timeout
        while True:
            try:
                self._verify()
                self._migrate()
                return
            except _Locked as exc:
                if time.monotonic() >= deadline:
                    raise self._fail(exc.what, exc.error) from None
                time.sleep(0.05)

    def _probe_write(self) -> None:
        try:
            self.conn.execute("BEGIN IMMEDIATE")
            self.conn.execute("ROLLBACK")
        except sqlite3.Error as exc:
            raise self._fail("checking it can be written", exc) from None

    def _fail(self, what: str, exc: sqlite3.Error) -> HistoryError:
        msg = str(exc)
        if "readonly" in msg or "read-only" in msg:
            return statefiles.read_only(self.path, msg)
        if _is_locked(exc):
            return HistoryError(f"history database {self.path} is locked by another process ({msg}) while {what}; "
                                "try again when the other sweep has finished")
        return HistoryError(f"history database {self.path} is corrupt or unreadable ({msg}) while {what}; "
                            "it was left untouched — restore it from a backup or move it aside")

    def _verify(self) -> None:
        try:
            # one read transaction: a version read before another process's migration commits and
            # its tables read after would look like some other program's database
            self.conn.execute("BEGIN")
            try:
                rows = self.conn.execute("PRAGMA quick_check").fetchall()
                version = self.conn.execute("PRAGMA user_version").fetchone()[0]
                names = [r[0] for r in self.conn.execute("SELECT name FROM sqlite_master WHERE name NOT LIKE 'sqlite_%' ORDER BY name")]
            finally:
                self.conn.execute("COMMIT")
        except sqlite3.Error as exc:
            raise _Locked("checking it", exc) if _is_locked(exc) else self._fail("checking it", exc) from None
        if version == 0 and names:  # not ours: never add our tables to another program's database
            shown = ", ".join(names[:5]) + (" …" if len(names) > 5 else "")
            raise HistoryError(f"history database {self.path} is an SQLite database of something else (it holds {shown}); "
                               "it was left untouched — point history.path elsewhere")
        if rows != [("ok",)]:
            detail = "; ".join(r[0] for r in rows[:3])
            raise HistoryError(f"history database {self.path} failed its integrity check ({detail}); it was left untouched — "
                               "restore it from a backup or move it aside")
        if version > SCHEMA_VERSION:
            raise HistoryError(f"history database {self.path} has schema version {version}, newer than this aegis "
                               f"understands ({SCHEMA_VERSION}); upgrade aegis")
        self.version = version

    def _migrate(self) -> None:
        what = f"migrating it to schema {SCHEMA_VERSION}"
        try:
            if self.conn.execute("PRAGMA journal_mode").fetchone()[0] != "wal":
                self.conn.execute("PRAGMA journal_mode=WAL")
            self.conn.execute("PRAGMA foreign_keys=ON")
            self.conn.execute("PRAGMA synchronous=NORMAL")
            while self.version < SCHEMA_VERSION:
                with self._transaction():
                    current = self.conn.execute("PRAGMA user_version").fetchone()[0]
                    if current == self.version:  # nobody migrated it meanwhile
                        for stmt in filter(str.strip, MIGRATIONS[self.version].split(";")):
                            self.conn.execute(stmt)
                        self.conn.execute(f"PRAGMA user_version = {self.version + 1}")
                self.version = self.conn.execute("PRAGMA user_version").fetchone()[0]
        except sqlite3.Error as exc:
            raise _Locked(what, exc) if _is_locked(exc) else self._fail(what, exc) from None

    def close(self) -> None:
        self.conn.close()

    def __enter__(self) -> History:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- writing -----------------------------------------------------------------------
    @contextlib.contextmanager
    def _transaction(self) -> Iterator[None]:
        """One write transaction, taken up front (no lock upgrade half-way); rolled back on any
        exception, a KeyboardInterrupt or SIGTERM included, so a sweep lands whole or not at all."""
        self.conn.execute("BEGIN IMMEDIATE")
        try:
            yield
        except BaseException:
            self.conn.execute("ROLLBACK")
            raise
        self.conn.execute("COMMIT")

    def record_sweep(self, doc: dict, *, rank: int | None = None, world_size: int | None = None) -> int:
        """Record one report (sweep or scan JSON) in a single transaction; returns the sweep id."""
        now = time.time()
        try:
            with self._transaction():
                marks = (doc.get("sweep") or {}).get("coverage") or {}
                cur = self.conn.execute(
                    "INSERT INTO sweeps(started, finished, host, kind, command, exit_code, duration, rank, world_size, seed, "
                    "seed_derived, dither) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (now - float(doc.get("duration_seconds") or 0), now, doc.get("host"), doc.get("kind"),
                     json.dumps(doc.get("command_line") or []), doc.get("exit_code"), doc.get("duration_seconds"), rank, world_size,
                     doc.get("seed"), int(bool(marks.get("seed_derived"))), marks.get("dither_index")))
                sweep_id = cur.lastrowid
                for d in doc["devices"]:
                    self._record_device(sweep_id, now, d)
        except sqlite3.Error as exc:
            raise self._fail("recording a sweep", exc) from None
        return sweep_id

    def _record_device(self, sweep_id: int, now: float, d: dict) -> None:
        dev = d["device"]
        self.conn.execute(
            "INSERT INTO devices(uuid, serial, name, backend, first_seen, last_seen, last_host, last_id) VALUES (?, ?, ?, ?, ?, ?, ?, ?) "
            "ON CONFLICT(uuid) DO UPDATE SET serial = coalesce(excluded.serial, serial), name = excluded.name, "
            "last_seen = excluded.last_seen, last_host = excluded.last_host, last_id = excluded.last_id",
            (dev["uuid"], dev.get("serial"), dev.get("name"), dev.get("backend"), now, now, dev.get("host"), dev.get("id")))
        ev = d.get("evidence") or []
        flagged = [e for e in ev if e.get("severity") in ("SUSPECT", "FAULTY")]
        noise = (d.get("noise") or {}).get("clean_max")
        cov = d.get("coverage") or {}
        self.conn.execute(
            "INSERT INTO results(sweep_id, uuid, ts, host, device_id, verdict, workload, error, seconds, evidence, checks, cases, noise_max, "
            "seed, coverage, launches, failures, vtasks) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (sweep_id, dev["uuid"], now, dev.get("host"), dev.get("id"), d["verdict"], d.get("workload"), d.get("error"),
             (d.get("timings") or {}).get("seconds"), len(ev),
             json.dumps(sorted({e["check"] for e in flagged})), json.dumps(sorted({e["case_id"] for e in flagged})),
             noise if isinstance(noise, (int, float)) else None, cov.get("seed"), json.dumps(cov.get("dither") or {}),
             cov.get("launches"), cov.get("failures"), json.dumps(_replays((d.get("probes") or {}).get("vtasks") or {}))))

    def record_action(self, uuid: str, event: str, state: str, reason: str, argv: list[str] | None,
                      executed: bool, returncode: int | None, output: str | None) -> None:
        try:
            with self._transaction():
                self.conn.execute("INSERT INTO actions(ts, uuid, event, state, reason, argv, executed, returncode, output) "
                                  "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                                  (time.time(), uuid, event, state, reason, json.dumps(argv) if argv is not None else None,
                                   int(executed), returncode, output))
        except sqlite3.Error as exc:
            raise self._fail("recording an action", exc) from None

    # -- reading -----------------------------------------------------------------------
    def _query(self, sql: str, args: Iterable = ()) -> list[tuple]:
        try:
            return self.conn.execute(sql, tuple(args)).fetchall()
        except sqlite3.Error as exc:
            raise self._fail("reading it", exc) from None

    def devices(self) -> list[dict]:
        cols = ("uuid", "serial", "name", "backend", "first_seen", "last_seen", "last_host", "last_id")
        return [dict(zip(cols, r, strict=True)) for r in self._query(f"SELECT {', '.join(cols)} FROM devices ORDER BY last_host, last_id")]

    def resolve(self, ident: str, host: str | None = None) -> list[str]:
        """UUIDs matching ``ident``: a UUID, a serial, a UUID prefix (≥ 4 characters), or a
        device id such as ``cuda:3`` as last seen on ``host`` (default: any host)."""
        rows = self._query("SELECT uuid FROM devices WHERE uuid = ? OR serial = ?", (ident, ident))
        if not rows and len(ident) >= 4:
            rows = self._query("SELECT uuid FROM devices WHERE uuid LIKE ? ESCAPE '\\'",
                               (ident.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%",))
        if not rows:
            sql, args = "SELECT uuid FROM devices WHERE last_id = ?", [ident]
            if host:
                sql, args = sql + " AND last_host = ?", [*args, host]
            rows = self._query(sql, args)
        return sorted(r[0] for r in rows)

    def results(self, uuids: list[str] | None = None, since: float | None = None) -> list[ResultRow]:
        sql = ("SELECT uuid, ts, verdict, host, device_id, workload, error, seconds, evidence, checks, cases, sweep_id, "
               "seed, coverage, launches, failures, vtasks FROM results")
        cond, args, wanted = _uuid_filter(uuids)
        where = [cond] if cond else []
        if since is not None:
            where.append("ts >= ?")
            args.append(since)
        if where:
            sql += " WHERE " + " AND ".join(where)
        out = []
        # in the order they were recorded, not by timestamp: a clock stepped back must not file a
        # new result under old ones (the policy walks results in this order)
        for r in self._query(sql + " ORDER BY id", args):
            if wanted is not None and r[0] not in wanted:
                continue
            out.append(ResultRow(uuid=r[0], ts=r[1], verdict=r[2], host=r[3] or "", device_id=r[4] or "", workload=r[5] or "",
                                 error=r[6], seconds=r[7] or 0.0, evidence=r[8] or 0, checks=json.loads(r[9] or "[]"),
                                 cases=json.loads(r[10] or "[]"), sweep_id=r[11], seed=r[12], coverage=json.loads(r[13] or "{}"),
                                 launches=r[14], failures=r[15], vtasks=json.loads(r[16] or "[]")))
        return out

    def sweeps(self, host: str | None = None) -> list[dict]:
        """The recorded sweeps (of ``host``), oldest first: when, seed, whether it was derived, dithering index."""
        cols = ("id", "started", "host", "kind", "seed", "seed_derived", "dither")
        sql, args = f"SELECT {', '.join(cols)} FROM sweeps", []
        if host is not None:
            sql, args = sql + " WHERE host = ?", [host]
        return [dict(zip(cols, r, strict=True)) for r in self._query(sql + " ORDER BY id", args)]

    def retire(self, uuid: str, reason: str) -> None:
        """Mark a device gone (replaced, RMA'd): it leaves the quarantine list until it reports
        results again. Its rows stay."""
        self.record_action(uuid, "retire", "RETIRED", reason, None, False, None, None)

    def retired(self) -> dict[str, float]:
        """uuid → when it was retired, for devices whose last recorded event is a retirement."""
        return {u: ts for u, (ev, ts) in self.last_events().items() if ev == "retire"}

    def last_events(self, uuids: list[str] | None = None) -> dict[str, tuple[str, float]]:
        """uuid → (event, ts) of the last event recorded for it (quarantine, readmit or retire:
        what was last announced), for ``uuids`` or every device."""
        if uuids is not None and not uuids:
            return {}
        cond, args, keep = _uuid_filter(uuids)
        where = f" WHERE {cond}" if cond else ""
        sql = f"SELECT uuid, event, ts FROM actions WHERE id IN (SELECT MAX(id) FROM actions{where} GROUP BY uuid)"
        return {u: (ev, ts) for u, ev, ts in self._query(sql, args) if keep is None or u in keep}

    def actions(self, uuid: str | None = None) -> list[dict]:
        cols = ("ts", "uuid", "event", "state", "reason", "argv", "executed", "returncode", "output")
        sql, args = f"SELECT {', '.join(cols)} FROM actions", []
        if uuid:
            sql, args = sql + " WHERE uuid = ?", [uuid]
        rows = [dict(zip(cols, r, strict=True)) for r in self._query(sql + " ORDER BY ts, id", args)]
        for r in rows:
            r["argv"] = json.loads(r["argv"]) if r["argv"] else None
            r["executed"] = bool(r["executed"])
        return rows

    def counts(self) -> dict[str, int]:
        return {t: self._query(f"SELECT count(*) FROM {t}")[0][0] for t in ("devices", "sweeps", "results", "actions")}
