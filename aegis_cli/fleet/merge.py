"""``aegis report FILES…``: merge per-node JSON reports into one fleet report, for sites
that prefer independent cron runs to a distributed launch.

Every report is checked whole before anything is merged: the fields the merge, the
comparison and the renderers read have their types (a wrong one is one line naming file,
entry and field), and nothing is nested deeper than MAX_DEPTH. Each device (UUID) appears
once, from the latest report that has it; its entries in older reports are listed in the
fleet report's ``duplicates``, never dropped without a word. Devices that carry fingerprints
(sweep reports) are compared across the fleet as in a distributed sweep (fleet/compare.py).
"""

from __future__ import annotations

import gc
import json

from aegis_cli.fleet import compare
from aegis_cli.fleet.distributed import fleet_doc
from aegis_cli.ops.config import read_input_text
from aegis_cli.ops.errors import ConfigError
from aegis_cli.ops.verdict import Verdict

KINDS = ("scan", "sweep", "fleet", "replay")
MAX_REPORT_BYTES = 1 << 30  # a fleet report of many thousand devices stays far below
MAX_DEPTH = 32  # an aegis report nests about 8 deep; every renderer walks what it is given
STAT_KEYS = ("gemms", "checksums", "flops", "skipped_scales")  # numbers the CSV and Prometheus output print
NOISE_KEYS = ("threshold", "clean_max", "margin")  # numbers, or what files.sanitize writes for inf and nan
_NONFINITE = ("inf", "-inf", "nan")


def _too_deep(doc) -> bool:
    """Whether ``doc`` nests containers more than MAX_DEPTH deep. Level by level, not
    recursively (the check must not be what recurses), and fast: it reads every value."""
    level, depth = [doc], 1
    while level:
        below = []
        for obj in level:
            below += [v for v in (obj.values() if obj.__class__ is dict else obj) if v.__class__ is dict or v.__class__ is list]
        if below and depth >= MAX_DEPTH:
            return True
        level, depth = below, depth + 1
    return False


def _number(v, *, named: tuple[str, ...] = ()) -> bool:
    """A JSON number (not a boolean), or one of the strings ``named``."""
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) or (isinstance(v, str) and v in named)


def load_report(path: str) -> dict:
    text = read_input_text(path, MAX_REPORT_BYTES)
    try:
        doc = json.loads(text)
    except RecursionError:
        raise ConfigError(f"{path}: not a JSON report (nested too deeply)") from None
    except ValueError as exc:
        raise ConfigError(f"{path}: not a JSON report ({exc})") from None
    if not isinstance(doc, dict) or doc.get("kind") not in KINDS or not isinstance(doc.get("devices"), list):
        raise ConfigError(f"{path}: not an aegis report (expected a JSON object with kind in {', '.join(KINDS)} and devices)")
    if _too_deep(doc):
        raise ConfigError(f"{path}: not an aegis report (nested over {MAX_DEPTH} levels deep)")
    major = str(doc.get("schema_version", "")).split(".")[0]
    if major != "1":
        raise ConfigError(f"{path}: report schema_version {doc.get('schema_version')!r} is not supported (1.x)")
    for key in ("host", "started", "finished"):
        if doc.get(key) is not None and not isinstance(doc[key], str):
            raise ConfigError(f"{path}: {key} must be a string, got {type(doc[key]).__name__}")
    injected = doc.get("injected") or []
    if not isinstance(injected, list) or not all(isinstance(i, str) for i in injected):  # merged as a sorted set
        raise ConfigError(f"{path}: injected must be a list of strings")
    if doc.get("fault_injected") is not None and not isinstance(doc["fault_injected"], bool):  # "false" is truthy
        raise ConfigError(f"{path}: fault_injected must be true or false, got {doc['fault_injected']!r}")
    seed = doc.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):  # compared across the reports
        raise ConfigError(f"{path}: seed must be an integer, got {type(seed).__name__}")
    for i, d in enumerate(doc["devices"]):
        _check_device(path, i, d)
    return doc


_VERDICTS = {v.value for v in Verdict}


def _check_device(path: str, i: int, d) -> None:
    """One device entry holds the types the merge and the comparison read; anything else is
    a malformed report (one line, exit 3), not a crash inside the merge."""
    where = f"{path}: devices[{i}]"
    dev = d.get("device") if isinstance(d, dict) else None
    if not isinstance(dev, dict) or "verdict" not in d or "uuid" not in dev:
        raise ConfigError(f"{path}: a device entry lacks device.uuid or verdict")
    for key, required in (("id", True), ("uuid", True), ("host", False), ("name", False)):
        v = dev.get(key)
        if (required or v is not None) and not (isinstance(v, str) and v):
            raise ConfigError(f"{where}: device.{key} must be a non-empty string")
    for key in ("verdict", "local_verdict"):
        if key in d and d[key] not in _VERDICTS:
            raise ConfigError(f"{where}: {key} {d[key]!r} is not one of {', '.join(sorted(_VERDICTS))}")
    evidence = d.get("evidence") or []
    if not isinstance(evidence, list) or not all(isinstance(e, dict) for e in evidence):
        raise ConfigError(f"{where}: evidence must be a list of objects")
    for e in evidence:
        if "severity" in e and e["severity"] not in _VERDICTS:
            raise ConfigError(f"{where}: evidence severity {e['severity']!r} is not a verdict")
        for key in ("check", "case_id", "summary"):  # shown in the table and the CSV
            if e.get(key) is not None and not isinstance(e[key], str):
                raise ConfigError(f"{where}: evidence {key} must be a string")
    for key in ("error", "workload"):
        if d.get(key) is not None and not isinstance(d[key], str):
            raise ConfigError(f"{where}: {key} must be a string")
    probes = d.get("probes") or {}
    if not isinstance(probes, dict) or not isinstance(d.get("noise") or {}, dict):
        raise ConfigError(f"{where}: probes and noise must be objects")
    if not isinstance(d.get("stats") or {}, dict) or not isinstance(d.get("timings") or {}, dict):
        raise ConfigError(f"{where}: stats and timings must be objects")
    for key, numbers, named in (("stats", STAT_KEYS, ()), ("timings", ("seconds", "gemm_tflops"), ()),
                                ("noise", NOISE_KEYS, _NONFINITE)):
        obj = d.get(key) or {}
        for k in numbers:  # printed into the CSV and the Prometheus file, compared across devices
            if obj.get(k) is not None and not _number(obj[k], named=named):
                raise ConfigError(f"{where}: {key}.{k} must be a number, got {str(json.dumps(obj[k]))[:40]}")
    fp = probes.get(compare.PROBE_KEY)
    if fp is None:
        return
    prints = fp.get("fingerprints") if isinstance(fp, dict) else None
    ok = isinstance(fp, dict) and isinstance(prints or {}, dict)
    ok = ok and all(isinstance(v, (str, int, float)) for v in (prints or {}).values())  # compared and counted
    ok = ok and (not prints or isinstance(fp.get("class"), str))
    if not ok:
        raise ConfigError(f"{where}: probes.{compare.PROBE_KEY} must hold a class string and a map of case → fingerprint")


def merge(paths: list[str]) -> dict:
    if not paths:
        raise ConfigError("aegis report: give at least one JSON report")
    # millions of small acyclic containers: the cycle collector would re-scan them all at every
    # collection it triggers (half the time of a 10^5-device merge), finding nothing to free
    enabled = gc.isenabled()
    gc.disable()
    try:
        return _merge(paths)
    finally:
        if enabled:
            gc.enable()


def _merge(paths: list[str]) -> dict:
    docs = [(p, load_report(p)) for p in paths]
    docs.sort(key=lambda pd: pd[1].get("finished") or pd[1].get("started") or "", reverse=True)
    kept: dict[str, str] = {}  # uuid → the report its entry comes from
    duplicates: dict[str, dict] = {}
    devices = []
    for path, doc in docs:
        for d in doc["devices"]:
            uuid = d["device"]["uuid"]
            if uuid in kept:  # an older run of the same GPU (or a report given twice)
                dup = duplicates.setdefault(uuid, {"uuid": uuid, "kept": kept[uuid], "superseded": []})
                dup["superseded"].append({"source": path, "finished": doc.get("finished"),
                                          "verdict": d.get("local_verdict", d["verdict"])})
                continue
            kept[uuid] = path
            # what the table, CSV and Prometheus output read, for entries that leave it out (all optional)
            d = {**d, "workload": d.get("workload") or "", "error": d.get("error"), "stats": d.get("stats"),
                 "timings": {"seconds": None, **(d.get("timings") or {})}}
            # "host": null is a valid report (no host known): never None here, the table sorts by host
            d["device"] = {**d["device"], "name": d["device"].get("name") or "",
                           "host": d["device"].get("host") or doc.get("host") or "?"}
            d["verdict"] = d.get("local_verdict", d["verdict"])  # re-compare from the devices' own verdicts
            d["evidence"] = [{"check": "", "case_id": "", "summary": "", **e} for e in d.get("evidence") or []
                             if not str(e.get("check", "")).startswith("fleet.")]
            d["source"] = path
            devices.append(d)
    devices.sort(key=lambda d: (d["device"].get("host", ""), d["device"]["id"]))
    comparison = compare.compare(devices)
    out = fleet_doc(None, compare.apply(devices, comparison), comparison, 0.0, sources=[p for p, _ in docs])
    seeds = {doc.get("seed") for _, doc in docs}
    out["seed"] = seeds.pop() if len(seeds) == 1 else None  # null only when the sources' seeds differ
    out["command_line"] = ["aegis", "report", *paths]
    out["fault_injected"] = any(doc.get("fault_injected") for _, doc in docs)
    out["injected"] = sorted({i for _, doc in docs for i in doc.get("injected") or []})
    out["duplicates"] = list(duplicates.values())
    return out
