"""False positives of the GEMM checks at the production thresholds, on many clean GEMMs.

Every GEMM of the given workloads (default llama3-8b and llama3-70b) × input distribution,
fresh seeds (the last one possibly cut short by the limits), at every scale of the scan plan and of a power-of-two grid (pairs (e, e) and
(e, −e), e a multiple of ``--pow2-step`` within the probe's exponent range, where scaling is
exact for the case), run through the scan's own GemmProbe (every check, the power-of-two
expectation included) with one confirmation re-run. Seeds are added until ``--gemms``
launches have run or ``--max-seconds`` has passed. Any evidence is a false positive.

    PYTHONPATH=. python3 benchmarks/false_positives.py --device cuda:0 --out "$OUT/false_positives.json"

Writes every case's largest clean value (in units of the device's noise scale, as the checks
see it) and any evidence to the JSON; prints a table by (K, distribution) last.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from pathlib import Path

from aegis_cli.backends import resolve_devices
from aegis_cli.ops import dither, numerics, workloads
from aegis_cli.probes.gemm import GemmProbe
from aegis_cli.probes.gemm_scan import plan_cases
from aegis_cli.probes.pow2 import EXP_RANGE


def pow2_grid(step: int) -> list[list[int]]:
    es = dither.grid(*EXP_RANGE, step, 0)  # the multiples of step inside the range
    return [[e, f] for e in es for f in (e, -e) if (e, f) != (0, 0)]


def run(device, names: list[str], scales: list[list[int]], target: int, max_seconds: float, seed0: int) -> dict:
    th = numerics.Thresholds()
    t0 = time.time()
    cases, evidence = [], []
    gemms = checksums = skipped = 0
    seed = seed0
    more = lambda: gemms < target and time.time() - t0 < max_seconds
    while more():
        for name in names:
            wl = workloads.load(name)
            for case in plan_cases(wl, seed):
                if not more():
                    break
                probe = GemmProbe(device, th, reruns=1)
                found = probe.run(case, [list(s) for s in dict.fromkeys(map(tuple, wl.scan.scales + scales))])
                st = probe.stats
                gemms, checksums, skipped = gemms + st.gemms, checksums + st.checksums, skipped + st.skipped_scales
                s = case.shape
                cases.append({"workload": name, "op": s.op, "layout": s.layout.value, "m": s.m, "n": s.n, "k": s.k,
                              "dist": case.dist, "seed": seed, "gemms": st.gemms, "clean_max": st.clean_max,
                              "flagged": len(found)})
                evidence += [e.to_dict() for e in found]
        print(f"[{time.time() - t0:6.0f} s] seed {seed}: {gemms} GEMMs, {len(evidence)} evidence", flush=True)
        seed += 1
    return {"tau": th.tau, "gemms": gemms, "checksums": checksums, "skipped_scales": skipped, "seeds": [seed0, seed - 1],
            "cases_run": len(cases),
            "seconds": time.time() - t0, "false_positives": len(evidence), "evidence": evidence[:50], "cases": cases}


def summary(doc: dict) -> list[str]:
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for c in doc["cases"]:
        groups[(c["k"], c["dist"])].append(c)
    out = ["| K | inputs | GEMMs | largest clean value (× σ) | τ ÷ largest | flagged |", "|---:|---|---:|---:|---:|---:|"]
    for (k, dist), cs in sorted(groups.items()):
        worst = max(c["clean_max"] for c in cs)
        out.append(f"| {k} | {dist} | {sum(c['gemms'] for c in cs)} | {worst:.3g} | {doc['tau'] / worst:.3g}× "
                   f"| {sum(c['flagged'] for c in cs)} |")
    worst = max(c["clean_max"] for c in doc["cases"])
    out.append(f"\n{doc['gemms']} clean GEMMs ({doc['checksums']} checksums, seeds {doc['seeds'][0]}…{doc['seeds'][1]}) in "
               f"{doc['seconds']:.0f} s: {doc['false_positives']} false positives; largest clean value {worst:.3g}·σ, "
               f"τ = {doc['tau']:g}·σ, margin {doc['tau'] / worst:.2f}×")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="auto")
    ap.add_argument("--workloads", nargs="+", default=["llama3-8b", "llama3-70b"])
    ap.add_argument("--gemms", type=int, default=10_000, help="run seeds until this many GEMMs have run")
    ap.add_argument("--max-seconds", type=float, default=240.0)
    ap.add_argument("--pow2-step", type=int, default=16)
    ap.add_argument("--seed", type=int, default=2000, help="first seed (the calibration used 1000…)")
    ap.add_argument("--out", default="false_positives.json")
    args = ap.parse_args()
    (device,) = resolve_devices(args.device)[:1]
    doc = run(device, args.workloads, pow2_grid(args.pow2_step), args.gemms, args.max_seconds, args.seed)
    doc.update(device=device.identity.to_dict(), kernel=getattr(device, "kernel", "cpu"),
               noise_model=device.noise_model(1).describe(1), workloads=args.workloads, pow2_step=args.pow2_step)
    Path(args.out).write_text(json.dumps(doc, indent=1, default=str))
    print("\n".join(summary(doc)))


if __name__ == "__main__":
    main()
