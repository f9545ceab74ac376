"""Data-parallel outlier warning: the robust leave-one-out rule, and 3 gloo ranks on CPU whose
statistics come from real checked GEMMs, one rank with an injected fault below τ."""

from __future__ import annotations

import datetime
import json
import math
import os
import socket
import time

import pytest
import torch
import torch.multiprocessing as mp

from aegis_cli.sensors.outlier import OutlierWarning, outliers

WORLD, FAULTY, STEPS, WARMUP, FAULT_FROM = 3, 2, 14, 4, 8
FAULT = "perturb:r=200,rate=0.001"  # about 60× the clean checksum noise, still 5× below τ


def test_rule_flags_the_far_rank_only():
    assert outliers([3e-9, 2.5e-9, 2e-7])[0] == [2]
    assert outliers([3e-9, 2.5e-9, 4e-9, 3.1e-9])[0] == []
    assert outliers([3e-9, 2e-7])[0] == [1]  # two ranks: the margin is min_decades
    assert outliers([3e-9, 2e-8])[0] == []  # under one decade apart
    assert outliers([3e-9, math.nan, 2e-9, 1e-9])[0] == [1]  # a non-finite statistic always
    assert outliers([0.0, 0.0, 0.0])[0] == []  # nothing sampled anywhere
    assert outliers([5e-9])[0] == []  # a single rank has no peers


def test_single_process_stays_quiet():
    w = OutlierWarning(warmup=0)
    assert w.observe(1, 1.0) is None  # no process group: nothing to compare with


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _checksum_statistic(rank: int, step: int, fault: str | None) -> float:
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


def _rank(rank: int, port: int, out: str) -> None:
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                                         timeout=datetime.timedelta(seconds=60))
    try:
        clean, faulty = OutlierWarning(warmup=WARMUP), OutlierWarning(warmup=WARMUP)
        seen = {"clean": [], "faulty": [], "values": []}
        for step in range(1, STEPS + 1):
            x = _checksum_statistic(rank, step, None)
            r = clean.observe(step, x)
            seen["clean"].append(r.flagged if r else None)
            fault = FAULT if rank == FAULTY and step >= FAULT_FROM else None
            y = x if fault is None else _checksum_statistic(rank, step, fault)
            r = faulty.observe(step, y)
            seen["faulty"].append(r.flagged if r else None)
            seen["values"].append(y)
        seen["warned"] = {"clean": len(clean.warnings), "faulty": len(faulty.warnings)}
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump(seen, f)
    finally:
        torch.distributed.destroy_process_group()


def test_three_gloo_ranks_warn_on_the_faulty_rank_only(tmp_path):
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
        assert g["clean"][:WARMUP] == [None] * WARMUP  # quiet during warm-up
        assert all(f == [] for f in g["clean"][WARMUP:]), g["clean"]  # no rank flagged without a fault
        expected = [[] if s < FAULT_FROM else [FAULTY] for s in range(WARMUP + 1, STEPS + 1)]
        assert g["faulty"][WARMUP:] == expected  # every rank sees the same comparison
        assert g["warned"] == {"clean": 0, "faulty": STEPS - FAULT_FROM + 1 if r == FAULTY else 0}
    # below τ = 1e-6: the scan's own threshold would not have flagged these
    assert max(got[FAULTY]["values"]) < 1e-6
    print(f"3 gloo ranks: {time.time() - t0:.1f} s")
