"""How much of the clean checksum noise is a predictable bias (an experiment for issue 17).

A matrix unit that chops each fp32 partial sum S_n errs by −(0…1)·ulp(S_n)·sign(S_n) per step,
on average about −0.36·2⁻²³·S_n: the expected error of a row checksum is then −c·Σ_n S_n summed
over its tile, which is a weighted checksum Σ_k w_k·A_ik·(B·1_t)_k with w_k the number of
accumulation steps after product k joins (C − ⌊k/step⌋ for C steps of ``step`` products),
computable in fp64 at the cost of the reference. Per launch this fits c by least squares for a
few step sizes and reports how much of |Δ| the fitted bias explains and how far the residual's
largest value lies above its median, in units of the noise scale σ: if the residual were much
tighter than Δ, subtracting the bias would let thresholds sit closer to the noise.

    PYTHONPATH=. python3 benchmarks/noise_bias.py --device cuda:0 --out "$OUT/noise_bias.json"
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

from aegis_cli.backends import resolve_devices
from aegis_cli.ops import numerics
from aegis_cli.ops.gemm import GemmOperands, Layout


def _fit(delta: torch.Tensor, pred: torch.Tensor, sigma: torch.Tensor) -> dict:
    c = -float((delta * pred).sum() / (pred * pred).sum().clamp(min=1e-300))
    resid = delta + c * pred
    d, r = (delta.abs() / sigma).reshape(-1), (resid.abs() / sigma).reshape(-1)
    return {"c_over_u23": c / 2.0**-23, "r2": 1 - float(resid.var() / delta.var()), "max": float(d.max()),
            "median": float(d.median()), "resid_max": float(r.max()), "resid_median": float(r.median())}


def launch(device, m: int, n: int, k: int, dist: str, seed: int, steps: list[int]) -> dict:
    ops = GemmOperands(device.generate((m, k), dist, 2 * seed), device.generate((k, n), dist, 2 * seed + 1), Layout.DGRAD)
    res, ref = device.checked_gemm(ops), device.reference_checksums(ops, device.tile)
    row_noise, col_noise = ref.noise()
    tm, tn = device.tile
    a, b = ops.a_mk.double(), ops.b_kn.double()
    b_tiles, a_tiles = numerics.sum_col_tiles(b, tn), numerics.sum_row_tiles(a, tm)  # (K, nt_n), (nt_m, K)
    out = {"m": m, "n": n, "k": k, "dist": dist, "seed": seed, "fits": {}}
    for step in steps:
        w = (math.ceil(k / step) - torch.arange(k, device=a.device) // step).double()  # (K,)
        out["fits"][step] = {
            "row": _fit(res.row_sums.double() - ref.row, a @ (w[:, None] * b_tiles), row_noise),
            "col": _fit(res.col_sums.double() - ref.col, (a_tiles * w[None, :]) @ b, col_noise)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="auto")
    ap.add_argument("--k", type=int, nargs="+", default=[1024, 8192])
    ap.add_argument("--size", type=int, default=1024, help="M = N")
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--steps", type=int, nargs="+", default=[16, 32, 64])
    ap.add_argument("--out", default="noise_bias.json")
    args = ap.parse_args()
    (device,) = resolve_devices(args.device)[:1]
    rows = [launch(device, args.size, args.size, k, dist, 3000 + s, args.steps)
            for k in args.k for dist in numerics.DISTRIBUTIONS for s in range(args.seeds)]
    Path(args.out).write_text(json.dumps({"device": device.identity.to_dict(), "launches": rows}, indent=1))
    print("| K | inputs | step | side | c ÷ 2⁻²³ | R² | max ÷ median of |Δ|/σ | of the residual |")
    print("|---:|---|---:|---|---:|---:|---:|---:|")
    for r in rows:
        if r["seed"] != 3000:
            continue
        for step, sides in r["fits"].items():
            for side, f in sides.items():
                print(f"| {r['k']} | {r['dist']} | {step} | {side} | {f['c_over_u23']:.3g} | {f['r2']:.3f} "
                      f"| {f['max'] / f['median']:.3g} ({f['max']:.3g}) | {f['resid_max'] / f['resid_median']:.3g} "
                      f"({f['resid_max']:.3g}) |")


if __name__ == "__main__":
    main()
