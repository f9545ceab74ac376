"""What checking every Linear launch would cost with the checksums inside the GEMM (issue 20).

    PYTHONPATH=. python3 benchmarks/abft_floor.py [--reps 10] [--step-ms 138.5] [--out DIR]

A separate reference pass per launch costs 0.33 ms (64 % of the 1.18B GPT's step when every
launch is checked), so the "every Linear ≤ 2 %" target needs the reference inside the GEMM: ABFT
checksum columns (B's tile sums, three bf16 pieces for fp32-accumulator precision) beside each
k-step's wgmma for the row check, and for wgrad's column check the transposed product (B's stage as
the A operand, A's tile sums as 8 columns). This times the tensor-core part of that on the GEMMs of
benchmarks/sensor_reference.py's model (22 layers × qkv, proj, fc, mlp.proj and the head; forward,
dgrad and wgrad in their layouts), interleaved with cuBLAS (``gemm.compare``): our kernel plain, with
its fused observed sums (checked), and with experiment builds of kernels/gemm_wgmma.cu:
``AEGIS_PROBE_ROWS`` / ``_COLS`` (the extra m64n8k16 wgmma issued on the stages' own data),
``AEGIS_PROBE_TCSUMS`` (the tile sums themselves on the tensor cores, the stage as the A operand),
all with C and sums unchanged (checked bit for bit here); and ``AEGIS_ABFT_ROWS``, the row check
built: each consumer makes B's tile sums on the tensor cores one stage ahead, splits them into three
bf16 pieces and multiplies them beside each k16 — the expected row sums, which the build writes in
place of the observed ones and this compares with the checked build's and with fp64 (an earlier
build summed B on the producer's idle warps instead: as precise, 2.7–4.2× slower; RESULTS.md);
``AEGIS_ABFT_PRE`` (variant ``pre``), the same check MMAs with their pieces made outside the kernel
(``pieces``) and loaded with each stage, no tile sums in the kernel. The other way to have the tile sums is a
pass over B (and A for columns) in memory; a floor for it is ``tile_abs_sums`` (one statistic at
memory bandwidth), timed per operand. Summed over a step with the launch counts and set against
``--step-ms`` (the plain step measured by sensors_overhead.py): what each design costs before its
comparison.
Writes DIR/abft_floor.json (DIR: --out, else $OUT, else .) and prints a table last.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gemm
from sensor_reference import LAYERS, LINEARS, operands, per_step, timed

from aegis_cli.backends.cuda import CudaDevice
from aegis_cli.ops import lean
from aegis_cli.ops.gemm import GemmOperands, Layout

VARIANTS = {"plain": ("nosums", {}), "checked": ("", {}), "rows": ("", {"AEGIS_PROBE_ROWS": 1}),
            "cols": ("", {"AEGIS_PROBE_COLS": 1}), "both": ("", {"AEGIS_PROBE_ROWS": 1, "AEGIS_PROBE_COLS": 1}),
            "abft": ("", {"AEGIS_ABFT_ROWS": 1}), "pre": ("", {"AEGIS_ABFT_ROWS": 1, "AEGIS_ABFT_PRE": 1}),
            "tc": ("", {"AEGIS_PROBE_ROWS": 1, "AEGIS_PROBE_TCSUMS": 1}),
            "tcboth": ("", {"AEGIS_PROBE_ROWS": 1, "AEGIS_PROBE_TCSUMS": 1, "AEGIS_PROBE_COLS": 1})}
ROW_VARIANTS = ("plain", "checked", "rows", "tc", "abft", "pre")  # timed on every layout
COL_VARIANTS = ("cols", "both", "tcboth")  # and on wgrad, its column check


def pieces(b_kn: torch.Tensor) -> torch.Tensor:
    """B's 128-column tile sums (fp64, then fp32) in three bf16 pieces (hi, mid, lo: fp32's 24 bits),
    as the AEGIS_ABFT_PRE build loads them: [256-column block][64-k block][8 rows × 64 k], row
    3·tile + piece (rows 6, 7 zero), each 1 KB block in the 128-byte swizzle of the stage it joins."""
    k, n = b_kn.shape
    nt, kt = -(-n // 256) * 2, -(-k // 64)
    padded = torch.zeros(kt * 64, nt * 128, dtype=torch.float64, device=b_kn.device)
    padded[:k, :n] = b_kn
    v = padded.view(kt * 64, nt, 128).sum(-1).float()  # (K, tiles)
    hi = v.bfloat16()
    r1 = v - hi.float()
    mid = r1.bfloat16()
    rows = torch.stack([hi, mid, (r1 - mid.float()).bfloat16()], -1)  # (K, tiles, 3)
    rows = rows.view(kt, 64, nt // 2, 6).permute(2, 0, 3, 1)  # (block, k-block, 3·tile + piece, k)
    logical = torch.zeros(nt // 2, kt, 8, 64, dtype=torch.bfloat16, device=b_kn.device)
    logical[:, :, :6] = rows
    r = torch.arange(8, device=b_kn.device)[:, None]
    kk = torch.arange(64, device=b_kn.device)[None, :]
    where = (((kk >> 3) ^ r) * 8 + (kk & 7)).expand(nt // 2, kt, 8, 64)
    return torch.zeros_like(logical).scatter_(-1, where, logical).contiguous()


def extend(defines: dict, launch, ops: GemmOperands) -> None:
    """The AEGIS_ABFT_PRE build's extra argument: the pieces of this launch's B."""
    if "AEGIS_ABFT_PRE" in defines:
        rt = pieces(ops.b_kn)
        launch.keep.append(rt)
        launch.args.append(ctypes.c_void_p(rt.data_ptr()))


def accuracy(dev, layout: Layout, m: int, n: int, k: int) -> dict:
    """The ABFT builds' row sums (expected: A times B's tile sums in three bf16 pieces, made in the
    kernel or before it) against the checked build's (observed: sums of the fp32 accumulator) and
    all against the fp64 reference, in units of s = Σ|a||b| over the tile; C must be the same bits."""
    sets = gemm._input_sets(dev, layout, m, n, k, 300, count=1)
    launches = gemm._variant_launches(dev, {v: VARIANTS[v] for v in ("checked", "abft", "pre")}, sets, layout, extend=extend)
    outs = {}
    for v, (launch,) in launches.items():
        launch.run()
        outs[v] = [t.clone() for t in launch.outputs]
    ops = GemmOperands(*sets[0], layout)
    ref, scale, _ = lean.lean_side(ops.a_mk, ops.b_kn, 128, rho=False)
    obs, exp, pre = (outs[v][1].double() for v in ("checked", "abft", "pre"))
    err = lambda x: ((x - ref).abs() / scale).max().item()
    return {"c_same": torch.equal(outs["checked"][0], outs["abft"][0]) and torch.equal(outs["checked"][0], outs["pre"][0]),
            "observed_err": err(obs), "expected_err": err(exp), "pre_err": err(pre),
            "expected_vs_observed": ((exp - obs).abs() / scale).max().item(),
            "pre_vs_observed": ((pre - obs).abs() / scale).max().item(), "pre_vs_expected": ((pre - exp).abs() / scale).max().item()}


def run(reps: int) -> list[dict]:
    dev = CudaDevice(0, kernel="wgmma")
    rows = []
    for name in LINEARS:
        for layout in Layout:
            ops = operands(name, layout, "cuda", 7)
            m, n, k = ops.mnk
            wgrad = layout is Layout.WGRAD
            variants = {v: VARIANTS[v] for v in ROW_VARIANTS + (COL_VARIANTS if wgrad else ())}
            (row,) = gemm.compare(variants, [(m, n, k)], reps=reps, layout=layout, extend=extend)
            flop = 2.0 * m * n * k
            row["ms"] = {v[: -len("_tflops")]: flop / (tf * 1e9) for v, tf in row.items() if v.endswith("_tflops")}
            # passes over memory for the tile sums: the right operand as (K, N) over 128-column tiles,
            # and wgrad's left as (K, M) over 64-row tiles (its column check)
            row["b_pass_ms"] = timed(lambda x=ops.b_kn: dev.tile_abs_sums(x, 128), reps)
            row["a_pass_ms"] = timed(lambda x=ops.a: dev.tile_abs_sums(x, 64), reps) if wgrad else 0.0
            row["accuracy"] = accuracy(dev, layout, m, n, k)
            row.update(op=f"{name}/{layout.value}", count=per_step(name))
            rows.append(row)
            print(f"{row['op']:<16} " + "  ".join(f"{v} {t:.3f}" for v, t in row["ms"].items())
                  + f"  passes {row['b_pass_ms']:.3f} + {row['a_pass_ms']:.3f} ms; {row['accuracy']}", flush=True)
    return rows


def totals(rows: list[dict], step_ms: float) -> dict:
    """Per step (launch counts applied), ms, and what checking every Linear adds over cuBLAS as a
    share of the plain step: with the tile sums made by passes over memory, or in the kernel."""
    def total(fn) -> float:
        return sum(r["count"] * fn(r) for r in rows)

    wg = lambda r: "cols" in r["ms"]
    out = {key: total(lambda r, key=key: r["ms"][key]) for key in ("cublas", "plain", "checked", "rows", "abft", "pre")}
    out["passes"] = total(lambda r: r["b_pass_ms"] + r["a_pass_ms"])
    out["with_passes_ms"] = total(lambda r: r["ms"]["both" if wg(r) else "rows"] + r["b_pass_ms"] + r["a_pass_ms"]) - out["cublas"]
    # the row check built (AEGIS_ABFT_ROWS), wgrad's column check as its probes' extra time
    out["in_kernel_ms"] = total(lambda r: r["ms"]["abft"] + (r["ms"]["tcboth"] - r["ms"]["tc"] if wg(r) else 0.0)) - out["cublas"]
    # the pieces made before the kernel: its time, wgrad's column MMAs, and a pass over B for the sums
    out["pre_ms"] = total(lambda r: r["ms"]["pre"] + (r["ms"]["both"] - r["ms"]["rows"] if wg(r) else 0.0) + r["b_pass_ms"]) - out["cublas"]
    out["tensor_cores_ms"] = total(lambda r: r["ms"]["tcboth" if wg(r) else "tc"]) - out["cublas"]
    out["step_ms"] = step_ms
    return out


def table(rows: list[dict], tot: dict) -> str:
    lines = [f"{'GEMM':<16} {'M×N×K':>18} {'cuBLAS':>7} {'plain':>7} {'checked':>8} {'+rows':>7} {'tc':>7} {'abft':>7} {'pre':>7} {'+cols':>7} "
             f"{'both':>7} {'tcboth':>7} {'B pass':>7} {'A pass':>7}  probes' bits; row sums' max error ÷ s: abft, pre, observed"]
    for r in rows:
        ms, acc = r["ms"], r["accuracy"]
        cell = lambda v, ms=ms: f"{ms[v]:>7.3f}" if v in ms else f"{'-':>7}"
        same = all(r.get(f"{v}_bitwise", True) for v in ("rows", "cols", "both", "tc", "tcboth")) and acc["c_same"]
        lines.append(f"{r['op']:<16} {r['m']:>6}×{r['n']}×{r['k']:<6} {cell('cublas')} {cell('plain')} {ms['checked']:>8.3f} "
                     f"{cell('rows')} {cell('tc')} {cell('abft')} {cell('pre')} {cell('cols')} {cell('both')} {cell('tcboth')} {r['b_pass_ms']:>7.3f} "
                     f"{r['a_pass_ms']:>7.3f}  "
                     f"{'same' if same else 'DIFFER'}; {acc['expected_err']:.1e} {acc['pre_err']:.1e} {acc['observed_err']:.1e}")
    s = tot["step_ms"]
    lines.append(f"a step ({LAYERS} layers + head), ms: cuBLAS {tot['cublas']:.2f}, ours plain {tot['plain']:.2f}, checked "
                 f"{tot['checked']:.2f}, + row columns {tot['rows']:.2f}, row check in the kernel {tot['abft']:.2f}, with pieces made before {tot['pre']:.2f}, "
                 f"tile-sum passes over memory {tot['passes']:.2f}")
    for key, label in (("with_passes_ms", "tile sums by passes over memory"), ("in_kernel_ms", "the row check built, tile sums on the tensor cores"),
                       ("tensor_cores_ms", "every tile sum on the tensor cores (MMA cost only)"),
                       ("pre_ms", "the pieces made by a pass over B before the kernel")):
        lines.append(f"every Linear checked in-GEMM, {label}, before any comparison: {tot[key]:+.2f} ms over cuBLAS = "
                     f"{100 * tot[key] / s:+.2f} % of a {s:.1f} ms step (target ≤ 2 %)")
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
