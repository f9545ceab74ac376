"""Writing files safely: atomic replacement that keeps a replaced file's owner and mode,
refusing symlinks and special files; private work folders; JSON-safe values.

Temp files and work folders are held with an ``flock`` while in use, so what a killed run
left behind (SIGKILL runs no cleanup) can be told from what a live one is using, and is
removed by the next run: a flock dies with its holder.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

from aegis_cli.ops.errors import OutputError


def sanitize(doc):
    """Replace non-finite floats (inf margins) by the strings "inf", "-inf", "nan" so the JSON
    stays standard (tuples come back as lists, as JSON writes them)."""
    if isinstance(doc, dict):
        return {k: sanitize(v) for k, v in doc.items()}
    if isinstance(doc, (list, tuple)):
        return [sanitize(v) for v in doc]
    if isinstance(doc, float) and doc != doc:
        return "nan"
    if isinstance(doc, float) and doc in (float("inf"), float("-inf")):
        return "inf" if doc > 0 else "-inf"
    return doc


def _existing_target(p: Path) -> os.stat_result | None:
    """lstat of an output path that already exists, refusing anything but a regular file: the
    rename would replace a device node, FIFO or socket with a plain file (as root, ``-o
    /dev/null`` would break /dev/null for the whole host). Symbolic links are refused too,
    deliberately, rather than written through: the rename would replace the link itself, and
    following a link planted in a shared directory would let another user aim a root-run write
    at any file."""
    try:
        st = p.lstat()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise OutputError(f"cannot write {p}: {exc.strerror or exc}") from None
    if stat.S_ISDIR(st.st_mode):
        raise OutputError(f"cannot write {p}: is a directory")
    if stat.S_ISLNK(st.st_mode):
        raise OutputError(f"cannot write {p}: is a symbolic link (give the path of a regular file)")
    if not stat.S_ISREG(st.st_mode):
        raise OutputError(f"cannot write {p}: exists and is not a regular file (a device, FIFO or socket); not replacing it")
    return st


def check_writable(path: str | os.PathLike) -> None:
    """Refuse, before any long work, an output path atomic_write could not write: a directory,
    something that is not a regular file, or a file whose directory is missing or does not
    accept new files (the temp file goes there). A typo in ``-o`` must not cost a finished
    scan's results."""
    p = Path(path)
    parent = p.parent
    _existing_target(p)
    if not parent.is_dir():
        raise OutputError(f"cannot write {p}: no directory {parent}")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise OutputError(f"cannot write {p}: directory {parent} is not writable")


def _umask() -> int:
    """The process umask, read without changing it where Linux says it (os.umask sets it, which
    another thread could see in between)."""
    try:
        with open("/proc/self/status", encoding="ascii", errors="replace") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def new_file_mode() -> int:
    """The mode of a file aegis creates: 0644 less the umask. Never group- or world-writable,
    whatever the umask (cron may run with 000): nothing aegis writes is for others to edit. To
    make an export group-writable, create it with that mode once; a replaced file keeps it."""
    return 0o644 & ~_umask()


def _held(fd: int) -> bool:
    """Take an exclusive flock on ``fd`` without waiting; False when another process holds one."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def hold_new(fd: int) -> bool:
    """Lock a temp file or folder just made; False when a cleaner removed it in between
    (unlinked: no links left), and the caller makes another."""
    fcntl.flock(fd, fcntl.LOCK_EX)
    return os.fstat(fd).st_nlink > 0


def remove_stale(folder: str | os.PathLike, prefix: str, suffix: str = "", *, dirs: bool = False) -> list[str]:
    """Remove the temp files (``dirs``: folders) named ``prefix…suffix`` in ``folder`` that a
    killed run of ours left: owned by this user, of that kind (links never followed), and with
    no flock held on them. Returns the paths removed; anything else is left alone."""
    removed, entries = [], []
    with contextlib.suppress(OSError), os.scandir(folder) as it:
        entries = [e for e in it if e.name.startswith(prefix) and e.name.endswith(suffix)]
    for e in entries:
        with contextlib.suppress(OSError):
            st = e.stat(follow_symlinks=False)
            kind_ok = stat.S_ISDIR(st.st_mode) if dirs else stat.S_ISREG(st.st_mode)
            if not kind_ok or st.st_uid != os.geteuid():
                continue
            flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | (os.O_DIRECTORY if dirs else os.O_NONBLOCK)
            fd = os.open(e.path, flags)
            try:
                again = os.lstat(e.path)
                if not _held(fd) or (again.st_dev, again.st_ino) != (st.st_dev, st.st_ino):
                    continue
                if dirs:
                    shutil.rmtree(e.path)  # fd-based on Linux: links inside are removed, not followed
                else:
                    os.unlink(e.path)
                removed.append(e.path)
            finally:
                os.close(fd)
    return removed


def held_temp_file(folder: str | os.PathLike, prefix: str, suffix: str) -> tuple[int, str]:
    """(fd, path) of a new temp file ``prefix…suffix`` in ``folder``, held with a flock while the
    fd is open; those that killed runs left there are removed first. Raises OSError."""
    remove_stale(folder, prefix, suffix)
    while True:
        fd, tmp = tempfile.mkstemp(prefix=prefix, suffix=suffix, dir=folder)
        if hold_new(fd):
            return fd, tmp
        os.close(fd)


@contextlib.contextmanager
def work_dir(prefix: str) -> Iterator[str]:
    """A private temp folder (0700) held for the duration and removed after, for a run's
    scratch files; folders of the same prefix that killed runs left are removed first."""
    base = tempfile.gettempdir()
    remove_stale(base, prefix, dirs=True)
    while True:
        path = tempfile.mkdtemp(prefix=prefix, dir=base)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except FileNotFoundError:  # a concurrent run's cleaner took it before it was held: make another
            continue
        if hold_new(fd):
            break
        os.close(fd)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
        os.close(fd)


def atomic_write(path: str | os.PathLike, text: str | bytes) -> None:
    """Write to a temp file in the same directory, fsync, rename: no half-written file
    ever appears under ``path``. A replaced file keeps its owner, group and mode (root
    rewriting a ``nobody:nogroup 0640`` export leaves it so); a new one gets new_file_mode()
    (mkstemp makes 0600, which hid reports from the monitoring that reads them). Temp files
    that killed writes left beside ``path`` are removed first."""
    path = Path(path)
    data = text.encode("utf-8") if isinstance(text, str) else text
    old = _existing_target(path)  # again here: the path may have changed since check_writable
    try:
        fd, tmp = held_temp_file(path.parent, f".{path.name}.", ".tmp")
    except OSError as exc:
        raise OutputError(f"cannot write {path}: {exc.strerror or exc}") from None
    try:
        with os.fdopen(fd, "wb") as fh:
            if old and (old.st_uid, old.st_gid) != (os.geteuid(), os.getegid()):
                with contextlib.suppress(PermissionError):  # only root may give a file away; the mode is kept all the same
                    os.fchown(fh.fileno(), old.st_uid, old.st_gid)
            os.fchmod(fh.fileno(), stat.S_IMODE(old.st_mode) if old else new_file_mode())  # after chown, which clears set-id bits
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise OutputError(f"cannot write {path}: {exc.strerror or exc}") from None
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
