"""The files a sweep keeps its state in — the history database (with SQLite's ``-wal``,
``-shm`` and ``-journal`` beside it) and the node lock — checked the way a root-run cron job
must: before any work, and never through a link someone else planted.

- A symbolic link as the last component of any of these paths is refused, dangling or not:
  SQLite resolves links and creates its ``-wal``/``-shm`` next to the target, so a link in a
  shared directory would aim root's writes at any file (``/etc/…``). Links in the directories
  above are the operator's own layout and are followed.
- A FIFO, socket or device there is refused before it is opened (opening a FIFO blocks
  forever, with the node lock held).
- A history that cannot be written (immutable file, read-only directory or file system) is
  refused with that reason, before any device is scanned, not after.
- An empty (0-byte) history file is refused: aegis never leaves one (a new database appears
  complete, see ``History``), so it is a truncated database or a placeholder, and taking it as
  a new history would silently release every quarantined device.
"""

from __future__ import annotations

import contextlib
import errno
import os
import sqlite3
import stat
from pathlib import Path

from aegis_cli.ops import files
from aegis_cli.ops.errors import ConfigError, HistoryError, LockError

SQLITE_MAGIC = b"SQLite format 3\x00"
SIDE_FILES = ("-wal", "-shm", "-journal")  # what SQLite keeps beside a database
_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))


def lstat(path: Path, error: type[Exception] = HistoryError) -> os.stat_result | None:
    """The path's own lstat, None when it does not exist."""
    try:
        return path.lstat()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise error(f"{path}: cannot examine it ({exc.strerror})") from None


def not_a_plain_file(st: os.stat_result) -> str | None:
    """Why ``st`` (an lstat) is not a regular file, or None."""
    if stat.S_ISLNK(st.st_mode):
        return "is a symbolic link (aegis never follows one there: give the real path)"
    if stat.S_ISREG(st.st_mode):
        return None
    kind = next((name for test, name in _KINDS if test(st.st_mode)), "not a regular file")
    return f"is {kind}, not a regular file"


def check_database(path: Path, *, write: bool) -> None:
    """Refuse, without opening it for SQLite, a history ``path`` (which exists) that is a
    link or special file, empty, not SQLite or truncated, with a linked or special side file,
    or (``write``) that cannot be written. Raises HistoryError; leaves everything untouched."""
    st = lstat(path)
    if st is None:
        return
    problem = not_a_plain_file(st)
    if problem:
        raise HistoryError(f"history database {path} {problem}; it was left untouched")
    for suffix in SIDE_FILES:
        side = lstat(Path(f"{path}{suffix}"))
        problem = side and not_a_plain_file(side)
        if problem:
            raise HistoryError(f"history database {path}: its {suffix[1:].upper()} file {path}{suffix} {problem}; "
                               "it was left untouched — remove it")
    _check_header(path)
    if write:
        check_writable(path)


def _check_header(path: Path) -> None:
    try:
        # O_NONBLOCK: a FIFO swapped in since the lstat must not hang the sweep here
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise HistoryError(f"history database {path} is not a regular file; it was left untouched")
            head = os.pread(fd, 100, 0)
        finally:
            os.close(fd)
    except OSError as exc:
        raise HistoryError(f"history database {path}: cannot read ({exc.strerror})") from None
    if not head:
        raise HistoryError(f"history database {path} is empty (0 bytes): a truncated database or a placeholder, "
                           "never a history aegis wrote; it was left untouched — restore it from a backup, or remove "
                           "it to start a new history (every device then starts with no record)")
    if not head.startswith(SQLITE_MAGIC):
        raise HistoryError(f"history database {path} is not an SQLite database (header {head[:16]!r}); it was left untouched — "
                           "move it aside to start a new history, or point history.path elsewhere")
    if len(head) < 100:
        raise HistoryError(f"history database {path} is truncated ({len(head)} bytes, shorter than an SQLite header); "
                           "it was left untouched — restore it from a backup or move it aside")


def read_only(path: Path, why: str) -> HistoryError:
    return HistoryError(f"history database {path} is read-only ({why}); a sweep records its results there, so it "
                        "stopped before scanning any device — make it writable (chattr -i, a read-write mount, "
                        "permissions) or point history.path elsewhere")


def check_writable(path: Path) -> None:
    """The history file (if it exists) and its folder (SQLite creates ``-wal``/``-shm`` there)
    accept writes. Asked of the kernel, not of the mode bits: root passes every mode check
    but not an immutable file or a read-only mount."""
    if path.exists():
        try:
            os.close(os.open(path, os.O_WRONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC))
        except OSError as exc:
            if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS, errno.ETXTBSY):
                raise read_only(path, f"the file: {exc.strerror}") from None
            raise HistoryError(f"history database {path}: cannot open it for writing ({exc.strerror})") from None
    parent = path.parent
    if parent.is_dir() and not os.access(parent, os.W_OK | os.X_OK):
        raise read_only(path, f"its directory {parent} does not accept new files")


def check_lock_path(path: Path) -> None:
    """A lock file that exists is a regular file (SweepLock also opens it with O_NOFOLLOW)."""
    st = lstat(path, LockError)
    problem = st and not_a_plain_file(st)
    if problem:
        raise LockError(f"lock file {path} {problem}; it was left untouched — point lock_file at a file of its own")


def preflight(history_path: str | os.PathLike, lock_file: str | os.PathLike) -> None:
    """Everything about the sweep's own state files that can be refused before the lock is
    taken and any device is touched."""
    hist, lock = Path(history_path), Path(lock_file)
    if os.path.realpath(hist) == os.path.realpath(lock) or any(
            os.path.realpath(f"{hist}{s}") == os.path.realpath(lock) for s in SIDE_FILES):
        raise ConfigError(f"lock_file {lock} is the history database (history.path {hist}): give each a file of its own")
    check_lock_path(lock)
    if lstat(hist) is not None:
        check_database(hist, write=True)
    else:
        parent = hist.parent
        while not parent.exists() and parent != parent.parent:  # the nearest folder that exists gets the new ones
            parent = parent.parent
        if not os.access(parent, os.W_OK | os.X_OK):
            raise read_only(hist, f"{parent} does not accept new files")


def create_database(path: Path, initialise) -> None:
    """Make a new history at ``path`` that appears complete or not at all: ``initialise(conn)``
    runs on a private temp file beside it, which is then hard-linked into place. link() never
    follows or replaces what is there (a link planted meanwhile fails it), and when another
    process (a rank of the same node) got there first, its database is the one used."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = files.held_temp_file(path.parent, f".{path.name}.", ".new")  # removes what a sweep killed here left
    except OSError as exc:
        if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            raise read_only(path, f"cannot create it: {exc.strerror}") from None
        raise HistoryError(f"history database {path}: cannot create it ({exc.strerror})") from None
    try:
        os.fchmod(fd, files.new_file_mode())  # as SQLite would create it, not mkstemp's 0600
        conn = sqlite3.connect(tmp, isolation_level=None)
        try:
            initialise(conn)
        finally:
            conn.close()
        with contextlib.suppress(FileExistsError):  # another process created it first: that one is used
            os.link(tmp, path)
    except (OSError, sqlite3.Error) as exc:
        raise HistoryError(f"history database {path}: cannot create it ({getattr(exc, 'strerror', None) or exc})") from None
    finally:
        for name in (tmp, *(tmp + s for s in SIDE_FILES)):
            with contextlib.suppress(OSError):
                os.unlink(name)
        os.close(fd)
