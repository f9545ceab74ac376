"""Clean checksum noise of the checked GEMM at training shapes: the data the noise model of
each device (numerics.NoiseModel, docs/calibration.md) is calibrated from and checked against.

For every GEMM of the given workloads × input distribution × scale of the scan plan, with
fresh seeds, one clean launch; per launch, of the row and column checksum differences
|fused sum − fp64 reference| (less the subnormal floor), three normalisations:

  s     ÷ Σ|A||B| over the checksum's tile (the former statistic)
  rho   ÷ ρ = sqrt(Σ_k A_ik²·Σ_{j∈t} B_kj²) (the noise model without its K factor)
  model ÷ the device's noise scale σ (what the checks use; τ = Thresholds().tau on it)

and of each the median, 99th and 99.99th percentiles and the maximum. Prints a table by
(K, distribution) and writes every launch to a JSON:

    PYTHONPATH=. python3 benchmarks/noise_profile.py --device cuda:0 --workloads llama3-8b llama3-70b \
        --seeds 3 --out "$OUT/noise_profile.json"

What to read: whether rho's maximum divided by K^power is flat in K and across distributions
(the model's power), max ÷ median under the model (how far above the typical difference the
largest lies) and τ ÷ the largest model value (the margin a scan reports).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections import defaultdict
from pathlib import Path

import torch

from aegis_cli.backends import resolve_devices
from aegis_cli.ops import numerics, workloads
from aegis_cli.probes.gemm import scaled
from aegis_cli.probes.gemm_scan import plan_cases

QUANTILE_SAMPLE = 1 << 22  # torch.quantile takes at most 2^24 values; a strided sample of this many
RHO = numerics.NoiseModel(unit=1.0, power=0.0, cap=math.inf, source="ρ alone")
NORMS = ("s", "rho", "model")


def _stats(d: torch.Tensor) -> dict[str, float]:
    flat = d.reshape(-1)
    step = max(1, flat.numel() // QUANTILE_SAMPLE)
    q = torch.quantile(flat[::step].float(), torch.tensor([0.5, 0.99, 0.9999], device=flat.device)).tolist()
    return {"median": q[0], "q99": q[1], "q9999": q[2], "max": float(flat.max()), "n": flat.numel()}


def launch_stats(device, res, ref, k: int) -> dict[str, dict]:
    """Per normalisation and side, the statistics of one launch's differences (``ref`` with ρ)."""
    model = device.noise_model(k)
    out = {}
    for side, sums, want, s, rho in (("row", res.row_sums, ref.row, ref.row_scale, ref.row_noise),
                                     ("col", res.col_sums, ref.col, ref.col_scale, ref.col_noise)):
        for norm, by in (("s", s), ("rho", rho), ("model", model.scale(rho, s, k))):
            out[f"{norm}_{side}"] = _stats(numerics.normalised_diff(sums, want, by, ref.floor))
    return out


def profile(device, wl: workloads.Workload, seeds: list[int]) -> list[dict]:
    tau = numerics.Thresholds().tau
    rows = []
    for seed in seeds:
        for case in plan_cases(wl, seed):
            ops0 = case.operands(device)
            ref0 = numerics.reference_checksums(ops0, device.tile, RHO)
            mag = numerics.magnitudes(ops0)
            s = case.shape
            for ea, eb in wl.scan.scales:
                if (ea, eb) != (0, 0) and not numerics.pow2_exact_safe(mag, ea, eb):
                    continue
                ops = scaled(ops0, ea, eb) if (ea, eb) != (0, 0) else ops0
                res = device.checked_gemm(ops)
                rows.append({"workload": wl.name, "op": s.op, "layout": s.layout.value, "m": s.m, "n": s.n, "k": s.k,
                             "dist": case.dist, "scale": [ea, eb], "seed": seed, "tau": tau,
                             **launch_stats(device, res, ref0.scaled(ea + eb), s.k)})
    return rows


def _worst(rs: list[dict], norm: str, key: str = "max") -> float:
    return max(max(r[f"{norm}_row"][key], r[f"{norm}_col"][key]) for r in rs)


def summary(rows: list[dict]) -> list[str]:
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        groups[(r["k"], r["dist"])].append(r)
    out = ["| K | inputs | launches | s: largest max | s: max ÷ median | ρ: largest max | ÷ √K | ÷ K "
           "| model: median (typ.) | model: largest max | model: max ÷ median (worst launch) | τ ÷ largest max |",
           "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for (k, dist), rs in sorted(groups.items()):
        def spread(norm: str, rs: list[dict] = rs) -> float:
            return max(max(r[f"{norm}_{side}"]["max"] / max(r[f"{norm}_{side}"]["median"], 1e-300) for side in ("row", "col"))
                       for r in rs)
        rho = _worst(rs, "rho")
        med = sorted(min(r["model_row"]["median"], r["model_col"]["median"]) for r in rs)[len(rs) // 2]
        worst = _worst(rs, "model")
        tau = max(r["tau"] for r in rs)
        out.append(f"| {k} | {dist} | {len(rs)} | {_worst(rs, 's'):.3g} | {spread('s'):.3g} | {rho:.3g} | {rho / math.sqrt(k):.3g} "
                   f"| {rho / k:.3g} | {med:.3g} | {worst:.3g} | {spread('model'):.3g} | {tau / worst if worst else math.inf:.3g}× |")
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
                                          "noise_model": device.noise_model(1).describe(1), "launches": rows}, indent=1))
    print("\n".join(summary(rows)))


if __name__ == "__main__":
    main()
