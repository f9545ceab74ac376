"""vTask bundles: one safetensors file of vTasks (normative spec: docs/bundle-format.md).

A bundle is one safetensors file: the tensors, plus a JSON manifest in the header's
``__metadata__``. Bundles come from other machines and other people, so ``read_bundle``
trusts nothing: it parses the safetensors header itself (length against the file size
and the limits, offsets against dtypes and shapes, every tensor against the manifest),
checks a SHA-256 over every tensor and over the manifest, and only then hands the bytes
to ``safetensors.torch.load`` (no pickle, no code, ever); it checks each stored tensor's
values once, however many vTasks share it. Every problem is a BundleError naming the file
on one line. ``BundleWriter`` appends vTasks and finalises atomically, refusing what a
reader would refuse (the reader's own limits included) before anything is written.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import math
import os
import re
import stat
import struct
from datetime import datetime, timezone
from pathlib import Path

import torch

from aegis_cli import numerics
from aegis_cli.backends.base import GemmOperands, Layout
from aegis_cli.errors import AegisError, BundleError
from aegis_cli.vtask import (
    DTYPES,
    FORMAT,
    FORMAT_VERSION,
    GEMM_CHECKS,
    GEMM_ROLES,
    KINDS,
    MAX_DEPTH,
    MAX_DIM,
    MAX_SAMPLES,
    MAX_STRING,
    NORMALISATIONS,
    READABLE_VERSIONS,
    SEVERITIES,
    TAU_RANGE,
    TORCH_DTYPE_NAME,
    Bundle,
    GemmSpec,
    Limits,
    VTask,
)

# matched with fullmatch: "$" would also accept a trailing newline
ID_RE = re.compile(r"[A-Za-z0-9._:/+=@-]{1,256}")
_HEX64 = re.compile(r"[0-9a-f]{64}")
_HEX16 = re.compile(r"[0-9a-f]{16}")
_SURROGATE = re.compile(r"[\ud800-\udfff]")


# -- strict JSON -----------------------------------------------------------------------------
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


def _tree_problem(doc, max_depth: int) -> str | None:
    """What is wrong with a parsed JSON document as a whole, or None: containers nested deeper
    than ``max_depth``, or a string holding a lone surrogate (a "\\ud800" escape decodes to one;
    it is no Unicode text, and fails wherever it is encoded later). Iterative: a recursive
    walk hits Python's recursion limit on a few hundred levels that json.loads accepts."""
    stack = [(doc, 0)]
    while stack:
        x, d = stack.pop()
        if isinstance(x, (dict, list)):
            if d + 1 > max_depth:
                return f"is nested deeper than {max_depth} levels"
            if isinstance(x, dict):
                stack.extend((k, d) for k in x)
                stack.extend((v, d + 1) for v in x.values())
            else:
                stack.extend((v, d + 1) for v in x)
        elif isinstance(x, str) and not x.isascii() and _SURROGATE.search(x):
            return "holds a string that is not valid Unicode (a lone surrogate)"
    return None


def error(label: str, msg: str) -> BundleError:
    """A BundleError naming the bundle ``label`` on one line, whatever characters its name holds."""
    return _Check(label).fail(msg)


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
        if pattern is not None and not pattern.fullmatch(v):
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
    ck.str_(v["id"], f"{w}.id", ID_RE)
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
    ck.num(th["tau"], f"{w}: threshold.tau", *TAU_RANGE)
    # optional, but not nullable: absent means the default, null means nothing a reader can use
    if "confirm_margin" in th:
        ck.num(th["confirm_margin"], f"{w}: threshold.confirm_margin", 1.0, 1e12)
    if "normalisation" in th:
        ck.str_(th["normalisation"], f"{w}: threshold.normalisation", None, NORMALISATIONS)
    names = ck.obj(v["tensors"], f"{w}: tensors", {"a", "b"}, set(GEMM_ROLES) - {"a", "b"})
    for role, name in names.items():
        ck.str_(name, f"{w}: tensors.{role}")
    if "row_sums" in names and g.get("cols") is not None:
        raise ck.fail(f"{w}: tensors.row_sums is only allowed when gemm.cols is null")
    if "col_sums" in names and g.get("rows") is not None:
        raise ck.fail(f"{w}: tensors.col_sums is only allowed when gemm.rows is null")
    obs = ck.obj(v.get("observed", {}), f"{w}: observed", set(), _OBSERVED)
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
    prov = ck.obj(v.get("provenance", {}), f"{w}: provenance", set(), set(_PROVENANCE))
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
    ck.str_map(v.get("extra", {}), f"{w}: extra")
    return v, names


class _InputCheck:
    """The inputs' rules (spec §3.2): finite operands whose products cannot overflow fp32 in any
    partial sum of C or of its checksums. Beyond that an inf in C or in a sum is arithmetic, not
    a fault, and a replay would call every device FAULTY.

    Work is done once per stored tensor (keys name them), not per vTask: many vTasks may share
    one tensor, and redoing the checks for each let a small bundle keep a reader busy for hours.
    A pair of operands is first bounded from per-tensor maxima along K (Σ_k max_i|A_ik|·max_j|B_kj|
    bounds every output); only a pair that bound cannot clear gets numerics.overflow_bound,
    the tighter one the spec names, so what is accepted does not change."""

    def __init__(self, ck: _Check):
        self.ck = ck
        self._finite: set = set()
        self._kmax: dict[tuple, tuple[torch.Tensor, float, float]] = {}  # key → (max along K, its max, its sum)
        self._pairs: set = set()

    def _maxima(self, key, t: torch.Tensor, dim: int) -> tuple[torch.Tensor, float, float]:
        if (key, dim) not in self._kmax:
            v = numerics.abs_max_along(t, dim)
            self._kmax[(key, dim)] = (v, float(v.max()), float(v.sum()))
        return self._kmax[(key, dim)]

    def check(self, vid: str, tensors: dict[str, torch.Tensor], keys: dict[str, object], layout: Layout) -> None:
        for role in ("a", "b"):
            if keys[role] not in self._finite:
                if not bool(torch.isfinite(tensors[role]).all()):
                    raise self.ck.fail(f"vTask {vid!r}: input {role} contains NaN or Inf")
                self._finite.add(keys[role])
        pair = (keys["a"], keys["b"], layout)
        if pair in self._pairs:
            return
        ops = GemmOperands(tensors["a"], tensors["b"], layout)
        a_max, a_top, a_sum = self._maxima(keys["a"], ops.a_mk, 0)  # (K,): max_i |A_ik|
        b_max, b_top, b_sum = self._maxima(keys["b"], ops.b_kn, 1)  # (K,): max_j |B_kj|
        span = numerics.CHECKSUM_SPAN
        bound = min(a_top * b_sum, a_sum * b_top) * span
        if bound >= numerics.SUM_LIMIT:
            bound = float(a_max @ b_max) * span
        if bound >= numerics.SUM_LIMIT:
            bound = numerics.overflow_bound(ops)
        if bound >= numerics.SUM_LIMIT:
            raise self.ck.fail(f"vTask {vid!r}: its inputs can overflow fp32 (Σ|A|·|B| over a checksum tile up to {bound:.3g}, "
                               f"limit {numerics.SUM_LIMIT:.3g}), so no check could tell a fault from overflow")
        self._pairs.add(pair)


def entry_problem(vt: VTask) -> str | None:
    """What a reader would object to in ``vt``'s manifest entry (its tensors aside), or None:
    lets a producer refuse, before any work, what it could not save."""
    try:
        _check_vtask(_Check(""), 0, vt.manifest_entry({"a": "a", "b": "b"}))
    except BundleError as exc:
        return str(exc).removeprefix("bundle : ")
    return None


def _vtask_from_entry(v: dict, spec: GemmSpec, tensors: dict[str, torch.Tensor]) -> VTask:
    th = v["threshold"]
    obs = {k: (float(x) if k in ("max_normalised_diff", "margin") and x is not None else x)
           for k, x in (v.get("observed") or {}).items()}
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
    if not raw.rstrip(b" ").endswith(b"}"):  # JSON would take any whitespace; the spec pads with spaces only
        raise ck.fail("header must be one JSON object, padded at the end with spaces (0x20) only")
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
    try:  # a JSON escape like \ud800 decodes to a lone surrogate, which has no UTF-8 bytes to hash
        mbytes = mtext.encode("utf-8")
    except UnicodeEncodeError:
        raise ck.fail("__metadata__.manifest is not valid Unicode text (a lone surrogate)") from None
    if hashlib.sha256(mbytes).hexdigest() != meta["manifest_sha256"]:
        raise ck.fail("manifest fails its SHA-256 check (corrupt bundle)")
    try:
        manifest = _loads(mtext)
    except RecursionError:
        raise ck.fail("manifest JSON is nested too deeply") from None
    except ValueError as exc:
        raise ck.fail(f"manifest is not valid JSON ({str(exc)[:120]})") from None
    problem = _tree_problem(manifest, MAX_DEPTH)
    if problem:
        raise ck.fail(f"manifest {problem}")
    ck.obj(manifest, "manifest", {"format", "format_version", "vtasks", "tensor_sha256"}, {"created", "producer"})
    ck.int_(manifest["format_version"], "manifest.format_version", 1, 2**31 - 1)  # an integer: not true, not 1.0
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
        ck.str_(name, "tensor name", ID_RE)
        ck.obj(e, f"tensor {name!r}", {"dtype", "shape", "data_offsets"}, set())
        if not isinstance(e["dtype"], str) or e["dtype"] not in DTYPES:  # a list or object is no dict key
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
        spec = GemmSpec.from_json(g)
        for role, name in names.items():
            if name not in header:
                raise ck.fail(f"vTask {v['id']!r}: tensor {name!r} (role {role}) is not in the file")
            dt, shape = spec.expected(role)
            e = header[name]
            if e["dtype"] != dt or tuple(e["shape"]) != shape:
                raise ck.fail(f"vTask {v['id']!r}: tensor {name!r} (role {role}) is {e['dtype']} {e['shape']}, "
                              f"expected {dt} {list(shape)} for a {g['layout']} GEMM of {spec.m_sub}x{spec.n_sub}x{spec.k}")
            used.add(name)
        entries.append((v, names, spec))
    unused = sorted(set(header) - used)
    if unused:
        raise ck.fail(f"tensor {unused[0]!r} is not used by any vTask")
    base = 8 + hlen
    for begin, end, name in spans:
        h = hashes[name]
        if not isinstance(h, str) or not _HEX64.fullmatch(h):
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
    inputs = _InputCheck(ck)
    for v, names, spec in entries:
        ts = {role: tensors[name] for role, name in names.items()}
        inputs.check(v["id"], ts, names, spec.layout)
        vtasks.append(_vtask_from_entry(v, spec, ts))
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
    try:  # the size it has, not the limit: a raised limit must not allocate that much
        with open(path, "rb") as fh:
            data = fh.read(st.st_size + 1)
    except OSError as exc:
        raise ck.fail(f"cannot read ({exc.strerror})") from None
    if len(data) > st.st_size:  # BundleWriter renames a finished file into place; it never grows
        raise ck.fail(f"file grew past its {st.st_size} bytes while being read (still being written?)")
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
        if len(self._vtasks) >= Limits().max_vtasks:
            raise ck.fail(f"a bundle holds at most {Limits().max_vtasks} vTasks (what readers accept); save the rest in another")
        _check_vtask(ck, len(self._vtasks), vt.manifest_entry({r: "x" for r in vt.tensors}))
        for role, t in vt.tensors.items():
            dt, shape = vt.gemm.expected(role)
            if TORCH_DTYPE_NAME.get(t.dtype) != dt or tuple(t.shape) != shape:
                raise ck.fail(f"vTask {vt.id!r}: tensor {role} is {t.dtype} {list(t.shape)}, expected {dt} {list(shape)}")
        _InputCheck(ck).check(vt.id, vt.tensors, {"a": "a", "b": "b"}, vt.gemm.layout)
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
        reader, with the reader's limits, before they reach the disk."""
        from aegis_cli.report import atomic_write

        data = self.to_bytes()
        # the header and count limits no reader can raise; the file-size limit it can (--max-bundle-size)
        limits = dataclasses.replace(Limits(), max_bytes=max(len(data), 16))
        (hlen,) = struct.unpack("<Q", data[:8])
        if hlen > limits.max_header:
            raise _Check(str(self.path)).fail(
                f"its {len(self._vtasks)} vTasks need a {hlen}-byte header, over the {limits.max_header} bytes readers "
                "accept; save fewer vTasks per bundle")
        _parse(data, str(self.path), limits)
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
