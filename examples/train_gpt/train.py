"""Train the small GPT of gpt.py with aegis' in-training sensors on, and print what they saw.

    python examples/train_gpt/train.py --steps 50                     # clean: nothing confirmed
    python examples/train_gpt/train.py --steps 20 --bundle-dir vt \\
        --inject 'bitflip:op=blocks.1.mlp.fc/fwd,bit=hi-mant'        # a self-test: caught, confirmed, saved
    aegis replay vt/*.aegis --inject 'bitflip:op=blocks.1.mlp.fc/fwd,bit=hi-mant'   # reproduces (exit 2)
    aegis replay vt/*.aegis                                            # does not (exit 0)
    torchrun --nproc_per_node 2 examples/train_gpt/train.py --budget 0.01   # data-parallel (DDP)

The loop verifies at each step boundary, before the optimizer applies the step's gradients, and
stops when the sensors confirm corruption, naming the last clean step to resume from. Under
torchrun (or with a process group already initialised) every rank trains its own batches of the
same data under DistributedDataParallel: the sensors sample in lockstep across the ranks, and the
outlier warning compares each step's largest clean difference across them (docs/sensors.md §4).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpt import GPT, PRESETS, markov_batches

from aegis_cli.sensors import Action, OutlierWarning, SensorConfig, instrument, uninstrument
from aegis_cli.sensors.collective import any_rank


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--checkpointing", action="store_true", help="recompute blocks in backward (fingerprinted by the sensors)")
    p.add_argument("--bundle-dir", default=None, help="save confirmed events as vTask bundles here")
    p.add_argument("--inject", default=None, help="self-test: an --inject fault spec (docs/fault-injection.md)")
    p.add_argument("--sample-prob", type=float, default=1.0, help="initial per-operator sampling probability")
    p.add_argument("--budget", type=float, default=None, help="sensing overhead budget (e.g. 0.01); default: check every launch")
    p.add_argument("--json", action="store_true", help="print the sensor statistics as JSON")
    return p.parse_args(argv)


def data_parallel(args: argparse.Namespace) -> tuple[int, int, bool]:
    """(rank, ranks, whether this call initialised the process group): under torchrun (WORLD_SIZE
    ≥ 2) it is initialised here (NCCL on CUDA, this rank's LOCAL_RANK GPU; gloo on the CPU); one a
    caller initialised is used as it is."""
    dist = torch.distributed
    owned = False
    if not dist.is_initialized():
        if int(os.environ.get("WORLD_SIZE", "1")) < 2:
            return 0, 1, False
        if args.device.startswith("cuda"):
            args.device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
            torch.cuda.set_device(torch.device(args.device))
        dist.init_process_group("nccl" if args.device.startswith("cuda") else "gloo")
        owned = True
    return dist.get_rank(), dist.get_world_size(), owned


def main(argv: list[str] | None = None) -> dict:
    args = parse(argv)
    rank, ranks, owned = data_parallel(args)
    say = print if rank == 0 else (lambda *_a, **_k: None)
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    cfg = PRESETS[args.preset]
    with torch.device(args.device):  # initialised where it trains: the 1b preset's init on the host takes long
        model = GPT(cfg)
    model.to(getattr(torch, args.dtype))
    if args.checkpointing:
        model.gradient_checkpointing_enable()
    if ranks > 1:
        model = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    handle = instrument(model, SensorConfig(bundle_dir=args.bundle_dir, inject=args.inject, sample_prob=args.sample_prob,
                                            overhead_budget=args.budget, job="train_gpt", seed=args.seed))
    outlier = OutlierWarning() if ranks > 1 else None
    say(f"GPT {args.preset}: {cfg.params / 1e6:.2f}M parameters, {args.steps} steps on {args.device} ({args.dtype})"
        + (f", {ranks} data-parallel ranks" if ranks > 1 else "") + (f", injecting {args.inject!r}" if args.inject else ""))
    data = markov_batches(cfg, args.batch, args.seed, stream=rank)
    losses, stopped = [], None
    t0 = time.perf_counter()
    for step in range(args.steps):
        x, y = (z.to(args.device) for z in next(data))
        _, loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        action = handle.step()  # the verifier runs here, before the update
        if outlier is not None:  # a collective: every rank, every step
            outlier.observe(step, handle.last_step["max_ratio"])
        losses.append(loss.item())
        stop = action is Action.STOP  # one rank's confirmed corruption stops every rank (they would wait for it)
        if stop if ranks == 1 else any_rank(stop):
            stopped = step
            break
        opt.step()
        if step % 10 == 0 or step == args.steps - 1:
            say(f"step {step:4d}  loss {loss.item():.4f}")
    seconds = time.perf_counter() - t0
    uninstrument(model)  # verifies anything still queued
    stats = handle.stats_dict()
    confirmed = [e for e in handle.events if e.kind == "confirmed"]
    if stopped is not None:
        print(f"stopped at step {stopped}: corruption confirmed; last clean step: {handle.last_clean_step}")
    for e in confirmed:
        print(f"  CONFIRMED {e.check} in {e.op} at step {e.step} (latency {e.latency_s:.3f} s): {e.summary}")
        if e.bundle:
            print(f"    saved {e.bundle}\n    replay: aegis replay {e.bundle}" + (f" --inject '{args.inject}'" if args.inject else ""))
    s = stats
    print(("" if ranks == 1 else f"rank {rank}: ") + f"sensors: {s['launches']} checked GEMMs, {s['checked']} compared with fp64, "
          f"{s['fingerprinted']} regions fingerprinted; suspicions raised {s['raised']}, cleared {s['cleared']}, "
          f"confirmed {s['confirmed']}, dropped {s['dropped']}; queue peak {s['queue']['peak']}; saved {s['saved']} bundle(s); "
          f"largest clean difference {s['clean_max_ratio']:.3g}×τ; {seconds:.2f} s")
    if args.json:
        print(json.dumps(stats, indent=1, default=str))
    if owned:
        torch.distributed.destroy_process_group()
    return {"stats": stats, "losses": losses, "stopped": stopped, "events": list(handle.events), "rank": rank,
            "outlier_warnings": len(outlier.warnings) if outlier is not None else 0}


if __name__ == "__main__":
    main()
