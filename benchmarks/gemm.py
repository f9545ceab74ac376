"""GEMM throughput: cuBLAS (torch.matmul) against our checked kernel with and without the
fused checksums, on 8192³ and the llama3-70b per-GPU shapes, in one run.

    PYTHONPATH=. python3 benchmarks/gemm.py [--json out.json] [--reps 20] [--kernel wgmma|mma]
                                            [--baseline old/gemm_wgmma.cu]

``--baseline FILE`` times another gemm_wgmma.cu (e.g. ``git show REF:kernels/gemm_wgmma.cu``)
beside the current one, plain and checked, interleaved in the same samples: an A/B in one run.

Each figure is the median of event-timed launches after warm-up, rotating over several
input sets so no run reads operands another left in L2. Inputs are seeded random bf16
(never zeros: zeros run faster than real data).

``--sustained`` runs each variant for seconds at a time instead (``--compare … --clocks`` for
chosen variants and shapes, with NVML clock and power). On a power-capped card this is the
figure a long scan sees: the checksums' energy lowers the SM clock, and interleaved bursts
share that clock drop between the variants instead of charging it to the checked kernel.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from aegis_cli.ops import workloads
from aegis_cli.ops.gemm import GemmOperands, Layout

N_SETS = 3


def _time(fns: dict, reps: int, warmup: int = 3, burst: int = 4) -> dict[str, float]:
    """Median milliseconds per call of each ``fn(i)`` (i rotates input sets). Each sample times
    ``burst`` back-to-back calls between two events (no host sync inside, so the GPU never idles
    between them); candidates alternate sample by sample so clock and power drift hit all alike."""
    for i in range(warmup):
        for fn in fns.values():
            fn(i)
    torch.cuda.synchronize()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for r in range(reps):
        for key, fn in fns.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for j in range(burst):
                fn(r * burst + j)
            end.record()
            end.synchronize()
            times[key].append(start.elapsed_time(end) / burst)
    return {k: statistics.median(v) for k, v in times.items()}


def _clocks() -> dict:
    """SM clock (MHz), power (W) and clock-event reasons right now, when NVML answers."""
    try:
        import pynvml

        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
        out = {"sm_mhz": pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM),
               "power_w": pynvml.nvmlDeviceGetPowerUsage(h) / 1000.0,
               "temp_c": pynvml.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU)}
        with contextlib.suppress(Exception):
            out["clock_reasons"] = hex(pynvml.nvmlDeviceGetCurrentClocksEventReasons(h))
        return out
    except Exception:
        return {}


def _torch_matmul(a: torch.Tensor, b: torch.Tensor, layout: Layout) -> torch.Tensor:
    if layout is Layout.FWD:
        return a @ b.t()
    if layout is Layout.WGRAD:
        return a.t() @ b
    return a @ b


@contextlib.contextmanager
def _wgmma_source(path: str | None):
    """Build gemm_wgmma launches from ``path`` instead of kernels/gemm_wgmma.cu while inside (a
    define keeps the compiled functions apart from the current source's in cuda.py's cache)."""
    if path is None:
        yield
        return
    from aegis_cli.backends import cuda, loader

    orig = loader.get_module
    src = str(Path(path).resolve())

    def get_module(name: str, **kw):
        return orig(src if name == "gemm_wgmma.cu" else name, **kw)

    saved = dict(cuda.WGMMA_DEFINES)
    loader.get_module = get_module
    cuda.WGMMA_DEFINES["AEGIS_BASELINE_SOURCE"] = 1
    try:
        yield
    finally:
        loader.get_module = orig
        cuda.WGMMA_DEFINES.clear()
        cuda.WGMMA_DEFINES.update(saved)


def _input_sets(dev, layout: Layout, m: int, n: int, k: int, seed: int, count: int = N_SETS) -> list[tuple]:
    """``count`` seeded random (A, B) pairs, stored as ``layout`` stores them."""
    return [(dev.generate(layout.a_stored_shape(m, k), "normal", seed + s), dev.generate(layout.b_stored_shape(k, n), "normal", seed + 100 + s))
            for s in range(count)]


def _same_bits(outs: tuple, ref: tuple, checked: bool) -> bool:
    """C equal bit for bit, and the row and column sums too when both builds compute them."""
    n = 3 if checked else 1  # never tile_sm: which SM runs a tile is the scheduler's choice
    return all(torch.equal(x, y) for x, y in zip(outs[:n], ref[:n], strict=True))


def bench_shape(dev, name: str, layout: Layout, m: int, n: int, k: int, reps: int, kernel: str | None,
                baseline: str | None = None) -> dict:
    sets = _input_sets(dev, layout, m, n, k, 100)
    flop = 2.0 * m * n * k
    row = {"name": name, "layout": layout.value, "m": m, "n": n, "k": k}
    fns = {"cublas": lambda i: _torch_matmul(*sets[i % N_SETS], layout)}
    outs = {}
    for variant, key in (("nosums", "plain"), ("", "checked")):
        launches = [dev.prepare(a, b, layout, variant=variant, kernel=kernel) for a, b in sets]
        row["kernel"] = f"gemm_{launches[0].kernel}"
        fns[key] = lambda i, launches=launches: launches[i % N_SETS].run()
        outs[key] = launches[0].outputs  # of input set 0
    if baseline is not None:
        with _wgmma_source(baseline):
            for variant, key in (("nosums", "base_plain"), ("", "base_checked")):
                launches = [dev.prepare(a, b, layout, variant=variant, kernel=kernel) for a, b in sets]
                fns[key] = lambda i, launches=launches: launches[i % N_SETS].run()
                outs[key] = launches[0].outputs
    ms = _time(fns, reps)
    row.update(_clocks())  # read right after the timed bursts: the state they ran in
    dev.synchronize()
    if baseline is not None:  # a rewrite that keeps the arithmetic must keep the bits
        row["bitwise_vs_baseline"] = (_same_bits(outs["plain"], outs["base_plain"], checked=False)
                                      and _same_bits(outs["checked"], outs["base_checked"], checked=True))
    for key, t in ms.items():
        row[f"{key}_tflops"] = flop / t / 1e9
    row["checked_vs_cublas"] = row["checked_tflops"] / row["cublas_tflops"]
    row["checksum_overhead"] = row["plain_tflops"] / row["checked_tflops"] - 1.0
    if baseline is not None:
        row["base_checked_vs_cublas"] = row["base_checked_tflops"] / row["cublas_tflops"]
        row["base_checksum_overhead"] = row["base_plain_tflops"] / row["base_checked_tflops"] - 1.0
    return row


def _variant_launches(dev, variants: dict[str, tuple[str, dict]], sets, layout: Layout,
                      ctas: int | None = None, extend=None) -> dict[str, list]:
    """One prepared launch per input set for each wgmma variant ``name: (variant, extra -D defines)``.
    ``ctas`` caps the persistent grid: the same tiles walked by fewer SMs, so the card runs below
    its power cap and a cost that stays is time (issue, latency), not energy. ``extend(defines,
    launch, operands)``: appends the arguments an experiment build takes beyond the kernel's own."""
    from aegis_cli.backends import cuda

    out = {}
    try:
        for name, (variant, defines) in variants.items():
            cuda.WGMMA_DEFINES.clear()
            cuda.WGMMA_DEFINES.update(defines)
            out[name] = [dev.prepare(a, b, layout, variant=variant) for a, b in sets]
            for launch, (a, b) in zip(out[name], sets, strict=True) if extend else ():
                extend(defines, launch, GemmOperands(a, b, layout))
            for launch in out[name] if ctas else ():
                launch.grid = (min(ctas, launch.grid[0]), 1)
    finally:
        cuda.WGMMA_DEFINES.clear()
    return out


def compare(variants: dict[str, tuple[str, dict]], sizes, reps: int = 12, layout: Layout = Layout.FWD,
            ctas: int | None = None, extend=None) -> list[dict]:
    """Interleaved timing of wgmma-kernel variants, each ``name: (variant, extra -D defines)``, plus
    cuBLAS, on each (m, n, k) of ``sizes``; costs are relative to the first variant. Variants of
    the same build that should compute the same bits (no ``AEGIS_NO_*`` knob) are also checked
    bit for bit against the first of them: C, and the sums of checked builds."""
    from aegis_cli.backends import cuda

    dev = cuda.CudaDevice(0, kernel="wgmma")
    first = next(iter(variants))
    rows = []
    for m, n, k in sizes:
        sets = _input_sets(dev, layout, m, n, k, 300)
        # cuBLAS runs on every SM: beside a capped grid it would set the power state for both
        fns = {} if ctas else {"cublas": lambda i, sets=sets: _torch_matmul(*sets[i % N_SETS], layout)}
        launches = _variant_launches(dev, variants, sets, layout, ctas, extend)
        fns.update({name: (lambda i, ls=ls: ls[i % N_SETS].run()) for name, ls in launches.items()})
        outputs = {name: (variant, launches[name][0].outputs)  # of input set 0
                   for name, (variant, defines) in variants.items() if not any(d.startswith("AEGIS_NO_") for d in defines)}
        ms = _time(fns, reps)
        row = {"m": m, "n": n, "k": k, "layout": layout.value, "ctas": ctas, **{f"{v}_tflops": 2.0 * m * n * k / t / 1e9 for v, t in ms.items()}}
        row.update({f"{v}_cost": ms[v] / ms[first] - 1.0 for v in variants if v != first})
        refs: dict[str, tuple] = {}
        for name, (variant, outs) in outputs.items():
            same = _same_bits(outs, refs.setdefault(variant, outs), checked=variant == "")
            row[f"{name}_bitwise"] = same
            if not same:
                print(f"  {name}: NOT bit-identical to the first {variant or 'checked'} variant", flush=True)
        print(f"{layout.value} {m}x{n}x{k}: " + "  ".join(f"{v} {row[f'{v}_tflops']:.1f}" for v in fns) + "  TF;  vs "
              + first + ": " + "  ".join(f"{v} {row[f'{v}_cost']:+.1%}" for v in variants if v != first), flush=True)
        rows.append(row)
    return rows


def clocks_under_load(variants: dict[str, tuple[str, dict]], size, seconds: float = 2.0, rounds: int = 3,
                      layout: Layout = Layout.FWD, ctas: int | None = None) -> list[dict]:
    """Sustained runs of each variant: ``seconds`` of back-to-back launches (the launch queue
    fills, so the GPU paces the host), variants alternating for ``rounds``, with the SM clock
    and board power sampled through NVML meanwhile. Tells a power-capped card (the clock drops
    under extra work) from one limited by issue or latency (the clock holds)."""
    import pynvml

    from aegis_cli.backends import cuda

    pynvml.nvmlInit()
    h = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
    dev = cuda.CudaDevice(0, kernel="wgmma")
    m, n, k = size
    sets = _input_sets(dev, layout, m, n, k, 500)
    fns = {"cublas": lambda i: _torch_matmul(*sets[i % N_SETS], layout)}
    fns.update({name: (lambda i, ls=ls: ls[i % N_SETS].run()) for name, ls in _variant_launches(dev, variants, sets, layout, ctas).items()})
    samples: dict[str, dict[str, list[float]]] = {v: {"mhz": [], "w": [], "tflops": []} for v in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            for i in range(4):
                fn(i)
            torch.cuda.synchronize()
            done, t0 = 0, time.perf_counter()
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            e0 = None
            while time.perf_counter() - t0 < seconds:
                for j in range(8):
                    fn(done + j)
                done += 8
                if done > 16:  # sample only after the queue holds work, mid-run
                    if e0 is None:  # board energy (mJ) from here to the last sample: the mean power
                        e0, te0 = pynvml.nvmlDeviceGetTotalEnergyConsumption(h), time.perf_counter()
                    samples[name]["mhz"].append(pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM))
            if e0 is not None:
                de, dt = pynvml.nvmlDeviceGetTotalEnergyConsumption(h) - e0, time.perf_counter() - te0
                if dt > 0.2:
                    samples[name]["w"].append(de / 1000.0 / dt)
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            end.synchronize()
            samples[name]["tflops"].append(2.0 * m * n * k * done / (start.elapsed_time(end) * 1e9))
    rows = []
    for name, s in samples.items():
        # the clock is sampled in 15 MHz steps that it dithers between at the cap: the mean over
        # hundreds of samples resolves it finer than the median, which snaps to one step
        row = {"variant": name, "layout": layout.value, "m": m, "n": n, "k": k, "ctas": ctas, "sm_mhz": statistics.fmean(s["mhz"]),
               "clock_samples": len(s["mhz"]), "power_w": statistics.fmean(s["w"]) if s["w"] else float("nan"),
               "tflops": statistics.median(s["tflops"]), "tflops_rounds": [round(x, 1) for x in s["tflops"]]}
        row["tflop_per_ghz"] = row["tflops"] / (row["sm_mhz"] / 1000.0)
        rows.append(row)
        print(f"{name:<10} {layout.value:<6} {m}x{n}x{k}: {row['tflops']:6.1f} TF at {row['sm_mhz']:.1f} MHz "
              f"({row['clock_samples']} samples), {row['power_w']:.1f} W "
              f"({row['tflop_per_ghz']:.1f} TF per GHz); rounds {row['tflops_rounds']}", flush=True)
    return rows


def sustained(rounds: int = 2, only: tuple[tuple[str, str], ...] | None = None) -> list[dict]:
    """Every shape of ``shapes()`` (or the (name, layout) pairs in ``only``) under sustained load
    (clocks_under_load): cuBLAS, plain and checked, 2 s each per round. At the power cap the
    checksum work lowers the clock; interleaved short bursts (``run``) share that clock between
    the variants and so do not charge it to the checked kernel."""
    out = []
    for name, layout, m, n, k in shapes():
        if only is not None and (name, layout.value) not in only:
            continue
        rows = {r["variant"]: r for r in clocks_under_load({"plain": ("nosums", {}), "checked": ("", {})}, (m, n, k),
                                                             rounds=rounds, layout=layout)}
        row = {"name": name, "layout": layout.value, "m": m, "n": n, "k": k,
               **{f"{v}_{key}": rows[v][key] for v in rows for key in ("tflops", "sm_mhz", "power_w")}}
        row["checked_vs_cublas"] = row["checked_tflops"] / row["cublas_tflops"]
        row["checksum_overhead"] = row["plain_tflops"] / row["checked_tflops"] - 1.0
        print(f"SUSTAINED {name:<24} {layout.value:<6} {m:>5}x{n:>5}x{k:>5}  cuBLAS {row['cublas_tflops']:6.1f}  plain "
              f"{row['plain_tflops']:6.1f}  checked {row['checked_tflops']:6.1f}  ratio {row['checked_vs_cublas']:.3f}  "
              f"checksum cost {100 * row['checksum_overhead']:+.1f}%", flush=True)
        out.append(row)
    return out


def epilogue_split(reps: int = 12) -> list[dict]:
    """Where the checksum epilogue's time goes (wgmma kernel): no sums, row sums only, column
    sums only, both — interleaved, on a long-K and a short-K shape."""
    variants = {"none": ("nosums", {}), "rows": ("", {"AEGIS_NO_COLSUMS": 1}), "cols": ("", {"AEGIS_NO_ROWSUMS": 1}),
                "both": ("", {})}
    return compare(variants, ((8192, 8192, 8192), (8192, 8192, 1024)), reps)


def parse_defines(items) -> dict[str, object]:
    """``NAME`` or ``NAME=VALUE`` items as -D defines (a bare name is defined as 1)."""
    return {d.partition("=")[0]: d.partition("=")[2] or 1 for d in items if d}


def _parse_variant(spec: str) -> tuple[str, tuple[str, dict]]:
    """``name=variant[+DEFINE[=VALUE]...]``, e.g. ``plain=nosums`` or ``nostore=+AEGIS_NO_CSTORE``."""
    name, _, rest = spec.partition("=")
    variant, *defines = rest.split("+")
    return name, (variant, parse_defines(defines))


def shapes() -> list[tuple[str, Layout, int, int, int]]:
    out = [("square-8192", lay, 8192, 8192, 8192) for lay in Layout]
    for g in workloads.load("llama3-70b").gemms():
        out.append((f"llama3-70b/{g.op}", g.layout, g.m, g.n, g.k))
    return out


def run(reps: int = 12, kernel: str | None = None, only_square: bool = False, baseline: str | None = None) -> list[dict]:
    from aegis_cli.backends.cuda import CudaDevice

    dev = CudaDevice(0, kernel=kernel)
    rows = []
    for name, layout, m, n, k in shapes():
        if only_square and not name.startswith("square"):
            continue
        rows.append(bench_shape(dev, name, layout, m, n, k, reps, kernel, baseline))
        print(format_row(rows[-1]), flush=True)
    return rows


def format_row(r: dict) -> str:
    return (f"{r['name']:<24} {r['layout']:<6} {r['m']:>5}x{r['n']:>5}x{r['k']:>5}  cuBLAS {r['cublas_tflops']:7.1f}  "
            f"{r['kernel']} plain {r['plain_tflops']:7.1f}  checked {r['checked_tflops']:7.1f}  "
            f"ratio {r['checked_vs_cublas']:.3f}  checksum cost {100 * r['checksum_overhead']:+.1f}%  "
            f"SM {r.get('sm_mhz', '?')} MHz {r.get('power_w', 0):.0f} W"
            + (f"  | baseline plain {r['base_plain_tflops']:7.1f}  checked {r['base_checked_tflops']:7.1f}  "
               f"ratio {r['base_checked_vs_cublas']:.3f}  checksum cost {100 * r['base_checksum_overhead']:+.1f}%"
               f"  bitwise {'same' if r['bitwise_vs_baseline'] else 'DIFFERENT'}"
               if "base_plain_tflops" in r else ""))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write rows here")
    ap.add_argument("--reps", type=int, default=12)
    ap.add_argument("--kernel", choices=["wgmma", "mma"], default=None)
    ap.add_argument("--square", action="store_true", help="8192³ only")
    ap.add_argument("--baseline", help="another gemm_wgmma.cu to time beside the current one (A/B)")
    ap.add_argument("--repeat-square", action="store_true", help="time the 8192³ shapes again at the end (noise floor)")
    ap.add_argument("--compare", nargs="+", metavar="NAME=VARIANT[+DEFINE...]",
                    help="time these wgmma variants against each other instead (e.g. plain=nosums checked=)")
    ap.add_argument("--size", nargs=3, type=int, action="append", metavar=("M", "N", "K"), help="shapes for --compare")
    ap.add_argument("--layout", choices=[lay.value for lay in Layout], default="fwd", help="layout for --compare")
    ap.add_argument("--rounds", type=int, default=3, help="with --clocks: alternating rounds of 2 s per variant")
    ap.add_argument("--sustained", action="store_true",
                    help="every shape under sustained load (2 s per variant, 2 rounds) instead of interleaved bursts")
    ap.add_argument("--ctas", type=int, default=None,
                    help="with --compare: run the wgmma variants on at most this many SMs (below the power cap)")
    ap.add_argument("--clocks", action="store_true",
                    help="with --compare: sustained runs sampling SM clock and power instead of timed bursts")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 3
    sizes = args.size or [(8192, 8192, 8192)]
    if args.sustained:
        rows = sustained()
    elif args.compare and args.clocks:
        variants = dict(map(_parse_variant, args.compare))
        rows = [r for size in sizes for r in clocks_under_load(variants, size, rounds=args.rounds, layout=Layout(args.layout),
                                                                ctas=args.ctas)]
    elif args.compare:
        rows = compare(dict(map(_parse_variant, args.compare)), sizes, args.reps, Layout(args.layout), args.ctas)
    else:
        rows = run(args.reps, args.kernel, args.square, args.baseline)
        if args.repeat_square:
            rows += [dict(r, name=r["name"] + "(repeat)") for r in run(args.reps, args.kernel, True, args.baseline)]
    write_rows(args.json, rows)
    return 0


def write_rows(path: str | None, rows: list[dict]) -> None:
    """The benchmark rows as JSON at ``path`` (nothing without one), with the device name."""
    if path:
        with open(path, "w", encoding="utf-8") as fh:
            json.dump({"device": torch.cuda.get_device_name(0), "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    sys.exit(main())
