"""Benchmark: write, read and replay a bundle of many small vTasks on the CPU.

    python benchmarks/replay.py [--n 1000] [--mnk 64,64,64] [--repeat 3]

Prints one JSON line (figures recorded in benchmarks/RESULTS.md).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time

import torch

from aegis_cli.ops import numerics
from aegis_cli.ops.gemm import GemmOperands, Layout
from aegis_cli.vtask.bundle import BundleWriter, read_bundle
from aegis_cli.vtask.model import GemmSpec, VTask
from aegis_cli.vtask.replay import DEFAULT_SCALES, ReplayOptions, run_replay


def small_vtask(i: int, m: int, n: int, k: int) -> VTask:
    layout = list(Layout)[i % 3]
    spec = GemmSpec(layout=layout, m=m, n=n, k=k, tile=(128, 128))
    a = numerics.generate_bf16(layout.a_stored_shape(m, k), "normal", 2 * i, "cpu")
    b = numerics.generate_bf16(layout.b_stored_shape(k, n), "normal", 2 * i + 1, "cpu")
    ops = GemmOperands(a, b, layout)
    acc = ops.a_mk.float() @ ops.b_kn.float()
    tensors = {"a": a, "b": b, "c": acc.to(torch.bfloat16), "row_sums": numerics.sum_col_tiles(acc.double(), 128).float(),
               "col_sums": numerics.sum_row_tiles(acc.double(), 128).float()}
    return VTask(id=f"bench/{i}", check="gemm.row_checksum", op="bench", gemm=spec, tensors=tensors, tau=5e-7,
                 case_id=f"bench/op{i}/{layout.value}/normal/{m}x{n}x{k}/s+0+0", seed=i, dist="normal",
                 provenance={"host": "bench", "gpu_uuid": "GPU-bench"})


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=1000)
    ap.add_argument("--mnk", default="64,64,64")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    m, n, k = (int(x) for x in args.mnk.split(","))
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "bench.aegis")
        vts = [small_vtask(i, m, n, k) for i in range(args.n)]
        t0 = time.perf_counter()
        with BundleWriter(path) as w:
            for vt in vts:
                w.add(vt)
        t_write = time.perf_counter() - t0
        t0 = time.perf_counter()
        b = read_bundle(path)
        t_read = time.perf_counter() - t0
        assert len(b.vtasks) == args.n
        t0 = time.perf_counter()
        rep = run_replay(ReplayOptions(bundles=[path], devices="cpu", repeat=args.repeat, scales=DEFAULT_SCALES))
        t_replay = time.perf_counter() - t0
        r = rep.devices[0].probe_stats["replay"]
        print(json.dumps({"vtasks": args.n, "mnk": [m, n, k], "repeat": args.repeat, "scales": len(DEFAULT_SCALES),
                          "gemms": rep.devices[0].stats.gemms, "bundle_bytes": os.path.getsize(path),
                          "write_s": round(t_write, 2), "read_s": round(t_read, 2), "replay_s": round(t_replay, 2),
                          "not_reproduced": r["not_reproduced"], "exit_code": rep.exit_code,
                          "threads": torch.get_num_threads(), "cpu": platform.processor() or platform.machine()}))


if __name__ == "__main__":
    main()
