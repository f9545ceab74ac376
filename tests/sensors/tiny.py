"""Small models and loops for the sensor tests (CPU, milliseconds per step)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_gpt"
if str(EXAMPLE) not in sys.path:
    sys.path.insert(0, str(EXAMPLE))

from gpt import GPT, GPTConfig, markov_batches  # noqa: E402

MICRO = GPTConfig(vocab=64, seq=16, layers=2, heads=2, dim=32)


class MLP(nn.Module):
    """Two Linears and a head; ``checkpointed`` runs the first two under activation checkpointing."""

    def __init__(self, checkpointed: bool = False):
        super().__init__()
        self.fc1, self.fc2, self.head = nn.Linear(32, 64), nn.Linear(64, 32), nn.Linear(32, 8, bias=False)
        self.checkpointed = checkpointed

    def body(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.checkpointed:
            from aegis_cli.sensors import checkpoint

            return self.head(checkpoint(self.body, x))
        return self.head(self.body(x))


def mlp(seed: int = 0, **kw) -> MLP:
    torch.manual_seed(seed)
    return MLP(**kw)


def gpt(seed: int = 0, cfg: GPTConfig = MICRO, checkpointing: bool = False) -> GPT:
    torch.manual_seed(seed)
    model = GPT(cfg)
    if checkpointing:
        model.gradient_checkpointing_enable()
    return model


def batches(cfg: GPTConfig = MICRO, batch: int = 4, seed: int = 0):
    return markov_batches(cfg, batch, seed)


def inputs(seed: int = 1, shape=(4, 16, 32)) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
