"""Which SDPA backends are bitwise deterministic on this GPU? (docs/probes.md)

    python3 benchmarks/sdpa_determinism.py [--runs 8]

For each backend (flash, efficient, cudnn, math) × torch.use_deterministic_algorithms off/on,
runs forward and backward ``--runs`` times on one set of seeded bf16 inputs (the determinism
probe's GPU shape, causal) and counts distinct fingerprints of o, dq, dk, dv.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from aegis_cli.ops.fingerprint import device_fingerprint
from aegis_cli.probes.computations import GPU_SIZES, deterministic_algorithms


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=8)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    g = torch.Generator(device="cuda")
    g.manual_seed(7)
    q, k, v, do = (torch.randn(GPU_SIZES.attn, generator=g, device="cuda").to(torch.bfloat16) for _ in range(4))
    rows = []
    for be in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.MATH):
        for det in (False, True):
            prints: dict[str, set] = {"o": set(), "dq": set(), "dk": set(), "dv": set()}
            try:
                for _ in range(args.runs):
                    qq, kk, vv = (x.detach().requires_grad_(True) for x in (q, k, v))
                    with warnings.catch_warnings(), sdpa_kernel([be]):
                        warnings.simplefilter("ignore")
                        ctx = deterministic_algorithms() if det else contextlib.nullcontext()
                        with ctx:
                            o = F.scaled_dot_product_attention(qq, kk, vv, is_causal=True)
                            dq, dk, dv = torch.autograd.grad(o, (qq, kk, vv), do)
                    for name, t in (("o", o), ("dq", dq), ("dk", dk), ("dv", dv)):
                        prints[name].add(device_fingerprint(t))
                row = {"backend": be.name, "deterministic_mode": det, **{n: len(s) for n, s in prints.items()}}
            except RuntimeError as exc:
                row = {"backend": be.name, "deterministic_mode": det, "error": str(exc).splitlines()[0][:120]}
            rows.append(row)
            print(json.dumps(row), flush=True)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "sdpa_determinism.json").write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                                                                     "runs": args.runs, "shape": GPU_SIZES.attn, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
