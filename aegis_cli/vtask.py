"""vTasks and vTask bundles (DESIGN §3; normative spec: docs/bundle-format.md).

A vTask is the minimal context needed to recompute one suspicious computation: the
operator and its layout, the inputs needed (rows of A plus B for a row check, A plus
columns of B for a column check, or the full operands when they are small), what was
observed, the threshold in force, the input scale and seed, and where it ran.

A bundle is one safetensors file: the tensors, plus a JSON manifest in the header's
``__metadata__``. Bundles come from other machines and other people, so ``read_bundle``
trusts nothing: it parses the safetensors header itself (length against the file size
and the limits, offsets against dtypes and shapes, every tensor against the manifest),
checks a SHA-256 over every tensor and over the manifest, and only then hands the bytes
to ``safetensors.torch.load`` (no pickle, no code, ever). Every problem is a BundleError
naming the file. ``BundleWriter`` appends vTasks and finalises atomically.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import os
import re
import stat
import struct
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from aegis_cli.backends.base import GemmOperands, Layout
from aegis_cli.errors import AegisError, BundleError

if TYPE_CHECKING:
    from aegis_cli.report import Report
    from aegis_cli.scan import ScanOptions

FORMAT = "aegis-vtask-bundle"
FORMAT_VERSION = 1
READABLE_VERSIONS = (1,)
KINDS = ("gemm",)  # later: "attention", "fingerprint" (each with its own object, see the spec)
GEMM_CHECKS = ("gemm.row_checksum", "gemm.col_checksum", "gemm.output_rowsum", "gemm.pow2_exact", "gemm.nonfinite")
GEMM_ROLES = ("a", "b", "c", "row_sums", "col_sums")
NORMALISATIONS = ("abs-product",)  # s = Σ_k |A_ik|·(|B|·1)_k over the checksum's tile
SEVERITIES = ("HEALTHY", "SUSPECT", "FAULTY", "ERROR")
DTYPES = {"BF16": (torch.bfloat16, 2), "F32": (torch.float32, 4)}
TORCH_DTYPE_NAME = {torch.bfloat16: "BF16", torch.float32: "F32"}

FULL_OPERANDS_LIMIT = 16 << 20  # writer policy: full operands up to this many bytes per vTask
MAX_SUBSET = 1024  # writer policy: at most this many flagged rows/columns in a subset vTask
MAX_DIM = 1 << 20
MAX_STRING = 4096
MAX_SAMPLES = 64
MAX_DEPTH = 8
_ID_RE = re.compile(r"^[A-Za-z0-9._:/+=@-]{1,256}$")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_HEX16 = re.compile(r"^[0-9a-f]{16}$")


@dataclass(frozen=True)
class Limits:
    """What a reader accepts. Memory used by ``read_bundle`` stays below about
    2·max_bytes + a small multiple of max_header."""

    max_bytes: int = 2 << 30  # whole file
    max_header: int = 32 << 20  # safetensors header (JSON), manifest included
    max_vtasks: int = 100_000
    max_tensors: int = 500_000

    @classmethod
    def from_env(cls, max_bytes: int | None = None) -> Limits:
        env = os.environ.get("AEGIS_BUNDLE_MAX_BYTES")
        if max_bytes is None and env:
            try:
                max_bytes = int(env)
            except ValueError:
                raise BundleError(f"AEGIS_BUNDLE_MAX_BYTES={env!r} is not an integer") from None
        if max_bytes is not None and max_bytes < 16:
            raise BundleError(f"bundle size limit {max_bytes} is too small (minimum 16 bytes)")
        return cls(max_bytes=max_bytes) if max_bytes is not None else cls()


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

    def to_json(self) -> dict:
        return {"layout": self.layout.value, "m": self.m, "n": self.n, "k": self.k, "tile": list(self.tile),
                "rows": self.rows, "cols": self.cols, "flagged_rows": self.flagged_rows, "flagged_cols": self.flagged_cols}


@dataclass
class VTask:
    id: str
    check: str
    op: str
    gemm: GemmSpec
    tensors: dict[str, torch.Tensor]  # role → tensor (a, b required; c, row_sums, col_sums observed)
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

    def operands(self, device: str | torch.device = "cpu") -> GemmOperands:
        return GemmOperands(self.tensors["a"].to(device), self.tensors["b"].to(device), self.gemm.layout)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def manifest_entry(self, names: dict[str, str]) -> dict:
        return {"id": self.id, "kind": self.kind, "check": self.check, "op": self.op, "case_id": self.case_id,
                "gemm": self.gemm.to_json(), "tensors": names, "scale": list(self.scale), "seed": self.seed,
                "dist": self.dist, "threshold": {"tau": self.tau, "confirm_margin": self.confirm_margin,
                                                 "normalisation": self.normalisation},
                "observed": _encode_floats(self.observed), "provenance": self.provenance, "extra": self.extra}


@dataclass
class Bundle:
    path: str
    format_version: int
    created: str
    producer: dict
    vtasks: list[VTask]


# -- JSON helpers ---------------------------------------------------------------------------
def _encode_floats(doc):
    """Non-finite floats as the strings "inf", "-inf", "nan" (JSON has no such numbers)."""
    if isinstance(doc, dict):
        return {k: _encode_floats(v) for k, v in doc.items()}
    if isinstance(doc, (list, tuple)):
        return [_encode_floats(v) for v in doc]
    if isinstance(doc, float) and not math.isfinite(doc):
        return "nan" if doc != doc else ("inf" if doc > 0 else "-inf")
    return doc


def _no_dupes(pairs):
    out = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"duplicate key {k!r}")
        out[k] = v
    return out


def _no_constants(name):
    raise ValueError(f"non-standard JSON constant {name}")


def _loads(text: str):
    return json.loads(text, object_pairs_hook=_no_dupes, parse_constant=_no_constants)


def _depth(doc, d: int = 0) -> int:
    if isinstance(doc, dict):
        return max([_depth(v, d + 1) for v in doc.values()] or [d + 1])
    if isinstance(doc, list):
        return max([_depth(v, d + 1) for v in doc] or [d + 1])
    return d


class _Check:
    """Schema checks with error messages that name the file and the field."""

    def __init__(self, label: str):
        self.label = "".join(ch if ch.isprintable() else "?" for ch in label)  # one line, whatever the name

    def fail(self, msg: str) -> BundleError:
        return BundleError(f"bundle {self.label}: {msg}")

    def obj(self, v, where: str, required: set[str], optional: set[str]) -> dict:
        if not isinstance(v, dict):
            raise self.fail(f"{where} must be a JSON object")
        missing = sorted(required - v.keys())
        if missing:
            raise self.fail(f"{where} lacks required field(s) {', '.join(missing)}")
        unknown = sorted(v.keys() - required - optional)
        if unknown:
            raise self.fail(f"{where} has unknown field(s) {', '.join(unknown)}")
        return v

    def int_(self, v, where: str, lo: int, hi: int) -> int:
        if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
            raise self.fail(f"{where} must be an integer in {lo}…{hi}, got {_short(v)}")
        return v

    def num(self, v, where: str, lo: float = -math.inf, hi: float = math.inf, nonfinite: bool = False) -> float:
        if nonfinite and v in ("inf", "-inf", "nan"):
            return float(v)
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not lo <= v <= hi:
            raise self.fail(f"{where} must be a number in [{lo}, {hi}], got {_short(v)}")
        return float(v)

    def str_(self, v, where: str, pattern: re.Pattern | None = None, choices: tuple[str, ...] | None = None) -> str:
        if not isinstance(v, str) or len(v) > MAX_STRING:
            raise self.fail(f"{where} must be a string of at most {MAX_STRING} characters")
        if choices is not None and v not in choices:
            raise self.fail(f"{where} is {_short(v)}, expected one of {', '.join(choices)}")
        if pattern is not None and not pattern.match(v):
            raise self.fail(f"{where} {_short(v)} is not valid (pattern {pattern.pattern})")
        return v

    def opt(self, v, fn, *args):
        return None if v is None else fn(v, *args)

    def indices(self, v, where: str, bound: int, strict: bool) -> list[int]:
        if not isinstance(v, list) or len(v) > bound:
            raise self.fail(f"{where} must be a list of at most {bound} indices")
        for i, x in enumerate(v):
            self.int_(x, f"{where}[{i}]", 0, bound - 1)
        if strict and any(b <= a for a, b in itertools.pairwise(v)):
            raise self.fail(f"{where} must be strictly increasing")
        return list(v)

    def str_map(self, v, where: str) -> dict:
        if not isinstance(v, dict) or len(v) > 256:
            raise self.fail(f"{where} must be an object of at most 256 strings")
        for k, x in v.items():
            self.str_(k, f"{where} key")
            self.str_(x, f"{where}.{k}")
        return dict(v)


def _short(v) -> str:
    r = repr(v)
    return r if len(r) <= 60 else r[:57] + "..."


_PROVENANCE = {"host": str, "device_id": str, "gpu_name": str, "gpu_uuid": str, "gpu_serial": str, "pci_bus_id": str,
               "rank": int, "step": int, "job": str, "captured": str, "command_line": list, "versions": dict,
               "kernel": str, "kernel_hashes": dict, "injected": bool}
_OBSERVED = {"severity", "summary", "max_normalised_diff", "margin", "elements", "reruns", "reproduced",
             "distinct_outputs", "samples", "fingerprints", "source", "truncated"}


def _check_vtask(ck: _Check, i: int, v) -> tuple[dict, dict]:
    """Validate one manifest vTask entry; returns (entry, role → tensor name)."""
    w = f"vtasks[{i}]"
    v = ck.obj(v, w, {"id", "kind", "check", "op", "gemm", "tensors", "scale", "threshold"},
               {"case_id", "seed", "dist", "observed", "provenance", "extra"})
    ck.str_(v["id"], f"{w}.id", _ID_RE)
    w = f"vTask {v['id']!r}"
    if v["kind"] not in KINDS:
        raise ck.fail(f"{w}: kind {_short(v['kind'])} is not supported by this aegis (supported: {', '.join(KINDS)})")
    ck.str_(v["check"], f"{w}: check", choices=GEMM_CHECKS)
    ck.str_(v["op"], f"{w}: op")
    ck.opt(v.get("case_id"), ck.str_, f"{w}: case_id")
    ck.opt(v.get("seed"), ck.int_, f"{w}: seed", 0, 2**63 - 1)
    ck.opt(v.get("dist"), ck.str_, f"{w}: dist")
    g = ck.obj(v["gemm"], f"{w}: gemm", {"layout", "m", "n", "k", "tile"}, {"rows", "cols", "flagged_rows", "flagged_cols"})
    ck.str_(g["layout"], f"{w}: gemm.layout", choices=tuple(x.value for x in Layout))
    for d in "mnk":
        ck.int_(g[d], f"{w}: gemm.{d}", 1, MAX_DIM)
    if not isinstance(g["tile"], list) or len(g["tile"]) != 2:
        raise ck.fail(f"{w}: gemm.tile must be a list of two integers (tm, tn)")
    for j, t in enumerate(g["tile"]):
        ck.int_(t, f"{w}: gemm.tile[{j}]", 1, MAX_DIM)
    for key, dim in (("rows", "m"), ("cols", "n")):
        if g.get(key) is not None:
            ck.indices(g[key], f"{w}: gemm.{key}", g[dim], strict=True)
            if not g[key]:
                raise ck.fail(f"{w}: gemm.{key} must not be empty (use null for all)")
        ck.indices(g.get(f"flagged_{key}", []), f"{w}: gemm.flagged_{key}", g[dim], strict=True)
    if not isinstance(v["scale"], list) or len(v["scale"]) != 2:
        raise ck.fail(f"{w}: scale must be a list of two integers (ea, eb)")
    for j, e in enumerate(v["scale"]):
        ck.int_(e, f"{w}: scale[{j}]", -126, 127)
    th = ck.obj(v["threshold"], f"{w}: threshold", {"tau"}, {"confirm_margin", "normalisation"})
    ck.num(th["tau"], f"{w}: threshold.tau", 1e-300, 0.999999)
    ck.opt(th.get("confirm_margin"), ck.num, f"{w}: threshold.confirm_margin", 1.0, 1e12)
    ck.opt(th.get("normalisation"), ck.str_, f"{w}: threshold.normalisation", None, NORMALISATIONS)
    names = ck.obj(v["tensors"], f"{w}: tensors", {"a", "b"}, set(GEMM_ROLES) - {"a", "b"})
    for role, name in names.items():
        ck.str_(name, f"{w}: tensors.{role}")
    if "row_sums" in names and g.get("cols") is not None:
        raise ck.fail(f"{w}: tensors.row_sums is only allowed when gemm.cols is null")
    if "col_sums" in names and g.get("rows") is not None:
        raise ck.fail(f"{w}: tensors.col_sums is only allowed when gemm.rows is null")
    obs = v.get("observed") or {}
    ck.obj(obs, f"{w}: observed", set(), _OBSERVED)
    for key in ("max_normalised_diff", "margin"):
        ck.opt(obs.get(key), ck.num, f"{w}: observed.{key}", -math.inf, math.inf, True)
    for key in ("elements", "reruns", "reproduced", "distinct_outputs"):
        ck.opt(obs.get(key), ck.int_, f"{w}: observed.{key}", 0, 2**62)
    ck.opt(obs.get("severity"), ck.str_, f"{w}: observed.severity", None, SEVERITIES)
    for key in ("summary", "source"):
        ck.opt(obs.get(key), ck.str_, f"{w}: observed.{key}")
    if obs.get("truncated") is not None and not isinstance(obs["truncated"], bool):
        raise ck.fail(f"{w}: observed.truncated must be true or false")
    samples = obs.get("samples", [])
    if not isinstance(samples, list) or len(samples) > MAX_SAMPLES or not all(isinstance(s, dict) for s in samples):
        raise ck.fail(f"{w}: observed.samples must be a list of at most {MAX_SAMPLES} objects")
    for s in samples:
        for key, x in s.items():
            ok = isinstance(x, (int, float, str, bool)) or (isinstance(x, list) and len(x) <= 4 and all(isinstance(e, int) for e in x))
            if not ok or (isinstance(x, str) and len(x) > 256):
                raise ck.fail(f"{w}: observed.samples entry {key!r} must be a number, a short string or a list of ≤ 4 integers")
    fps = ck.str_map(obs.get("fingerprints", {}), f"{w}: observed.fingerprints")
    for key, x in fps.items():
        ck.str_(x, f"{w}: observed.fingerprints.{key}", _HEX16)
    prov = v.get("provenance") or {}
    ck.obj(prov, f"{w}: provenance", set(), set(_PROVENANCE))
    for key, typ in _PROVENANCE.items():
        x = prov.get(key)
        if x is None:
            continue
        if typ is int:
            ck.int_(x, f"{w}: provenance.{key}", 0, 2**62)
        elif typ is bool:
            if not isinstance(x, bool):
                raise ck.fail(f"{w}: provenance.{key} must be true or false")
        elif typ is dict:
            ck.str_map(x, f"{w}: provenance.{key}")
        elif typ is list:
            if not isinstance(x, list) or len(x) > 256:
                raise ck.fail(f"{w}: provenance.{key} must be a list of at most 256 strings")
            for j, e in enumerate(x):
                ck.str_(e, f"{w}: provenance.{key}[{j}]")
        else:
            ck.str_(x, f"{w}: provenance.{key}")
    ck.str_map(v.get("extra") or {}, f"{w}: extra")
    return v, names


def _vtask_from_entry(v: dict, tensors: dict[str, torch.Tensor]) -> VTask:
    g, th = v["gemm"], v["threshold"]
    obs = {k: (float(x) if k in ("max_normalised_diff", "margin") and x is not None else x)
           for k, x in (v.get("observed") or {}).items()}
    spec = GemmSpec(layout=Layout(g["layout"]), m=g["m"], n=g["n"], k=g["k"], tile=(g["tile"][0], g["tile"][1]),
                    rows=g.get("rows"), cols=g.get("cols"), flagged_rows=list(g.get("flagged_rows", [])),
                    flagged_cols=list(g.get("flagged_cols", [])))
    return VTask(id=v["id"], kind=v["kind"], check=v["check"], op=v["op"], gemm=spec, tensors=tensors,
                 tau=float(th["tau"]), confirm_margin=float(th.get("confirm_margin", 4.0)),
                 normalisation=th.get("normalisation", "abs-product"), scale=(v["scale"][0], v["scale"][1]),
                 case_id=v.get("case_id") or "", seed=v.get("seed"), dist=v.get("dist"), observed=obs,
                 provenance=dict(v.get("provenance") or {}), extra=dict(v.get("extra") or {}))


# -- reading ---------------------------------------------------------------------------------
def _parse(data: bytes, label: str, limits: Limits) -> Bundle:
    """Validate a whole bundle held in memory, then load its tensors with safetensors."""
    ck = _Check(label)
    size = len(data)
    if size == 0:
        raise ck.fail("empty file")
    if size < 10:
        raise ck.fail(f"only {size} bytes: too short to be a bundle")
    (hlen,) = struct.unpack("<Q", data[:8])
    if hlen > size - 8:
        raise ck.fail(f"not a bundle, or truncated: header declares {hlen} bytes but the file has only {size - 8} after the length field")
    if hlen > limits.max_header:
        raise ck.fail(f"header declares {hlen} bytes, over the limit of {limits.max_header}")
    raw = data[8:8 + hlen]
    if raw[:1] != b"{":
        raise ck.fail("not a bundle: no safetensors JSON header at the start of the file")
    try:
        header = _loads(raw.decode("utf-8"))
    except RecursionError:
        raise ck.fail("header JSON is nested too deeply") from None
    except (UnicodeDecodeError, ValueError) as exc:
        raise ck.fail(f"header is not valid JSON ({str(exc).splitlines()[0][:120]})") from None
    if not isinstance(header, dict):
        raise ck.fail("header is not a JSON object")
    meta = header.pop("__metadata__", None)
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise ck.fail(f"not an aegis vTask bundle (safetensors __metadata__.format is not {FORMAT!r})")
    ck.obj(meta, "__metadata__", {"format", "format_version", "manifest", "manifest_sha256"}, set())
    if not all(isinstance(x, str) for x in meta.values()):  # the manifest's size is bounded by the header limit
        raise ck.fail("__metadata__ values must be strings")
    if meta["format_version"] not in [str(x) for x in READABLE_VERSIONS]:
        raise ck.fail(f"unknown format_version {_short(meta['format_version'])} (this aegis reads {', '.join(map(str, READABLE_VERSIONS))})")
    mtext = meta["manifest"]
    if hashlib.sha256(mtext.encode("utf-8")).hexdigest() != meta["manifest_sha256"]:
        raise ck.fail("manifest fails its SHA-256 check (corrupt bundle)")
    try:
        manifest = _loads(mtext)
    except RecursionError:
        raise ck.fail("manifest JSON is nested too deeply") from None
    except ValueError as exc:
        raise ck.fail(f"manifest is not valid JSON ({str(exc)[:120]})") from None
    if _depth(manifest) > MAX_DEPTH:
        raise ck.fail(f"manifest is nested deeper than {MAX_DEPTH} levels")
    ck.obj(manifest, "manifest", {"format", "format_version", "vtasks", "tensor_sha256"}, {"created", "producer"})
    if manifest["format"] != FORMAT or manifest["format_version"] != int(meta["format_version"]):
        raise ck.fail("manifest format/format_version disagree with the header's __metadata__")
    created = ck.opt(manifest.get("created"), ck.str_, "manifest.created") or ""
    producer = ck.str_map(manifest.get("producer") or {}, "manifest.producer")

    # tensor entries: dtype, shape and offsets must agree with each other and the file
    if len(header) > limits.max_tensors:
        raise ck.fail(f"{len(header)} tensors, over the limit of {limits.max_tensors}")
    data_len = size - 8 - hlen
    spans = []
    for name, e in header.items():
        ck.str_(name, "tensor name", _ID_RE)
        ck.obj(e, f"tensor {name!r}", {"dtype", "shape", "data_offsets"}, set())
        if e["dtype"] not in DTYPES:
            raise ck.fail(f"tensor {name!r} has dtype {_short(e['dtype'])}; bundles hold only {', '.join(DTYPES)}")
        if not isinstance(e["shape"], list) or len(e["shape"]) != 2:
            raise ck.fail(f"tensor {name!r} must be 2-D, shape is {_short(e['shape'])}")
        for d in e["shape"]:
            ck.int_(d, f"tensor {name!r} shape entry", 1, MAX_DIM)
        off = e["data_offsets"]
        if not isinstance(off, list) or len(off) != 2:
            raise ck.fail(f"tensor {name!r} data_offsets must be a list of two integers (begin, end)")
        begin, end = (ck.int_(x, f"tensor {name!r} data_offsets", 0, 2**63) for x in off)
        nbytes = e["shape"][0] * e["shape"][1] * DTYPES[e["dtype"]][1]
        if end - begin != nbytes:
            raise ck.fail(f"tensor {name!r}: shape {e['shape']} {e['dtype']} is {nbytes} bytes but data_offsets span {end - begin}")
        if end > data_len:
            raise ck.fail(f"tensor {name!r} declares bytes up to {end} but the data section has only {data_len} (truncated?)")
        spans.append((begin, end, name))
    spans.sort()
    pos = 0
    for begin, end, name in spans:
        if begin != pos:
            raise ck.fail(f"tensor {name!r} starts at {begin}, expected {pos} (overlapping or gapped data)")
        pos = end
    if pos != data_len:
        raise ck.fail(f"data section has {data_len} bytes but the tensors cover {pos}")

    # manifest: vTasks, roles, hashes
    hashes = manifest["tensor_sha256"]
    if not isinstance(hashes, dict) or set(hashes) != set(header):
        raise ck.fail("manifest.tensor_sha256 must list exactly the tensors in the file")
    vts = manifest["vtasks"]
    if not isinstance(vts, list) or len(vts) > limits.max_vtasks:
        raise ck.fail(f"manifest.vtasks must be a list of at most {limits.max_vtasks} vTasks")
    entries, seen, used = [], set(), set()
    for i, v in enumerate(vts):
        v, names = _check_vtask(ck, i, v)
        if v["id"] in seen:
            raise ck.fail(f"duplicate vTask id {v['id']!r}")
        seen.add(v["id"])
        g = v["gemm"]
        spec = GemmSpec(Layout(g["layout"]), g["m"], g["n"], g["k"], tuple(g["tile"]), g.get("rows"), g.get("cols"))
        for role, name in names.items():
            if name not in header:
                raise ck.fail(f"vTask {v['id']!r}: tensor {name!r} (role {role}) is not in the file")
            dt, shape = spec.expected(role)
            e = header[name]
            if e["dtype"] != dt or tuple(e["shape"]) != shape:
                raise ck.fail(f"vTask {v['id']!r}: tensor {name!r} (role {role}) is {e['dtype']} {e['shape']}, "
                              f"expected {dt} {list(shape)} for a {g['layout']} GEMM of {spec.m_sub}x{spec.n_sub}x{spec.k}")
            used.add(name)
        entries.append((v, names))
    unused = sorted(set(header) - used)
    if unused:
        raise ck.fail(f"tensor {unused[0]!r} is not used by any vTask")
    base = 8 + hlen
    for begin, end, name in spans:
        h = hashes[name]
        if not isinstance(h, str) or not _HEX64.match(h):
            raise ck.fail(f"manifest.tensor_sha256[{name!r}] is not a lower-case hex SHA-256")
        if hashlib.sha256(data[base + begin:base + end]).hexdigest() != h:
            raise ck.fail(f"tensor {name!r} fails its SHA-256 check (corrupt bundle)")

    # everything agrees: let safetensors build the tensors (no pickle, no code)
    try:
        from safetensors.torch import load as st_load

        tensors = st_load(data)
    except Exception as exc:  # safetensors' own validation; should not trigger after ours
        raise ck.fail(f"safetensors rejected the file ({str(exc).splitlines()[0][:160]})") from None
    vtasks = []
    for v, names in entries:
        ts = {role: tensors[name] for role, name in names.items()}
        for role in ("a", "b"):
            if not bool(torch.isfinite(ts[role]).all()):
                raise ck.fail(f"vTask {v['id']!r}: input {role} contains NaN or Inf")
        vtasks.append(_vtask_from_entry(v, ts))
    return Bundle(label, int(meta["format_version"]), created, producer, vtasks)


def read_bundle(path: str | os.PathLike, limits: Limits | None = None) -> Bundle:
    """Read and validate a bundle; BundleError (naming the file) on any problem."""
    limits = limits or Limits.from_env()
    label = str(path)
    ck = _Check(label)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise ck.fail("no such file") from None
    except OSError as exc:
        raise ck.fail(f"cannot read ({exc.strerror})") from None
    if stat.S_ISDIR(st.st_mode):
        raise ck.fail("is a directory, not a bundle file")
    if not stat.S_ISREG(st.st_mode):
        raise ck.fail("is not a regular file")
    if st.st_size > limits.max_bytes:
        raise ck.fail(f"file is {st.st_size} bytes, over the limit of {limits.max_bytes} (AEGIS_BUNDLE_MAX_BYTES)")
    try:
        with open(path, "rb") as fh:
            data = fh.read(limits.max_bytes + 1)
    except OSError as exc:
        raise ck.fail(f"cannot read ({exc.strerror})") from None
    if len(data) > limits.max_bytes:
        raise ck.fail(f"file grew past the limit of {limits.max_bytes} bytes while being read")
    return _parse(data, label, limits)


# -- writing ---------------------------------------------------------------------------------
class BundleWriter:
    """Append vTasks, then ``finalise()`` (or leave the ``with`` block) to write the bundle
    atomically: temp file in the same directory, fsync, rename. Nothing appears under
    ``path`` until then, and nothing at all when the block raises."""

    def __init__(self, path: str | os.PathLike, producer: dict[str, str] | None = None, created: str | None = None):
        from aegis_cli.report import tool_version

        self.path = Path(path)
        self.producer = producer or {"name": "aegis", "version": tool_version()}
        self.created = created or datetime.now(timezone.utc).isoformat(timespec="seconds")
        self._vtasks: list[VTask] = []
        self._ids: set[str] = set()

    def __enter__(self) -> BundleWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.finalise()

    def __len__(self) -> int:
        return len(self._vtasks)

    def add(self, vt: VTask) -> None:
        ck = _Check(str(self.path))
        if vt.id in self._ids:
            raise ck.fail(f"duplicate vTask id {vt.id!r}")
        _check_vtask(ck, len(self._vtasks), vt.manifest_entry({r: "x" for r in vt.tensors}))
        for role, t in vt.tensors.items():
            dt, shape = vt.gemm.expected(role)
            if TORCH_DTYPE_NAME.get(t.dtype) != dt or tuple(t.shape) != shape:
                raise ck.fail(f"vTask {vt.id!r}: tensor {role} is {t.dtype} {list(t.shape)}, expected {dt} {list(shape)}")
        for role in ("a", "b"):
            if not bool(torch.isfinite(vt.tensors[role]).all()):
                raise ck.fail(f"vTask {vt.id!r}: input {role} contains NaN or Inf")
        self._ids.add(vt.id)
        self._vtasks.append(vt)

    def to_bytes(self) -> bytes:
        from safetensors.torch import save as st_save

        tensors: dict[str, torch.Tensor] = {}
        hashes: dict[str, str] = {}
        by_content: dict[tuple, str] = {}
        entries = []
        for vt in self._vtasks:
            names = {}
            for role, t in vt.tensors.items():
                t = t.detach().to("cpu").contiguous()
                digest = hashlib.sha256(_raw(t)).hexdigest()
                key = (digest, TORCH_DTYPE_NAME[t.dtype], tuple(t.shape))
                if key not in by_content:  # identical tensors are stored once
                    name = f"t{len(tensors)}"
                    by_content[key] = name
                    tensors[name] = t.clone()
                    hashes[name] = digest
                names[role] = by_content[key]
            entries.append(vt.manifest_entry(names))
        manifest = {"format": FORMAT, "format_version": FORMAT_VERSION, "created": self.created,
                    "producer": self.producer, "tensor_sha256": hashes, "vtasks": entries}
        mtext = json.dumps(manifest, separators=(",", ":"), allow_nan=False)
        meta = {"format": FORMAT, "format_version": str(FORMAT_VERSION), "manifest": mtext,
                "manifest_sha256": hashlib.sha256(mtext.encode("utf-8")).hexdigest()}
        return st_save(tensors, metadata=meta)

    def finalise(self) -> int:
        """Write the bundle; returns the number of vTasks. The bytes are validated by the
        reader before they reach the disk."""
        from aegis_cli.report import atomic_write

        data = self.to_bytes()
        _parse(data, str(self.path), Limits(max_bytes=max(len(data), 16), max_header=max(len(data), 16),
                                            max_vtasks=10**9, max_tensors=10**9))
        if self.path.is_dir():
            raise BundleError(f"bundle {self.path}: is a directory")
        try:
            atomic_write(self.path, data)
        except OSError as exc:
            raise BundleError(f"bundle {self.path}: cannot write ({exc.strerror or exc})") from None
        except AegisError as exc:  # report.atomic_write's own error type
            raise BundleError(f"bundle {self.path}: {exc}") from None
        return len(self._vtasks)


def _raw(t: torch.Tensor) -> bytes:
    """The tensor's bytes as safetensors stores them (little-endian, row-major)."""
    view = {2: torch.int16, 4: torch.int32}[t.element_size()]
    return t.contiguous().view(view).numpy().astype(f"<i{t.element_size()}", copy=False).tobytes()


# -- capture from a scan -----------------------------------------------------------------------
def _flag_sets(res, ref, tau: float) -> tuple[list[int], list[int]]:
    from aegis_cli import numerics

    d_row = numerics.normalised_diff(res.row_sums, ref.row, ref.row_scale) > tau  # (M, nt_n)
    d_col = numerics.normalised_diff(res.col_sums, ref.col, ref.col_scale) > tau  # (nt_m, N)
    return (d_row.any(1).nonzero().flatten().cpu().tolist(), d_col.any(0).nonzero().flatten().cpu().tolist())


def _sample_rows(ev, key: str) -> list[int]:
    out = {int(s[key]) for s in ev.samples if isinstance(s.get(key), int)}
    out |= {int(p[0 if key == "row" else 1]) for p in ev.localised}
    return sorted(out)


def capture_gemm_vtasks(device, case, evidence: list, fault, tau: float, confirm_margin: float, provenance: dict) -> list[VTask]:
    """vTasks for the flagged evidence of one GEMM case (all at one scale): regenerate the
    case's operands on ``device``, re-run it once (with ``fault`` when the scan injected one)
    to record what the device produces, and keep the full operands when small, else the
    flagged rows (row checks) or columns (column checks)."""
    from aegis_cli import fingerprint
    from aegis_cli.probes.gemm import scaled

    ea, eb = evidence[0].scale
    cid = evidence[0].case_id
    ops = scaled(case.operands(device), ea, eb)
    ref = device.reference_checksums(ops, device.tile)
    clean_median = None
    if fault is not None and fault.needs_clean_median():
        base = case.operands(device)
        clean = device.checked_gemm(base)
        clean_median = float((clean.row_sums.double() - device.reference_checksums(base, device.tile).row).abs().median())
    res = device.checked_gemm(ops, fault, op=cid, clean_median=clean_median)
    frows, fcols = _flag_sets(res, ref, tau)
    m, n, k = ops.mnk
    full_bytes = 2 * (m * k + k * n + m * n) + 4 * (res.row_sums.numel() + res.col_sums.numel())
    a, b = device.to_host(ops.a), device.to_host(ops.b)
    c, rs, cs = device.to_host(res.c), device.to_host(res.row_sums), device.to_host(res.col_sums)
    fps = {"c": fingerprint.hex64(fingerprint.fingerprint(c)), "row_sums": fingerprint.hex64(fingerprint.fingerprint(rs)),
           "col_sums": fingerprint.hex64(fingerprint.fingerprint(cs))}
    s = case.shape
    out = []
    for ev in evidence:
        rows_flag = frows or _sample_rows(ev, "row")
        cols_flag = fcols or _sample_rows(ev, "col")
        spec = GemmSpec(layout=s.layout, m=m, n=n, k=k, tile=tuple(res.tile), flagged_rows=rows_flag[:MAX_SUBSET],
                        flagged_cols=cols_flag[:MAX_SUBSET])
        truncated = False
        use_cols = ev.check == "gemm.col_checksum"
        if full_bytes <= FULL_OPERANDS_LIMIT or not (cols_flag if use_cols else rows_flag):
            tensors = {"a": a, "b": b, "c": c, "row_sums": rs, "col_sums": cs}
        elif use_cols:
            spec.cols = cols_flag[:MAX_SUBSET]
            truncated = len(cols_flag) > MAX_SUBSET
            idx = torch.tensor(spec.cols)
            b_sub = b[idx] if s.layout is Layout.FWD else b[:, idx]
            tensors = {"a": a, "b": b_sub.contiguous(), "c": c[:, idx].contiguous(), "col_sums": cs[:, idx].contiguous()}
        else:
            spec.rows = rows_flag[:MAX_SUBSET]
            truncated = len(rows_flag) > MAX_SUBSET
            idx = torch.tensor(spec.rows)
            a_sub = a[:, idx] if s.layout is Layout.WGRAD else a[idx]
            tensors = {"a": a_sub.contiguous(), "b": b, "c": c[idx].contiguous(), "row_sums": rs[idx].contiguous()}
        observed = {"severity": ev.severity.value, "summary": ev.summary[:MAX_STRING], "max_normalised_diff": ev.max_value,
                    "margin": ev.margin, "elements": ev.elements, "reruns": ev.reruns, "reproduced": ev.reproduced,
                    "distinct_outputs": ev.distinct_outputs, "samples": [_clean_sample(x) for x in ev.samples[:MAX_SAMPLES]],
                    "fingerprints": fps, "source": "re-run at save time on the capturing device", "truncated": truncated}
        out.append(VTask(id=f"{provenance.get('device_id', 'dev')}/{cid}/{ev.check}", check=ev.check, op=s.op, gemm=spec,
                         tensors=tensors, tau=tau, confirm_margin=confirm_margin, scale=(ea, eb), case_id=cid,
                         seed=case.seed, dist=case.dist, observed={k: v for k, v in observed.items() if v is not None},
                         provenance={**provenance, "kernel": res.kernel}))
    return out


def _clean_sample(s: dict) -> dict:
    out = {}
    for k, v in s.items():
        if isinstance(v, (bool, int, str)) or (isinstance(v, list) and len(v) <= 4 and all(isinstance(e, int) for e in v)):
            out[k] = v[:256] if isinstance(v, str) else v
        elif isinstance(v, float):
            out[k] = v if math.isfinite(v) else ("nan" if v != v else ("inf" if v > 0 else "-inf"))
    return out


def save_scan_vtasks(report: Report, opts: ScanOptions, path: str | os.PathLike) -> int:
    """Save every flagged GEMM case of a scan as vTasks in one bundle; returns how many.

    Operands are regenerated deterministically (same workload, seed, case) on the device
    that flagged them. Evidence of non-GEMM checks is skipped (no vTask kind for it yet).
    """
    from aegis_cli import workloads
    from aegis_cli.backends import resolve_devices
    from aegis_cli.backends.loader import kernel_hashes
    from aegis_cli.inject import FaultPlan
    from aegis_cli.report import versions
    from aegis_cli.scan import DEFAULT_CPU_WORKLOAD, DEFAULT_GPU_WORKLOAD, plan_cases

    plan = FaultPlan.parse(opts.inject) if opts.inject else None
    vers = versions()
    rank = os.environ.get("RANK")
    writer = BundleWriter(path)
    for dr in report.devices:
        ev_gemm = [e for e in dr.evidence if e.check in GEMM_CHECKS]
        if not ev_gemm:
            continue
        device = resolve_devices(dr.identity.id)[0]
        ident = dr.identity
        wl = workloads.load(dr.workload or (DEFAULT_CPU_WORKLOAD if ident.backend == "cpu" else DEFAULT_GPU_WORKLOAD))
        fault = plan.for_device(ident.id) if plan else None
        prov = {"host": ident.host, "device_id": ident.id, "gpu_name": ident.name, "gpu_uuid": ident.uuid,
                "gpu_serial": ident.serial, "pci_bus_id": ident.pci_bus_id, "rank": int(rank) if rank and rank.isdigit() else None,
                "job": f"aegis scan (workload {wl.name}, seed {opts.seed})", "captured": report.started,
                "command_line": [str(x)[:MAX_STRING] for x in report.command_line][:256],
                "versions": {k: v for k, v in {**vers, "driver": ident.driver, "cuda": vers.get("torch_cuda")}.items() if v},
                "kernel_hashes": kernel_hashes(), "injected": plan is not None}
        prov = {k: v for k, v in prov.items() if v is not None}
        by_case: dict[str, list] = {}
        for e in ev_gemm:
            by_case.setdefault(e.case_id, []).append(e)
        for cid, evs in by_case.items():
            case = plan_cases(wl, opts.seed, cid)[0]
            for vt in capture_gemm_vtasks(device, case, evs, fault, opts.thresholds.tau, opts.thresholds.confirm_margin, prov):
                writer.add(vt)
    return writer.finalise()
