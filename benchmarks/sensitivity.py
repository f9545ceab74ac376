"""The AEGIS sensitivity study (aegis_cli.sensitivity) at training shapes; writes its whole doc.

For each K and input distribution: thresholds calibrated on held-out clean runs, then
perturbation trials on other inputs, detected (a) by the fp32-accumulator checks at the
production τ, (b) by the same checks at their held-out thresholds and (c) by a bf16-output
checksum at its held-out threshold. Every line of the doc is generated here.

    python benchmarks/sensitivity.py                              # CPU: docs/sensitivity.md
    PYTHONPATH=. python3 benchmarks/sensitivity.py --device cuda:0 --out-dir OUT
                                                                  # OUT/sensitivity-h200.md + .json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shlex
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from aegis_cli.backends import resolve_devices
from aegis_cli.ops import numerics
from aegis_cli.ops.provenance import versions
from aegis_cli.sensitivity import DETECTORS, SensitivityResult, Setup, half_decades, sensitivity

ROOT = Path(__file__).resolve().parent.parent
PAPER_R99 = 1.0  # AEGIS: near-100 % detection at r ≈ 1 × the median clean difference (fp32 accumulator)
PAPER_BF16_FACTOR = 1e4  # AEGIS: bf16-output checksums need ~10⁴× larger perturbations
DIST_TEXT = {"normal": "N(0, 1)", "uniform": "U(−√3, √3)", "heavy": "Student-t, 3 degrees of freedom"}


def fmt(x: float, grid_max: float | None = None) -> str:
    """3 significant digits, exponent written plainly (3.16e3); inf → "> grid max" (never reached)."""
    if math.isinf(x):
        return f"> {fmt(grid_max)}" if grid_max else "∞"
    if x == 0 or 1e-2 <= abs(x) < 1e3:
        return f"{x:.3g}"
    mant, exp = f"{x:.2e}".split("e")
    mant = mant.rstrip("0").rstrip(".")
    return f"{mant}e{int(exp)}" if mant != "1" else f"1e{int(exp)}"


def git_commit() -> str:
    """The checkout's commit; AEGIS_COMMIT names it where the tree was copied without its git
    metadata (a device machine's copy of a working tree)."""
    if os.environ.get("AEGIS_COMMIT"):
        return os.environ["AEGIS_COMMIT"]
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
        return sha + (" with uncommitted changes" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout)"


def jsonable(x):
    """The result as strict JSON: infinities (a rate never reached) become null."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: jsonable(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [jsonable(v) for v in x]
    return x


def summary_rows(results: list[SensitivityResult], grid_max: float) -> list[str]:
    rows = ["| K | inputs | τ (production) | largest clean fp32 Δ | τ ÷ clean max | (a) r50 / r99 | (b) r50 / r99 "
            "| (c) r50 / r99 | (c) ÷ (b) at 99 % | held-out clean runs flagged (a / b / c) |",
            "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for res in results:
        b, c = res.r99("fp32_heldout"), res.r99("bf16_heldout")
        ratio = "—" if math.isinf(b) else (f"> {fmt(grid_max / b)}" if math.isinf(c) else fmt(c / b))
        pair = " | ".join(f"{fmt(res.r50(d), grid_max)} / {fmt(res.r99(d), grid_max)}" for d in DETECTORS)
        fp = " / ".join(str(res.false_positives[d]) for d in DETECTORS)
        rows.append(f"| {res.setup.k} | {res.setup.dist} | {fmt(res.tau)}·σ | {fmt(res.fp32_clean_max)}·σ | {res.tau_over_clean:.2g}× "
                    f"| {pair} | {ratio} | {fp} of {res.setup.trial_inputs} |")
    return rows


def calibration_rows(results: list[SensitivityResult]) -> list[str]:
    rows = ["| K | inputs | check | clean max (calibration) | threshold | clean max (held-out inputs) | held-out ÷ threshold |",
            "|---:|---|---|---:|---:|---:|---:|"]
    for res in results:
        for c in ("fp32_row", "fp32_col", "bf16_row", "bf16_col"):
            th, unit = res.thresholds[c], "σ" if c.startswith("fp32") else "s"
            rows.append(f"| {res.setup.k} | {res.setup.dist} | {c.replace('_', ' ')} | {fmt(res.clean_max[c])}·{unit} | {fmt(th)}·{unit} "
                        f"| {fmt(res.heldout_max[c])}·{unit} | {fmt(res.heldout_max[c] / th) if th > 0 else '∞'} |")
    return rows


def curve_tables(results: list[SensitivityResult]) -> list[str]:
    lines = []
    for k in sorted({res.setup.k for res in results}):
        mine = [res for res in results if res.setup.k == k]
        lines += ["", f"### K = {k}", "", "Detection in % of trials, (a) · (b) · (c).", "",
                  "| r | " + " | ".join(res.setup.dist for res in mine) + " |", "|---:|" + "---:|" * len(mine)]
        for i, r in enumerate(mine[0].rs):
            cells = [" · ".join(f"{100 * res.detection[d][i]:.0f}" for d in DETECTORS) for res in mine]
            lines.append(f"| {fmt(r)} | " + " | ".join(cells) + " |")
    return lines


def gap_lines(results: list[SensitivityResult], margin: float, grid_max: float) -> list[str]:
    """The comparison with the paper, in numbers taken from this run (no hand-written figures)."""
    a = [res.r99("fp32_tau") for res in results]
    b = [res.r99("fp32_heldout") for res in results]
    spread = [res.fp32_clean_max / res.median_norm for res in results if res.median_norm > 0]
    ratios = [res.r99("bf16_heldout") / res.r99("fp32_heldout") for res in results
              if math.isfinite(res.r99("bf16_heldout")) and math.isfinite(res.r99("fp32_heldout"))]
    tau_over = [res.tau_over_clean for res in results]

    def span(xs: list[float]) -> str:
        lo, hi = min(xs), max(xs)
        return fmt(lo, grid_max) if lo == hi else f"{fmt(lo, grid_max)} … {fmt(hi, grid_max)}"

    lines = ["| | AEGIS paper | here: (a) production τ | here: (b) held-out threshold |", "|---|---:|---:|---:|",
             f"| fp32-accumulator r99 | ≈ {fmt(PAPER_R99)} | {span(a)} | {span(b)} |",
             f"| bf16-output r99 ÷ fp32-accumulator r99 | ~{fmt(PAPER_BF16_FACTOR)} | — | "
             f"{span(ratios) if ratios else '—'}{' (where both reached 99 % on the grid)' if len(ratios) < len(results) else ''} |",
             ""]
    lines.append(f"- **At the production τ the fp32-accumulator checks need r = {span(a)} for 99 % detection, against "
                 f"≈ {fmt(PAPER_R99)} in the paper.** τ sits {span(tau_over)}× above the largest clean difference of the "
                 "calibration inputs (in units of the noise scale σ).")
    lines.append(f"- The same perturbed launches against thresholds {margin:g}× the largest clean difference of the calibration "
                 f"inputs (b) give r99 = {span(b)}: what the checksums can do when the threshold follows the measured noise.")
    if spread:
        lines.append(f"- Both stay above the paper's r ≈ 1: one perturbed element is flagged only when it moves a checksum "
                     f"past the threshold, which must lie above the largest clean difference, and that maximum is "
                     f"{span(spread)}× the median clean difference (the unit of r) even in units of σ, where every "
                     "checksum's noise has the same spread: the largest of 10⁴–10⁶ half-normal values lies 6–8× above "
                     "their median. A threshold at r ≈ 1 would flag clean checksums.")
    return lines


def write_doc(path: Path, results: list[SensitivityResult], args, device, elapsed: float, cmd: str, commit: str) -> None:
    s0 = results[0].setup
    grid = results[0].rs
    ver = versions()
    desc = device.describe()
    kernel = desc.get("kernel", "cpu-fp32acc")
    hashes = desc.get("kernel_hashes", {})
    cal, trial = s0.seeds()
    lines = [
        f"# Sensitivity: fp32-accumulator vs bf16-output checksums ({device.identity.name})", "",
        f"Generated by `{cmd}` on {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC in {elapsed:.0f} s; commit {commit}; "
        f"device {device.identity.id} ({device.identity.name}), kernel {kernel}"
        + (f" ({', '.join(f'{k} {v}' for k, v in sorted(hashes.items()) if k.startswith('gemm'))})" if hashes else "")
        + "; " + ", ".join(f"{k} {v}" for k, v in ver.items()) + f"; seed {args.seed}. "
        "Every line of this page is written by `benchmarks/sensitivity.py` (the numbers also in "
        f"`{Path(args.json).name}`): regenerate it, do not edit it.",
        "",
        "## What is measured", "",
        f"- GEMMs {s0.m}×{s0.n}×K, K ∈ {{{', '.join(str(k) for k in args.k)}}}, bf16 inputs, fp32 accumulation, "
        f"bf16 output; checksum tiles {device.tile[0]}×{device.tile[1]}. Inputs, A and B alike: "
        + "; ".join(f"{d} ({DIST_TEXT[d]})" for d in args.dists) + ".",
        "- **Thresholds set on held-out clean runs.** For each K and distribution, clean GEMMs on "
        f"{s0.cal_inputs} calibration inputs (seeds {cal[0]}…{cal[-1]}; 1 000 more for each further distribution) "
        f"give the largest clean value of each of four checks: the fp32-accumulator row and column checksums and the "
        f"bf16-output row and column checksums (Σ of the rounded output over the same tiles against the same fp64 "
        f"reference), the fp32 ones normalised by the device's noise scale σ (`Device.noise_model`: unit·K^power·ρ, "
        f"ρ = sqrt(Σ_k A_ik²·Σ_j∈t B_kj²), docs/calibration.md), the bf16 ones by s = Σ|A||B| (their noise is the output "
        f"rounding's). Each check's threshold is {s0.margin:g}× its own clean maximum: "
        "zero false positives on the calibration set and the same margin for all four, so (b) and (c) are compared at "
        f"the same false-positive rate. The trials use {s0.trial_inputs} other inputs (seeds {trial[0]}…{trial[-1]}, "
        "disjoint); their clean runs are the held-out false-positive check (last column of the summary).",
        f"- **Perturbation** (the `perturb` fault of `aegis_cli.faults`, in the kernel on CUDA): each fp32 accumulator "
        f"element is moved, with probability {s0.rate:g} (≈ {s0.rate * s0.m * s0.n:.0f} elements per launch), by ±r × "
        "the median absolute clean row-checksum difference of that input, before the checksums and the bf16 rounding, so "
        f"all detectors see the same launches. {s0.trials} trials per r on a half-decade grid {fmt(grid[0])} … "
        f"{fmt(grid[-1])}. A trial is detected when any row or column tile is over its threshold.",
        "- Detectors: **(a)** the fp32-accumulator row and column checks at the production τ, "
        f"`numerics.Thresholds().tau` = {fmt(results[0].tau)}·σ, what `aegis scan` uses; **(b)** the same checks at their "
        "held-out thresholds; **(c)** the bf16-output row and column checks at theirs.",
        "- r50 / r99: the smallest r on the grid from which detection stays ≥ 50 % / ≥ 99 % "
        f"(\"> {fmt(grid[-1])}\": not reached on the grid).", "",
        "## Summary", "", *summary_rows(results, grid[-1]), "",
        "## Against the AEGIS paper", "",
        "The paper reports near-100 % detection at r ≈ 1× the median clean difference for fp32-accumulator checksums, "
        "and that bf16-output checksums need ~10⁴× larger perturbations.", "",
        *gap_lines(results, s0.margin, grid[-1]), "",
        "## Thresholds and the held-out check", "", *calibration_rows(results), "",
        "## Detection curves", *curve_tables(results), "",
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines))


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu:0", help="cpu:0 (the reference path) or cuda:N (in-kernel perturbation)")
    ap.add_argument("--m", type=int, help="rows of C (default 256 on the CPU, 1024 on CUDA)")
    ap.add_argument("--n", type=int, help="columns of C (default as --m)")
    ap.add_argument("--k", type=int, nargs="+", help="K values (default 1024 3584 8192)")
    ap.add_argument("--dists", nargs="+", default=list(numerics.DISTRIBUTIONS), choices=numerics.DISTRIBUTIONS)
    ap.add_argument("--trials", type=int, default=40, help="perturbed launches per r (per K and distribution)")
    ap.add_argument("--rate", type=float, default=2e-4, help="probability that one accumulator element is perturbed")
    ap.add_argument("--margin", type=float, default=3.0, help="held-out threshold = margin × the calibration clean maximum")
    ap.add_argument("--cal-inputs", type=int, default=8)
    ap.add_argument("--trial-inputs", type=int, default=8)
    ap.add_argument("--r-min", type=float, default=0.1)
    ap.add_argument("--r-max", type=float, default=1e10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out-dir", type=Path, default=ROOT / "docs", help="where the doc and the JSON go (default docs/)")
    ap.add_argument("--doc", type=Path, help="the doc's path (default OUT_DIR/sensitivity.md on the CPU, "
                    "OUT_DIR/sensitivity-<gpu>.md on CUDA, e.g. sensitivity-h200.md)")
    args = ap.parse_args(argv)
    (device,) = resolve_devices(args.device)
    cuda = device.identity.backend == "cuda"
    args.m = args.m or (1024 if cuda else 256)
    args.n = args.n or args.m
    args.k = args.k or [1024, 3584, 8192]
    gpu = "-".join(w for w in re.sub(r"[^a-z0-9]+", " ", device.identity.name.lower()).split() if w != "nvidia")
    name = "sensitivity" + (f"-{gpu}" if cuda else "")  # NVIDIA H200 → sensitivity-h200
    doc = args.doc or args.out_dir / f"{name}.md"
    args.json = str(args.out_dir / f"{name}.json")
    rs = half_decades(args.r_min, args.r_max)
    cmd = "python benchmarks/sensitivity.py" + ("".join(f" {shlex.quote(a)}" for a in argv))
    commit = git_commit()  # before this run writes anything
    t0 = time.time()
    results = []
    for k in args.k:
        for dist in args.dists:
            setup = Setup(args.m, args.n, k, dist, trials=args.trials, rate=args.rate, margin=args.margin,
                          cal_inputs=args.cal_inputs, trial_inputs=args.trial_inputs, seed=args.seed)
            res = sensitivity(device, setup, rs)
            results.append(res)
            print(f"[{time.time() - t0:6.0f} s] K={k} {dist}: τ÷clean {res.tau_over_clean:.0f}×, r99 "
                  + ", ".join(f"{d} {fmt(res.r99(d), rs[-1])}" for d in DETECTORS)
                  + f", held-out flagged {res.false_positives}", file=sys.stderr, flush=True)
    elapsed = time.time() - t0
    write_doc(Path(doc), results, args, device, elapsed, cmd, commit)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    meta = {"command": cmd, "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "commit": commit,
            "device": device.identity.to_dict(), "describe": device.describe(), "versions": versions(), "elapsed_s": elapsed}
    Path(args.json).write_text(json.dumps(jsonable({"meta": meta, "results": [r.to_dict() for r in results]}), indent=1) + "\n")
    print(f"wrote {doc} and {args.json}")


if __name__ == "__main__":
    main()
