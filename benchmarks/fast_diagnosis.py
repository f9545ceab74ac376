"""How long a device that fails every launch takes to diagnose, against a healthy scan
(issue 18: FAULTY in ≤ 1.5× the healthy wall time, a report < 1 MB).

Runs the default ``aegis scan`` as a process, once healthy and once per injected fault, each
written as JSON, and prints wall time, verdict, launches and report size. ``--warm`` first runs
the faults once on the small cpu-quick catalog, so NVRTC compiles the injection build before
anything is timed (a fresh machine's compile is no part of a diagnosis).

    python benchmarks/fast_diagnosis.py --out DIR [--warm] [--device cuda:0] [--repeat 1]
        [--fault 'bitflip:target=acc,bit=exp' --fault 'perturb:r=1e4'] [-- extra scan options]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

FAULTS = ["bitflip:target=acc,bit=exp", "perturb:r=1e4"]  # one element per launch; random positions per launch


def scan(out: Path, name: str, device: str, inject: str | None, extra: list[str]) -> dict:
    path = out / f"{name}.json"
    argv = [sys.executable, "-m", "aegis_cli", "scan", "-q", "--device", device, "--format", "json", "-o", str(path), *extra]
    if inject:
        argv += ["--inject", inject]
    t0 = time.perf_counter()
    rc = subprocess.run(argv, check=False).returncode
    wall = time.perf_counter() - t0
    doc = json.loads(path.read_text())
    d = doc["devices"][0]
    c = d.get("confirmation") or {}
    return {"run": name, "inject": inject, "exit": rc, "verdict": d["verdict"], "wall_s": round(wall, 2),
            "device_s": d["timings"]["seconds"], "gemms": (d["stats"] or {}).get("gemms"), "launches": c.get("launches"),
            "failed": c.get("failed_launches"), "evidence": len(d["evidence"]), "bytes": path.stat().st_size}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--fault", action="append", default=None, help="an --inject spec in every launch (repeatable)")
    ap.add_argument("--warm", action="store_true", help="compile the injection build before timing")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("extra", nargs="*", help="further scan options")
    args = ap.parse_args()
    faults = args.fault or FAULTS
    args.out.mkdir(parents=True, exist_ok=True)
    if args.warm:
        scan(args.out, "warm", args.device, ";".join(faults), ["--workload", "cpu-quick", "--probes", "gemm,determinism,pow2",
                                                                *args.extra])
    rows = []
    for i in range(args.repeat):
        rows.append(scan(args.out, f"healthy{i}", args.device, None, args.extra))
        for j, spec in enumerate(faults):
            rows.append(scan(args.out, f"fault{j}_{i}", args.device, spec, args.extra))
    healthy = min(r["wall_s"] for r in rows if r["inject"] is None)
    for r in rows:
        r["vs_healthy"] = round(r["wall_s"] / healthy, 2)
    (args.out / "summary.json").write_text(json.dumps(rows, indent=2) + "\n")
    cols = ["run", "verdict", "exit", "wall_s", "device_s", "vs_healthy", "gemms", "launches", "failed", "evidence", "bytes"]
    print(" ".join(f"{c:>10}" for c in cols))
    for r in rows:
        print(" ".join(f"{r[c]!s:>10}" for c in cols), r["inject"] or "")


if __name__ == "__main__":
    main()
