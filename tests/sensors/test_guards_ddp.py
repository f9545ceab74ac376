"""The training guard under DistributedDataParallel: 3 gloo ranks on CPU
(tests/sensors/gloo_ranks.py), a state fault on rank 1 only; every rank agrees, restores and
re-executes together (the backward's all-reduce needs every rank), and each rank's loss curve
equals its clean one bit for bit."""

from __future__ import annotations


def test_ddp_ranks_recover_together(gloo_ranks):
    for r, doc in enumerate(gloo_ranks):
        g = doc["ddp"]
        assert g["sync"] and g["same"] and g["clean_events"] == 0, g
        checks = ["train.adam_exp_avg_sq"] if r == 1 else []  # the others re-execute for rank 1's violation
        assert g["events"] == [[6, "recovered", 4, [5, 6], checks]], g
