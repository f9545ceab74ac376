"""One sweep per node at a time: an exclusive ``fcntl.flock`` on a lock file that records
who holds it (pid, host, start time, command line).

The kernel drops a flock when its holder dies, SIGKILL included, so a stale lock file
never blocks the next sweep; the file itself is left in place (deleting it would let two
sweeps lock two different inodes).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import stat
import sys
import time
from pathlib import Path

from aegis_cli.fleet.statefiles import check_lock_path
from aegis_cli.ops.errors import LockError


def _record(data: bytes) -> dict | None:
    """The lock record a lock file holds (a JSON object), or None."""
    try:
        rec = json.loads(data.decode("utf-8") or "{}")
    except (UnicodeDecodeError, ValueError):
        return None
    return rec if isinstance(rec, dict) else None


def _holder(path: Path) -> str:
    try:
        info = _record(path.read_bytes())
    except OSError:
        info = None
    if info is None:
        return "an unknown process (the lock file holds no readable record)"
    started = info.get("started")
    when = time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(started)) if isinstance(started, (int, float)) else "?"
    cmd = " ".join(info.get("command") or [])
    return f"pid {info.get('pid', '?')} on {info.get('host', '?')}, started {when}" + (f" ({cmd})" if cmd else "")


def _not_a_lock_file(fd: int) -> str | None:
    """Why the open file is not ours to truncate, or None: a lock file is a regular file that
    is empty or holds one lock record (a JSON object)."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        return "is not a regular file"
    data = os.pread(fd, 4096, 0)
    if not data.strip():
        return None
    rec = _record(data)
    if st.st_size >= 4096 or rec is None or not {"pid", "host", "started"} <= rec.keys():
        return f"exists and is not an aegis lock file ({st.st_size} bytes)"
    return None


class SweepLock:
    """``with SweepLock(path):`` — raises LockError naming the holder when taken."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._fd: int | None = None

    def acquire(self) -> None:
        # never through a link (a dangling one would create its target as root) and never
        # blocking on a FIFO: _not_a_lock_file then refuses what is not a regular file
        check_lock_path(self.path)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise LockError(f"lock file {self.path} is a symbolic link (aegis never follows one there: give the real "
                                "path); it was left untouched") from None
            raise LockError(f"cannot open lock file {self.path}: {exc.strerror}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise LockError(f"another aegis sweep holds the lock {self.path}: {_holder(self.path)}") from None
        problem = _not_a_lock_file(fd)
        if problem:  # lock_file pointed at something else (the history, a report): never truncate it
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)
            raise LockError(f"lock file {self.path} {problem}; it was left untouched — point lock_file at a file of its own")
        record = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time(), "command": sys.argv}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
        self._fd = fd

    def release(self) -> None:
        if self._fd is None:
            return
        with contextlib.suppress(OSError):
            os.ftruncate(self._fd, 0)
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None

    def __enter__(self) -> SweepLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()
