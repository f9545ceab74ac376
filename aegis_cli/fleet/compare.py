"""Cross-device comparison (docs/design.md §4.1): the same seeded workload on identical devices
must give the same bits, so the device whose fingerprints disagree with the majority is
the odd one out.

Devices are compared only within a *class*: same backend, device model, library versions
and kernel sources (``fingerprint_class``); across classes different bits are expected.
Per case, the fingerprint held by more than half of the class is the majority; a device
holding another value is flagged (FAULTY evidence ``fleet.cross_device_fingerprint``).
When devices disagree and no value has a majority (two devices that differ, or three
with three answers), hardware cannot be told from software (a library, driver or
nondeterministic kernel) and the outcome is INCONCLUSIVE — a fleet-level outcome kept
apart from the per-device Verdict enum. Clean checksum noise far above the class median
(NOISE_OUTLIER×) is SUSPECT evidence ``fleet.noise_outlier``.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import math
from collections import Counter

from aegis_cli.ops.verdict import Verdict, overall_exit, worst

CONSISTENT, ODD_ONE_OUT, INCONCLUSIVE, NOT_COMPARED = "CONSISTENT", "ODD_ONE_OUT", "INCONCLUSIVE", "NOT_COMPARED"
OUTCOMES = (CONSISTENT, ODD_ONE_OUT, INCONCLUSIVE, NOT_COMPARED)
NOISE_OUTLIER = 10.0
PROBE_KEY = "fleet_fingerprint"  # where a device report keeps its fingerprints: probes.fleet_fingerprint


def fingerprint_class(identity: dict, versions: dict, kernel_hashes: dict, workload: str, seed: int) -> str:
    """Devices with equal classes must produce equal bits for the same seeded workload. The aegis
    version is part of it (input generation is aegis code): during a rolling upgrade the old and
    new halves of a fleet are compared within themselves, never against each other."""
    keep = {k: v for k, v in versions.items() if k != "python"}
    blob = json.dumps([identity.get("backend"), identity.get("name"), keep, kernel_hashes, workload, seed], sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def device_key(d: dict) -> str:
    return f"{d['device'].get('host', '?')}/{d['device']['id']}"


def device_keys(devices: list[dict]) -> list[str]:
    """One distinct key per device: host/id, with the UUID added where host/id is shared. Under
    ``srun --gpus-per-task=1`` every task of a node sees its GPU as cuda:0; one key for all of
    them would flag every GPU of the node for the one that differs."""
    plain = [device_key(d) for d in devices]
    shared = {k for k, n in Counter(plain).items() if n > 1}
    return [f"{k}/{d['device']['uuid']}" if k in shared else k for k, d in zip(plain, devices, strict=True)]


def compare(devices: list[dict]) -> dict:
    """Compare the fingerprints carried by device reports; returns the comparison record."""
    groups: dict[str, list[tuple[str, dict]]] = {}
    for k, d in zip(device_keys(devices), devices, strict=True):
        fp = (d.get("probes") or {}).get(PROBE_KEY)
        if fp and fp.get("fingerprints"):
            groups.setdefault(fp["class"], []).append((k, d))
    out_groups, odd, inconclusive, outliers = [], {}, [], []
    for cls, keyed in groups.items():
        keys, members = [k for k, _ in keyed], [m for _, m in keyed]
        g = {"class": cls, "devices": keys, "name": members[0]["device"].get("name"), "cases": 0, "outcome": NOT_COMPARED}
        out_groups.append(g)
        if len(members) < 2:
            continue
        fps = [m["probes"][PROBE_KEY]["fingerprints"] for m in members]
        cases = sorted(set.intersection(*(set(f) for f in fps)))
        g["cases"] = len(cases)
        g_odd, g_inc = set(), []
        for case in cases:
            votes = Counter(f[case] for f in fps)
            value, n = votes.most_common(1)[0]
            if len(votes) == 1:
                continue
            if 2 * n <= len(members):
                g_inc.append({"case": case, "values": {k: f[case] for k, f in zip(keys, fps, strict=True)}})
                continue
            for k, f in zip(keys, fps, strict=True):
                if f[case] != value:
                    odd.setdefault(k, {"device": k, "cases": [], "majority": n, "of": len(members)})["cases"].append(case)
                    g_odd.add(k)
        inconclusive += g_inc
        g["outcome"] = INCONCLUSIVE if g_inc else ODD_ONE_OUT if g_odd else CONSISTENT
        outliers += _noise_outliers(keys, members)
    outcomes = {g["outcome"] for g in out_groups}
    outcome = next((o for o in (INCONCLUSIVE, ODD_ONE_OUT, CONSISTENT) if o in outcomes), NOT_COMPARED)
    note = {INCONCLUSIVE: "devices disagree with no majority: a software cause (library, driver, nondeterministic kernel) "
                          "is as likely as a hardware one; replay the cases on a known-good device",
            ODD_ONE_OUT: "the flagged device's results differ from the majority of identical devices",
            CONSISTENT: "every compared device produced the same bits",
            NOT_COMPARED: "fewer than two comparable devices (same model, software, workload and seed, "
                          "with the fingerprints of a sweep: scan reports carry none)"}[outcome]
    return {"outcome": outcome, "note": note, "groups": out_groups, "odd": list(odd.values()),
            "inconclusive_cases": inconclusive[:50], "noise_outliers": outliers}


def _measured(x) -> bool:
    """A clean noise level to compare: a finite number. A non-finite one (JSON's Infinity, NaN,
    or aegis's own "inf") is no measurement, never an outlier."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _median_without(ordered: list[float], value: float) -> float | None:
    """The median of ``ordered`` (sorted) with one occurrence of ``value`` left out when it is
    there: each device's class median without itself, in O(log n) instead of a new list per device."""
    i = bisect.bisect_left(ordered, value)
    drop = i if i < len(ordered) and ordered[i] == value else None
    n = len(ordered) - (drop is not None)
    if n == 0:
        return None

    def at(j: int) -> float:  # j-th element of ordered with ``drop`` removed
        return ordered[j + 1] if drop is not None and j >= drop else ordered[j]

    return at(n // 2) if n % 2 else (at(n // 2 - 1) + at(n // 2)) / 2


def _noise_outliers(keys: list[str], members: list[dict]) -> list[dict]:
    """Devices whose clean noise is over NOISE_OUTLIER× the median of the class's other devices
    (those with a positive measurement); linear in the class after one sort."""
    noise = [(m.get("noise") or {}).get("clean_max") for m in members]
    ordered = sorted(x for x in noise if _measured(x) and x > 0)
    out = []
    for k, v in zip(keys, noise, strict=True):
        if not _measured(v):
            continue
        median = _median_without(ordered, v) if v > 0 else _median_without(ordered, math.inf)
        if median is not None and v > NOISE_OUTLIER * median:
            out.append({"device": k, "clean_max": v, "class_median": median})
    return out


def apply(devices: list[dict], comparison: dict) -> list[dict]:
    """Device reports with the comparison's evidence added and verdicts raised accordingly
    (the device's own verdict is kept as ``local_verdict``)."""
    odd = {o["device"]: o for o in comparison["odd"]}
    noisy = {o["device"]: o for o in comparison["noise_outliers"]}
    out = []
    for k, d in zip(device_keys(devices), devices, strict=True):
        d = dict(d)
        d["local_verdict"] = d.get("local_verdict", d["verdict"])
        ev = list(d.get("evidence") or [])
        if k in odd:
            o = odd[k]
            ev.append({"check": "fleet.cross_device_fingerprint", "severity": "FAULTY", "case_id": o["cases"][0],
                       "summary": f"output fingerprint differs from {o['majority']} of {o['of']} identical devices "
                                  f"in {len(o['cases'])} case(s)", "elements": len(o["cases"]), "samples": [{"cases": o["cases"][:8]}],
                       "seed": d.get("seed", 0), "reruns": 0, "reproduced": 0, "reproduction": "compared across devices",
                       "distinct_outputs": 2})
        if k in noisy:
            o = noisy[k]
            ev.append({"check": "fleet.noise_outlier", "severity": "SUSPECT", "case_id": "",
                       "summary": f"clean checksum noise {o['clean_max']:.3g} is over {NOISE_OUTLIER:g}× the class median "
                                  f"{o['class_median']:.3g}", "elements": 1, "samples": [],
                       "seed": d.get("seed", 0), "reruns": 0, "reproduced": 0, "reproduction": "compared across devices",
                       "distinct_outputs": 1})
        d["evidence"] = ev
        if ev:  # with none, the verdict stands as it is (and a fleet has many such devices)
            d["verdict"] = worst([Verdict(d["verdict"]), *(Verdict(e["severity"]) for e in ev)]).value
        out.append(d)
    return out


def fleet_exit(devices: list[dict], outcome: str) -> int:
    """Exit code of a fleet report: the device verdicts' code; an INCONCLUSIVE comparison
    over otherwise clean devices is 3 (unknown), never 0."""
    code = int(overall_exit(Verdict(d["verdict"]) for d in devices))
    return 3 if outcome == INCONCLUSIVE and code == 0 else code
