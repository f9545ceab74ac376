"""What checking every Linear launch would cost with the checksums inside the GEMM (issue 20).

    PYTHONPATH=. python3 benchmarks/abft_floor.py [--reps 10] [--step-ms 138.5] [--out DIR]

A separate reference pass per launch costs 0.33 ms (64 % of the 1.18B GPT's step when every
launch is checked), so the "every Linear ≤ 2 %" target needs the reference inside the GEMM: ABFT
checksum columns (B's tile sums, three bf16 pieces for fp32-accumulator precision) beside each
k-step's wgmma for the row check, and for wgrad's column check the transposed product (B's stage as
the A operand, A's tile sums as 8 columns). This times the tensor-core part of that on the GEMMs of
benchmarks/sensor_reference.py's model (22 layers × qkv, proj, fc, mlp.proj and the head; forward,
dgrad and wgrad in their layouts), interleaved with cuBLAS (``gemm.compare``): our kernel plain, with
its fused observed sums (checked), and with the experiment builds ``AEGIS_PROBE_ROWS`` /
``AEGIS_PROBE_COLS`` (kernels/gemm_wgmma.cu: the extra m64n8k16 wgmma issued on the stages' own data,
C and sums unchanged — checked bit for bit here). The tile sums themselves need one more pass over
B (and A for columns): a floor for it is ``tile_abs_sums`` (one statistic at memory bandwidth),
timed per operand. Summed over a step with the launch counts and set against ``--step-ms`` (the
plain step measured by sensors_overhead.py), this is what such a design costs before its comparison.
Writes DIR/abft_floor.json (DIR: --out, else $OUT, else .) and prints a table last.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gemm
from sensor_reference import LINEARS, TOKENS, operands, timed

from aegis_cli.backends.cuda import CudaDevice
from aegis_cli.ops.gemm import Layout

LAYERS = 22
VARIANTS = {"plain": ("nosums", {}), "checked": ("", {}), "rows": ("", {"AEGIS_PROBE_ROWS": 1}),
            "cols": ("", {"AEGIS_PROBE_COLS": 1}), "both": ("", {"AEGIS_PROBE_ROWS": 1, "AEGIS_PROBE_COLS": 1})}


def shape(name: str, layout: Layout) -> tuple[int, int, int]:
    fin, fout = LINEARS[name]
    return {Layout.FWD: (TOKENS, fout, fin), Layout.DGRAD: (TOKENS, fin, fout), Layout.WGRAD: (fout, fin, TOKENS)}[layout]


def run(reps: int) -> list[dict]:
    dev = CudaDevice(0, kernel="wgmma")
    rows = []
    for name in LINEARS:
        for layout in Layout:
            m, n, k = shape(name, layout)
            variants = {v: VARIANTS[v] for v in (("plain", "checked", "rows", "cols", "both") if layout is Layout.WGRAD
                                                   else ("plain", "checked", "rows"))}
            (row,) = gemm.compare(variants, [(m, n, k)], reps=reps, layout=layout)
            flop = 2.0 * m * n * k
            row["ms"] = {v[: -len("_tflops")]: flop / (tf * 1e9) for v, tf in row.items() if v.endswith("_tflops")}
            ops = operands(name, layout, "cuda", 7)
            # the right operand as (K, N) over 128-column tiles; wgrad's left as (K, M) over 64-row tiles
            sides = [(ops.b.t() if layout is Layout.FWD else ops.b, 128)] + ([(ops.a, 64)] if layout is Layout.WGRAD else [])
            row["tile_sums_ms"] = sum(timed(lambda x=x, t=t: dev.tile_abs_sums(x, t), reps) for x, t in sides)
            row.update(op=f"{name}/{layout.value}", count=1 if name == "head" else LAYERS)
            rows.append(row)
            print(f"{row['op']:<16} " + "  ".join(f"{v} {t:.3f}" for v, t in row["ms"].items()) + f"  tile sums {row['tile_sums_ms']:.3f} ms",
                  flush=True)
    return rows


def totals(rows: list[dict], step_ms: float) -> dict:
    """Per step (launch counts applied), ms and the share of the plain step over cuBLAS."""
    def total(key) -> float:
        return sum(r["count"] * (key(r) if callable(key) else r["ms"][key]) for r in rows)

    full = lambda r: r["ms"]["both" if "both" in r["ms"] else "rows"]
    out = {"cublas": total("cublas"), "plain": total("plain"), "checked": total("checked"), "rows": total("rows"),
           "rows_and_wgrad_cols": total(full), "tile_sums": total(lambda r: r["tile_sums_ms"])}
    out["every_linear_floor_ms"] = out["rows_and_wgrad_cols"] + out["tile_sums"] - out["cublas"]
    out["every_linear_floor_share"] = out["every_linear_floor_ms"] / step_ms
    out["step_ms"] = step_ms
    return out


def table(rows: list[dict], tot: dict) -> str:
    lines = [f"{'GEMM':<16} {'M×N×K':>18} {'cuBLAS':>7} {'plain':>7} {'checked':>8} {'+rows':>7} {'+cols':>7} {'both':>7} "
             f"{'sums pass':>9}  (ms; bits same as checked)"]
    for r in rows:
        ms = r["ms"]
        cell = lambda v, ms=ms: f"{ms[v]:>7.3f}" if v in ms else f"{'-':>7}"
        same = all(r.get(f"{v}_bitwise", True) for v in ("rows", "cols", "both"))
        lines.append(f"{r['op']:<16} {r['m']:>6}×{r['n']}×{r['k']:<6} {cell('cublas')} {cell('plain')} {ms['checked']:>8.3f} "
                     f"{cell('rows')} {cell('cols')} {cell('both')} {r['tile_sums_ms']:>9.3f}  {'same' if same else 'DIFFER'}")
    s = tot["step_ms"]
    lines.append(f"a step ({LAYERS} layers + head), ms: cuBLAS {tot['cublas']:.2f}, ours plain {tot['plain']:.2f}, checked "
                 f"{tot['checked']:.2f}, + row columns {tot['rows']:.2f}, + wgrad's column check {tot['rows_and_wgrad_cols']:.2f}, "
                 f"tile-sum passes {tot['tile_sums']:.2f}")
    lines.append(f"every Linear checked in-GEMM, before any comparison: +{tot['every_linear_floor_ms']:.2f} ms over cuBLAS = "
                 f"{100 * tot['every_linear_floor_share']:.2f} % of a {s:.1f} ms step (target ≤ 2 %)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--step-ms", type=float, default=138.5, help="the plain training step (sensors_overhead.py's plain mean)")
    p.add_argument("--out", default=os.environ.get("OUT") or ".")
    args = p.parse_args(argv)
    rows = run(args.reps)
    tot = totals(rows, args.step_ms)
    result = {"rows": rows, "totals": tot, "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "abft_floor.json").write_text(json.dumps(result, indent=1, default=str), encoding="utf-8")
    print(table(rows, tot))
    return result


if __name__ == "__main__":
    main()
