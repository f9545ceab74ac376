"""Detection rate of every GEMM fault model on the CPU reference path (≥ 100 random trials each).

Each trial draws fresh inputs (scan seed) and a fresh fault placement (fault seed), runs one
tiny case group (M=160, N=256, K=512, fwd, scales 2^0 and 2^-8/2^8) with one confirmation
re-run, and records whether the device was called FAULTY/SUSPECT and by which check.
Writes docs/detection-rates.md.

    python benchmarks/detection.py [--trials 100] [--out docs/detection-rates.md]
"""

from __future__ import annotations

import argparse
import collections
import time
from pathlib import Path

from aegis_cli.backends.cpu import CpuDevice
from aegis_cli.faults.spec import FaultPlan
from aegis_cli.ops import workloads
from aegis_cli.ops.numerics import Thresholds
from aegis_cli.ops.verdict import Verdict, worst
from aegis_cli.probes.gemm import GemmCase, GemmProbe

ROOT = Path(__file__).resolve().parent.parent
WL = workloads.load(str(ROOT / "tests" / "data" / "tiny.yaml"))

MODELS = [
    # (family, spec template; {s} is the fault seed)
    ("bit flip, accumulator", "bitflip:bit=sign,seed={s}"),
    ("bit flip, accumulator", "bitflip:bit=exp,seed={s}"),
    ("bit flip, accumulator", "bitflip:bit=hi-mant,seed={s}"),
    ("bit flip, accumulator", "bitflip:bit=mant,seed={s}"),
    ("bit flip, accumulator", "bitflip:bit=lo-mant,seed={s}"),
    ("bit flip, output (bf16)", "bitflip:target=out,bit=sign,seed={s}"),
    ("bit flip, output (bf16)", "bitflip:target=out,bit=exp,seed={s}"),
    ("bit flip, output (bf16)", "bitflip:target=out,bit=mant,seed={s}"),
    ("multi-bit mask", "mask:mask=0x00c00000,seed={s}"),
    ("multi-bit mask", "mask:mask=0x0000ff00,seed={s}"),
    ("multi-bit mask, 4 elements", "mask:mask=0x01800000,count=4,seed={s}"),
    ("stuck lane (every 32nd element)", "stuck-lane:mask=0x00400000,offset={s}"),
    ("stuck lane (every 32nd element)", "stuck-lane:mask=0x00000100,offset={s}"),
    *[("replace, accumulator", f"replace:span={span},value={v},seed={{s}}")
      for span in ("1", "16", "64", "random") for v in ("flip", "random", "copy", "zero")],
    *[("replace, output (bf16)", f"replace:target=out,span={span},value={v},seed={{s}}")
      for span in ("1", "16", "64", "random") for v in ("flip", "random", "copy", "zero")],
    *[(f"replace, operand {t.upper()} (spreads along a {'row' if t == 'a' else 'column'})",
       f"replace:target={t},span={span},value={v},seed={{s}}")
      for t in ("a", "b") for span in ("1", "16", "64", "random") for v in ("flip", "random", "copy", "zero")],
    ("perturbation 2e-4 of elements, r×median", "perturb:rate=2e-4,r=1e2,seed={s}"),
    ("perturbation 2e-4 of elements, r×median", "perturb:rate=2e-4,r=1e4,seed={s}"),
    ("perturbation 2e-4 of elements, r×median", "perturb:rate=2e-4,r=1e6,seed={s}"),
    ("tile zeroed", "tile:mode=zero,seed={s}"),
    ("tile stuck at a value", "tile:mode=stuck,value=1.0,seed={s}"),
    ("tile from a shifted input block (wrong address)", "tile:mode=shift,seed={s}"),
    ("tile missing one k-step", "tile:mode=skipk,seed={s}"),
    ("every tile on one SM", "tile:mode=skipk,sm={sm}"),
    ("every n-th tile", "tile:mode=zero,every=3"),
    ("row zeroed", "row:mode=zero,seed={s}"),
    ("row stuck at a value", "row:mode=stuck,value=0.5,seed={s}"),
    ("intermittent exponent flip (prob 0.3)", "bitflip:bit=exp,prob=0.3,seed={s}"),
]


def trial(spec: str, seed: int) -> tuple[Verdict, collections.Counter, bool]:
    dev = CpuDevice()
    plan = FaultPlan.parse(spec)
    probe = GemmProbe(dev, Thresholds(), reruns=1, fault=plan)
    ev = []
    for shape in WL.gemms():
        ev += probe.run(GemmCase(WL.name, shape, "normal", seed), WL.scan.scales)
    verdict = worst([Verdict.HEALTHY, *(e.severity for e in ev)])
    changed = any(rec.get("elements", 0) or rec.get("n_tiles", 0) for rec in plan.injected)
    return verdict, collections.Counter(e.check for e in ev), changed


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trials", type=int, default=100)
    ap.add_argument("--out", default=str(ROOT / "docs" / "detection-rates.md"))
    args = ap.parse_args()
    rows = []
    t0 = time.time()
    for family, template in MODELS:
        verdicts, checks, fired = collections.Counter(), collections.Counter(), 0
        for t in range(args.trials):
            spec = template.format(s=t + 1, sm=t % 4)
            v, c, changed = trial(spec, seed=1000 + t)
            verdicts[v] += 1
            checks.update({k: 1 for k in c})
            fired += changed
        detected = verdicts[Verdict.FAULTY] + verdicts[Verdict.SUSPECT]
        by = ", ".join(f"{k.split('.')[1]} {n}" for k, n in checks.most_common())
        rows.append((family, template.replace("seed={s}", "seed=S").replace(",seed=S", "").replace(":seed=S", "")
                     .replace("{sm}", "N").replace("offset={s}", "offset=S"), args.trials, fired, detected,
                     verdicts[Verdict.FAULTY], by))
        print(f"{template:60s} detected {detected}/{args.trials}  ({by})", flush=True)
    lines = [
        "# Detection rates of the GEMM fault models (CPU reference path)",
        "",
        "Generated by `python benchmarks/detection.py` "
        f"({args.trials} trials per row, {time.time() - t0:.0f} s on 2 CPU cores). Each trial: fresh inputs (normal), a",
        "fresh fault placement, one case group of `tests/data/tiny.yaml` (mlp_down fwd, M=160 N=256 K=512,",
        f"scales 2^0 and 2^-8/2^8), one confirmation re-run, threshold τ = {Thresholds().tau:g} on the CPU's noise scale σ "
        "(`aegis_cli.ops.numerics.Thresholds`, docs/calibration.md).",
        "*detected* = verdict FAULTY or SUSPECT; *caught by* counts trials in which each check fired",
        "(row_checksum, col_checksum: fp32-accumulator sums; output_rowsum: bf16 output against the accumulator",
        "sums with a rigorous rounding bound; pow2_exact: bitwise C(2^a·A, 2^b·B) = 2^(a+b)·C(A, B); nonfinite).",
        "",
        "Misses are faults that stay inside the noise of every check, and are counted here, not hidden:",
        "a flip of a low mantissa bit changes an fp32 accumulator by ≤ 2^-17 of its value, far below rounding",
        "noise; a bf16 output mantissa flip that is permanent commutes with power-of-two scaling and stays",
        "under the output rounding bound (Σ|c|·2^-8 over a 128-column tile); a *copy* of an element that",
        "happens to hold an equal or near-equal value, or *zero* written over a near-zero value, changes",
        "nothing measurable. Bitwise comparisons against other runs, other GPUs or golden fingerprints",
        "(docs/fingerprints.md) see the output-side faults the checksums cannot.",
        "",
        "| fault family | spec | trials | fault applied | detected | FAULTY | caught by (trials) |",
        "|---|---|---:|---:|---:|---:|---|",
    ]
    for fam, spec, n, fired, det, faulty, by in rows:
        lines.append(f"| {fam} | `{spec}` | {n} | {fired} | {det} ({100 * det / n:.0f}%) | {faulty} | {by or '—'} |")
    Path(args.out).write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
