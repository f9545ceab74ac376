"""The few small collectives the sensors run over torch.distributed (the outlier warning, the
sampling lockstep, the training guard's agreement, the example's stop): where their tensors live,
a MAX all-reduce of a handful of numbers, and whether a flag holds on any rank."""

from __future__ import annotations

import torch


def collective_device(group=None) -> torch.device:
    """Where a collective's tensors must live: the current GPU under NCCL (device tensors only), else the host."""
    if torch.distributed.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_max(values: list[float], group=None) -> list[float]:
    """Each value's maximum over the ranks of ``group`` (one all-reduce, fp64: exact for integers
    below 2⁵³), the same on every rank."""
    t = torch.tensor(values, dtype=torch.float64, device=collective_device(group))
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX, group=group)
    return t.tolist()


def any_rank(flag: bool, group=None) -> bool:
    """Whether ``flag`` holds on any rank of ``group`` (one all-reduce)."""
    return all_max([1.0 if flag else 0.0], group)[0] > 0
