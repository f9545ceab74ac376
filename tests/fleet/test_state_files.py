"""The history and lock files as a root-run sweep meets them: read-only, empty, linked,
FIFOs, and the lock named as the history. Each is refused before any device is scanned,
with a message that says what is wrong, and nothing outside is written."""

from __future__ import annotations

import contextlib
import os
import subprocess
import time

import pytest

from aegis_cli.fleet.config import load_config
from aegis_cli.fleet.history import History
from aegis_cli.fleet.lock import SweepLock
from aegis_cli.fleet.sweep import run_sweep
from aegis_cli.ops.errors import ConfigError, HistoryError, LockError
from tests.fleet_helpers import aegis, env, write_config


@contextlib.contextmanager
def immutable(path):
    """chattr +i for the duration; skips where the file system or capabilities do not allow it."""
    if subprocess.run(["chattr", "+i", str(path)], capture_output=True).returncode != 0:
        pytest.skip("chattr +i is not available here")
    try:
        yield
    finally:
        subprocess.run(["chattr", "-i", str(path)], check=True)


def sweep(config, timeout=120):
    return subprocess.run(aegis("sweep", "--config", str(config)), env=env(1), capture_output=True, text=True,
                          timeout=timeout, cwd=config.parent)


@pytest.mark.parametrize("what", ["file", "folder"])
def test_read_only_history_is_refused_as_read_only_before_any_device_is_scanned(tmp_path, what):
    state = tmp_path / "state"
    state.mkdir()
    db = state / "history.sqlite"
    History(db).close()
    cfg = write_config(tmp_path, history={"path": "state/history.sqlite"})
    with immutable(db if what == "file" else state):
        with pytest.raises(HistoryError, match="is read-only"):
            History(db)
        p = sweep(cfg)
    assert p.returncode == 3, p.stderr
    err = [ln for ln in p.stderr.splitlines() if ln.startswith("Error:")]
    assert len(err) == 1 and "read-only" in err[0] and "corrupt" not in err[0], p.stderr
    assert "device_start" not in p.stderr and "Traceback" not in p.stderr


def test_empty_history_file_is_refused_not_taken_as_a_new_history(tmp_path):
    db = tmp_path / "history.sqlite"
    db.touch()
    for create in (True, False):
        with pytest.raises(HistoryError, match=r"is empty \(0 bytes\).*left untouched"):
            History(db, create=create)
    assert db.read_bytes() == b""
    p = sweep(write_config(tmp_path))
    assert p.returncode == 3 and "is empty (0 bytes)" in p.stderr and "device_start" not in p.stderr, p.stderr
    assert db.read_bytes() == b""


def test_a_new_history_appears_complete_and_is_opened_by_every_process(tmp_path):
    db = tmp_path / "sub" / "history.sqlite"
    with History(db) as h:
        assert h.counts() == {"devices": 0, "sweeps": 0, "results": 0, "actions": 0}
    assert db.read_bytes().startswith(b"SQLite format 3\x00")
    assert [p.name for p in db.parent.iterdir()] == ["history.sqlite"]  # no temp file left beside it


@pytest.mark.parametrize("side", ["", "-wal", "-shm"])
def test_history_never_follows_a_planted_symlink(tmp_path, side):
    db = tmp_path / "history.sqlite"
    if side:
        History(db).close()
    victim, dangling = tmp_path / "etc-passwd", tmp_path / "etc" / "created-by-root.db"
    victim.write_text("root:x:0:0\n")
    for target in (victim, dangling):
        link = tmp_path / f"history.sqlite{side}"
        link.unlink(missing_ok=True)
        link.symlink_to(target)
        for create in (True, False):
            with pytest.raises(HistoryError, match="symbolic link"):
                History(db, create=create)
        assert victim.read_text() == "root:x:0:0\n"
        assert not dangling.parent.exists()
        assert not list(tmp_path.glob("etc-passwd-*"))


def test_lock_file_never_follows_a_planted_symlink(tmp_path):
    victim, dangling = tmp_path / "victim", tmp_path / "nowhere" / "made-by-root"
    victim.write_text("keep me\n")
    for target in (victim, dangling):
        link = tmp_path / "sweep.lock"
        link.unlink(missing_ok=True)
        link.symlink_to(target)
        with pytest.raises(LockError, match="symbolic link"), SweepLock(link):
            pass
    assert victim.read_text() == "keep me\n" and not dangling.parent.exists()


def test_fifo_history_is_refused_at_once_without_hanging(tmp_path):
    fifo = tmp_path / "history.sqlite"
    os.mkfifo(fifo)
    start = time.monotonic()
    with pytest.raises(HistoryError, match="is a FIFO, not a regular file"):
        History(fifo)
    p = sweep(write_config(tmp_path), timeout=60)
    assert p.returncode == 3 and "is a FIFO" in p.stderr and "device_start" not in p.stderr, p.stderr
    h = subprocess.run(aegis("history", "--db", str(fifo)), env=env(1), capture_output=True, text=True, timeout=60)
    assert h.returncode == 3 and "is a FIFO" in h.stderr and "Traceback" not in h.stderr, h.stderr
    assert time.monotonic() - start < 60
    # the node lock was released: a sweep with a usable history now runs
    fifo.unlink()
    assert sweep(write_config(tmp_path)).returncode in (0, 1, 2)


def test_fifo_lock_file_is_refused(tmp_path):
    fifo = tmp_path / "sweep.lock"
    os.mkfifo(fifo)
    with pytest.raises(LockError, match="is a FIFO, not a regular file"), SweepLock(fifo):
        pass


@pytest.mark.parametrize("lock", ["history.sqlite", "./history.sqlite", "history.sqlite-wal"])
def test_lock_file_naming_the_history_is_a_config_error(tmp_path, lock):
    cfg = load_config(write_config(tmp_path, lock_file=lock))
    with pytest.raises(ConfigError, match=r"lock_file .* is the history database"):
        run_sweep(cfg)
    assert not (tmp_path / "history.sqlite").exists() and not (tmp_path / lock).exists()
