"""One spawn of 3 gloo ranks on CPU (loopback) for the data-parallel tests: each rank runs the
outlier-warning scenario (test_outlier.py), the DDP guard scenario (test_guards_ddp.py), the
sampling-lockstep scenario and the data-parallel example (test_lockstep.py) and writes what it saw
to rank<N>.json. One spawn for
all: starting torch in 3 processes is most of the cost."""

from __future__ import annotations

import datetime
import json
import os
import socket
import time

import pytest
import torch
import torch.multiprocessing as mp

from aegis_cli.sensors.guards import TrainingGuard
from aegis_cli.sensors.outlier import OutlierWarning

WORLD = 3
# outlier warning: rank 2 gets a fault from step 8 on
FAULTY, STEPS, WARMUP, FAULT_FROM = 2, 14, 4, 8
PERTURB = "perturb:r=200,rate=0.001"  # about 60× the clean checksum noise
# DDP guard: a state fault on rank 1 only
DDP_STEPS, STATE_FAULT = 7, "stateflip:target=exp_avg_sq,step=6,bit=30,device=cpu:1"
# lockstep: a budget of 30 % of the step, agreements every 3 steps
LOCK_STEPS, LOCK_EVERY = 10, 3


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def checksum_statistic(rank: int, step: int, fault: str | None) -> float:
    """The largest normalised checksum difference of one checked GEMM on this rank's data."""
    from aegis_cli.backends.cpu import CpuDevice
    from aegis_cli.faults.spec import FaultPlan
    from aegis_cli.ops import numerics
    from aegis_cli.ops.gemm import GemmOperands, Layout

    d = CpuDevice(rank)
    seed = 1000 * rank + step
    ops = GemmOperands(d.generate((64, 256), "normal", seed), d.generate((128, 256), "normal", seed + 500), Layout.FWD)
    ref = d.reference_checksums(ops, d.tile)
    plan = FaultPlan.parse(fault) if fault else None
    clean = numerics.median_row_diff(d.checked_gemm(ops), ref) if plan else None
    res = d.checked_gemm(ops, plan, op="train/mlp/fwd", clean_median=clean)
    rows, cols = numerics.checksum_diffs(res, ref)
    return float(max(rows.max(), cols.max()))


def _outlier(rank: int) -> dict:
    clean, faulty = OutlierWarning(warmup=WARMUP), OutlierWarning(warmup=WARMUP)
    seen = {"clean": [], "faulty": [], "values": []}
    for step in range(1, STEPS + 1):
        x = checksum_statistic(rank, step, None)
        r = clean.observe(step, x)
        seen["clean"].append(r.flagged if r else None)
        fault = PERTURB if rank == FAULTY and step >= FAULT_FROM else None
        y = x if fault is None else checksum_statistic(rank, step, fault)
        r = faulty.observe(step, y)
        seen["faulty"].append(r.flagged if r else None)
        seen["values"].append(y)
    seen["warned"] = {"clean": len(clean.warnings), "faulty": len(faulty.warnings)}
    return seen


def _ddp(rank: int) -> dict:
    from tests.sensors.test_guards import batches, make, step_fn

    def train(inject: str | None):
        model, _ = make()
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.Adam(ddp.parameters(), lr=1e-2)
        guard = TrainingGuard(ddp, opt, step_fn, inject=inject, device_id=f"cpu:{rank}")
        torch.manual_seed(100 + rank)
        return [guard.step(b) for b in batches(DDP_STEPS, seed=10 + rank)], guard

    clean, g0 = train(None)
    faulty, g1 = train(STATE_FAULT)
    return {"same": clean == faulty, "sync": g1.sync, "clean_events": len(g0.events),
            "events": [[e.step, e.outcome, e.restored_to, e.replayed, [v.check for v in e.violations]] for e in g1.events]}


def _lockstep(rank: int, device: str = "cpu") -> dict:
    """Each rank trains the micro GPT under DDP on its own batches under a budget of 30 % of the step
    (on this CPU the checks cost nearly as much as the layers: a 1 % budget leaves only the coverage
    floor, whose phases agree anyway), once in lockstep and once without; per step, which operators
    it checked, and the probabilities it ended with. ``device``: where the model trains
    (test_lockstep_gpu.py: each rank's own GPU, over NCCL)."""
    from aegis_cli.sensors import SensorConfig, instrument, lockstep, uninstrument
    from tests.sensors.tiny import batches, gpt

    lockstep.EVERY = LOCK_EVERY
    seen = {}
    for mode in (True, False):
        model = torch.nn.parallel.DistributedDataParallel(gpt().to(device))  # the instrumented job as it would run
        handle = instrument(model, SensorConfig(lockstep=mode, coverage_steps=5, overhead_budget=0.3))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        data, checked = batches(seed=rank), []
        for _ in range(LOCK_STEPS):
            x, y = (t.to(device) for t in next(data))
            before = {op: st.checks_total for op, st in handle.controller.ops.items()}
            opt.zero_grad()
            model(x, y)[1].backward()
            handle.step()
            opt.step()
            checked.append(sorted(op for op, st in handle.controller.ops.items() if st.checks_total > before.get(op, 0)))
        weights = float(sum(p.double().abs().sum() for p in model.parameters()))  # alike on every rank: DDP averaged the grads
        seen["lockstep" if mode else "own"] = {"checked": checked, "probs": {op: st.prob for op, st in handle.controller.ops.items()},
                                                "joined": handle.lockstep is not None, "weights": weights,
                                                "confirmed": handle.stats_dict()["confirmed"]}
        uninstrument(model)
    return seen


def _example(rank: int) -> dict:
    """examples/train_gpt/train.py on every rank (DDP over the group initialised here): clean under a
    budget, then with a fault injected on rank 1 only."""
    import train  # examples/train_gpt (on the path through tests.sensors.tiny)

    clean = train.main(["--steps", str(LOCK_STEPS), "--budget", "0.3"])
    faulty = train.main(["--steps", "4", *(["--inject", "bitflip:op=blocks.1.mlp.fc/fwd,bit=hi-mant"] if rank == 1 else [])])
    s = clean["stats"]
    return {"checked": s["checked"], "probs": {op: o["prob"] for op, o in s["operators"].items()}, "confirmed": s["confirmed"],
            "stopped": clean["stopped"], "losses": clean["losses"], "faulty_stopped": faulty["stopped"],
            "faulty_confirmed": faulty["stats"]["confirmed"]}


def _rank(rank: int, port: int, out: str) -> None:
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                                         timeout=datetime.timedelta(seconds=60))
    try:
        doc = {"outlier": _outlier(rank), "ddp": _ddp(rank), "lockstep": _lockstep(rank), "example": _example(rank)}
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump(doc, f)
        # no rank tears down while another still talks to it: rank 0 hosts the store, and a rank
        # that exited first made another abort now and then ("terminate called without an active exception")
        torch.distributed.barrier()
    finally:
        torch.distributed.destroy_process_group()


def run(out: str, limit_s: float = 180.0, tries: int = 2) -> list[dict]:
    """Spawn the ranks, wait at most ``limit_s``, return each rank's document. A spawn whose rank
    died is tried once more on a fresh port: the free port is found before the store binds it,
    and another process on the machine can take it in between."""
    t0 = time.time()
    for attempt in range(tries):
        ctx = mp.start_processes(_rank, args=(_free_port(), out), nprocs=WORLD, join=False, start_method="spawn")
        try:
            while not ctx.join(timeout=max(1.0, t0 + limit_s - time.time())):
                if time.time() > t0 + limit_s:
                    for p in ctx.processes:
                        p.kill()
                    pytest.fail(f"gloo ranks did not finish in {limit_s:.0f} s")
            break
        except mp.ProcessExitedException:
            if attempt == tries - 1:
                raise
    print(f"{WORLD} gloo ranks: {time.time() - t0:.1f} s")
    return [json.loads(open(os.path.join(out, f"rank{r}.json")).read()) for r in range(WORLD)]
