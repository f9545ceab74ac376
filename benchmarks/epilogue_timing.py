"""Where a tile's cycles go in the wgmma kernel: main loop, epilogue phase 1, the next tile's
head issue, phase 2, for the plain and the checked build, from clock64() inside the kernel.

    PYTHONPATH=. python3 benchmarks/epilogue_timing.py [--size M N K ...] [--ctas N] [--json FILE]

Builds with -DAEGIS_TIMING, where consumer warp 0 of each warpgroup writes its cycle counts
per tile into tile_sm instead of the SM id (an experiment build: C and the sums are as usual).
Medians over every tile of the last of several back-to-back launches; the first and last tile
of each CTA (start-up, no next head) are left out.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from gemm import N_SETS, _input_sets, _parse_variant, _variant_launches, write_rows

from aegis_cli.ops.gemm import Layout

VARIANTS = ("plain=nosums", "checked=")


def decode(tile_sm: torch.Tensor, m: int, n: int, grid: int) -> dict[str, list[int]]:
    """Cycle counts per (CTA tile, consumer), leaving out each CTA's first and last tile."""
    ts = tile_sm.cpu().to(torch.int64)
    tiles_m, tiles_n = -(-m // 128), -(-n // 256)
    n_tiles = tiles_m * tiles_n
    out: dict[str, list[int]] = {"main_loop": [], "phase1": [], "head": [], "phase2": []}
    group = 16 * tiles_n
    for t in range(n_tiles):
        if t < grid or t + grid >= n_tiles:
            continue
        first = (t // group) * 16  # the kernel's tile_coords
        gsz = min(tiles_m - first, 16)
        bm, bc = first + (t % group) % gsz, (t % group) // gsz
        for c in range(2):
            s0, s1 = int(ts[2 * bm + c, 2 * bc]), int(ts[2 * bm + c, 2 * bc + 1])
            out["phase1"].append(s0 & 0xFFFF)
            out["head"].append(s0 >> 16)
            out["phase2"].append(s1 & 0xFFFF)
            out["main_loop"].append((s1 >> 16) * 8)
    return out


def run(sizes, ctas: int | None, specs=VARIANTS, launches_per: int = 8) -> list[dict]:
    """``specs`` as gemm.py --compare takes them (``name=variant[+DEFINE...]``); deltas are
    against the first."""
    from aegis_cli.backends import cuda

    variants = {name: (v, {**d, "AEGIS_TIMING": 1}) for name, (v, d) in map(_parse_variant, specs)}
    dev = cuda.CudaDevice(0, kernel="wgmma")
    rows = []
    for m, n, k in sizes:
        sets = _input_sets(dev, Layout.FWD, m, n, k, 300)
        launches = _variant_launches(dev, variants, sets, Layout.FWD, ctas)
        first = len(rows)
        for name, ls in launches.items():
            for i in range(launches_per):
                ls[i % N_SETS].run()
            torch.cuda.synchronize()
            last = ls[(launches_per - 1) % N_SETS]
            parts = decode(last.outputs[3], m, n, last.grid[0])
            med = {p: statistics.median(v) for p, v in parts.items()}
            total = sum(med.values())
            rows.append({"variant": name, "m": m, "n": n, "k": k, "ctas": last.grid[0], **med, "tile": total,
                         "samples": len(parts["phase1"])})
            print(f"{name:<8} {m}x{n}x{k} on {last.grid[0]} SMs: main loop {med['main_loop']:7.0f}  phase 1 "
                  f"{med['phase1']:5.0f}  head {med['head']:5.0f}  phase 2 {med['phase2']:5.0f}  = {total:7.0f} "
                  f"cycles per tile (median of {len(parts['phase1'])})", flush=True)
        p = rows[first]
        for c in rows[first + 1:]:
            print(f"  {c['variant']} - {p['variant']}: " + "  ".join(
                f"{part} {c[part] - p[part]:+.0f}" for part in ("main_loop", "phase1", "head", "phase2", "tile"))
                  + f" ({c['tile'] / p['tile'] - 1:+.2%})", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", nargs=3, type=int, action="append", metavar=("M", "N", "K"))
    ap.add_argument("--ctas", type=int, default=None, help="at most this many SMs (persistent grid)")
    ap.add_argument("--compare", nargs="+", default=VARIANTS, metavar="NAME=VARIANT[+DEFINE...]",
                    help="variants as gemm.py --compare takes them (AEGIS_TIMING is added)")
    ap.add_argument("--json", help="write rows here")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 3
    rows = run(args.size or [(8192, 8192, 3584)], args.ctas, args.compare)
    write_rows(args.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
