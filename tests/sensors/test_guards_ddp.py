"""The training guard under DistributedDataParallel: 2 gloo ranks on CPU, a state fault on one
rank only; both ranks agree, restore and re-execute together (the backward's all-reduce needs
every rank), and each rank's loss curve equals its clean one bit for bit."""

from __future__ import annotations

import datetime
import json
import os
import time

import pytest
import torch
import torch.multiprocessing as mp

from aegis_cli.sensors.guards import TrainingGuard
from tests.sensors.test_guards import batches, make, step_fn
from tests.sensors.test_outlier import _free_port

WORLD, STEPS = 2, 7
FAULT = "stateflip:target=exp_avg_sq,step=6,bit=30,device=cpu:1"


def _train(rank: int, inject: str | None) -> tuple[list[float], TrainingGuard]:
    model, _ = make()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.Adam(ddp.parameters(), lr=1e-2)
    guard = TrainingGuard(ddp, opt, step_fn, inject=inject, device_id=f"cpu:{rank}")
    torch.manual_seed(100 + rank)
    losses = [guard.step(b) for b in batches(STEPS, seed=10 + rank)]
    return losses, guard


def _rank(rank: int, port: int, out: str) -> None:
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                                         timeout=datetime.timedelta(seconds=60))
    try:
        clean, g0 = _train(rank, None)
        faulty, g1 = _train(rank, FAULT)
        doc = {"same": clean == faulty, "sync": g1.sync, "clean_events": len(g0.events),
               "events": [(e.step, e.outcome, e.restored_to, e.replayed, [v.check for v in e.violations]) for e in g1.events]}
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump(doc, f)
    finally:
        torch.distributed.destroy_process_group()


def test_two_ddp_ranks_recover_together(tmp_path):
    t0 = time.time()
    ctx = mp.start_processes(_rank, args=(_free_port(), str(tmp_path)), nprocs=WORLD, join=False, start_method="spawn")
    deadline = time.time() + 120
    while not ctx.join(timeout=max(1.0, deadline - time.time())):
        if time.time() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail("gloo ranks did not finish in 120 s")
    got = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]
    for r, g in enumerate(got):
        assert g["sync"] and g["same"] and g["clean_events"] == 0, g
        checks = ["train.adam_exp_avg_sq"] if r == 1 else []  # rank 0 re-executes for rank 1's violation
        assert g["events"] == [[6, "recovered", 4, [5, 6], checks]], g
    print(f"2 DDP ranks: {time.time() - t0:.1f} s")
