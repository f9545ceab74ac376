"""Sampling in lockstep over NCCL (sensors/lockstep.py): 2 ranks, each training the micro GPT on
its own GPU and its own batches under a budget, check the same operators in every step (the
gloo scenario of tests/sensors/gloo_ranks.py, with device tensors in the collectives). Needs two
GPUs."""

from __future__ import annotations

import datetime
import json
import os

import pytest
import torch
import torch.multiprocessing as mp

from tests.sensors.gloo_ranks import LOCK_STEPS, _free_port, _lockstep

pytestmark = pytest.mark.gpu
WORLD = 2


def _rank(rank: int, port: int, out: str) -> None:
    torch.cuda.set_device(rank)
    torch.distributed.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                                         timeout=datetime.timedelta(seconds=120), device_id=torch.device("cuda", rank))
    try:
        doc = _lockstep(rank, f"cuda:{rank}")
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump(doc, f)
        torch.distributed.barrier()
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.skipif(torch.cuda.device_count() < WORLD, reason="needs two GPUs")
def test_two_gpus_in_lockstep_check_the_same_operators_in_every_step(tmp_path):
    mp.start_processes(_rank, args=(_free_port(), str(tmp_path)), nprocs=WORLD, join=True, start_method="spawn")
    docs = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]
    runs = [d["lockstep"] for d in docs]
    assert all(r["joined"] for r in runs) and [len(r["checked"]) for r in runs] == [LOCK_STEPS] * WORLD
    assert runs[0]["checked"] == runs[1]["checked"] and runs[0]["probs"] == runs[1]["probs"]
    assert any(runs[0]["checked"])
    own = [d["own"] for d in docs]
    assert not any(r["joined"] for r in own)
