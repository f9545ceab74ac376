"""Clean checksum noise of the checked GEMM at training shapes: the data a threshold that
follows the noise (issue 17) is designed from.

For every GEMM of the given workloads × input distribution × scale of the scan plan, with
fresh seeds, one clean launch; per launch, of the normalised row and column checksum
differences |fused sum − fp64 reference| / Σ|A||B| (numerics.checksum_diffs): the median, the
99.99th percentile and the maximum, and the production τ (Thresholds.tau_for). Prints a table
by (K, distribution) and writes every launch to a JSON:

    PYTHONPATH=. python3 benchmarks/noise_profile.py --device cuda:0 --workloads llama3-8b llama3-70b \
        --seeds 2 --out "$OUT/noise_profile.json"

What to read: max ÷ median (how far above the typical tile difference the largest clean one
lies, the least factor a median-relative threshold needs) and τ ÷ max (how far the production τ
sits above the noise).
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from pathlib import Path

import torch

from aegis_cli.backends import resolve_devices
from aegis_cli.ops import numerics, workloads
from aegis_cli.probes.gemm import scaled, scaled_reference
from aegis_cli.probes.gemm_scan import plan_cases

QUANTILE_SAMPLE = 1 << 22  # torch.quantile takes at most 2^24 values; a strided sample of this many


def _stats(d: torch.Tensor) -> dict[str, float]:
    flat = d.reshape(-1)
    step = max(1, flat.numel() // QUANTILE_SAMPLE)
    q = torch.quantile(flat[::step].float(), torch.tensor([0.5, 0.9999], device=flat.device)).tolist()
    return {"median": q[0], "q9999": q[1], "max": float(flat.max()), "n": flat.numel()}


def profile(device, wl: workloads.Workload, seeds: list[int]) -> list[dict]:
    th = numerics.Thresholds()
    rows = []
    for seed in seeds:
        for case in plan_cases(wl, seed):
            ops0 = case.operands(device)
            ref0 = device.reference_checksums(ops0, device.tile)
            mag = numerics.magnitudes(ops0)
            s = case.shape
            for ea, eb in wl.scan.scales:
                if (ea, eb) != (0, 0) and not numerics.pow2_exact_safe(mag, ea, eb):
                    continue
                ops = scaled(ops0, ea, eb) if (ea, eb) != (0, 0) else ops0
                res = device.checked_gemm(ops)
                d_row, d_col = numerics.checksum_diffs(res, scaled_reference(ref0, ea + eb))
                rows.append({"workload": wl.name, "op": s.op, "layout": s.layout.value, "m": s.m, "n": s.n, "k": s.k,
                             "dist": case.dist, "scale": [ea, eb], "seed": seed, "tau": th.tau_for(device, s.k),
                             "row": _stats(d_row), "col": _stats(d_col)})
    return rows


def summary(rows: list[dict]) -> list[str]:
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        groups[(r["k"], r["dist"])].append(r)
    out = ["| K | inputs | launches | median (typ.) | largest max | max ÷ median (worst launch) | τ | τ ÷ largest max |",
           "|---:|---|---:|---:|---:|---:|---:|---:|"]
    for (k, dist), rs in sorted(groups.items()):
        ratio = max(max(r[side]["max"] / max(r[side]["median"], 1e-300) for side in ("row", "col")) for r in rs)
        worst = max(max(r["row"]["max"], r["col"]["max"]) for r in rs)
        med = sorted(min(r["row"]["median"], r["col"]["median"]) for r in rs)[len(rs) // 2]
        tau = max(r["tau"] for r in rs)
        out.append(f"| {k} | {dist} | {len(rs)} | {med:.3g} | {worst:.3g} | {ratio:.3g} | {tau:.3g} | {tau / worst:.3g}× |")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="auto")
    ap.add_argument("--workloads", nargs="+", default=["cpu-quick"])
    ap.add_argument("--seeds", type=int, default=2, help="fresh inputs per case (seeds 1000…)")
    ap.add_argument("--out", default="noise_profile.json")
    args = ap.parse_args()
    (device,) = resolve_devices(args.device)[:1]
    t0 = time.time()
    rows = []
    for name in args.workloads:
        rows += profile(device, workloads.load(name), list(range(1000, 1000 + args.seeds)))
        print(f"[{time.time() - t0:6.0f} s] {name}: {len(rows)} launches so far", flush=True)
    Path(args.out).write_text(json.dumps({"device": device.identity.to_dict(), "kernel": getattr(device, "kernel", "cpu"),
                                          "launches": rows}, indent=1))
    print("\n".join(summary(rows)))


if __name__ == "__main__":
    main()
