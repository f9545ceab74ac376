"""Writing files safely: atomic replacement that keeps a replaced file's mode, refusing
symlinks and special files, and JSON-safe values."""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
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


def atomic_write(path: str | os.PathLike, text: str | bytes) -> None:
    """Write to a temp file in the same directory, fsync, rename: no half-written file
    ever appears under ``path``. The file gets the mode an ordinary write would give it:
    a replaced file keeps its mode, a new one 0666 less the umask
    (mkstemp makes 0600, which hid reports from the monitoring that reads them)."""
    path = Path(path)
    data = text.encode("utf-8") if isinstance(text, str) else text
    old = _existing_target(path)  # again here: the path may have changed since check_writable
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent or ".")
    except OSError as exc:
        raise OutputError(f"cannot write {path}: {exc.strerror or exc}") from None
    try:
        with os.fdopen(fd, "wb") as fh:
            os.fchmod(fh.fileno(), stat.S_IMODE(old.st_mode) if old else 0o666 & ~_umask())
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
