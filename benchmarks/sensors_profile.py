"""Where the sensors' cost goes in a training step (``benchmarks/sensors_overhead.py --profile N``).

N steps of each of ``--profile-modes`` (default ``plain``, ``sampled`` and ``drained``: sampled, with
the device drained at the step boundary, as the sensors read their comparisons before session 13;
``kernels``: every GEMM pinned to aegis' checked kernels, nothing compared) run under torch.profiler
(CPU and CUDA activities) with the step's phases annotated on the host (forward, backward, the
sensors' step boundary, the optimizer step). Each step starts from a synchronised device, so the
kernels that run between a step's host start and end are its own. Per mode and step, averaged:

  wall         the step's host time (start to the final synchronisation)
  busy         the union of its kernels' intervals on the GPU (kernels, copies, memsets)
  idle         wall − busy, split by the host phase that launched the work ending each gap (the
               CUDA runtime call correlated with the next kernel): a gap before the optimizer's
               first kernel is charged to the optimizer, the lead before the first kernel to ``lead``
  kernels      GPU time by kind (cuBLAS GEMMs, aegis' checked GEMM, its reference, its comparison,
               the optimizer, attention, fills, copies, adds, other elementwise and reductions) and by
               kernel name (the largest differences from plain are listed)

and the differences from ``plain``: each mode's extra cost as extra kernel time plus extra idle
time. Also the host seconds a fresh CUDA Device costs (NVML identity), which each instrument() used
to pay inside its first checked step, and the host time of one checked launch by part (``host_costs``:
the tensor maps, the output allocations, the driver launch, the whole path of a pinned GEMM, against
torch's matmul). Traces are parsed in memory (written under a temporary folder).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path

import torch
from sensor_reference import timed  # benchmarks/ is on sys.path beside this module
from torch.profiler import ProfilerActivity, profile, record_function

from aegis_cli.backends import cuda_compare

PHASES = ("fwd", "bwd", "sensors", "opt")
KINDS = (("aegis_sc", "aegis compare"), ("aegis_sr", "aegis reference"), ("gemm_wgmma", "aegis checked GEMM"),
         ("gemm_mma", "aegis checked GEMM"), ("nvjet", "cuBLAS GEMM"), ("gemm", "cuBLAS GEMM"), ("xmma", "cuBLAS GEMM"),
         ("cutlass", "cuBLAS GEMM"), ("attn_", "aegis attention"), ("multi_tensor", "optimizer"), ("adam", "optimizer"), ("flash", "attention"),
         ("fmha", "attention"), ("attention", "attention"), ("memcpy", "copies"), ("memset", "fills"),
         ("fill", "fills"), ("copy", "copies"), ("functor_add", "adds"), ("elementwise", "elementwise"),
         ("reduce", "reductions"))


def kind(name: str) -> str:
    low = name.lower()
    return next((label for key, label in KINDS if key in low), "other")


def short(name: str) -> str:
    """A kernel's name without its namespaces and launch parameters, cut to 90 characters."""
    for junk in ("void ", "at::native::", "(anonymous namespace)::", "c10::"):
        name = name.replace(junk, "")
    return name[:90]


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
        by_name: dict[str, float] = collections.Counter()
        for a, b, name, _ in ks:
            by_kind[kind(name)] += b - a
            by_name[short(name)] += b - a
        host = {p: sum(b - a for a, b, q in phases if q == p and s0 <= a <= s1) for p in PHASES}
        out.append({"wall": s1 - s0, "busy": _union([(a, b) for a, b, _, _ in ks]), "kernels": len(ks), "idle": dict(idle),
                    "by_kind": dict(by_kind), "by_name": dict(by_name), "host": host, "gaps": sorted(gaps, reverse=True)[:4]})
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
            "name_ms": {k: _avg(rows, lambda r, k=k: r["by_name"].get(k, 0.0)) / 1e3 for k in keys("by_name")},
            "host_ms": {k: _avg(rows, lambda r, k=k: r["host"][k]) / 1e3 for k in PHASES},
            "largest_gaps_us": sorted((g for r in rows for g in r["gaps"]), reverse=True)[:6]}


def fresh_device_seconds() -> float:
    """Host seconds to make a CUDA Device (its NVML identity): what each instrument() paid before
    handles shared one per process."""
    from aegis_cli.backends import get_backend

    t0 = time.perf_counter()
    get_backend("cuda").device(0)
    return time.perf_counter() - t0


# experiment modes, all pinned: the config of the mode each varies (sensors_overhead builds the configs)
EXPERIMENTS = {"nosums": "kernels", "nosync": "kernels"}
PINNED = ("kernels", *EXPERIMENTS)  # the modes Bench.mode_step runs pinned


@contextlib.contextmanager
def _variant(mode: str):
    """Experiments on the pinned step. ``nosums``: the kernels' AEGIS_NOSUMS build, C alone, so the
    checksums' share of the pinned GEMMs' time in the step shows. ``nosync``: the step boundary
    never waits for pinned launches (``SensorHandle.enqueued`` reads False, so ``sense.settle_pinned``
    records no event to wait for at the next one; it drained the device when the experiment was
    written), so what that wait costs shows. Any other mode as it is."""
    if mode not in EXPERIMENTS:
        yield
        return
    from aegis_cli.backends.cuda import CudaDevice
    from aegis_cli.sensors.handle import SensorHandle

    prepare = CudaDevice.prepare
    if mode == "nosums":
        CudaDevice.prepare = functools.partialmethod(prepare, variant="nosums")
    else:  # a data descriptor outranks the instance's own attribute; deleted after, that shows again
        SensorHandle.enqueued = property(lambda self: False, lambda self, value: None)
    try:
        yield
    finally:
        CudaDevice.prepare = prepare
        if mode == "nosync":
            del SensorHandle.enqueued


@functools.cache
def _identity(index: int):
    """The identity of CUDA device ``index``, made once: each fresh Device looks it up through NVML
    (``fresh_device_seconds``), and every window of sensors_overhead samples clocks."""
    from aegis_cli.backends import get_backend

    return get_backend("cuda").device(index).identity


class Clocks:
    """SM clock and power sampled by NVML every 10 ms on a thread while a mode's steps run: whether
    a mode runs the GPU at other clocks (power capping) than plain."""

    def __init__(self, bench):
        from aegis_cli.backends.nvml import Telemetry

        self.tel = Telemetry(_identity(bench.dev.index or 0)) if bench.dev.type == "cuda" else None
        self.samples: list[dict] = []
        self._stop = threading.Event()

    def __enter__(self):
        if self.tel is not None and self.tel.available:
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()
        return self

    def _run(self):
        while not self._stop.wait(0.01):
            r = self.tel.read()
            if r:
                self.samples.append(r)

    def __exit__(self, *exc):
        self._stop.set()
        if self.tel is not None and self.tel.available:
            self._thread.join()
            self.tel.close()

    def summary(self) -> dict:
        xs = self.samples
        if not xs:
            return {}

        def mean(key: str) -> float | None:
            vals = [x[key] for x in xs if x[key] is not None]
            return statistics.fmean(vals) if vals else None

        capped = sum(any("power" in t.lower() for t in (x["throttle"] or [])) for x in xs) / len(xs)
        return {"samples": len(xs), "sm_clock_mhz": mean("sm_clock_mhz"), "power_w": mean("power_w"), "power_capped": capped}


def run(bench, modes: dict, steps: int, counter) -> dict:
    """Profile ``steps`` steps of each mode (name → SensorConfig, None for plain; each step as
    ``Bench.mode_step`` runs it: ``drained`` drains the device at the step boundary, ``kernels`` runs
    pinned, ``EXPERIMENTS`` vary it: ``_variant``); attribute and compare with plain."""
    from aegis_cli.sensors import instrument, uninstrument

    cuda = bench.dev.type == "cuda"
    modes = {"plain": None, **modes}
    out: dict = {"fresh_device_s": fresh_device_seconds() if cuda else None,
                 "compare": compare_costs(bench) if cuda and "sampled" in modes else [],
                 "host": _or_error(host_costs, bench) if cuda else {}, "modes": {}}
    tmp = Path(tempfile.mkdtemp(prefix="aegis_profile_"))
    for mode, cfg in modes.items():
        handle = instrument(bench.model, cfg) if cfg is not None else None

        def step(handle=handle, mode=mode):
            bench.mode_step(mode, next(counter), handle, _annotated)

        try:
            with _variant(mode):
                for _ in range(2):  # unprofiled: the handle's first steps
                    step()
                with Clocks(bench) as clocks:  # unprofiled too: the clocks of the mode's own steps
                    for _ in range(steps):
                        step()
                checked0 = handle.stats.checked if handle else 0
                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    for _ in range(steps):
                        step()
                checks = (handle.stats.checked - checked0) if handle else 0
        finally:
            if handle is not None:
                uninstrument(bench.model)
        path = tmp / f"{mode}.json"
        prof.export_chrome_trace(str(path))
        rows = attribute(json.loads(path.read_text()))
        path.unlink()
        out["modes"][mode] = {**summarise(rows), "checks_per_step": checks / steps, "clocks": clocks.summary()}
    plain = out["modes"]["plain"]
    for mode in out["modes"]:
        if mode == "plain":
            continue
        m = out["modes"][mode]
        diff = lambda field, m=m: {k: m[field].get(k, 0.0) - plain[field].get(k, 0.0) for k in sorted(set(m[field]) | set(plain[field]))}
        names = diff("name_ms")
        m["extra_ms"] = {"wall": m["wall_ms"] - plain["wall_ms"], "busy": m["busy_ms"] - plain["busy_ms"],
                         "idle": sum(m["idle_ms"].values()) - sum(plain["idle_ms"].values()),
                         "idle_by_phase": diff("idle_ms"), "kind": diff("kind_ms"), "host": diff("host_ms"),
                         "names": dict(sorted(names.items(), key=lambda kv: -abs(kv[1]))[:14])}
    return out


def _or_error(fn, *args) -> dict:
    """``fn(*args)``, or its error: a side measurement never costs the profile its figures."""
    try:
        return fn(*args)
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}


def host_costs(bench, reps: int = 200) -> dict:
    """Host µs of one checked launch by part, and of torch's matmul of the same operands: the parts of
    ``CudaDevice.prepare`` (a tensor map, the four outputs), the driver launch of a prepared launch,
    ``sense.launch`` whole, and ``sense.run_gemm`` pinned (what a Linear's GEMM costs the host in the
    pinned step). On a small forward GEMM, so that the GPU keeps up and the host's time is what is timed."""
    from aegis_cli.backends import cuda, get_backend
    from aegis_cli.ops.gemm import GemmOperands, Layout
    from aegis_cli.sensors import SensorConfig, instrument, sense, uninstrument

    dev = get_backend("cuda").device(0)
    g = torch.Generator(device=bench.dev).manual_seed(5)
    a = torch.randn(256, 256, generator=g, device=bench.dev).to(torch.bfloat16)
    b = (torch.randn(512, 256, generator=g, device=bench.dev) * 0.02).to(torch.bfloat16)
    ops = GemmOperands(a, b, Layout.FWD)
    m, n, _ = ops.mnk
    prepared = dev.prepare(a, b, Layout.FWD)
    lin = torch.nn.Linear(1, 1)
    handle = instrument(lin, SensorConfig(sample_prob=0.0, overhead_budget=None, coverage_steps=None))

    def pinned():
        with handle.pin():
            sense.run_gemm(handle, "host", Layout.FWD, a, b, False)

    parts = {"tensor map (one operand, cached)": lambda: cuda._tensor_map(a, 64, 128),
             "encode a tensor map": lambda: cuda._encode_map(a, 64, 128),
             "outputs (C, sums, tile→SM)": lambda: (torch.empty((m, n), dtype=torch.bfloat16, device=bench.dev),
                                                    torch.empty((m, -(-n // 128)), device=bench.dev),
                                                    torch.empty((-(-m // 64), n), device=bench.dev),
                                                    torch.empty((-(-m // 64), -(-n // 128)), dtype=torch.int32, device=bench.dev)),
             "prepare": lambda: dev.prepare(a, b, Layout.FWD),
             "driver launch (prepared)": prepared.run,
             "sense.launch": lambda: sense.launch(dev, ops, None, "train/host"),
             "run_gemm pinned": pinned,
             "torch.matmul (cuBLAS)": lambda: torch.matmul(a, b.t()),
             "torch.nn.functional.linear": lambda: torch.nn.functional.linear(a, b)}
    out = {}
    try:
        for name, fn in parts.items():
            fn()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for i in range(reps):
                fn()
                if i % 50 == 49:  # keep the launch queue short: the GPU work is not what is timed
                    torch.cuda.synchronize()
            out[name] = 1e6 * (time.perf_counter() - t0) / reps
            torch.cuda.synchronize()
    finally:
        uninstrument(lin)
    return {"shape": [m, n, ops.mnk[2]], "us": out}


def table(prof: dict) -> list[str]:
    if "modes" not in prof:
        return []  # its error is in the table's failures
    fresh = prof["fresh_device_s"]
    lines = [f"profile (torch.profiler, {prof['modes']['plain']['steps']} steps a mode; ms a step)"
             + (f": a fresh CUDA Device costs {1e3 * fresh:.1f} ms of host time" if fresh is not None else "")]
    lines.append("mode      wall     busy   idle   checks  kernels  host fwd/bwd/sensors/opt   SM MHz  W  power-capped")
    for mode, m in prof["modes"].items():
        h, c = m["host_ms"], m.get("clocks") or {}
        clk = (f"   {c['sm_clock_mhz'] or 0:6.0f} {c['power_w'] or 0:4.0f}  {100 * c['power_capped']:.0f}%" if c else "")
        lines.append(f"{mode:<8} {m['wall_ms']:7.2f} {m['busy_ms']:8.2f} {sum(m['idle_ms'].values()):6.2f} {m['checks_per_step']:7.2f} "
                     f"{m['kernels']:8.0f}  {h['fwd']:.1f}/{h['bwd']:.1f}/{h['sensors']:.2f}/{h['opt']:.2f}{clk}")
    for mode in prof["modes"]:
        x = prof["modes"][mode].get("extra_ms")
        if not x:
            continue
        idle = ", ".join(f"{k} {v:+.3f}" for k, v in x["idle_by_phase"].items() if abs(v) >= 0.005)
        kinds = ", ".join(f"{k} {v:+.3f}" for k, v in x["kind"].items() if abs(v) >= 0.005)
        lines.append(f"{mode} vs plain: wall {x['wall']:+.3f} = busy {x['busy']:+.3f} + idle {x['idle']:+.3f}")
        lines.append(f"  idle by phase: {idle}")
        lines.append(f"  GPU time by kind: {kinds}")
        lines.append("  host by phase: " + ", ".join(f"{k} {v:+.2f}" for k, v in x["host"].items()))
        lines += [f"  {v:+8.3f}  {k}" for k, v in list(x["names"].items())[:8] if abs(v) >= 0.01]
        gaps = prof["modes"][mode]["largest_gaps_us"][:3]
        lines.append("  largest gaps (µs, phase, next kernel): " + "; ".join(f"{g:.0f} {p} {n[:40]}" for g, p, n in gaps))
    if prof.get("host", {}).get("error"):
        lines.append(f"host costs FAILED: {prof['host']['error'][:150]}")
    elif prof.get("host"):
        h = prof["host"]
        lines.append(f"host µs per launch, {'x'.join(map(str, h['shape']))} forward: "
                     + ", ".join(f"{k} {v:.1f}" for k, v in h["us"].items()))
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
