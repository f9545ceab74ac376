"""``aegis report FILES…``: merge per-node JSON reports into one fleet report, for sites
that prefer independent cron runs to a distributed launch.

Every device of every report is kept, latest report first when one device (UUID) appears
twice; devices that carry fingerprints (sweep reports) are compared across the fleet as in
a distributed sweep (fleet/compare.py).
"""

from __future__ import annotations

import json

from aegis_cli.config import read_input_text
from aegis_cli.errors import ConfigError
from aegis_cli.fleet import compare
from aegis_cli.fleet.distributed import fleet_doc

KINDS = ("scan", "sweep", "fleet", "replay")
MAX_REPORT_BYTES = 1 << 30  # a fleet report of many thousand devices stays far below


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
    major = str(doc.get("schema_version", "")).split(".")[0]
    if major != "1":
        raise ConfigError(f"{path}: report schema_version {doc.get('schema_version')!r} is not supported (1.x)")
    for d in doc["devices"]:
        if not isinstance(d, dict) or "device" not in d or "verdict" not in d or "uuid" not in d.get("device", {}):
            raise ConfigError(f"{path}: a device entry lacks device.uuid or verdict")
    return doc


def merge(paths: list[str]) -> dict:
    if not paths:
        raise ConfigError("aegis report: give at least one JSON report")
    docs = [(p, load_report(p)) for p in paths]
    docs.sort(key=lambda pd: pd[1].get("finished") or pd[1].get("started") or "", reverse=True)
    seen, devices = set(), []
    for path, doc in docs:
        for d in doc["devices"]:
            uuid = d["device"]["uuid"]
            if uuid in seen:
                continue
            seen.add(uuid)
            d = dict(d)
            d["device"] = {**d["device"], "host": d["device"].get("host") or doc.get("host", "?")}
            d["verdict"] = d.get("local_verdict", d["verdict"])  # re-compare from the devices' own verdicts
            d["evidence"] = [e for e in d.get("evidence") or [] if not str(e.get("check", "")).startswith("fleet.")]
            d["source"] = path
            devices.append(d)
    devices.sort(key=lambda d: (d["device"].get("host", ""), d["device"]["id"]))
    comparison = compare.compare(devices)
    out = fleet_doc(None, compare.apply(devices, comparison), comparison, 0.0, sources=[p for p, _ in docs])
    out["fault_injected"] = any(doc.get("fault_injected") for _, doc in docs)
    out["injected"] = sorted({i for _, doc in docs for i in doc.get("injected") or []})
    return out
