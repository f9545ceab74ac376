"""vTasks: the model (docs/design.md §8; normative spec: docs/bundle-format.md).

A vTask is the minimal context needed to recompute one suspicious computation: the
operator and its layout, the inputs needed (rows of A plus B for a row check, A plus
columns of B for a column check, or the full operands when they are small), what was
observed, the threshold in force, the input scale and seed, and where it ran.

Reading and writing bundles of vTasks: vtask/bundle.py (the file), vtask/manifest.py (its
entries). Making vTasks of an observed GEMM: vtask/capture.py; of a scan's flagged cases:
vtask/from_scan.py.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from aegis_cli.ops.errors import BundleError
from aegis_cli.ops.files import sanitize
from aegis_cli.ops.gemm import GemmOperands, Layout
from aegis_cli.ops.numerics import TAU_MAX

FORMAT = "aegis-vtask-bundle"
FORMAT_VERSION = 2  # 2: kind "attention"; a GEMM τ in "device-noise" units (docs/bundle-format.md §7)
READABLE_VERSIONS = (1, 2)
KINDS = ("gemm", "attention")  # later: "fingerprint" (each with its own object, see the spec)
GEMM_ROLES = ("a", "b", "c", "row_sums", "col_sums")
ATTENTION_INPUTS = ("q", "k", "v", "do")
ATTENTION_ROLES = (*ATTENTION_INPUTS, "o", "lse", "o_rowsum", "dq", "dk", "dv", "dq_rowsum", "dk_colsum", "dv_colsum")
# what a GEMM τ is in units of: "abs-product", s = Σ_k |A_ik|·(|B|·1)_k over the checksum's tile; "device-noise",
# the replaying device's noise scale σ (numerics.NoiseModel), in which its calibrated clean maximum is 1. An attention
# τ is in "rounding-spread" units: the spread the bf16 roundings of P and dS give each invariant (docs/attention.md §3)
NORMALISATIONS = ("abs-product", "device-noise")
SEVERITIES = ("HEALTHY", "SUSPECT", "FAULTY", "ERROR")
DTYPES = {"BF16": (torch.bfloat16, 2), "F32": (torch.float32, 4)}
TORCH_DTYPE_NAME = {t: name for name, (t, _) in DTYPES.items()}

MAX_DIM = 1 << 20
MAX_STRING = 4096
MAX_SAMPLES = 64
MAX_DEPTH = 8
TAU_RANGE = (1e-300, TAU_MAX)  # what threshold.tau may be in a bundle (in units of Σ|A||B|: below 1)
MAX_BYTES_LIMIT = 1 << 40  # the highest file-size limit one may set: far above any host's memory


@dataclass(frozen=True)
class Limits:
    """What a reader accepts. Memory used by ``read_bundle`` stays below about
    2·max_bytes + a small multiple of max_header."""

    max_bytes: int = 2 << 30  # whole file
    max_header: int = 32 << 20  # safetensors header (JSON), manifest included
    max_vtasks: int = 100_000
    max_tensors: int = 500_000
    source: str = "the default; --max-bundle-size or AEGIS_BUNDLE_MAX_BYTES raise it"  # of max_bytes, for messages

    @classmethod
    def from_env(cls, max_bytes: int | None = None) -> Limits:
        """The limits with the file-size limit given (--max-bundle-size), else from
        AEGIS_BUNDLE_MAX_BYTES, else the default."""
        env = os.environ.get("AEGIS_BUNDLE_MAX_BYTES")
        given = f"--max-bundle-size {max_bytes}"
        if max_bytes is None and env:
            given = f"AEGIS_BUNDLE_MAX_BYTES={env}"
            try:
                max_bytes = int(env)
            except ValueError:
                raise BundleError(f"AEGIS_BUNDLE_MAX_BYTES={env!r} is not an integer") from None
        if max_bytes is not None and not 16 <= max_bytes <= MAX_BYTES_LIMIT:
            raise BundleError(f"{given} is out of range: a bundle size limit lies in 16…{MAX_BYTES_LIMIT} bytes")
        return cls(max_bytes=max_bytes, source=given.partition(" ")[0].partition("=")[0]) if max_bytes is not None else cls()


# -- the model -----------------------------------------------------------------------------
@dataclass
class GemmSpec:
    """Which part of C = A·B (M×N×K, stored per ``layout``) the vTask carries.

    ``rows``/``cols``: indices into M/N of the rows of A / columns of B stored; None = all.
    The stored tensors are the operands of the sub-GEMM A[rows,:]·B[:,cols], in the
    layout's stored orientation.
    """

    layout: Layout
    m: int
    n: int
    k: int
    tile: tuple[int, int]  # checksum tile (tm, tn) of the capturing device
    rows: list[int] | None = None
    cols: list[int] | None = None
    flagged_rows: list[int] = field(default_factory=list)  # full-GEMM indices flagged at capture
    flagged_cols: list[int] = field(default_factory=list)

    @property
    def m_sub(self) -> int:
        return self.m if self.rows is None else len(self.rows)

    @property
    def n_sub(self) -> int:
        return self.n if self.cols is None else len(self.cols)

    @property
    def subset(self) -> str:
        return {(False, False): "full", (True, False): "rows", (False, True): "cols", (True, True): "block"}[
            (self.rows is not None, self.cols is not None)]

    def expected(self, role: str) -> tuple[str, tuple[int, ...]]:
        """(dtype, shape) a tensor of ``role`` must have."""
        m, n, k = self.m_sub, self.n_sub, self.k
        tm, tn = self.tile
        return {"a": ("BF16", self.layout.a_stored_shape(m, k)), "b": ("BF16", self.layout.b_stored_shape(k, n)),
                "c": ("BF16", (m, n)), "row_sums": ("F32", (m, -(-n // tn))), "col_sums": ("F32", (-(-m // tm), n))}[role]

    def sub_operands(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The stored operands of the sub-GEMM, from the full ones (both in the layout's stored
        orientation): A's rows ``rows`` and B's columns ``cols``."""
        if self.rows is not None:
            idx = torch.tensor(self.rows, device=a.device)
            a = (a[:, idx] if self.layout is Layout.WGRAD else a[idx]).contiguous()  # wgrad stores A as (K, M)
        if self.cols is not None:
            idx = torch.tensor(self.cols, device=b.device)
            b = (b[idx] if self.layout is Layout.FWD else b[:, idx]).contiguous()  # fwd stores B as W: (N, K)
        return a, b

    @classmethod
    def from_json(cls, g: dict) -> GemmSpec:
        """The inverse of to_json, for a manifest entry already checked by the bundle reader."""
        return cls(layout=Layout(g["layout"]), m=g["m"], n=g["n"], k=g["k"], tile=(g["tile"][0], g["tile"][1]),
                   rows=g.get("rows"), cols=g.get("cols"), flagged_rows=list(g.get("flagged_rows", [])),
                   flagged_cols=list(g.get("flagged_cols", [])))

    def to_json(self) -> dict:
        return {"layout": self.layout.value, "m": self.m, "n": self.n, "k": self.k, "tile": list(self.tile),
                "rows": self.rows, "cols": self.cols, "flagged_rows": self.flagged_rows, "flagged_cols": self.flagged_cols}


@dataclass(frozen=True)
class AttentionSpec:
    """The attention a vTask of kind ``attention`` carries: Q (B, Hq, S, D), K, V (B, Hkv, S, D),
    dO like Q, the softmax scale and the mask. Bundles hold 2-D tensors: (B·H·S, D) for the
    (B, H, S, D) ones, (B·H, S) for the LSE and the row sums, (B·Hkv, D) for the column sums."""

    batch: int
    q_heads: int
    kv_heads: int
    seq: int
    head_dim: int
    causal: bool
    scale: float

    def expected(self, role: str) -> tuple[str, tuple[int, int]]:
        b, hq, hkv, s, d = self.batch, self.q_heads, self.kv_heads, self.seq, self.head_dim
        rows = {"q": b * hq * s, "do": b * hq * s, "o": b * hq * s, "dq": b * hq * s, "k": b * hkv * s, "v": b * hkv * s,
                "dk": b * hkv * s, "dv": b * hkv * s}
        if role in rows:
            return "BF16", (rows[role], d)
        return "F32", {"lse": (b * hq, s), "o_rowsum": (b * hq, s), "dq_rowsum": (b * hq, s), "dk_colsum": (b * hkv, d),
                       "dv_colsum": (b * hkv, d)}[role]

    def full_shape(self, role: str) -> tuple[int, ...]:
        """The (B, H, …) shape of a role's 2-D tensor."""
        h = self.kv_heads if role in ("k", "v", "dk", "dv", "dk_colsum", "dv_colsum") else self.q_heads
        rows, cols = self.expected(role)[1]
        return (self.batch, h, rows // (self.batch * h), cols) if role not in ("lse", "o_rowsum", "dq_rowsum",
                                                                              "dk_colsum", "dv_colsum") else (self.batch, h, cols)

    @classmethod
    def from_json(cls, a: dict) -> AttentionSpec:
        return cls(a["batch"], a["q_heads"], a["kv_heads"], a["seq"], a["head_dim"], a["causal"], float(a["scale"]))

    def to_json(self) -> dict:
        return {"batch": self.batch, "q_heads": self.q_heads, "kv_heads": self.kv_heads, "seq": self.seq,
                "head_dim": self.head_dim, "causal": self.causal, "scale": self.scale}


@dataclass
class VTask:
    id: str
    check: str
    op: str
    gemm: GemmSpec | None  # kind gemm
    tensors: dict[str, torch.Tensor]  # role → tensor (gemm: a, b required; c, row_sums, col_sums observed)
    tau: float
    scale: tuple[int, int] = (0, 0)  # the stored operands are 2^ea·A, 2^eb·B of the case
    confirm_margin: float = 4.0
    normalisation: str = "abs-product"
    kind: str = "gemm"
    case_id: str = ""
    seed: int | None = None
    dist: str | None = None
    observed: dict = field(default_factory=dict)
    provenance: dict = field(default_factory=dict)
    extra: dict = field(default_factory=dict)
    attention: AttentionSpec | None = None  # kind attention

    @property
    def spec(self) -> GemmSpec | AttentionSpec:
        """The object of this vTask's kind (what its tensors' roles and shapes follow)."""
        return self.attention if self.kind == "attention" else self.gemm

    def full(self, role: str) -> torch.Tensor:
        """An attention tensor in its (B, H, …) shape."""
        return self.tensors[role].reshape(self.attention.full_shape(role))

    def operands(self, device: str | torch.device = "cpu") -> GemmOperands:
        return GemmOperands(self.tensors["a"].to(device), self.tensors["b"].to(device), self.gemm.layout)

    def manifest_entry(self, names: dict[str, str]) -> dict:
        return {"id": self.id, "kind": self.kind, "check": self.check, "op": self.op, "case_id": self.case_id,
                self.kind: self.spec.to_json(), "tensors": names, "scale": list(self.scale), "seed": self.seed,
                "dist": self.dist, "threshold": {"tau": self.tau, "confirm_margin": self.confirm_margin,
                                                 "normalisation": self.normalisation},
                "observed": sanitize(self.observed), "provenance": self.provenance, "extra": self.extra}


@dataclass
class Bundle:
    path: str
    format_version: int
    created: str
    producer: dict
    vtasks: list[VTask]
