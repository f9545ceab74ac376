"""Cost of one attention check (the sensors' and the scan's): the reference sides of the
invariants from torch in fp64 (ops/attention.py ``reference``), with and without the outputs O,
dQ, dK, dV, and from the device's sides kernel (``Device.attention_reference``:
kernels/attention_sides.cu on CUDA), with how far the kernel's sides lie from torch's (o_rowsum
and dq_rowsum in units of their σ, the LSE in units of its τ·s, the spreads relative), and the
whole ``checks.attention.check_attention`` given the kernels' outputs with either, per shape.

    PYTHONPATH=. python3 benchmarks/attention_check.py [--reps 5] [--shape B,HQ,HKV,S,D ...] [--json out.json]

Default shapes: the example GPT's SDPA call (batch 2, 16 heads, S = 4096, D = 128, causal: the
sensors' operator) and the scan's GPU attention case (S = 2048). Each figure is the median of
``reps`` calls, each timed from a synchronised device to a synchronised device (the reference is
many launches; host gaps are part of its cost); with the peak memory the call allocated. Inputs
are the scan's seeded draw (`AttentionCase`, normal; never zeros). A short table prints last.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from aegis_cli.backends import resolve_devices
from aegis_cli.checks import attention as checks
from aegis_cli.ops import attention as A
from aegis_cli.ops import attention_sums as sums
from aegis_cli.probes.attention import AttentionCase

SHAPES = ("2,16,16,4096,128", "2,16,16,2048,128")


def timed(fn, reps: int, dev: torch.device) -> tuple[float, float]:
    """(median ms, peak MiB allocated above the start) of ``reps`` calls after one warm-up."""
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    fn()
    times, peak = [], 0.0
    for _ in range(reps):
        sync()
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
            base = torch.cuda.memory_allocated(dev)
        t0 = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
        if dev.type == "cuda":
            peak = max(peak, (torch.cuda.max_memory_allocated(dev) - base) / 2**20)
    return statistics.median(times), peak


def one(device, dev: torch.device, text: str, reps: int) -> dict:
    """The figures of one shape ``B,HQ,HKV,S,D``."""
    # the scan's seeded draw of a causal case (normal inputs), on the device
    ops = AttentionCase(A.AttentionShape(*(int(x) for x in text.split(",")), True), "normal", 0).operands(device)
    sc = ops.shape.scale
    fwd = device.attention_forward(ops.q, ops.k, ops.v, causal=True, scale=sc)
    bwd = device.attention_backward(ops.q, ops.k, ops.v, fwd.o, fwd.lse, ops.do, causal=True, scale=sc)
    th = sums.AttentionThresholds()
    check = lambda: checks.check_attention(ops, fwd, bwd, A.reference(ops, sc), sc, th)
    check_k = lambda: checks.check_attention(ops, fwd, bwd, device.attention_reference(ops, sc), sc, th)
    sides_ms, sides_mib = timed(lambda: A.reference(ops, sc), reps, dev)
    full_ms, full_mib = timed(lambda: A.reference(ops, sc, outputs=True), reps, dev)
    kern_ms, kern_mib = timed(lambda: device.attention_reference(ops, sc), reps, dev)
    check_ms, _ = timed(check, reps, dev)
    check_k_ms, _ = timed(check_k, reps, dev)
    c, ck = check(), check_k()
    return {"shape": text, "sides_ms": sides_ms, "sides_mib": sides_mib, "outputs_ms": full_ms, "outputs_mib": full_mib,
            "kernel_ms": kern_ms, "kernel_mib": kern_mib, "check_ms": check_ms, "check_kernel_ms": check_k_ms,
            "agreement": {n: float(f"{v:.3g}") for n, v in
                          sums.reference_disagreement(device.attention_reference(ops, sc), A.reference(ops, sc), ops, sc).items()},
            "signals": [s.check for s in c.signals], "signals_kernel": [s.check for s in ck.signals],
            "clean_max": {n: round(v, 4) for n, v in c.clean_max.items()},
            "clean_max_kernel": {n: round(v, 4) for n, v in ck.clean_max.items()}}


def run(args) -> dict:
    device = resolve_devices(args.device)[0]
    dev = torch.device(device.torch_device)
    out = {"device": device.identity.name, "torch": torch.__version__, "reps": args.reps, "shapes": []}
    for text in args.shape:
        out["shapes"].append(one(device, dev, text, args.reps))
        print(json.dumps(out["shapes"][-1]), flush=True)
    return out


def table(out: dict) -> str:
    lines = [f"{out['device']}, torch {out['torch']}: one attention check, ms (median of {out['reps']}), causal",
             f"{'B,HQ,HKV,S,D':<18} {'sides':>8} {'(MiB)':>6} {'+outputs':>9} {'(MiB)':>6} {'kernel':>7} {'(MiB)':>6} "
             f"{'check':>7} {'kernel':>7}  worst Δ/σ  signals"]
    for r in out["shapes"]:
        a = r["agreement"]
        lines.append(f"{r['shape']:<18} {r['sides_ms']:8.1f} {r['sides_mib']:6.0f} {r['outputs_ms']:9.1f} "
                     f"{r['outputs_mib']:6.0f} {r['kernel_ms']:7.2f} {r['kernel_mib']:6.0f} {r['check_ms']:7.1f} "
                     f"{r['check_kernel_ms']:7.1f}  {max(a['o_rowsum'], a['dq_rowsum']):.1e}  "
                     f"{','.join(r['signals'] + r['signals_kernel']) or 'none'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="auto")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--shape", nargs="+", default=list(SHAPES), metavar="B,HQ,HKV,S,D")
    ap.add_argument("--json", default=os.path.join(os.environ.get("OUT", "."), "attention_check.json"))
    args = ap.parse_args(argv)
    out = run(args)
    tmp = args.json + ".tmp"
    with open(tmp, "w") as f:
        json.dump(out, f, indent=1)
    os.replace(tmp, args.json)
    print(table(out))
    return out


if __name__ == "__main__":
    main()
