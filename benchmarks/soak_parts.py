"""Where the burn-in's GPU time goes (issue 18), per shape and on the whole mix, in one run:

    PYTHONPATH=. python3 benchmarks/soak_parts.py [--mix-seconds 5] [--soak-seconds 20] [--json out.json]

1. Per shape of llama3-70b TP=8, event-timed bursts: cuBLAS and our checked kernel, each on one
   stream and alternating between two (a launch's last partial wave of tiles overlapping the
   next's first); and per launch, what the burn-in adds: a fingerprint of C, the screen of its
   checksums (fp32 bounds), and the screen as it was (fp64 differences of stacked checksums).
2. Per input set and per scale: what the burn-in draws and computes once (operands, fp64
   references, magnitudes; scaled operands, the expected fingerprint, noise, limits), in ms
   and as a share of the set's GEMM time.
3. The whole mix sustained (the GPU at its power cap), ``--mix-seconds`` each: cuBLAS and our
   kernel alone, one stream and two.
4. The burn-in itself for ``--soak-seconds`` with the shipped settings, and for half that with
   a fingerprint of every launch.

(Device call 1 of issue 18's last item ran this at commit 3bd7563, when the burn-in itself
alternated two streams; benchmarks/RESULTS.md has its figures.)
"""
# ruff: noqa: B023  (every lambda here runs inside the loop iteration that makes it)

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from aegis_cli.backends import resolve_devices
from aegis_cli.backends.fingerprints import device_fingerprint_tensor
from aegis_cli.backends.soak_cuda import Launcher
from aegis_cli.checks import screen
from aegis_cli.ops import numerics, workloads
from aegis_cli.ops.gemm import GemmOperands
from aegis_cli.probes import DEFAULT_GPU_WORKLOAD
from aegis_cli.soak import run as soak_run
from aegis_cli.soak import schedule
from aegis_cli.soak.run import SoakOptions, run_soak
from benchmarks.soak import shape_runs


def burst_ms(fns: list, n: int, reps: int = 3) -> float:
    """Median ms per call of n calls spread round-robin over len(fns) streams (one: the current)."""
    main = torch.cuda.current_stream()
    streams = [torch.cuda.Stream() for _ in fns] if len(fns) > 1 else [main]
    out = []
    for rep in range(reps + 1):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for st in streams:
            st.wait_stream(main)
        for i in range(n):
            with torch.cuda.stream(streams[i % len(streams)]):
                fns[i % len(fns)]()
        for st in streams:
            main.wait_stream(st)
        e1.record()
        e1.synchronize()
        if rep:  # the first is a warm-up
            out.append(e0.elapsed_time(e1) / n)
    return statistics.median(out)


def old_flagged(r, c, ref):
    """The screen before: fp64 differences of stacked checksums against fp64 limits."""
    row_unit, col_unit = ref.noise()
    rl, cl = row_unit.clamp(min=numerics.SMALLEST_SCALE) * 3.5 + ref.floor, col_unit.clamp(min=numerics.SMALLEST_SCALE) * 3.5 + ref.floor
    r, c = torch.stack([r]), torch.stack([c])
    return ((r - ref.row).abs_() <= rl).sum((1, 2)) + ((c - ref.col).abs_() <= cl).sum((1, 2))


def sync_ms(fn) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) * 1e3


def per_shape(dev, wl, tau):
    rows, keep = {}, {}
    for i, (key, s, ops, cublas, ours) in enumerate(shape_runs(dev, wl, "parts")):
        n = max(8, round(0.03 / (s.flops / 6.5e14)))
        out2 = torch.empty((s.m, s.n), dtype=torch.bfloat16, device=ops.a.device)  # the second stream's cuBLAS output
        cub = [cublas, lambda: torch.matmul(ops.a_mk, ops.b_kn, out=out2)]
        row = {"flops": s.flops, "n": n,
               "cublas_ms": burst_ms(cub[:1], n), "cublas2_ms": burst_ms(cub, n),
               "ours_ms": burst_ms([ours], n), "ours2_ms": burst_ms([ours, ours], n)}
        res = ours()
        ref = dev.reference_checksums(ops, dev.tile)
        lim = screen.limits(ref, tau)
        row["fingerprint_ms"] = burst_ms([lambda: device_fingerprint_tensor(res.c)], n)
        row["screen_ms"] = burst_ms([lambda: screen.flagged([res.row_sums], [res.col_sums], lim)], n)
        row["screen_old_ms"] = burst_ms([lambda: old_flagged(res.row_sums, res.col_sums, ref)], n)
        # once per set and once per scale
        case = schedule.set_case(wl, 0, i)
        sync_ms(lambda: case.operands(dev))
        row["set_draw_ms"] = sync_ms(lambda: case.operands(dev))
        row["set_reference_ms"] = sync_ms(lambda: dev.reference_checksums(ops, dev.tile))
        row["set_magnitudes_ms"] = sync_ms(lambda: screen.magnitudes(ops))

        def per_scale():
            GemmOperands(schedule.pow2(ops.a, 3), schedule.pow2(ops.b, -5), ops.layout)
            r2 = ref.scaled(-2)
            screen.limits(r2, tau)
            device_fingerprint_tensor(schedule.pow2(res.c, -2))
            screen.clean_max(res, ref, tau)
        row["scale_setup_ms"] = sync_ms(per_scale)
        reps = schedule.repeats_for(s.flops, schedule.SCALES, "cuda")
        set_ms = schedule.SCALES * reps * row["ours_ms"]
        row["set_gemm_ms"] = round(set_ms, 2)
        row["set_overhead_pct"] = round(100 * (row["set_draw_ms"] + row["set_reference_ms"] + row["set_magnitudes_ms"]
                                               + schedule.SCALES * row["scale_setup_ms"]) / set_ms, 2)
        rows[key] = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}
        keep[key] = (s, ops, reps)
    return rows, keep


def mix_sustained(fn_for, keep, seconds, streams):
    """Shapes in turn, each for a burn-in set's launches, on 1 or 2 streams, for ``seconds``."""
    main = torch.cuda.current_stream()
    sts = [torch.cuda.Stream() for _ in range(streams)] if streams > 1 else [main]
    fns = {k: fn_for(k) for k in keep}
    flops = 0
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for k, (s, _ops, reps) in keep.items():
            for st in sts:
                st.wait_stream(main)
            for i in range(schedule.SCALES * reps):
                with torch.cuda.stream(sts[i % len(sts)]):
                    fns[k][i % 2]()
            for st in sts:
                main.wait_stream(st)
            flops += schedule.SCALES * reps * s.flops
            torch.cuda.synchronize()
    return round(flops / (time.perf_counter() - t0) / 1e12, 1)


def soak(seconds, every):
    schedule.FINGERPRINT_EVERY = soak_run.FINGERPRINT_EVERY = every
    d = run_soak(SoakOptions(seconds=seconds, devices="cuda:0")).to_dict()["devices"][0]
    s = d.get("soak") or {}
    t = s.get("telemetry") or {}
    return {"fingerprint_every": every, "verdict": d["verdict"], "error": d["error"],
            "tflops": s.get("tflops"), "launches": s.get("launches"), "host_wait": s.get("host_wait"), "elapsed": s.get("elapsed"),
            "intervals": [i["tflops"] for i in s.get("intervals", [])], "clock": t.get("sm_clock_mhz"), "power": t.get("power_w"),
            "throttle": t.get("throttle")}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mix-seconds", type=float, default=5.0)
    ap.add_argument("--soak-seconds", type=float, default=20.0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    (dev,) = resolve_devices("cuda:0")
    wl = workloads.load(DEFAULT_GPU_WORKLOAD)
    tau = numerics.Thresholds().tau
    t0 = time.time()
    rows, keep = per_shape(dev, wl, tau)
    print(f"per shape done in {time.time() - t0:.1f} s", flush=True)
    launcher = Launcher(dev)
    outs = {k: [torch.empty((s.m, s.n), dtype=torch.bfloat16, device="cuda") for _ in range(2)] for k, (s, *_r) in keep.items()}
    cub = lambda k: [lambda j=j: torch.matmul(keep[k][1].a_mk, keep[k][1].b_kn, out=outs[k][j]) for j in range(2)]
    prepared = {k: launcher.prepare(keep[k][1]) for k in keep}
    ours = lambda k: [lambda: launcher.run(prepared[k])] * 2
    mix = {}
    for name, fn, st in (("cublas1", cub, 1), ("ours1", ours, 1), ("cublas2", cub, 2), ("ours2", ours, 2)):
        mix[name] = mix_sustained(fn, keep, args.mix_seconds, st)
        print(f"mix {name}: {mix[name]} TF/s", flush=True)
    outs.clear(), prepared.clear(), keep.clear()
    torch.cuda.empty_cache()
    soaks = [soak(args.soak_seconds, schedule.FINGERPRINT_EVERY)]
    print(f"soak {soaks[-1]}", flush=True)
    soaks.append(soak(args.soak_seconds / 2, 1))
    print(f"soak {soaks[-1]}", flush=True)
    result = {"per_shape": rows, "mix_sustained_tflops": mix, "soaks": soaks}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    print("shape                         cuBLAS  cuBLAS2   ours   ours2 | fp_ms  scr_ms  scr_old | set%  (ms per launch; set% = per-set/scale work)")
    for k, r in rows.items():
        print(f"{k:30s}{r['cublas_ms']:7.3f} {r['cublas2_ms']:7.3f} {r['ours_ms']:7.3f} {r['ours2_ms']:7.3f} | "
              f"{r['fingerprint_ms']:.4f} {r['screen_ms']:.4f} {r['screen_old_ms']:.4f} | {r['set_overhead_pct']}")
    print("mix sustained TF/s:", mix)
    for s in soaks:
        print(f"soak fp_every={s['fingerprint_every']}: {s['verdict']} {s['tflops']} TF/s, "
              f"{s['launches']} launches, host wait {s['host_wait']} of {s['elapsed']} s, clock {s['clock']}, power {s['power']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
