"""Workload catalogs: a model config → the per-GPU GEMMs a training step runs.

A catalog (``workloads/NAME.yaml``) holds a model config and what to scan. Per-GPU
shapes under tensor parallelism (Megatron-style, T = seq_len · micro_batch tokens):

    op           fwd (M, N, K)                      dgrad (M, N, K)     wgrad (M, N, K)
    qkv          (T, (h + 2·kv)·d / tp, H)          (T, H, (h+2kv)d/tp) ((h+2kv)d/tp, H, T)
    attn_out     (T, H, h·d / tp)                   (T, h·d/tp, H)      (H, h·d/tp, T)
    mlp_gate_up  (T, 2·F / tp, H)   (gate and up fused, as Megatron runs them)
    mlp_down     (T, H, F / tp)
with H hidden, F ffn, h heads, kv KV heads, d = H / h head dim.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from aegis_cli.ops import config
from aegis_cli.ops.errors import ConfigError
from aegis_cli.ops.gemm import GemmShape, Layout
from aegis_cli.ops.numerics import DISTRIBUTIONS
from aegis_cli.ops.paths import catalog_dir

OPS = ("qkv", "attn_out", "mlp_gate_up", "mlp_down")
MAX_DIM = 1 << 20


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    seq_len: int
    micro_batch: int = 1
    tp: int = 1

    def __post_init__(self) -> None:
        for name in ("hidden", "ffn", "heads", "kv_heads", "seq_len", "micro_batch", "tp"):
            v = getattr(self, name)
            if not 1 <= v <= MAX_DIM:
                raise ConfigError(f"model.{name} = {v} is outside 1…{MAX_DIM}")
        if self.hidden % self.heads:
            raise ConfigError(f"model.hidden {self.hidden} is not a multiple of heads {self.heads}")
        if self.heads % self.kv_heads:
            raise ConfigError(f"model.heads {self.heads} is not a multiple of kv_heads {self.kv_heads}")
        if self.heads % self.tp or self.ffn % self.tp or (self.kv_heads % self.tp and self.tp % self.kv_heads):
            raise ConfigError(f"model.tp {self.tp} does not divide heads {self.heads}, kv_heads {self.kv_heads} and ffn {self.ffn}")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


@dataclass(kw_only=True, slots=True)
class ScanPlan:
    ops: list[str] = field(default_factory=lambda: list(OPS))
    layouts: list[str] = field(default_factory=lambda: [x.value for x in Layout])
    distributions: list[str] = field(default_factory=lambda: list(DISTRIBUTIONS))
    # (ea, eb): A scaled by 2^ea, B by 2^eb; (0, 0) is the base every other scale is checked against
    scales: list[list[int]] = field(default_factory=lambda: [[0, 0], [-16, -16], [16, 16], [-8, 8]])
    max_tokens: int | None = None  # cap T (and so M of fwd/dgrad, K of wgrad) to shrink a preset

    def __post_init__(self) -> None:
        for op in self.ops:
            if op not in OPS:
                raise ConfigError(f"scan.ops: unknown op {op!r} (known: {', '.join(OPS)})")
        for lay in self.layouts:
            if lay not in {x.value for x in Layout}:
                raise ConfigError(f"scan.layouts: unknown layout {lay!r} (known: fwd, dgrad, wgrad)")
        for dist in self.distributions:
            if dist not in DISTRIBUTIONS:
                raise ConfigError(f"scan.distributions: unknown distribution {dist!r} (known: {', '.join(DISTRIBUTIONS)})")
        if not self.ops or not self.layouts or not self.distributions:
            raise ConfigError("scan: ops, layouts and distributions must not be empty")
        for key in ("ops", "layouts", "distributions", "scales"):  # a repeat would run (and report) twice
            items = [tuple(x) if isinstance(x, list) else x for x in getattr(self, key)]
            dup = next((x for i, x in enumerate(items) if x in items[:i]), None)
            if dup is not None:
                raise ConfigError(f"scan.{key}: {list(dup) if isinstance(dup, tuple) else dup!r} is listed twice")
        for s in self.scales:
            if len(s) != 2 or not all(-40 <= e <= 40 for e in s):
                raise ConfigError(f"scan.scales: each entry is [ea, eb] with exponents in -40…40, got {s}")
        if [0, 0] not in self.scales:
            self.scales.insert(0, [0, 0])
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ConfigError(f"scan.max_tokens must be ≥ 1, got {self.max_tokens}")


@dataclass(kw_only=True, slots=True)
class Workload:
    name: str
    description: str = ""
    model: ModelConfig
    scan: ScanPlan = field(default_factory=ScanPlan)
    source: str = ""  # file it came from

    def tokens(self) -> int:
        t = self.model.seq_len * self.model.micro_batch
        return min(t, self.scan.max_tokens) if self.scan.max_tokens else t

    def op_dims(self, op: str) -> tuple[int, int]:
        """(in_features, out_features) of one linear layer on one GPU."""
        m = self.model
        d = m.head_dim
        kv_local = max(1, m.kv_heads // m.tp)
        return {
            "qkv": (m.hidden, (m.heads // m.tp + 2 * kv_local) * d),
            "attn_out": (m.heads // m.tp * d, m.hidden),
            "mlp_gate_up": (m.hidden, 2 * m.ffn // m.tp),
            "mlp_down": (m.ffn // m.tp, m.hidden),
        }[op]

    def gemms(self) -> list[GemmShape]:
        out = []
        t = self.tokens()
        for op in self.scan.ops:
            fin, fout = self.op_dims(op)
            for lay in self.scan.layouts:
                mnk = {"fwd": (t, fout, fin), "dgrad": (t, fin, fout), "wgrad": (fout, fin, t)}[lay]
                out.append(GemmShape(op=op, layout=Layout(lay), m=mnk[0], n=mnk[1], k=mnk[2]))
        return out


def available() -> list[str]:
    return sorted(p.stem for p in catalog_dir().glob("*.yaml"))


def load(name_or_path: str) -> Workload:
    """Load a catalog by shipped name (``cpu-quick``) or by path to a YAML file. A shipped name
    wins over a file or folder of that name in the current directory (a checkpoint folder called
    llama3-70b must not replace the catalog); give ./NAME for such a file."""
    path = Path(name_or_path)
    if name_or_path in available():
        path = catalog_dir() / f"{name_or_path}.yaml"
    elif not (path.suffix in (".yaml", ".yml") or path.exists()):
        raise ConfigError(f"unknown workload {name_or_path!r} (shipped: {', '.join(available())}; or give a path to a .yaml file)")
    data = config.load_yaml(path)
    wl = config.from_dict(Workload, data, str(path))
    return dataclasses.replace(wl, source=str(path))
