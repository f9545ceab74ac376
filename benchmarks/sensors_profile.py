"""Where the sampled sensors' cost goes in a training step (``benchmarks/sensors_overhead.py --profile N``).

N steps of each of ``plain``, ``sampled`` and ``drained`` (sampled, with the device drained at the
step boundary, as the sensors read their comparisons before session 13) run under torch.profiler
(CPU and CUDA activities) with the step's phases annotated on the host (forward, backward, the
sensors' step boundary, the optimizer step). Each step starts from a synchronised device, so the
kernels that run between a step's host start and end are its own. Per mode and step, averaged:

  wall         the step's host time (start to the final synchronisation)
  busy         the union of its kernels' intervals on the GPU (kernels, copies, memsets)
  idle         wall − busy, split by the host phase that launched the work ending each gap (the
               CUDA runtime call correlated with the next kernel): a gap before the optimizer's
               first kernel is charged to the optimizer, the lead before the first kernel to ``lead``
  kernels      GPU time by kind (cuBLAS GEMMs, aegis' checked GEMM, its reference, its comparison,
               the optimizer, attention, elementwise and other torch kernels, copies)

and the differences from ``plain``: the sampled step's extra cost as extra kernel time plus extra idle
time. Also the host seconds a fresh CUDA Device costs (NVML identity), which each instrument() used
to pay inside its first checked step. Traces are parsed in memory (written under a temporary folder).
"""

from __future__ import annotations

import collections
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from sensor_reference import timed  # benchmarks/ is on sys.path beside this module
from torch.profiler import ProfilerActivity, profile, record_function

from aegis_cli.backends import cuda_compare

PHASES = ("fwd", "bwd", "sensors", "opt")
KINDS = (("aegis_sc", "aegis compare"), ("aegis_sr", "aegis reference"), ("gemm_wgmma", "aegis checked GEMM"),
         ("gemm_mma", "aegis checked GEMM"), ("nvjet", "cuBLAS GEMM"), ("gemm", "cuBLAS GEMM"), ("xmma", "cuBLAS GEMM"),
         ("cutlass", "cuBLAS GEMM"), ("multi_tensor", "optimizer"), ("adam", "optimizer"), ("flash", "attention"),
         ("fmha", "attention"), ("attention", "attention"), ("memcpy", "copies"), ("memset", "copies"),
         ("elementwise", "elementwise"), ("reduce", "reductions"))


def kind(name: str) -> str:
    low = name.lower()
    return next((label for key, label in KINDS if key in low), "other")


def _annotated(name: str):
    """Bench.step's phase marks as profiler annotations (aegis:step, aegis:fwd, …: ``attribute`` reads them)."""
    return record_function(f"aegis:{name}")


def _union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, -1e30
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def attribute(trace: dict) -> list[dict]:
    """Per annotated step of a chrome trace: wall, busy, idle by phase, kernel time by kind (µs)."""
    ev = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    marks = [e for e in ev if e.get("cat") == "user_annotation" and e.get("name", "").startswith("aegis:")]  # host side
    steps = sorted((e["ts"], e["ts"] + e["dur"]) for e in marks if e["name"] == "aegis:step")
    phases = sorted((e["ts"], e["ts"] + e["dur"], e["name"].split(":")[1]) for e in marks if e["name"] != "aegis:step")
    launch_ts = {e["args"]["correlation"]: e["ts"] for e in ev  # the host call that enqueued each GPU event
                 if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    gpu = sorted((e["ts"], e["ts"] + e["dur"], e["name"], e.get("args", {}).get("correlation"))
                 for e in ev if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"))

    def phase_at(t: float | None) -> str:
        if t is None:
            return "unknown"
        return next((p for a, b, p in phases if a <= t <= b), "between")

    out = []
    for s0, s1 in steps:
        ks = [k for k in gpu if s0 <= k[0] <= s1]
        if not ks:
            continue
        idle: dict[str, float] = collections.Counter()
        gaps = []
        idle["lead"] = ks[0][0] - s0
        end = ks[0][1]
        for a, b, name, corr in ks[1:]:
            if a > end:
                who = phase_at(launch_ts.get(corr))
                idle[who] += a - end
                gaps.append((a - end, who, name[:60]))
            end = max(end, b)
        idle["tail"] = s1 - end
        by_kind: dict[str, float] = collections.Counter()
        for a, b, name, _ in ks:
            by_kind[kind(name)] += b - a
        host = {p: sum(b - a for a, b, q in phases if q == p and s0 <= a <= s1) for p in PHASES}
        out.append({"wall": s1 - s0, "busy": _union([(a, b) for a, b, _, _ in ks]), "kernels": len(ks), "idle": dict(idle),
                    "by_kind": dict(by_kind), "host": host, "gaps": sorted(gaps, reverse=True)[:4]})
    return out


def _avg(rows: list[dict], get) -> float:
    return statistics.fmean(get(r) for r in rows) if rows else 0.0


def summarise(rows: list[dict]) -> dict:
    """Means over a mode's steps, in ms."""
    keys = lambda field: sorted({k for r in rows for k in r[field]})
    return {"steps": len(rows), "wall_ms": _avg(rows, lambda r: r["wall"]) / 1e3, "busy_ms": _avg(rows, lambda r: r["busy"]) / 1e3,
            "kernels": _avg(rows, lambda r: r["kernels"]),
            "idle_ms": {k: _avg(rows, lambda r, k=k: r["idle"].get(k, 0.0)) / 1e3 for k in keys("idle")},
            "kind_ms": {k: _avg(rows, lambda r, k=k: r["by_kind"].get(k, 0.0)) / 1e3 for k in keys("by_kind")},
            "host_ms": {k: _avg(rows, lambda r, k=k: r["host"][k]) / 1e3 for k in PHASES},
            "largest_gaps_us": sorted((g for r in rows for g in r["gaps"]), reverse=True)[:6]}


def fresh_device_seconds() -> float:
    """Host seconds to make a CUDA Device (its NVML identity): what each instrument() paid before
    handles shared one per process."""
    from aegis_cli.backends import get_backend

    t0 = time.perf_counter()
    get_backend("cuda").device(0)
    return time.perf_counter() - t0


def run(bench, cfg, steps: int, counter) -> dict:
    """Profile ``steps`` steps of plain, sampled (``cfg``) and drained; attribute and compare with plain."""
    from aegis_cli.sensors import instrument, uninstrument

    cuda = bench.dev.type == "cuda"
    out: dict = {"fresh_device_s": fresh_device_seconds() if cuda else None, "compare": compare_costs(bench) if cuda else [],
                 "modes": {}}
    tmp = Path(tempfile.mkdtemp(prefix="aegis_profile_"))
    for mode in ("plain", "sampled", "drained"):
        handle = instrument(bench.model, cfg) if mode != "plain" else None
        try:
            for _ in range(2):  # unprofiled: the handle's first steps
                bench.step(next(counter), handle, mode == "drained", _annotated)
            checked0 = handle.stats.checked if handle else 0
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(steps):
                    bench.step(next(counter), handle, mode == "drained", _annotated)
            checks = (handle.stats.checked - checked0) if handle else 0
        finally:
            if handle is not None:
                uninstrument(bench.model)
        path = tmp / f"{mode}.json"
        prof.export_chrome_trace(str(path))
        rows = attribute(json.loads(path.read_text()))
        path.unlink()
        out["modes"][mode] = {**summarise(rows), "checks_per_step": checks / steps}
    plain = out["modes"]["plain"]
    for mode in ("sampled", "drained"):
        m = out["modes"][mode]
        m["extra_ms"] = {"wall": m["wall_ms"] - plain["wall_ms"], "busy": m["busy_ms"] - plain["busy_ms"],
                         "idle": sum(m["idle_ms"].values()) - sum(plain["idle_ms"].values()),
                         "idle_by_phase": {k: m["idle_ms"].get(k, 0.0) - plain["idle_ms"].get(k, 0.0)
                                           for k in sorted(set(m["idle_ms"]) | set(plain["idle_ms"]))},
                         "kind": {k: m["kind_ms"].get(k, 0.0) - plain["kind_ms"].get(k, 0.0)
                                  for k in sorted(set(m["kind_ms"]) | set(plain["kind_ms"]))}}
    return out


def table(prof: dict) -> list[str]:
    if "modes" not in prof:
        return []  # its error is in the table's failures
    fresh = prof["fresh_device_s"]
    lines = [f"profile (torch.profiler, {prof['modes']['plain']['steps']} steps a mode; ms a step)"
             + (f": a fresh CUDA Device costs {1e3 * fresh:.1f} ms of host time" if fresh is not None else "")]
    lines.append("mode      wall     busy   idle   checks  kernels  host fwd/bwd/sensors/opt")
    for mode, m in prof["modes"].items():
        h = m["host_ms"]
        lines.append(f"{mode:<8} {m['wall_ms']:7.2f} {m['busy_ms']:8.2f} {sum(m['idle_ms'].values()):6.2f} {m['checks_per_step']:7.2f} "
                     f"{m['kernels']:8.0f}  {h['fwd']:.1f}/{h['bwd']:.1f}/{h['sensors']:.2f}/{h['opt']:.2f}")
    for mode in ("sampled", "drained"):
        x = prof["modes"][mode].get("extra_ms")
        if not x:
            continue
        idle = ", ".join(f"{k} {v:+.3f}" for k, v in x["idle_by_phase"].items() if abs(v) >= 0.005)
        kinds = ", ".join(f"{k} {v:+.3f}" for k, v in x["kind"].items() if abs(v) >= 0.005)
        lines.append(f"{mode} vs plain: wall {x['wall']:+.3f} = busy {x['busy']:+.3f} + idle {x['idle']:+.3f}")
        lines.append(f"  idle by phase: {idle}")
        lines.append(f"  GPU time by kind: {kinds}")
        gaps = prof["modes"][mode]["largest_gaps_us"][:3]
        lines.append("  largest gaps (µs, phase, next kernel): " + "; ".join(f"{g:.0f} {p} {n[:40]}" for g, p, n in gaps))
    if prof.get("compare"):
        lines.append("comparison per check, GPU ms (torch path → fused kernel; the references for scale):")
        lines += [f"  {r['gemm']:<18} {r['torch_ms']:.3f} → {r['fused_ms']:.3f}   reference {r['reference_ms']:.3f}" for r in prof["compare"]]
    return lines


def compare_costs(bench) -> list[dict]:
    """Per GEMM of the model (one Linear of each shape, every layout): GPU ms of the comparison given
    the references, by torch's elementwise path and by the fused kernel (the sensors' choice on CUDA)."""
    from aegis_cli.backends import get_backend
    from aegis_cli.ops.gemm import GemmOperands, Layout
    from aegis_cli.sensors import sense

    dev = get_backend("cuda").device(0)
    tokens = bench.batches[0][0].numel()
    shapes = sorted({(m.in_features, m.out_features) for m in bench.model.modules() if isinstance(m, torch.nn.Linear)})
    g = torch.Generator(device=bench.dev).manual_seed(3)
    out = []
    for fin, fout in shapes:
        for layout in Layout:
            m, n, k = {Layout.FWD: (tokens, fout, fin), Layout.DGRAD: (tokens, fin, fout), Layout.WGRAD: (fout, fin, tokens)}[layout]
            a = torch.randn(layout.a_stored_shape(m, k), generator=g, device=bench.dev).to(torch.bfloat16)
            b = (torch.randn(layout.b_stored_shape(k, n), generator=g, device=bench.dev) * 0.02).to(torch.bfloat16)
            ops = GemmOperands(a, b, layout)
            res = sense.launch(dev, ops, None, "train/profile")
            noise = dev.noise_model(k)
            named = sense._sides(ops, res, True, dev)
            sides = [x[1:] for x in named]
            c = sense.Sigma.of(noise, k)

            def torch_path(named=named, c=c):
                return sense.compare_torch(named, c)

            def fused(sides=sides, c=c):
                summary = cuda_compare.new_summary(len(sides), bench.dev)
                cuda_compare.compare(sides, c.u, c.p, c.b, c.w, summary)

            out.append({"gemm": f"{fin}x{fout}/{layout.value}", "mnk": [m, n, k], "torch_ms": timed(torch_path, 5),
                        "fused_ms": timed(fused, 5), "reference_ms": timed(lambda ops=ops, res=res: sense._sides(ops, res, True, dev), 5)})
            del a, b, ops, res, sides, named
    return out
