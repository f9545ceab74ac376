"""Cost of one sensor check (sense.enqueue) on the GPU, per GEMM of the benchmark model, and of its parts.

    PYTHONPATH=. python3 benchmarks/sensor_reference.py [--reps 10] [--profile mlp.fc/wgrad] [--out DIR]

The Linears of the 1.18B GPT of benchmarks/sensors_overhead.py (dim 2048, MLP 8192, vocabulary
32768, 8,192 tokens a step), each as forward, dgrad and wgrad, with operands stored as training
stores them (seeded: activations ~N(0,1), weights ~N(0,0.02²), gradients ~N(0,10⁻⁶)). Times, by
CUDA events queued behind a GPU sleep (the GPU's work alone; median of --reps after a warm-up),
the whole comparison of a sampled launch with the torch reference (``lean.lean_side``) and
with the device's (``Device.lean_side``, the kernel on CUDA; also from an idle GPU, the host's
launch gaps counted; and the host's own time in it while the GPU is busy), and its parts: the
reference alone, and the σ and normalised differences by the torch path (``sense.sigma_of``,
``normalised_diff``) given the references and Σ|c| (on CUDA the sensors run them as one kernel:
benchmarks/sensors_profile.py times both); the checked GEMM for scale.
Checks the kernel against the torch reference (|Δ sums| in units of σ, s and ρ relative) and its
repeatability, and lists the top kernels by CUDA time (torch.profiler) of one check each way.
Also times the kernel's sides alone (``cuda_reference.lean_side`` of each side the check computes:
statistics, products, reduction), their rate in fp64 multiply-adds per second, and the same in
other builds of the kernel (``--builds``, e.g. SR_KM_PACK=0: the k-major stage of 8-byte copies
and 2-byte reads; SR_MMA_K=4: the products on m16n8k4; WAVE_SMS=512: the splits of four waves);
and the statistics alone (the right operand of each side, ``tile_stats``, and Σ|c|,
``tile_abs_sums``, where the check reads it) with the bytes they move a second.
Writes DIR/sensor_reference.json (DIR: --out, else $OUT, else .) and prints a table last.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from aegis_cli.backends import cuda_reference
from aegis_cli.backends.cuda import CudaDevice
from aegis_cli.ops import lean
from aegis_cli.ops.gemm import GemmOperands, Layout
from aegis_cli.sensors import sense

TOKENS, DIM, VOCAB, LAYERS = 8192, 2048, 32768, 22
LINEARS = {"attn.qkv": (DIM, 3 * DIM), "attn.proj": (DIM, DIM), "mlp.fc": (DIM, 4 * DIM), "mlp.proj": (4 * DIM, DIM),
           "head": (DIM, VOCAB)}


def per_step(name: str) -> int:
    """Launches a step of one layout of Linear ``name``: each block's once a layer, the head's once."""
    return 1 if name == "head" else LAYERS


def operands(name: str, layout: Layout, dev: str, seed: int) -> GemmOperands:
    fin, fout = LINEARS[name]
    g = torch.Generator(device=dev).manual_seed(seed)
    x = torch.randn((TOKENS, fin), generator=g, device=dev).to(torch.bfloat16)
    w = (torch.randn((fout, fin), generator=g, device=dev) * 0.02).to(torch.bfloat16)
    dy = (torch.randn((TOKENS, fout), generator=g, device=dev) * 1e-3).to(torch.bfloat16)
    if layout is Layout.FWD:
        return GemmOperands(x, w, layout)  # Y = X·Wᵀ
    if layout is Layout.DGRAD:
        return GemmOperands(dy, w, layout)  # dX = dY·W
    return GemmOperands(dy, x, layout)  # dW = dYᵀ·X


BUSY_CYCLES = 20_000_000  # ~10 ms of GPU sleep ahead of the timed work: the host enqueues it all meanwhile


def timed(fn, reps: int, busy: bool = True) -> float:
    """Median ms of ``fn`` by CUDA events on the current stream, after one warm-up call. ``busy``:
    behind a GPU sleep, so the events time the GPU's work alone, as in a training step whose host
    runs ahead of the GPU; else from an idle GPU (the host's launch gaps counted too)."""
    fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if busy:
            torch.cuda._sleep(BUSY_CYCLES)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def host_timed(fn, reps: int) -> float:
    """Median ms the host spends in ``fn`` while the GPU is busy (behind a GPU sleep): the launches'
    Python and driver time alone, which a step pays where its host, not its GPU, is behind."""
    fn()
    times = []
    for _ in range(reps):
        torch.cuda._sleep(BUSY_CYCLES)
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
        torch.cuda.synchronize()
    return statistics.median(times)


def agreement(ops, res, noise, dev) -> dict:
    """The kernel's reference against torch's: sums in σ, s and ρ relative; two runs' bits; and how
    far s's stage bound moved σ (forward, dgrad) from the σ of the exact s."""
    both = ops.layout is Layout.WGRAD
    want = lean.lean_reference(ops, res.tile, noise, cols=both)
    got = lean.lean_reference(ops, res.tile, noise, cols=both, side=dev.lean_side)
    again = lean.lean_reference(ops, res.tile, noise, cols=both, side=dev.lean_side)
    pairs = [(got.row, want.row, want.row_noise, got.row_scale, want.row_scale, got.row_noise)]
    if both:
        pairs.append((got.col, want.col, want.col_noise, got.col_scale, want.col_scale, got.col_noise))
    out = {"sum_sigma": 0.0, "s_rel": 0.0, "sigma_rel": 0.0}
    for g, w, sig, gs, ws, gn in pairs:
        out["sum_sigma"] = max(out["sum_sigma"], float(((g - w).abs() / sig).max()))
        out["s_rel"] = max(out["s_rel"], float(((gs - ws).abs() / ws).max()))
        out["sigma_rel"] = max(out["sigma_rel"], float(((gn - sig).abs() / sig).max()))
    out["cap_moved"] = 0.0  # forward, dgrad: the most σ from the stage bound exceeds σ from the exact s (torch), relative
    if not both:
        _, bound, rho = lean.lean_side(ops.a_mk, ops.b_kn, res.tile[1])
        exact = lean.lean_side(ops.a_mk, ops.b_kn, res.tile[1], rho=False)[1]
        k = ops.mnk[2]
        out["cap_moved"] = float((noise.scale(rho, bound, k) / noise.scale(rho, exact, k)).max() - 1.0)
    out["repeats"] = all(torch.equal(a, b) for a, b in ((got.row, again.row), (got.row_scale, again.row_scale),
                                                        (got.row_noise, again.row_noise), (got.col, again.col)))
    return out


def build_name(build: str) -> str:
    return build.replace("=", "").replace(",", "_").lower()


HOST_KNOBS = ("WAVE_SMS",)  # cuda_reference's own constants (the split count's rule), not kernel defines


@contextlib.contextmanager
def built(build: str):
    """The kernel as ``build`` makes it, NAME=VALUE[,NAME=VALUE]: kernel defines, or
    cuda_reference's HOST_KNOBS; everything restored after."""
    saved = {name: getattr(cuda_reference, name) for name in HOST_KNOBS}
    try:
        for item in build.split(","):
            name, value = item.split("=")
            if name in HOST_KNOBS:
                setattr(cuda_reference, name, int(value))
            else:
                cuda_reference.DEFINES[name] = int(value)
        yield
    finally:
        cuda_reference.DEFINES.clear()
        for name, value in saved.items():
            setattr(cuda_reference, name, value)


def sides_alone(ops, tile, rho: bool, reps: int, builds: list[str]) -> dict:
    """The kernel's sides of one check alone (rows; wgrad also columns): ms of the default build
    and of each of ``builds`` (NAME=VALUE defines), and the default's rate in fp64 multiply-adds per second."""
    sides = [(ops.a_mk, ops.b_kn, tile[1])]
    if ops.layout is Layout.WGRAD:
        sides.append((ops.b_kn.t(), ops.a_mk.t(), tile[0]))

    def fn():
        for left, right, t in sides:
            cuda_reference.lean_side(left, right, t, rho)

    out = {"sides_ms": timed(fn, reps)}
    for build in builds:
        with built(build):
            out[f"sides_{build_name(build)}_ms"] = timed(fn, reps)
    fma = sum((3 if rho else 2) * left.shape[0] * left.shape[1] * -(-right.shape[1] // t) for left, right, t in sides)
    out["sides_tfma"] = fma / out["sides_ms"] / 1e9
    return out


def stats_alone(ops, res, reps: int) -> dict:
    """The statistics of one check alone: those of the right operand of each side (rows; wgrad also
    columns) and Σ|c| (forward and dgrad: wgrad's σ follows s): ms, and TB/s of bf16 read plus fp64 written."""
    tm, tn = res.tile
    wgrad = ops.layout is Layout.WGRAD
    stats = [(ops.b_kn, tn)] + ([(ops.a_mk.t(), tm)] if wgrad else [])
    abs_c = [] if wgrad else [(res.c, tn)]

    def fn():
        for x, t in stats:
            cuda_reference.tile_stats(x, t)
        for x, t in abs_c:
            cuda_reference.tile_abs_sums(x, t)

    nbytes = sum(2 * x.numel() + 8 * w * x.shape[0] * -(-x.shape[1] // t) for w, group in ((3, stats), (1, abs_c))
                 for x, t in group)
    ms = timed(fn, reps)
    return {"stats_ms": ms, "stats_tbs": nbytes / ms / 1e9}


def top_kernels(fn, n: int = 8) -> list[dict]:
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    rows = [e for e in prof.key_averages() if getattr(e, "device_time_total", 0) > 0 and e.device_type.name == "CUDA"]
    rows.sort(key=lambda e: -e.device_time_total)
    return [{"kernel": e.key[:90], "calls": e.count, "ms": round(e.device_time_total / 1e3, 4)} for e in rows[:n]]


def run(args) -> dict:
    dev = CudaDevice(0)
    cuda = "cuda:0"
    out: dict = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "builds": args.builds, "shapes": []}
    for name in LINEARS:
        for layout in Layout:
            ops = operands(name, layout, cuda, 7)
            m, n, k = ops.mnk
            res = sense.launch(dev, ops, None, "train/bench")
            noise, trunc = dev.noise_model(k), dev.accumulation_bound(k) > 0
            both = layout is Layout.WGRAD
            ref_noise = None if both and trunc else noise  # as sense.enqueue: wgrad's σ follows s, no ρ
            ref = lean.lean_reference(ops, res.tile, ref_noise, cols=both, side=dev.lean_side)

            sides, sig = sense._sides(ops, res, trunc, dev), sense.Sigma.of(noise, k)

            def rest(sides=sides, sig=sig):  # σ and differences by the torch path, given the references and Σ|c|
                return sense.compare_torch(sides, sig)

            row = {"op": f"{name}/{layout.value}", "mnk": [m, n, k],
                   "gemm_ms": timed(lambda ops=ops: sense.launch(dev, ops, None, "train/bench"), args.reps),
                   "enqueue_torch_ms": timed(lambda ops=ops, res=res, noise=noise, trunc=trunc: sense.enqueue(ops, res, noise, trunc),
                                             args.reps),
                   "enqueue_kernel_ms": timed(lambda ops=ops, res=res, noise=noise, trunc=trunc:
                                              sense.enqueue(ops, res, noise, trunc, dev), args.reps),
                   "ref_torch_ms": timed(lambda ops=ops, res=res, noise=ref_noise, both=both:
                                         lean.lean_reference(ops, res.tile, noise, cols=both), args.reps),
                   "ref_kernel_ms": timed(lambda ops=ops, res=res, noise=ref_noise, both=both:
                                          lean.lean_reference(ops, res.tile, noise, cols=both,
                                                                       side=dev.lean_side), args.reps),
                   "noise_diff_ms": timed(rest, args.reps),
                   "enqueue_host_ms": host_timed(lambda ops=ops, res=res, noise=noise, trunc=trunc:
                                                 sense.enqueue(ops, res, noise, trunc, dev), args.reps),
                   "enqueue_kernel_idle_ms": timed(lambda ops=ops, res=res, noise=noise, trunc=trunc:
                                                   sense.enqueue(ops, res, noise, trunc, dev), args.reps, busy=False),
                   **agreement(ops, res, noise, dev),
                   **sides_alone(ops, res.tile, ref_noise is not None, args.reps, args.builds),
                   **stats_alone(ops, res, args.reps)}
            if row["op"] in args.profile:
                row["profile_torch"] = top_kernels(lambda ops=ops, res=res, noise=noise, trunc=trunc: sense.enqueue(ops, res, noise, trunc))
                row["profile_kernel"] = top_kernels(lambda ops=ops, res=res, noise=noise, trunc=trunc:
                                                    sense.enqueue(ops, res, noise, trunc, dev))
            out["shapes"].append(row)
            print(json.dumps({k: v for k, v in row.items() if not k.startswith("profile")}), flush=True)
            del ops, res, ref
            torch.cuda.empty_cache()
    # the coverage floor checks every operator equally often: weighted as the model has them
    weights = [per_step(r["op"].split("/")[0]) for r in out["shapes"]]
    for key in ("enqueue_torch_ms", "enqueue_kernel_ms", "enqueue_kernel_idle_ms", "enqueue_host_ms", "ref_kernel_ms", "sides_ms",
                "stats_ms",
                *(f"sides_{build_name(b)}_ms" for b in args.builds)):
        out[f"per_check_{key}"] = sum(w * r[key] for w, r in zip(weights, out["shapes"], strict=True)) / sum(weights)
    return out


def table(out: dict) -> str:
    lines = [f"{out['gpu']}, torch {out['torch']}: one check (sense.enqueue), ms by CUDA events",
             f"{'op':<18} {'M×N×K':>19} {'gemm':>7} {'torch':>7} {'kernel':>7} {'idle':>7} {'ref t':>7} {'ref k':>7} {'σ,diff':>7}"
             f" {'Δ/σ':>8} {'s rel':>8} {'σ rel':>8} {'σ cap':>8} rep {'sides':>7} {'TFMA/s':>6}"
             + "".join(f" {'b' + str(i + 1):>7}" for i in range(len(out["builds"]))) + f" {'stats':>7} {'TB/s':>5}"]
    for r in out["shapes"]:
        lines.append(f"{r['op']:<18} {'×'.join(map(str, r['mnk'])):>19} {r['gemm_ms']:7.3f} {r['enqueue_torch_ms']:7.3f} "
                     f"{r['enqueue_kernel_ms']:7.3f} {r['enqueue_kernel_idle_ms']:7.3f} {r['ref_torch_ms']:7.3f} "
                     f"{r['ref_kernel_ms']:7.3f} {r['noise_diff_ms']:7.3f} "
                     f"{r['sum_sigma']:8.1e} {r['s_rel']:8.1e} {r['sigma_rel']:8.1e} {r['cap_moved']:8.1e} "
                     f"{'yes' if r['repeats'] else 'NO ':<3} "
                     f"{r['sides_ms']:7.3f} {r['sides_tfma']:6.1f}"
                     + "".join(f" {r[f'sides_{build_name(b)}_ms']:7.3f}" for b in out["builds"])
                     + f" {r['stats_ms']:7.3f} {r['stats_tbs']:5.2f}")
    lines += [f"b{i + 1}: built with {b}" for i, b in enumerate(out["builds"])]
    lines.append(f"per check at the coverage floor (operators weighted as the model has them), GPU time: torch "
                 f"{out['per_check_enqueue_torch_ms']:.3f} ms, kernel {out['per_check_enqueue_kernel_ms']:.3f} ms "
                 f"(kernel from an idle GPU, host gaps included: {out['per_check_enqueue_kernel_idle_ms']:.3f} ms; "
                 f"the host's time in it with the GPU busy: {out['per_check_enqueue_host_ms']:.3f} ms); "
                 f"its reference {out['per_check_ref_kernel_ms']:.3f} ms, its sides alone {out['per_check_sides_ms']:.3f} ms"
                 + "".join(f", built with {b} {out[f'per_check_sides_{build_name(b)}_ms']:.3f} ms" for b in out["builds"])
                 + f"; its statistics alone {out['per_check_stats_ms']:.3f} ms")
    profiles = [f"  {r['op']} {key[8:]:<6} {p['ms']:8.4f} ms  {p['calls']:>3}×  {p['kernel']}"
                for r in out["shapes"] for key in ("profile_torch", "profile_kernel") for p in r.get(key, [])]
    return "\n".join(profiles + lines)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--profile", nargs="*", default=["mlp.fc/wgrad", "head/fwd", "head/wgrad"], help="ops whose top kernels to list")
    p.add_argument("--out", default=os.environ.get("OUT") or ".")
    p.add_argument("--builds", nargs="*", default=["SR_KM_PACK=0"],
                   help="other builds of the kernel to time the sides in, NAME=VALUE[,NAME=VALUE]: kernel defines (SR_KM_PACK=0, "
                        "SR_CTAS=3) or cuda_reference's WAVE_SMS (the split count's rule)")
    args = p.parse_args(argv)
    out = run(args)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "sensor_reference.json").write_text(json.dumps(out, indent=1))
    print(table(out))
    return out


if __name__ == "__main__":
    main()
