"""The burn-in's sustained throughput against cuBLAS on the same shapes, in one run (issue 18).

    PYTHONPATH=. python3 benchmarks/soak.py [--seconds 120] [--cublas-seconds 30] [--inject-seconds 25]
                                           [--device cuda:0] [--json out.json]

1. Per shape of the workload (llama3-70b on a GPU): cuBLAS (torch.matmul, bf16, the operands as
   training stores them) and our checked kernel alone, event-timed medians: where the time goes.
2. cuBLAS sustained: the workload's shapes back to back in the burn-in's proportions (each
   shape's launches per input set) for ``--cublas-seconds``, so it meets the clocks and power
   cap a long run meets.
3. ``aegis scan --soak`` for ``--seconds`` (run_soak): every launch checked; its sustained TFLOP/s
   over the whole run (set-up, screening, host reads included) ÷ cuBLAS's on the same mix.
   Target: ≥ 0.90. It must be HEALTHY on a healthy GPU.
4. ``--inject-seconds``: the burn-in again with ``bitflip:target=acc,bit=exp,prob=1e-4``; it must
   be FAULTY with its "k of n launches". The coin is drawn per launch from the fault's seed, so
   with seed 0 it fires at launches 1579, 2923, 6403, 8818, 43786, …: a few seconds catch four.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from aegis_cli.backends import resolve_devices
from aegis_cli.backends.soak_cuda import Launcher
from aegis_cli.faults.spec import FaultPlan
from aegis_cli.ops import workloads
from aegis_cli.ops.gemm import Layout
from aegis_cli.probes import DEFAULT_GPU_WORKLOAD
from aegis_cli.probes.gemm import draw_operands
from aegis_cli.soak.record import shape_key
from aegis_cli.soak.run import SoakOptions, run_soak
from aegis_cli.soak.schedule import SCALES, repeats_for
from benchmarks.fingerprint import timed

INJECT = "bitflip:target=acc,bit=exp,prob=1e-4"


def _median_ms(fn, burst: int = 4) -> float:
    """Median milliseconds per call over bursts of ``burst`` back-to-back calls (no sync inside)."""
    return timed(lambda: [fn() for _ in range(burst)], iters=6) * 1e3 / burst


def shape_runs(dev, wl, tag: str):
    """Per GEMM shape of ``wl``: (key, shape, operands, cublas, checked). The operands are drawn on
    ``dev`` as the scan draws a case's (seed 0, group ``tag/i``); ``cublas()`` (torch.matmul into an
    output of its own) and ``checked()`` (our checked kernel as the burn-in launches it, returning
    its GemmResult) enqueue one GEMM on them without a sync."""
    launcher = Launcher(dev)
    for i, s in enumerate(wl.gemms()):
        o = draw_operands(dev.generate, s.layout, s.m, s.n, s.k, "normal", 0, f"{tag}/{i}")
        out = torch.empty((s.m, s.n), dtype=torch.bfloat16, device=o.a.device)
        p = launcher.prepare(o)
        yield shape_key(s), s, o, (lambda o=o, out=out: torch.matmul(o.a_mk, o.b_kn, out=out)), (lambda p=p: launcher.run(p))


def per_shape(dev, wl) -> tuple[dict, dict]:
    """Operands per shape, and event-timed cuBLAS and checked-kernel milliseconds per shape."""
    ops, rows = {}, {}
    for key, s, o, cublas_fn, checked_fn in shape_runs(dev, wl, "bench"):
        ops[key] = (s, o)
        cublas, checked = _median_ms(cublas_fn), _median_ms(checked_fn)
        rows[key] = {"flops": s.flops, "cublas_ms": round(cublas, 4), "checked_ms": round(checked, 4),
                     "cublas_tflops": round(s.flops / cublas / 1e9, 1), "checked_tflops": round(s.flops / checked / 1e9, 1),
                     "checked_vs_cublas": round(cublas / checked, 3)}
    return ops, rows


def cublas_sustained(ops: dict, seconds: float) -> dict:
    """cuBLAS over the shapes in turn, each for as many launches as a burn-in set gives it."""
    outs = {k: torch.empty((s.m, s.n), dtype=torch.bfloat16, device=o.a.device) for k, (s, o) in ops.items()}
    per_set = {k: SCALES * repeats_for(s.flops, SCALES, "cuda") for k, (s, _o) in ops.items()}
    flops, launches = 0, 0
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for key, (s, o) in ops.items():
            for _ in range(per_set[key]):
                torch.matmul(o.a_mk, o.b_kn, out=outs[key])
            flops += per_set[key] * s.flops
            launches += per_set[key]
            torch.cuda.synchronize()  # one set at a time, as the burn-in's queue depth
    elapsed = time.perf_counter() - t0
    return {"seconds": round(elapsed, 2), "launches": launches, "tflops": round(flops / elapsed / 1e12, 1)}


def _save(path: str | None, result: dict) -> None:
    """The figures so far: a run cut short (a device's time limit) keeps the phases it finished."""
    if path:
        Path(path).write_text(json.dumps(result, indent=2) + "\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--seconds", type=float, default=120.0)
    ap.add_argument("--cublas-seconds", type=float, default=30.0)
    ap.add_argument("--inject-seconds", type=float, default=25.0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    say = lambda *a: print(*a, flush=True)  # each phase as it ends
    (dev,) = resolve_devices(args.device)
    wl = workloads.load(DEFAULT_GPU_WORKLOAD)
    ops, shapes = per_shape(dev, wl)
    result: dict = {"per_shape": shapes}
    _save(args.json, result)
    say("shape                               cuBLAS TF/s  checked TF/s  checked/cuBLAS")
    for k, r in shapes.items():
        say(f"{k:36s}{r['cublas_tflops']:>10}  {r['checked_tflops']:>12}  {r['checked_vs_cublas']:>14}")
    # build the kernels' injection variant now: compiled at the first firing, it would stall the timed run
    small = draw_operands(dev.generate, Layout.FWD, 128, 256, 64, "normal", 0, "bench/warm")
    dev.checked_gemm(small, FaultPlan.parse("bitflip:target=acc"), op="warm")
    cublas = result["cublas_sustained"] = cublas_sustained(ops, args.cublas_seconds)
    _save(args.json, result)
    say(f"cuBLAS sustained {cublas['tflops']} TF/s over {cublas['seconds']} s")
    del ops
    torch.cuda.empty_cache()
    rep = run_soak(SoakOptions(seconds=args.seconds, devices=args.device))
    d = rep.to_dict()["devices"][0]
    soak = d.get("soak") or {}
    by = (soak.get("coverage") or {}).get("launches_by_shape", {})
    # cuBLAS on exactly the burn-in's mix: each shape's launches at cuBLAS's own per-shape time
    mix_ms = sum(n * shapes[k]["cublas_ms"] for k, n in by.items())
    mix_flops = sum(n * shapes[k]["flops"] for k, n in by.items())
    result.update({"device": d["device"]["name"], "uuid": d["device"]["uuid"],
                   "soak": {"verdict": d["verdict"], "error": d["error"], "seconds": soak.get("elapsed"), "launches": soak.get("launches"),
                            "fingerprinted": soak.get("fingerprinted"), "host_wait": soak.get("host_wait"),
                            "input_sets": soak.get("input_sets"), "tflops": soak.get("tflops"), "failures": soak.get("failures"),
                            "telemetry": soak.get("telemetry"), "coverage": soak.get("coverage"),
                            "intervals_tflops": [i["tflops"] for i in soak.get("intervals", [])]},
                   "cublas_same_mix_tflops": round(mix_flops / mix_ms / 1e9, 1) if mix_ms else None})
    if soak.get("tflops"):
        result["ratio_vs_cublas_sustained"] = round(soak["tflops"] / cublas["tflops"], 3)
        if mix_ms:
            result["ratio_vs_cublas_same_mix"] = round(soak["tflops"] / (mix_flops / mix_ms / 1e9), 3)
    _save(args.json, result)
    t = soak.get("telemetry") or {}
    say(f"cuBLAS on the soak's mix (event-timed) {result['cublas_same_mix_tflops']} TF/s")
    say(f"soak {d['verdict']}: {soak.get('launches')} launches ({soak.get('fingerprinted')} fingerprinted) "
        f"in {soak.get('elapsed')} s (host waited {soak.get('host_wait')} s), "
        f"{soak.get('tflops')} TF/s sustained; "
        f"ratio vs cuBLAS sustained {result.get('ratio_vs_cublas_sustained')}, vs same-mix {result.get('ratio_vs_cublas_same_mix')}")
    say(f"clock {t.get('sm_clock_mhz')}, temp {t.get('temperature_c')}, power {t.get('power_w')}, throttle {t.get('throttle')}")
    if args.inject_seconds > 0:
        rep = run_soak(SoakOptions(seconds=args.inject_seconds, devices=args.device, inject=INJECT))
        di = rep.to_dict()["devices"][0]
        fi = (di.get("soak") or {}).get("failures", {})
        i = result["injected"] = {"spec": INJECT, "verdict": di["verdict"], "error": di["error"], "failed": fi.get("launches"),
                                  "of": fi.get("of"), "first": (fi.get("first") or [None])[0],
                                  "evidence": [e["summary"] for e in di["evidence"]][:3]}
        _save(args.json, result)
        say(f"injected {i['spec']}: {i['verdict']}, failed {i['failed']} of {i['of']} launches; error {i['error']}")
    return 0 if d["verdict"] == "HEALTHY" else 1


if __name__ == "__main__":
    sys.exit(main())
