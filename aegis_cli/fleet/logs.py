"""The sweep's structured log lines (logfmt or JSON lines), shared by the sweep and its workers,
and how a sweep is told to stop."""

from __future__ import annotations

import json
import time
from collections.abc import Callable

from aegis_cli.ops.errors import AegisError

Log = Callable[..., None]  # log(event, level="info", **fields)
Stop = Callable[[], "str | None"]  # returns why the sweep must stop (e.g. "SIGTERM"), or None


class SweepInterrupted(AegisError):
    """The sweep was asked to stop (SIGTERM, SIGINT): workers and actions killed, nothing recorded."""


def log_line(event: str, level: str = "info", fmt: str = "logfmt", **kv) -> str:
    """One structured log line (logfmt, or a JSON object with ``fmt="json"``), local time with offset."""
    ts = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    if fmt == "json":
        return json.dumps({"ts": ts, "level": level, "event": event, **kv}, default=str)
    parts = [f"ts={ts}", f"level={level}", f"event={event}"]
    for k, v in kv.items():
        v = "" if v is None else str(v)
        quote = not v or any(c in v for c in ' ="')
        parts.append(f"{k}={json.dumps(v, ensure_ascii=False) if quote else v}")
    return " ".join(parts)
