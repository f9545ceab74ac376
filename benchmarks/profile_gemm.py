"""A few launches of one checked GEMM, for a profiler to attach to (Nsight Compute, Nsight Systems):

    ncu --set full -k regex:gemm_wgmma --launch-skip 2 --launch-count 1 \\
        python3 benchmarks/profile_gemm.py 8192 8192 3584 [--layout fwd] [--variant nosums] [--define AEGIS_NO_CSTORE]

Inputs are seeded random bf16 (zeros run faster than real data); the launches are the same
objects the scan and gemm.py time.
"""

from __future__ import annotations

import argparse
import sys

import torch


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("m", type=int)
    ap.add_argument("n", type=int)
    ap.add_argument("k", type=int)
    ap.add_argument("--layout", default="fwd", choices=["fwd", "dgrad", "wgrad"])
    ap.add_argument("--variant", default="", choices=["", "nosums", "inject"], help="kernel build ('' = checked)")
    ap.add_argument("--kernel", default=None, choices=["wgmma", "mma"])
    ap.add_argument("--define", action="append", default=[], metavar="NAME[=VALUE]",
                    help="extra -D for gemm_wgmma.cu (experiment knobs)")
    ap.add_argument("--launches", type=int, default=4)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 3
    from gemm import parse_defines  # benchmarks/gemm.py, beside this script

    from aegis_cli.backends import cuda
    from aegis_cli.ops.gemm import Layout

    cuda.WGMMA_DEFINES.update(parse_defines(args.define))
    dev = cuda.CudaDevice(0, kernel=args.kernel)
    layout = Layout(args.layout)
    a = dev.generate(layout.a_stored_shape(args.m, args.k), "normal", 1)
    b = dev.generate(layout.b_stored_shape(args.k, args.n), "normal", 2)
    launch = dev.prepare(a, b, layout, variant=args.variant, kernel=args.kernel)
    for _ in range(args.launches):
        launch.run()
    dev.synchronize()
    print(f"{args.launches} launches of gemm_{launch.kernel}_{args.layout} {args.m}x{args.n}x{args.k} variant={args.variant or 'checked'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
