"""Clean noise and fault coverage of the attention checks on one device: the CPU reference or
the CUDA kernels. Writes that device's section of docs/attention-coverage.md (the other
device's section is kept) and, with ``--json``, every figure and trial.

Clean runs, as the probe runs a case (probes/attention.py): per group (shape, distribution, Q
scale, seed) the inputs are drawn on the device and the fp64 reference computed once; forward
and backward run at the probe's (V, dO) exponents (0, 0), (8, −8), (−8, 8) through every check
(the five invariants, NaN/Inf, and each scaled run's outputs bit for bit against the base run's,
scaled), and the base run is repeated and compared bit for bit and by the device's fingerprint
(the rule the confirmation judges by: our kernels are deterministic). Q·c (c = ¼, 1, 4) gives
flatter or sharper softmax rows; it is a new input, not an exact scaling. Any signal is a false
positive. On the CPU: the small SHAPES × distributions × Q scales × seeds. On a GPU: the per-GPU
attention shapes of the workload catalog (CATALOG: query heads heads/TP, KV heads kv_heads/TP,
head dim hidden/heads; causal and not; ragged sequence lengths), groups in a seeded order until
``--clean-runs`` checked runs have run or ``--max-seconds`` has passed.

Fault trials, on the device's own fault path (``Device.attention_*`` with a fault plan: the CUDA
kernels' AEGIS_INJECT build, the reference's hook on the CPU): fresh inputs (a small shape,
distribution, seed; the same on both devices) and one fault at one stage — a flip of one random
bit (0…31) of one fp32 value at the position faults/attention.py draws, as
``mask:target=attn.STAGE,mask=…,index=…`` — run at V·2^0 and, with the fault at the same place,
at V·2^8, dO·2^-8. The baseline is the same build with the same fault slot editing nothing
(``perturb`` r=0). Each trial is:

  benign      no output bit changed (the value was masked, or rounding absorbed it)
  invariant   an invariant (attention.o_rowsum, lse, dv_colsum, dk_colsum, dq_rowsum) fired
  pow2 only   only the exact-scaling comparison saw it (a permanent fault)
  escaped     outputs changed and nothing fired; the table gives the largest relative output change

A fault that strikes only some runs (intermittent) is also caught by the re-runs of a flagged or
scaled case differing bit for bit; a permanent one repeats its own bits, so it is left out here.

    python benchmarks/attention_coverage.py [--device cpu] [--trials 100]
    PYTHONPATH=. python3 benchmarks/attention_coverage.py --device cuda:0 --commit "$(git rev-parse --short HEAD)" \\
        --clean-runs 1500 --max-seconds 60 --long-seconds 60 --out "$OUT/attention-coverage.md" \\
        --json "$OUT/attention-coverage.json" [--compare cpu.json]

``--render JSON`` rewrites a section from a saved ``--json`` without running anything.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import itertools
import json
import time
from pathlib import Path

import numpy as np
import torch

from aegis_cli.backends import resolve_devices
from aegis_cli.checks import attention as checks
from aegis_cli.faults.attention import draw as draw_fault
from aegis_cli.faults.spec import FaultPlan, FaultSpec
from aegis_cli.ops import attention as A
from aegis_cli.ops import attention_sums as sums
from aegis_cli.ops import workloads
from aegis_cli.ops.fingerprint import int_view
from aegis_cli.ops.numerics import generate_bf16
from aegis_cli.probes.attention import SCALES, run_pass, scaled_runs

ROOT = Path(__file__).resolve().parent.parent
SHAPES = [(1, 4, 2, 64, 64, True), (1, 2, 1, 96, 128, True), (1, 4, 4, 48, 64, False), (1, 8, 2, 77, 32, True),
          (2, 2, 1, 33, 64, True), (1, 2, 2, 130, 64, False)]
DISTS = ("normal", "uniform", "heavy")
Q_SCALES = (0.25, 1.0, 4.0)  # Q·c: sharper or flatter softmax (not an exact scaling: a new input)
CATALOG = (("llama3-1b", (1, 2)), ("llama3-8b", (1, 2, 4, 8)), ("llama3-70b", (2, 4, 8)))
RAGGED_SEQ = (509, 1000, 1531, 2048)
LONG_SEQ = (4099, 8192)  # the catalog's training length, and a ragged one near half of it
TH = sums.AttentionThresholds()
BIT_CLASSES = (("sign", range(31, 32)), ("exponent", range(23, 31)), ("mantissa 16–22", range(16, 23)),
               ("mantissa 0–15", range(0, 16)))


def catalog_shapes(seqs: tuple[int, ...] = RAGGED_SEQ) -> list[tuple[str, tuple]]:
    """(label, (B, Hq, Hkv, S, D, causal)) of every catalog model × TP × S of ``seqs`` × causal or not."""
    out = []
    for name, tps in CATALOG:
        m = workloads.load(name).model
        for tp, s, causal in itertools.product(tps, seqs, (True, False)):
            out.append((f"{name} TP={tp}", (m.micro_batch, m.heads // tp, max(1, m.kv_heads // tp), s, m.head_dim, causal)))
    return out


def operands(shape, dist: str, qs: float, seed: int, device, host: bool = False) -> A.AttentionOperands:
    """Seeded Q·qs, K, V, dO of ``shape``: drawn on the device, or on the CPU and copied (``host``:
    the same bits on every device)."""
    b, hq, hkv, s, d, causal = shape
    gen = (lambda sh, i: generate_bf16(sh, dist, seed * 16 + i, "cpu").to(device.torch_device)) if host else \
        (lambda sh, i: device.generate(sh, dist, seed * 16 + i))
    q = (gen((b, hq, s, d), 0).float() * qs).bfloat16()
    return A.AttentionOperands(q, gen((b, hkv, s, d), 1), gen((b, hkv, s, d), 2), gen((b, hq, s, d), 3), causal)


# ------------------------------------------------------------------------------------- clean runs
def clean_group(device, ops: A.AttentionOperands, cid: str, acc: dict) -> None:
    """One group as the probe runs it (module docstring; probes.attention.scaled_runs), tallied into ``acc``."""
    ref = A.reference(ops, ops.shape.scale)
    for x in scaled_runs(device, ops, ref, TH, None, lambda ev, edo: f"{cid}/s{ev:+d}{edo:+d}"):
        if x.checked is None:
            acc["skipped_scales"] += 1
            continue
        acc["runs"] += 1
        seen = dict(x.checked.clean_max)
        for sig in x.checked.signals:
            acc["flagged"][sig.check] += 1
            if sig.check in checks.INVARIANT_CHECKS:
                seen[sig.tensor] = max(seen[sig.tensor], sig.max_value)
            if len(acc["evidence"]) < 20:
                acc["evidence"].append({"case": cid, "scale": [x.ev, x.edo], "check": sig.check, "max": sig.max_value})
        for worst in (acc["worst"].setdefault(acc["label"], {}), acc["worst_seq"].setdefault(str(ops.shape.seq), {})):
            for name, v in seen.items():
                worst[name] = max(worst.get(name, 0.0), v)
        if x.expected is None:  # the base run, repeated: the same bits and fingerprints
            base = checks.outputs_of(x.fwd, x.bwd)
            again = checks.outputs_of(*run_pass(device, x.ops, None, f"{cid}/repeat"))
            acc["repeats"] += 1
            same_bits = all(torch.equal(int_view(base[k]), int_view(again[k])) for k in base)
            same_prints = all(device.fingerprint(base[k]) == device.fingerprint(again[k]) for k in base)
            acc["repeat_mismatch"] += not (same_bits and same_prints)


def clean_campaign(device, groups, target_runs: int, max_seconds: float) -> dict:
    """Run ``groups`` ((label, shape, dist, q scale, seed)…) until ``target_runs`` checked runs or
    ``max_seconds``; the tallies."""
    acc = {"groups": 0, "runs": 0, "repeats": 0, "repeat_mismatch": 0, "skipped_scales": 0, "worst": {}, "worst_seq": {},
           "flagged": collections.Counter(), "evidence": [], "group_counts": collections.Counter()}
    t0 = time.perf_counter()
    for label, shape, dist, qs, seed in groups:
        if acc["runs"] >= target_runs or time.perf_counter() - t0 > max_seconds:
            break
        acc["label"] = label
        ops = operands(shape, dist, qs, seed, device)
        token = A.AttentionShape(*shape).token()
        clean_group(device, ops, f"attention/{dist}/{token}/q{qs:g}/seed{seed}", acc)
        acc["groups"] += 1
        acc["group_counts"][label] += 1
    acc.pop("label", None)
    acc["seconds"] = time.perf_counter() - t0
    acc["false_positives"] = sum(acc["flagged"].values())
    return acc


def clean_groups(backend: str, seeds: int, seqs: tuple[int, ...] = RAGGED_SEQ, order_seed: int = 19, seed0: int = 3000):
    """The CPU's small shapes in a fixed order, or the catalog's shapes at ``seqs`` in a seeded order."""
    if backend == "cpu":
        for shape, dist, qs, seed in itertools.product(SHAPES, DISTS, Q_SCALES, range(seeds)):
            yield f"B{shape[0]} Hq{shape[1]} Hkv{shape[2]} S{shape[3]} D{shape[4]} {'causal' if shape[5] else 'full'}", \
                shape, dist, qs, 1000 + seed
        return
    combos = [(label, shape, dist, qs) for (label, shape), dist, qs in itertools.product(catalog_shapes(seqs), DISTS, Q_SCALES)]
    for rnd in itertools.count():
        order = np.random.default_rng([order_seed, rnd]).permutation(len(combos))
        for i, j in enumerate(order):
            yield (*combos[j], seed0 + rnd * len(combos) + i)


# ---------------------------------------------------------------------------------- fault trials
def bit_class(bit: int) -> str:
    return next(name for name, bits in BIT_CLASSES if bit in bits)


def trial(device, stage: str, t: int, rng: np.random.Generator) -> dict:
    shape_i = int(rng.integers(len(SHAPES)))
    dist = DISTS[int(rng.integers(len(DISTS)))]
    ops = operands(SHAPES[shape_i], dist, 1.0, t, device, host=True)
    bit = int(rng.integers(32))
    af = draw_fault(FaultSpec("bitflip", {"target": f"attn.{stage}", "bit": str(bit)}), ops.shape, rng)
    where = f"target=attn.{stage},index={af.index}"
    cid = f"attention/{dist}/{ops.shape.token()}/trial{t}"
    rec = {"stage": stage, "trial": t, "shape": shape_i, "dist": dist, "bit": bit, "index": af.index, "fired": [],
           "change": 0.0}
    ref = A.reference(ops, ops.shape.scale)
    clean = checks.outputs_of(*run_pass(device, ops, FaultPlan.parse(f"perturb:{where},r=0"), cid))
    fault = FaultPlan.parse(f"mask:{where},mask={af.xor:#x}")
    f, b = run_pass(device, ops, fault, cid)
    got = checks.outputs_of(f, b)
    if all(torch.equal(int_view(got[k]), int_view(clean[k])) for k in got):
        return rec | {"outcome": "benign"}
    fired = sorted({s.check for s in checks.check_attention(ops, f, b, ref, ops.shape.scale, TH).signals})
    if fired:
        return rec | {"outcome": "invariant", "fired": fired}
    ev, edo = 8, -8
    if sums.pow2_safe(ops, ref, ev, edo):
        s_out = checks.outputs_of(*run_pass(device, sums.scaled_operands(ops, ev, edo), fault, cid))
        if checks.pow2_signal(s_out, checks.expected_at(got, ev, edo)) is not None:
            return rec | {"outcome": "pow2 only"}
    change = max(float(((got[k].double() - clean[k].double()).abs().max() / clean[k].double().abs().max().clamp(min=1e-30))
                       .nan_to_num(nan=float("inf"))) for k in ("o", "dq", "dk", "dv"))
    return rec | {"outcome": "escaped", "change": change}


def fault_trials(device, trials: int) -> list[dict]:
    out = []
    for k, stage in enumerate(A.STAGES):
        rng = np.random.default_rng([19, k])
        rows = [trial(device, stage, t, rng) for t in range(trials)]
        print(stage, dict(collections.Counter(r["outcome"] for r in rows)), flush=True)
        out += rows
    return out


# ----------------------------------------------------------------------------------------- doc
HEADER = """# Attention coverage

The clean noise of the attention invariants and which injected faults the checks catch, measured
by `benchmarks/attention_coverage.py` on the CPU reference and on the CUDA kernels (one section
each; docs/attention.md explains the checks). Regenerate a section with
`python benchmarks/attention_coverage.py --device cpu` (or `cuda:0` on a GPU).
"""


def _worst(cl: dict) -> dict[str, float]:
    return {n: max((w.get(n, 0.0) for w in cl["worst"].values()), default=0.0) for n in sums.INVARIANTS}


def clean_lines(cl: dict, shapes: str, by_shape: bool) -> list[str]:
    """A clean campaign's summary, its largest value per invariant against τ, and (GPU) the same by
    shape and by sequence length."""
    worst = _worst(cl)
    lines = [
        f"{cl['groups']} groups ({shapes}; {', '.join(DISTS)} inputs; Q scaled by {', '.join(map(str, Q_SCALES))}; "
        f"fresh seeds), each at the probe's (V, dO) exponents {', '.join(f'({a}, {b})' for a, b in SCALES)}: "
        f"**{cl['runs']} checked forward+backward runs** in {cl['seconds']:.0f} s ({cl['skipped_scales']} scaled runs "
        "skipped where the scaling would not be exact).",
        f"False positives at the shipped τ: **{cl['false_positives']} of {cl['runs']} runs**"
        + (f" ({', '.join(f'{c} {n}' for c, n in cl['flagged'].items())})" if cl["false_positives"] else "")
        + f"; scaled runs bit for bit equal to the base run scaled: {'all' if not cl['flagged'].get(checks.POW2_CHECK) else 'not all'}; "
        f"repeats of the base run bit-identical (bits and fingerprints): **{cl['repeats'] - cl['repeat_mismatch']} of "
        f"{cl['repeats']}**.", "",
        "| invariant | largest clean \\|Δ\\|/σ (LSE: /s) | τ | τ ÷ largest clean |", "|---|---|---|---|"]
    for name in sums.INVARIANTS:
        lines.append(f"| attention.{name} | {worst[name]:.3g} | {TH.tau[name]:.3g} | {TH.tau[name] / max(worst[name], 1e-300):.1f}× |")
    if by_shape:
        lines += ["", "By shape and by sequence length (largest clean \\|Δ\\|/σ per invariant; groups run):", "",
                  "| shape | groups | " + " | ".join(sums.INVARIANTS) + " |", "|---|---:|" + "---:|" * len(sums.INVARIANTS)]
        rows = [(label, str(cl["group_counts"][label]), w) for label, w in sorted(cl["worst"].items())]
        rows += [(f"S = {seq}", "", w) for seq, w in sorted(cl.get("worst_seq", {}).items(), key=lambda kv: int(kv[0]))]
        for label, n, w in rows:
            lines.append(f"| {label} | {n} | " + " | ".join(f"{w.get(x, 0.0):.3g}" for x in sums.INVARIANTS) + " |")
    return lines


def section(doc: dict) -> str:
    pct = lambda c, n: f"{100 * c / n:.0f}%" if n else "—"
    key = doc["backend"]
    title = "CPU reference" if key == "cpu" else f"{doc['device']} (CUDA kernels)"
    lines = [f"<!-- section:{key} -->", f"## {title}", "",
             f"Generated on {doc['date']} ({doc['device']}{', ' + doc['driver'] if doc.get('driver') else ''}; "
             f"commit {doc['commit']}) in {doc['seconds']:.0f} s"
             + (f" ({doc['warm_up_seconds']:.0f} s of it compiling the kernels)" if doc.get("warm_up_seconds", 0) > 1 else "")
             + f": `{doc['command']}`.", "", "### Clean runs", ""]
    catalog = lambda seqs: (", ".join(f"{n} TP {'/'.join(map(str, tps))}" for n, tps in CATALOG)
                            + f" (per-GPU query and KV heads, D 64 for llama3-1b, 128 otherwise), S {', '.join(map(str, seqs))}, "
                            "causal and not")
    lines += clean_lines(doc["clean"], "; ".join(f"{s}" for s in SHAPES) if key == "cpu" else catalog(RAGGED_SEQ), key != "cpu")
    if doc.get("clean_long"):
        lines += ["", "### Clean runs at training sequence lengths", ""]
        lines += clean_lines(doc["clean_long"], catalog(LONG_SEQ), True)
    trials = doc["trials"]
    per = collections.defaultdict(list)
    for r in trials:
        per[r["stage"]].append(r)
    lines += ["", "### Injected faults", "",
              f"{doc['trials_per_stage']} trials per stage: one random bit (0…31, uniform) of one fp32 value at a seeded "
              "position (faults/attention.py), fresh inputs each trial (the CPU clean shapes); the same fault at V·2^8, "
              "dO·2^-8 for the exact-scaling check.", "",
              "| stage | benign | caught by an invariant | pow2 only | escaped | largest escaped change (rel. to max\\|output\\|) "
              "| which invariant fired (trials) |", "|---|---|---|---|---|---|---|"]
    for stage, rows in per.items():
        n, out = len(rows), collections.Counter(r["outcome"] for r in rows)
        fired = collections.Counter(c for r in rows for c in r["fired"])
        esc = [r["change"] for r in rows if r["outcome"] == "escaped"]
        lines.append(f"| {stage} | {pct(out['benign'], n)} | {pct(out['invariant'], n)} | {pct(out['pow2 only'], n)} | "
                     f"{pct(out['escaped'], n)} | {f'{max(esc):.2g}' if esc else '—'} | "
                     + (", ".join(f"{c.removeprefix('attention.')} {k}" for c, k in fired.most_common()) or "—") + " |")
    lines += ["", "By the bit flipped: caught (by an invariant or pow2) / flips that changed an output, per stage.", "",
              "| stage | " + " | ".join(name for name, _ in BIT_CLASSES) + " |", "|---|" + "---|" * len(BIT_CLASSES)]
    for stage, rows in per.items():
        cells = []
        for name, _ in BIT_CLASSES:
            mine = [r for r in rows if bit_class(r["bit"]) == name and r["outcome"] != "benign"]
            caught = sum(r["outcome"] in ("invariant", "pow2 only") for r in mine)
            cells.append(f"{caught}/{len(mine)}" if mine else "—")
        lines.append(f"| {stage} | " + " | ".join(cells) + " |")
    if doc.get("agreement"):
        a = doc["agreement"]
        lines += ["", f"Same inputs, positions and bits as the {a['other']} trials: the same outcome in "
                      f"**{a['same']} of {a['n']}** trials" + (f"; differing: {a['differ']}" if a["differ"] else "") + "."]
    lines += ["", "Benign flips change no output bit: a flipped low mantissa bit that bf16 rounding absorbs, a score",
              "whose probability underflows anyway. Escapes are flips below every invariant's τ whose effect stays",
              "within the clean noise of the sums (low mantissa bits, or exponent bits that shrink a value",
              "towards zero) and that scale exactly (a mantissa or sign flip of a value V·2^8 is the flip of V,",
              "scaled). Escaped changes are given relative to the largest output; see docs/attention.md §8.",
              f"<!-- /section:{key} -->"]
    return "\n".join(lines)


def agreement(trials: list[dict], other: list[dict], name: str) -> dict:
    """How often the same trial (stage, number) had the same outcome on another device."""
    theirs = {(r["stage"], r["trial"]): r["outcome"] for r in other}
    pairs = [(r["outcome"], theirs[(r["stage"], r["trial"])]) for r in trials if (r["stage"], r["trial"]) in theirs]
    differ = collections.Counter(f"{a} here, {b} there" for a, b in pairs if a != b)
    return {"other": name, "n": len(pairs), "same": sum(a == b for a, b in pairs),
            "differ": ", ".join(f"{k} ({n})" for k, n in differ.most_common())}


def write_doc(path: str | Path, doc: dict) -> None:
    """Replace (or add) ``doc``'s device section of the coverage file; keep the other ones."""
    path = Path(path)
    old = path.read_text(encoding="utf-8") if path.exists() else ""
    parts = {}
    for key in ("cpu", "cuda"):
        begin, end = f"<!-- section:{key} -->", f"<!-- /section:{key} -->"
        if begin in old and end in old:
            parts[key] = old[old.index(begin):old.index(end) + len(end)]
    parts[doc["backend"]] = section(doc)
    path.write_text(HEADER + "".join(f"\n{parts[k]}\n" for k in ("cpu", "cuda") if k in parts), encoding="utf-8")


def command(args, backend: str) -> str:
    """The command line that reproduces the figures (without where they are written)."""
    opts = {"device": args.device, "trials": args.trials}
    opts |= {"clean-seeds": args.clean_seeds} if backend == "cpu" else \
        {"clean-runs": args.clean_runs, "max-seconds": f"{args.max_seconds:g}", "long-seconds": f"{args.long_seconds:g}"}
    return "python benchmarks/attention_coverage.py " + " ".join(f"--{k} {v}" for k, v in opts.items())


def plain(acc: dict) -> dict:
    return {**acc, "flagged": dict(acc["flagged"]), "group_counts": dict(acc["group_counts"])}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--trials", type=int, default=100)
    ap.add_argument("--clean-seeds", type=int, default=19, help="CPU: seeds per (shape, distribution, Q scale)")
    ap.add_argument("--clean-runs", type=int, default=1200, help="GPU: stop the clean runs after this many checked runs")
    ap.add_argument("--max-seconds", type=float, default=90.0, help="GPU: and at the latest after this long")
    ap.add_argument("--long-seconds", type=float, default=0.0,
                    help=f"GPU: then clean runs at S {', '.join(map(str, LONG_SEQ))} for this long (0: none)")
    ap.add_argument("--commit", default="(working tree)")
    ap.add_argument("--compare", help="another device's --json: how often each trial's outcome agrees")
    ap.add_argument("--json")
    ap.add_argument("--render", help="only rewrite the section from this --json")
    ap.add_argument("--out", default=str(ROOT / "docs" / "attention-coverage.md"))
    args = ap.parse_args(argv)
    if args.render:
        doc = json.loads(Path(args.render).read_text())
    else:
        (device,) = resolve_devices(args.device)[:1]
        backend = device.identity.backend
        if backend == "cpu":
            torch.set_num_threads(1)
        t0 = time.perf_counter()
        if backend != "cpu":  # compile the kernels (and the fingerprint's) before the clock of the clean runs starts
            for d in (64, 128):
                warm = operands((1, 2, 1, 64, d, True), "normal", 1.0, 0, device)
                out = checks.outputs_of(*run_pass(device, warm, None, "warm-up"))
                device.fingerprint(out["o"])
        warm_s = time.perf_counter() - t0
        clean = clean_campaign(device, clean_groups(backend, args.clean_seeds),
                               10**9 if backend == "cpu" else args.clean_runs, 1e9 if backend == "cpu" else args.max_seconds)
        long = clean_campaign(device, clean_groups(backend, 0, LONG_SEQ, order_seed=23, seed0=90000), 10**9,
                              args.long_seconds) if backend != "cpu" and args.long_seconds > 0 else None
        for name, c in (("clean", clean), ("long", long)):
            if c is not None:
                print(f"{name}: {c['runs']} runs, {c['false_positives']} false positives, "
                      f"{c['repeat_mismatch']} repeat mismatches, {c['seconds']:.0f} s", flush=True)
        trials = fault_trials(device, args.trials)
        ident = device.identity
        doc = {"backend": backend, "device": ident.name, "driver": ident.driver, "commit": args.commit,
               "date": str(datetime.date.today()), "seconds": time.perf_counter() - t0, "warm_up_seconds": warm_s, "trials_per_stage": args.trials,
               "command": command(args, backend),
               "clean": plain(clean), "clean_long": plain(long) if long else None,
               "trials": trials, "tau": dict(TH.tau)}
    if args.compare:
        other = json.loads(Path(args.compare).read_text())
        doc["agreement"] = agreement(doc["trials"], other["trials"], "CPU reference" if other["backend"] == "cpu" else other["device"])
    if args.json and not args.render:
        Path(args.json).write_text(json.dumps(doc, indent=1, default=str))
    write_doc(args.out, doc)
    print(f"wrote the {doc['backend']} section of {args.out} ({doc['seconds']:.0f} s)")
    return doc


if __name__ == "__main__":
    main()
