"""``aegis report`` over a large fleet: merge time and peak memory against the device count.

    python3 benchmarks/report_merge.py [--devices 1000000] [--reports 1000] [--fingerprints 12]

Writes --reports sweep reports (one per node, the devices spread over them, each device with
--fingerprints fleet fingerprints of one class, one odd device and one noisy one) into a temp
folder, then times, in this process: merge (read, check, compare, apply) and rendering the fleet
report as JSON and as Prometheus text. Prints seconds per phase and the peak resident memory;
the merge should stay under a minute at 10^6 devices (CPU time: on a busy machine the
wall time is longer) and memory grow linearly. Results: benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from aegis_cli import report as report_mod
from aegis_cli.fleet import compare
from aegis_cli.fleet.merge import merge


def node_report(node: int, first: int, count: int, cases: int) -> dict:
    devices = []
    for i in range(first, first + count):
        fps = {f"case-{c}": f"{c:016x}" for c in range(cases)}
        if i == 7:
            fps["case-0"] = "ffffffffffffffff"  # the odd one out
        devices.append({
            "device": {"id": f"cuda:{i - first}", "uuid": f"GPU-{i:012d}", "host": f"node{node:05d}", "name": "H200",
                       "backend": "cuda"},
            "verdict": "HEALTHY", "workload": "llama3-8b", "error": None, "evidence": [],
            "stats": {"gemms": 480, "checksums": 960, "flops": 3.2e12, "skipped_scales": 0},
            "noise": {"threshold": 1e-6, "clean_max": 5e-3 if i == 11 else 1e-7 * (1 + i % 97 / 97), "margin": 10.0},
            "probes": {compare.PROBE_KEY: {"class": "h200-cuda13", "fingerprints": fps}},
            "timings": {"seconds": 41.5, "gemm_tflops": 300.1}})
    return {"schema_version": "1.0", "kind": "sweep", "host": f"node{node:05d}", "seed": 0, "injected": [],
            "fault_injected": False, "started": "2025-01-01T00:00:00+00:00", "finished": "2025-01-01T00:01:00+00:00",
            "devices": devices}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--devices", type=int, default=1_000_000)
    ap.add_argument("--reports", type=int, default=1000)
    ap.add_argument("--fingerprints", type=int, default=12)
    ap.add_argument("--render", action="store_true", help="also time the JSON and Prometheus renderers (memory: ~15 KiB a device)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="aegis-bench-") as tmp:
        per = -(-args.devices // args.reports)
        paths = []
        for r in range(args.reports):
            first = r * per
            count = min(per, args.devices - first)
            if count <= 0:
                break
            p = Path(tmp) / f"node{r:05d}.json"
            p.write_text(json.dumps(node_report(r, first, count, args.fingerprints)), encoding="utf-8")
            paths.append(str(p))
        t0, c0 = time.perf_counter(), time.process_time()
        doc = merge(paths)
        t1, c1 = time.perf_counter(), time.process_time()
        merge_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        rendered = ""
        if args.render:
            text = report_mod.render(doc, "json")
            t2 = time.perf_counter()
            prom = report_mod.render(doc, "prom")
            t3 = time.perf_counter()
            rendered = (f", json {t2 - t1:.1f} s ({len(text) / 2**20:.0f} MiB), prom {t3 - t2:.1f} s "
                        f"({len(prom) / 2**20:.0f} MiB)")
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"devices {len(doc['devices'])} in {len(paths)} reports: merge {t1 - t0:.1f} s ({c1 - c0:.1f} s CPU){rendered}; peak RSS "
          f"{merge_mib:.0f} MiB after the merge, {peak_mib:.0f} MiB in all; outcome {doc['outcome']}, "
          f"odd {len(doc['comparison']['odd'])}, noise outliers {len(doc['comparison']['noise_outliers'])}, "
          f"duplicates {len(doc['duplicates'])}")


if __name__ == "__main__":
    main()
