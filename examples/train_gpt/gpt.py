"""A small GPT in plain torch (decoder-only, pre-norm, causal self-attention, GELU MLP, tied
embeddings) for the in-training sensors example. Nothing in it knows about aegis: the sensors
instrument its nn.Linear layers from outside, and its activation checkpointing follows the Hugging
Face convention (a ``_gradient_checkpointing_func`` attribute) that instrument() wraps."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn


@dataclass(frozen=True)
class GPTConfig:
    vocab: int = 256
    seq: int = 64
    layers: int = 2
    heads: int = 4
    dim: int = 64
    dropout: float = 0.0

    @property
    def params(self) -> int:
        """Parameters, embeddings included (the head is tied to the token embedding)."""
        block = 12 * self.dim * self.dim + 13 * self.dim
        return self.layers * block + (self.vocab + self.seq) * self.dim + 2 * self.dim


PRESETS = {
    "tiny": GPTConfig(),  # CPU tests: ~0.1M parameters, a step in milliseconds
    "small": GPTConfig(vocab=4096, seq=256, layers=6, heads=8, dim=512),  # ~21M: a CPU demo in minutes
    "1b": GPTConfig(vocab=32768, seq=4096, layers=22, heads=16, dim=2048),  # ~1.2B: an H200 in bf16
}


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.heads, self.dropout = cfg.heads, cfg.dropout
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim)
        self.proj = nn.Linear(cfg.dim, cfg.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=-1)  # (B, T, D) each
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))  # (B, H, T, D/H)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.dim, 4 * cfg.dim)
        self.proj = nn.Linear(4 * cfg.dim, cfg.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(cfg.dim), Attention(cfg)
        self.ln2, self.mlp = nn.LayerNorm(cfg.dim), MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab, cfg.dim)
        self.wpe = nn.Embedding(cfg.seq, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab, bias=False)
        self.head.weight = self.wte.weight  # tied
        self.gradient_checkpointing = False
        self.apply(self._init)
        for name, p in self.named_parameters():  # GPT-2's scaled init of the residual projections
            if name.endswith("proj.weight"):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * cfg.layers))

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def gradient_checkpointing_enable(self) -> None:
        """Recompute each block in backward instead of keeping its activations."""
        self.gradient_checkpointing = True
        self._gradient_checkpointing_func = functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        t = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(t, device=idx.device))  # (B, T, D)
        for block in self.blocks:
            x = self._gradient_checkpointing_func(block, x) if self.gradient_checkpointing and self.training else block(x)
        logits = self.head(self.ln_f(x))  # (B, T, V)
        loss = None if targets is None else F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        return logits, loss


def markov_batches(cfg: GPTConfig, batch: int, seed: int, stream: int = 0):
    """An endless stream of (inputs, targets) from a fixed random sparse Markov chain over the
    vocabulary: something a small model can learn, so the loss falls. ``stream`` > 0 draws other
    sequences of the same chain (a data-parallel rank's own batches)."""
    g = torch.Generator().manual_seed(seed)
    nxt = torch.randint(0, cfg.vocab, (cfg.vocab, 4), generator=g)  # each token has 4 possible successors
    if stream:
        g = torch.Generator().manual_seed(seed * 1_000_003 + stream)
    while True:
        seqs = torch.empty(batch, cfg.seq + 1, dtype=torch.long)
        seqs[:, 0] = torch.randint(0, cfg.vocab, (batch,), generator=g)
        choice = torch.randint(0, 4, (batch, cfg.seq), generator=g)
        for i in range(cfg.seq):
            seqs[:, i + 1] = nxt[seqs[:, i], choice[:, i]]
        yield seqs[:, :-1], seqs[:, 1:]
