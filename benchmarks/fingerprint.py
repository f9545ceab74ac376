"""Fingerprint throughput on a GPU: bytes of tensor read per second (kernels/fingerprint.cu).

    python3 benchmarks/fingerprint.py [--gib 4] [--out DIR]

Times, with CUDA events (median of --iters after warm-up, rotating among three buffers
much larger than L2):
  fingerprint      gpu_fingerprint(t): block kernel + final sum, per dtype
  blocks           gpu_block_tensor(t, 4096): per-block fingerprints (localisation)
  unroll=N         the block kernel alone, built with FP_UNROLL=N (tuning)
  xor_sum          a plain XOR-sum reduction through CuPy (the AEGIS-style baseline)
  copy             a device-to-device copy (bytes read + written), the bandwidth ceiling
and checks the GPU value against the CPU implementation on a slice of each dtype.
Writes fingerprint_bench.json under --out and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from aegis_cli.backends.fingerprint_cuda import gpu_block_tensor, gpu_fingerprint
from aegis_cli.backends.loader import get_module, source_hash
from aegis_cli.ops import fingerprint

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp64": torch.float64,
          "int8": torch.int8, "uint8": torch.uint8, "int32": torch.int32}


def timed(fn, iters: int, warmup: int = 3) -> float:
    """Median seconds of fn() over iters, with CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    return statistics.median(times)


def random_buffers(nbytes: int, n: int) -> list[torch.Tensor]:
    g = torch.Generator(device="cuda")
    g.manual_seed(1234)
    return [torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda", generator=g) for _ in range(n)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=4.0)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    nbytes = int(args.gib * 2**30) // 4096 * 4096
    bufs = random_buffers(nbytes, 3)
    props = torch.cuda.get_device_properties(0)
    res: dict = {"gpu": props.name, "sms": props.multi_processor_count, "bytes": nbytes, "torch": torch.__version__,
                 "kernel_sha": source_hash("fingerprint.cu")[:16], "date": time.strftime("%Y-%m-%d"), "rows": []}
    rot = {"i": 0}

    def next_buf() -> torch.Tensor:
        rot["i"] = (rot["i"] + 1) % len(bufs)
        return bufs[rot["i"]]

    Path(args.out).mkdir(parents=True, exist_ok=True)
    print(f"{res['gpu']} ({res['sms']} SMs), {nbytes / 2**30:.2f} GiB per tensor, kernel {res['kernel_sha']}", flush=True)

    def row(name: str, sec: float, moved: int) -> None:
        r = {"case": name, "ms": round(sec * 1e3, 4), "tb_per_s": round(moved / sec / 1e12, 3)}
        res["rows"].append(r)
        print(f"  {r['case']:<40} {r['ms']:>9.3f} ms  {r['tb_per_s']:>6.3f} TB/s", flush=True)
        (Path(args.out) / "fingerprint_bench.json").write_text(json.dumps(res, indent=1))

    for name, dt in DTYPES.items():
        views = [b.view(dt) for b in bufs]
        k = {"i": 0}

        def fp(views=views, k=k):
            k["i"] = (k["i"] + 1) % 3
            gpu_fingerprint(views[k["i"]])

        row(f"fingerprint {name}", timed(fp, args.iters), nbytes)
        # correctness on a slice (the CPU implementation is slow on GiBs)
        sl = views[0][: (64 << 20) // views[0].element_size() + 3]
        assert gpu_fingerprint(sl) == fingerprint.fingerprint(sl), f"GPU and CPU fingerprints differ for {name}"
    row("blocks bf16 (4096 elements)", timed(lambda: gpu_block_tensor(next_buf().view(torch.bfloat16), 4096), args.iters), nbytes)

    import cupy

    out = torch.empty(nbytes // 8 // 16384 + 1, dtype=torch.int64, device="cuda")
    for unroll in (1, 2, 4, 8):
        fn = get_module("fingerprint.cu", defines={"FP_UNROLL": unroll}).get_function("aegis_fp_blocks")
        nblocks = -(-nbytes // 8 // 16384)

        def launch(fn=fn, nblocks=nblocks):
            b = next_buf()
            fn((nblocks,), (256,), (np.uint64(b.data_ptr()), np.int64(nbytes), np.int64(16384), np.uint64(out.data_ptr()),
                                    np.int64(nblocks)))  # legacy default stream, as torch's events

        row(f"block kernel unroll={unroll}", timed(launch, args.iters), nbytes)
    cviews = [cupy.asarray(b).view(cupy.uint64) for b in bufs]
    xor_kernel = cupy.ReductionKernel("uint64 x", "uint64 y", "x", "a ^ b", "y = a", "0", "aegis_bench_xor_sum")
    xk = {"i": 0}

    def xor_sum() -> None:
        xk["i"] = (xk["i"] + 1) % 3
        xor_kernel(cviews[xk["i"]])

    row("xor_sum (CuPy ReductionKernel)", timed(xor_sum, args.iters), nbytes)
    dst = torch.empty_like(bufs[0])
    row("copy (read + write)", timed(lambda: dst.copy_(next_buf()), args.iters), 2 * nbytes)


if __name__ == "__main__":
    main()
