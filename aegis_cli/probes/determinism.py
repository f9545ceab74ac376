"""The determinism probe (docs/design.md §4.1): the same computation, N times, identical inputs.

Every canonical computation (_common.COMPUTATIONS: our checked GEMM, torch.matmul, SDPA
forward and backward, RMSNorm, GeLU, SiLU) runs ``runs`` times on one set of seeded
inputs; each run's outputs are fingerprinted on the device (fingerprints.device_fingerprint:
the CUDA kernel for GPU tensors). All runs of a deterministic
computation must give the same bits:

  determinism.mismatch   a run's fingerprint differs from the majority's. The differing
                         run is localised against a majority run by block fingerprints
                         to the block, element, (GEMM) tile, with expected/actual bits
                         and XOR mask. FAULTY: a deterministic computation changed its bits.

Computations known to be nondeterministic on a healthy device of the backend
(_common.NONDETERMINISTIC, measured on an H200: docs/probes.md) are run and reported in
the stats (``deterministic: false``) but never produce evidence: their mismatches mean
nothing. The stats say, for every computation, whether it was bitwise deterministic here.
"""

from __future__ import annotations

import time

import torch

from aegis_cli.backends.base import Device
from aegis_cli.backends.fingerprints import device_fingerprint
from aegis_cli.faults.spec import recent_injections
from aegis_cli.ops.case import CaseId
from aegis_cli.ops.verdict import Evidence, Verdict
from aegis_cli.probes import ProbeContext, bounded, quick_or_full, register
from aegis_cli.probes.computations import (
    COMPUTATIONS,
    MAX_SAMPLES,
    assumed_deterministic,
    bytes_of,
    case_shape,
    computation_list,
    localise,
    majority,
    sizes_for,
)

MAX_HELD = 4  # distinct results whose tensors are kept for localisation
MAX_RUNS = 1000  # a typo (runs=1000000) must not hang the scan; full mode runs 16


OPTIONS = {
    "mode": (quick_or_full, "quick", "quick: 4 runs per computation (3 on the CPU backend, without sdpa_bwd_det); full: 16"),
    # one run has nothing to compare with: HEALTHY would mean nothing was checked
    "runs": (bounded(int, 2, MAX_RUNS, auto=0), 0, f"runs per computation, 2…{MAX_RUNS} (0: by mode)"),
    "only": (computation_list(allow_empty=True), "", "comma-separated computations to run (default: all)"),
}


def run_computation(device: Device, name: str, runs: int, seed: int, ctx: ProbeContext) -> tuple[dict, Evidence | None]:
    """Run one computation ``runs`` times; (stats, evidence or None)."""
    comp = COMPUTATIONS[name]
    sizes = sizes_for(device)
    t0 = time.perf_counter()
    x = comp.inputs(device, sizes, seed)
    prints: list[tuple[int, ...]] = []
    held: dict[tuple[int, ...], tuple[int, dict[str, torch.Tensor]]] = {}
    seen: dict[tuple[int, ...], int] = {}
    first: dict[tuple[int, ...], int] = {}
    keys: list[str] = []
    # majority()'s order: more runs first, then the earlier first appearance
    rank = lambda p: (seen[p], -first[p])
    for r in range(runs):
        op = f"determinism/{name}/run{r}"
        out = comp.held(device, x, ctx.fault, op)
        keys = sorted(out)
        fp = tuple(device_fingerprint(out[k]) for k in keys)
        prints.append(fp)
        seen[fp] = seen.get(fp, 0) + 1
        first.setdefault(fp, r)
        if fp not in held:
            # keep at most MAX_HELD results, the highest-ranked so far in majority()'s order: the
            # majority (the reference) may first appear after MAX_HELD different corrupted runs,
            # or be dropped and come back; ranking ties as majority() does keeps it held at the end
            rare = min(held, key=rank) if len(held) >= MAX_HELD else None
            if rare is None or rank(rare) < rank(fp):
                held.pop(rare, None)
                held[fp] = (r, out)
        ctx.progress("step", device=device.identity.id, case=op)
    device.synchronize()
    best, odd = majority(prints)
    assumed = assumed_deterministic(device, name)
    stats = {"runs": runs, "distinct": len(set(prints)), "deterministic": not odd, "assumed_deterministic": assumed,
             "shape": comp.shape(sizes), "bytes_per_run": bytes_of(held[best][1]),
             "fingerprints": {k: f"{v:016x}" for k, v in zip(keys, best, strict=True)},
             "seconds": round(time.perf_counter() - t0, 4)}
    if not odd:
        return stats, None
    stats["differing_runs"] = odd
    if not assumed:
        return stats, None
    ref_run, ref = held[best]
    # without a strict majority the reference is only the first result seen, maybe a wrong one
    no_majority = 2 * prints.count(best) <= runs
    samples, tiles, localised, count, blocks = [], set(), [], 0, {}
    tile = device.tile if name in ("checked_gemm", "matmul") else None
    for fp in dict.fromkeys(prints[r] for r in odd):
        if fp not in held:
            continue
        run, out = held[fp]
        for i, k in enumerate(keys):
            if fp[i] == best[i]:
                continue
            loc = localise(ref[k], out[k], tile=tile if k == "c" else None)
            count += loc["elements"]
            blocks[f"run{run}:{k}"] = loc["blocks"][:16]
            for s in loc["samples"]:
                if len(samples) < MAX_SAMPLES:
                    samples.append({"output": k, "run": run, "reference_run": ref_run, **s,
                                    **({"no_majority": True} if no_majority else {})})
            tiles.update(tuple(t) for t in loc["tiles"])
            localised += loc["localised"][: MAX_SAMPLES - len(localised)]
    distinct = len(set(prints))
    where = ", ".join(f"{k} blocks {v[:4]}" for k, v in blocks.items())
    ev = Evidence(
        check="determinism.mismatch", severity=Verdict.FAULTY,
        case_id=case_id(name, sizes),
        summary=(f"determinism.mismatch: {name}: "
                 + (f"{distinct} distinct results in {runs} runs and no majority; compared with run {ref_run}, which may "
                    f"itself be a wrong one (" if no_majority else f"{len(odd)} of {runs} runs differ from the majority (")
                 + f"{distinct} distinct results of a computation that is bitwise deterministic on a healthy device); "
                 f"{count} element(s) differ ({where})"),
        op=name, shape=comp.shape(sizes), dist="normal", seed=seed, max_value=1.0, elements=count, samples=samples,
        tiles=[list(t) for t in sorted(tiles)][:16], localised=localised, reruns=runs - 1, reproduced=runs - 1 - len(odd),
        distinct_outputs=distinct, kernel="aegis" if not comp.vendor else "torch",
        injected=recent_injections(ctx.fault),
    )
    return stats, ev


def case_id(name: str, sizes) -> str:
    return str(CaseId("determinism", (name, case_shape(COMPUTATIONS[name].shape(sizes)))))


@register("determinism", OPTIONS)
def determinism_probe(device: Device, ctx: ProbeContext) -> list[Evidence]:
    """Repeat each canonical computation on identical inputs; bits must not change."""
    mode = ctx.option("determinism", "mode")
    cpu_quick = mode == "quick" and device.identity.backend == "cpu"
    runs = ctx.option("determinism", "runs") or (16 if mode == "full" else 3 if cpu_quick else 4)
    # torch's CPU kernels have no separate deterministic mode: sdpa_bwd_det repeats sdpa_bwd there
    only = [n.strip() for n in ctx.option("determinism", "only").split(",") if n.strip()] or [
        n for n in COMPUTATIONS if not (cpu_quick and n == "sdpa_bwd_det")]
    sizes = sizes_for(device)
    chosen = ctx.case_choice("determinism", {case_id(n, sizes): n for n in COMPUTATIONS}, device.identity.id)
    if chosen is not None:  # --case determinism/NAME/SHAPE
        only = [chosen]
    evidence: list[Evidence] = []
    stats: dict[str, dict] = {}
    tally = ctx.tally.probe("determinism")
    for name in only:
        st, ev = run_computation(device, name, runs, ctx.config.seed, ctx)
        stats[name] = st
        tally.launches += runs
        if ev is not None:  # the runs off the majority (or off the first run, without one)
            tally.failed += runs - 1 - ev.reproduced
            tally.flagged(ev.case_id, ev.check, runs, runs - 1 - ev.reproduced, shown=True)
            evidence.append(ev)
    ctx.stats["determinism"] = {"mode": mode, "runs": runs, "computations": stats,
                                "nondeterministic": sorted(n for n, s in stats.items() if not s["deterministic"])}
    return evidence
