"""Coverage of the attention checks on the CPU reference (≥ 100 trials per injected stage), and
the clean noise of every invariant that their thresholds follow. Writes docs/attention-coverage.md.

Clean runs: shapes × distributions × query scales (wider and narrower softmax) × seeds; for each
invariant the largest normalised difference, and the false positives at the shipped τ.

Fault trials: a fresh draw of inputs (shape, distribution, seed) and one fault at one stage — a
flip of one random bit (0…31) of one fp32 value at a seeded position, as faults/attention.py
draws it — run at V·2^0 and, with the fault at the same place, at V·2^8, dO·2^-8. Each trial is:

  benign      no output bit changed (the value was masked, or rounding absorbed it)
  invariant   an invariant (attention.o_rowsum, lse, dv_colsum, dk_colsum, dq_rowsum) fired
  pow2 only   only the exact-scaling comparison saw it (a permanent fault)
  escaped     outputs changed and nothing fired; the table gives the largest relative output change

A fault that strikes only some runs (intermittent) is also caught by the re-runs of a flagged or
scaled case differing bit for bit; a permanent one repeats its own bits, so it is left out here.

    python benchmarks/attention_coverage.py [--trials 100] [--out docs/attention-coverage.md]
"""

from __future__ import annotations

import argparse
import collections
import datetime
import itertools
import time
from pathlib import Path

import numpy as np
import torch

from aegis_cli.checks import attention as checks
from aegis_cli.faults.attention import draw as draw_fault
from aegis_cli.faults.spec import FaultSpec
from aegis_cli.ops import attention as A
from aegis_cli.ops import attention_sums as sums
from aegis_cli.ops.numerics import generate_bf16

ROOT = Path(__file__).resolve().parent.parent
SHAPES = [(1, 4, 2, 64, 64, True), (1, 2, 1, 96, 128, True), (1, 4, 4, 48, 64, False), (1, 8, 2, 77, 32, True),
          (2, 2, 1, 33, 64, True), (1, 2, 2, 130, 64, False)]
DISTS = ("normal", "uniform", "heavy")
Q_SCALES = (0.25, 1.0, 4.0)  # Q·c: sharper or flatter softmax (not an exact scaling: a new input)
TH = sums.AttentionThresholds()


def operands(shape, dist, qs, seed) -> A.AttentionOperands:
    b, hq, hkv, s, d, causal = shape
    g = lambda sh, i: generate_bf16(sh, dist, seed * 16 + i, "cpu")
    q = (g((b, hq, s, d), 0).float() * qs).bfloat16()
    return A.AttentionOperands(q, g((b, hkv, s, d), 1), g((b, hkv, s, d), 2), g((b, hq, s, d), 3), causal)


def run(ops, fault=None):
    sc = ops.shape.scale
    f = A.flash_forward(ops.q, ops.k, ops.v, causal=ops.causal, scale=sc, fault=fault)
    b = A.flash_backward(ops.q, ops.k, ops.v, f.o, f.lse, ops.do, causal=ops.causal, scale=sc, fault=fault)
    return f, b


def clean_noise(seeds: int) -> tuple[dict, int, int]:
    worst = collections.defaultdict(float)
    fp, n = 0, 0
    for shape, dist, qs, seed in itertools.product(SHAPES, DISTS, Q_SCALES, range(seeds)):
        ops = operands(shape, dist, qs, 1000 + seed)
        f, b = run(ops)
        sc, ref = ops.shape.scale, A.reference(ops, ops.shape.scale)  # the fp64 attention, once per run
        c = checks.check_attention(ops, f, b, ref, sc, TH)
        for name, d in {**sums.forward_diffs(ops, f, ref, sc).diff, **sums.backward_diffs(ops, b, ref, sc).diff}.items():
            worst[name] = max(worst[name], float(d.max()))
        fp += bool(c.signals)
        n += 1
    return dict(worst), fp, n


BIT_CLASSES = (("sign", range(31, 32)), ("exponent", range(23, 31)), ("mantissa 16–22", range(16, 23)),
               ("mantissa 0–15", range(0, 16)))


def bit_class(bit: int) -> str:
    return next(name for name, bits in BIT_CLASSES if bit in bits)


def trial(stage: str, t: int, rng: np.random.Generator) -> tuple[str, set[str], float, int]:
    shape = SHAPES[int(rng.integers(len(SHAPES)))]
    dist = DISTS[int(rng.integers(len(DISTS)))]
    ops = operands(shape, dist, 1.0, t)
    bit = int(rng.integers(32))
    spec = FaultSpec("bitflip", {"target": f"attn.{stage}", "bit": str(bit)})
    fault = draw_fault(spec, ops.shape, rng)
    ref = A.reference(ops, ops.shape.scale)
    clean = checks.outputs_of(*run(ops))
    f, b = run(ops, fault)
    got = checks.outputs_of(f, b)
    if all(torch.equal(checks.bits(got[k]), checks.bits(clean[k])) for k in got):
        return "benign", set(), 0.0, bit
    fired = {s.check for s in checks.check_attention(ops, f, b, ref, ops.shape.scale, TH).signals}
    if fired:
        return "invariant", fired, 0.0, bit
    ev, edo = 8, -8
    if sums.pow2_safe(ops, ref, ev, edo):
        scaled = sums.scaled_operands(ops, ev, edo)
        s_out = checks.outputs_of(*run(scaled, fault))
        if checks.pow2_signal(s_out, checks.expected_at(got, ev, edo)) is not None:
            return "pow2 only", set(), 0.0, bit
    change = max(float(((got[k].double() - clean[k].double()).abs().max() / clean[k].double().abs().max().clamp(min=1e-30))
                       .nan_to_num(nan=float("inf"))) for k in ("o", "dq", "dk", "dv"))
    return "escaped", set(), change, bit


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=100)
    ap.add_argument("--clean-seeds", type=int, default=19)  # 6 shapes × 3 distributions × 3 Q scales × 19 = 1026 runs
    ap.add_argument("--out", default=str(ROOT / "docs" / "attention-coverage.md"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    worst, fp, n_clean = clean_noise(args.clean_seeds)
    rows = []
    for k, stage in enumerate(A.STAGES):
        rng = np.random.default_rng([19, k])
        outcome, by_check, escapes, by_bits = collections.Counter(), collections.Counter(), [], collections.Counter()
        for t in range(args.trials):
            what, fired, change, bit = trial(stage, t, rng)
            outcome[what] += 1
            by_bits[(bit_class(bit), what)] += 1
            by_check.update(fired)
            if what == "escaped":
                escapes.append(change)
        rows.append((stage, outcome, by_check, escapes, by_bits))
        print(stage, dict(outcome), dict(by_check), flush=True)
    secs = time.perf_counter() - t0
    write(args.out, worst, fp, n_clean, rows, args.trials, secs)
    print(f"wrote {args.out} in {secs:.0f} s")


def write(path, worst, fp, n_clean, rows, trials, secs) -> None:
    pct = lambda c, n: f"{100 * c / n:.0f}%"
    lines = [
        "# Attention coverage (CPU reference)",
        "",
        f"Generated by `python benchmarks/attention_coverage.py` on {datetime.date.today()} in {secs:.0f} s "
        "(docs/attention.md explains the checks). The CUDA kernels' figures go in benchmarks/RESULTS.md when measured.",
        "",
        "## Clean noise",
        "",
        f"{n_clean} clean forward+backward runs: {len(SHAPES)} shapes (B, Hq, Hkv, S, D, causal: "
        + "; ".join(f"{s}" for s in SHAPES) + f") × {', '.join(DISTS)} × Q scaled by {', '.join(map(str, Q_SCALES))} × seeds. "
        f"False positives at the shipped τ: **{fp} of {n_clean} runs**.",
        "",
        "| invariant | largest clean \\|Δ\\|/σ (LSE: /s) | τ | τ ÷ largest clean |",
        "|---|---|---|---|",
    ]
    for name in sums.INVARIANTS:
        lines.append(f"| attention.{name} | {worst[name]:.3g} | {TH.tau[name]:.3g} | {TH.tau[name] / max(worst[name], 1e-300):.1f}× |")
    lines += [
        "",
        "## Injected faults",
        "",
        f"{trials} trials per stage: one random bit (0…31, uniform) of one fp32 value at a seeded position "
        "(faults/attention.py), fresh inputs each trial; the same fault at V·2^8, dO·2^-8 for the exact-scaling check.",
        "",
        "| stage | benign | caught by an invariant | pow2 only | escaped | largest escaped change (rel. to max\\|output\\|) | which invariant fired (trials) |",
        "|---|---|---|---|---|---|---|",
    ]
    for stage, out, by_check, esc, _ in rows:
        fired = ", ".join(f"{c.removeprefix('attention.')} {k}" for c, k in by_check.most_common()) or "—"
        worst_esc = f"{max(esc):.2g}" if esc else "—"
        lines.append(f"| {stage} | {pct(out['benign'], trials)} | {pct(out['invariant'], trials)} | "
                     f"{pct(out['pow2 only'], trials)} | {pct(out['escaped'], trials)} | {worst_esc} | {fired} |")
    lines += [
        "",
        "By the bit flipped: caught (by an invariant or pow2) / flips that changed an output, per stage.",
        "",
        "| stage | " + " | ".join(name for name, _ in BIT_CLASSES) + " |",
        "|---|" + "---|" * len(BIT_CLASSES),
    ]
    for stage, _, _, _, by_bits in rows:
        cells = []
        for name, _ in BIT_CLASSES:
            caught = by_bits[(name, "invariant")] + by_bits[(name, "pow2 only")]
            changed = caught + by_bits[(name, "escaped")]
            cells.append(f"{caught}/{changed}" if changed else "—")
        lines.append(f"| {stage} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Benign flips change no output bit: a flipped low mantissa bit that bf16 rounding absorbs, a score",
        "whose probability underflows anyway. Escapes are flips below every invariant's τ whose effect stays",
        "within the clean noise of the sums (low mantissa bits, or exponent bits that shrink a value",
        "towards zero) and that scale exactly (a mantissa or sign flip of a value V·2^8 is the flip of V,",
        "scaled). Escaped changes are given relative to the largest output; see docs/attention.md §8.",
        "",
    ]
    Path(path).write_text("\n".join(lines), encoding="utf-8")


if __name__ == "__main__":
    main()
