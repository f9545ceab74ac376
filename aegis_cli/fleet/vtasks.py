"""Replaying captured vTasks in a sweep (``vtasks: DIR``, docs/fleet.md §8).

A training job's sensors (or ``aegis scan --save-vtasks``) leave vTask bundles in a
directory; each sweep worker replays every bundle there on its device (vtask/replay.py, the
library call behind ``aegis replay``) after its scan, and its report says per bundle: its
name, SHA-256, and ``reproduced`` (a check fired, or runs of the same inputs differed),
``not_reproduced`` or ``error``. Bundles come from elsewhere: one that is corrupt, hostile,
too large or unreadable is an ``error`` entry with the reader's one-line reason, and the
sweep goes on. The outcomes are recorded in the history beside the device's result; they
inform and do not change its verdict (a vTask that reproduces on every device points at the
data or the software, not at one GPU: the sweep report's ``vtasks`` says where each bundle
reproduced).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from aegis_cli.fleet.config import SweepConfig
from aegis_cli.ops.errors import AegisError, BundleError

# a bundle's conventional suffix (the sensors write it) and safetensors' own (scans saved so); temp files
# (hidden) and others are left alone
SUFFIXES = (".aegis", ".safetensors")
MAX_BUNDLES = 256  # per sweep: a directory that filled up must not eat the device's whole timeout


def bundle_paths(directory: str) -> tuple[list[Path], int]:
    """The bundles of ``directory`` (name order) and how many more were left for later sweeps."""
    names = sorted(e.name for e in os.scandir(directory) if e.name.endswith(SUFFIXES) and not e.name.startswith("."))
    return [Path(directory) / n for n in names[:MAX_BUNDLES]], max(0, len(names) - MAX_BUNDLES)


def replay_one(device, path: Path) -> dict:
    """One bundle on ``device``: its outcome entry. Never raises for the bundle's sake. The file
    is read once: its SHA-256 is that of the bytes replayed (an entry that fails to parse has
    it too, when the file could be read)."""
    from aegis_cli.vtask import model
    from aegis_cli.vtask.bundle import parse_bundle, read_bytes
    from aegis_cli.vtask.replay import ReplayOptions, check_memory, replay_device, replayable

    entry: dict = {"bundle": path.name, "sha256": None}
    try:
        if path.is_symlink():  # the directory is a drop box: a link could point the sweep at any file
            raise BundleError(f"{path}: is a symbolic link, not a bundle file")
        limits = model.Limits.from_env()
        data = read_bytes(path, limits)
        entry["sha256"] = hashlib.sha256(data).hexdigest()
        bundles = replayable([parse_bundle(data, str(path), limits)], str(path))
        check_memory(bundles, [device])
        dr = replay_device(device, bundles, ReplayOptions(bundles=[str(path)], devices=device.identity.id), None,
                           lambda *a, **k: None)
    except AegisError as exc:
        return {**entry, "outcome": "error", "error": str(exc)}
    except Exception as exc:  # anything else a bundle provokes: recorded against it, never the sweep's end
        return {**entry, "outcome": "error", "error": f"{type(exc).__name__}: {exc}"}
    if dr.error:
        return {**entry, "outcome": "error", "error": dr.error}
    outs = dr.probe_stats["replay"]["outcomes"]
    hit = [o for o in outs if o["outcome"] != "not_reproduced"]
    return {**entry, "outcome": "reproduced" if hit else "not_reproduced", "verdict": dr.verdict.value, "vtasks": len(outs),
            "reproduced": [{"id": o["id"], "outcome": o["outcome"], "severity": o["severity"], "checks": o["checks_fired"]}
                           for o in hit]}


def replay_directory(device, directory: str, log) -> dict:
    """Every bundle of ``directory`` replayed on ``device`` (the worker's ``probes.vtasks``)."""
    try:
        paths, left = bundle_paths(directory)
    except OSError as exc:
        log("vtasks_unreadable", level="error", device=device.identity.id, directory=directory, error=exc.strerror)
        return {"directory": directory, "error": f"cannot list {directory}: {exc.strerror}", "bundles": []}
    out = [replay_one(device, p) for p in paths]  # the sweep logs each outcome (summarise)
    counts = {k: sum(e["outcome"] == k for e in out) for k in ("reproduced", "not_reproduced", "error")}
    return {"directory": directory, "bundles": out, "counts": counts, "left_for_later": left}


def summarise(cfg: SweepConfig, devices: list[dict], log) -> dict:
    """The sweep report's ``vtasks``: per bundle (name and hash), the devices it reproduced on,
    did not, or failed on, and what that points at; one log line per device and bundle."""
    if not cfg.vtasks:
        return {}
    by: dict[tuple, dict] = {}
    for d in devices:
        vt = (d.get("probes") or {}).get("vtasks") or {}
        if vt.get("error"):
            log("vtasks_not_replayed", level="error", device=d["device"]["id"], error=str(vt["error"])[:300])
        for e in vt.get("bundles") or []:
            log("vtask_replayed", level="error" if e["outcome"] == "error" else "info", device=d["device"]["id"],
                bundle=e["bundle"], outcome=e["outcome"], **({"error": str(e["error"])[:300]} if "error" in e else {}))
            b = by.setdefault((e["bundle"], e.get("sha256")), {"bundle": e["bundle"], "sha256": e.get("sha256"),
                                                                "reproduced": [], "not_reproduced": [], "error": []})
            b[e["outcome"]].append(d["device"]["id"])
    for b in by.values():
        here, clean = b["reproduced"], b["not_reproduced"]
        b["points_at"] = ("nothing: not reproduced" if not here else
                          "the data or the software (reproduces on every device)" if not clean and len(here) > 1 else
                          f"the device(s) {', '.join(here)}" if clean else "undecided: one device replayed it")
    return {"vtasks": {"directory": cfg.vtasks, "bundles": list(by.values())}}
