"""The manifest of a vTask bundle: strict JSON, and the schema checks of each vTask entry and
of its input values (normative spec: docs/bundle-format.md §3). Split from bundle.py, which
owns the file format (safetensors header, hashes, reading and writing): this module knows
what a vTask entry may say, bundle.py where it is stored. Every problem is a BundleError
naming the file on one line.
"""

from __future__ import annotations

import itertools
import json
import math
import re

import torch

from aegis_cli.checks.gemm import GEMM_CHECKS
from aegis_cli.ops import numerics
from aegis_cli.ops.errors import BundleError
from aegis_cli.ops.gemm import GemmOperands, Layout
from aegis_cli.vtask.attention_entry import check_attention
from aegis_cli.vtask.model import (
    ATTENTION_INPUTS,
    FORMAT_VERSION,
    GEMM_ROLES,
    KINDS,
    MAX_DIM,
    MAX_SAMPLES,
    MAX_STRING,
    NORMALISATIONS,
    SEVERITIES,
    TAU_RANGE,
    AttentionSpec,
    GemmSpec,
    VTask,
)

ID_CHARS = "A-Za-z0-9._:/+=@-"  # what vTask ids and tensor names are made of (docs/bundle-format.md)
# matched with fullmatch: "$" would also accept a trailing newline
ID_RE = re.compile(f"[{ID_CHARS}]{{1,256}}")
NOT_ID = re.compile(f"[^{ID_CHARS}]")
HEX64 = re.compile(r"[0-9a-f]{64}")
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


def loads(text: str):
    return json.loads(text, object_pairs_hook=_no_dupes, parse_constant=_no_constants)


def tree_problem(doc, max_depth: int) -> str | None:
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
    return Check(label).fail(msg)


class Check:
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
            raise self.fail(f"{where} must be an integer in {lo}…{hi}, got {short(v)}")
        return v

    def num(self, v, where: str, lo: float = -math.inf, hi: float = math.inf, nonfinite: bool = False) -> float:
        if nonfinite and v in ("inf", "-inf", "nan"):
            return float(v)
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not lo <= v <= hi:
            raise self.fail(f"{where} must be a number in [{lo}, {hi}], got {short(v)}")
        return float(v)

    def str_(self, v, where: str, pattern: re.Pattern | None = None, choices: tuple[str, ...] | None = None) -> str:
        if not isinstance(v, str) or len(v) > MAX_STRING:
            raise self.fail(f"{where} must be a string of at most {MAX_STRING} characters")
        if choices is not None and v not in choices:
            raise self.fail(f"{where} is {short(v)}, expected one of {', '.join(choices)}")
        if pattern is not None and not pattern.fullmatch(v):
            raise self.fail(f"{where} {short(v)} is not valid (pattern {pattern.pattern})")
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

    def exponents(self, v, where: str, what: str) -> list[int]:
        """A pair of power-of-two exponents (an entry's ``scale``); ``what`` names them in the message."""
        if not isinstance(v, list) or len(v) != 2:
            raise self.fail(f"{where} must be a list of two integers ({what})")
        for j, e in enumerate(v):
            self.int_(e, f"{where}[{j}]", -126, 127)
        return v

    def threshold(self, v, where: str, tau: tuple[float, float], normalisations: tuple[str, ...]) -> dict:
        """An entry's ``threshold``: τ in ``tau``; confirm_margin and normalisation optional but,
        when present, not null (absent means the default, null means nothing a reader can use)."""
        th = self.obj(v, where, {"tau"}, {"confirm_margin", "normalisation"})
        self.num(th["tau"], f"{where}.tau", *tau)
        if "confirm_margin" in th:
            self.num(th["confirm_margin"], f"{where}.confirm_margin", 1.0, 1e12)
        if "normalisation" in th:
            self.str_(th["normalisation"], f"{where}.normalisation", None, normalisations)
        return th

    def tensor_names(self, v, where: str, required: set[str], optional: set[str]) -> dict:
        """An entry's ``tensors``: role → the name of its tensor in the bundle."""
        names = self.obj(v, where, required, optional)
        for role, name in names.items():
            self.str_(name, f"{where}.{role}")
        return names

    def str_map(self, v, where: str) -> dict:
        if not isinstance(v, dict) or len(v) > 256:
            raise self.fail(f"{where} must be an object of at most 256 strings")
        for k, x in v.items():
            self.str_(k, f"{where} key")
            self.str_(x, f"{where}.{k}")
        return dict(v)


def short(v) -> str:
    r = repr(v)
    return r if len(r) <= 60 else r[:57] + "..."


_PROVENANCE = {"host": str, "device_id": str, "gpu_name": str, "gpu_uuid": str, "gpu_serial": str, "pci_bus_id": str,
               "rank": int, "step": int, "job": str, "captured": str, "command_line": list, "versions": dict,
               "kernel": str, "kernel_hashes": dict, "injected": bool}
_OBSERVED = {"severity", "summary", "max_normalised_diff", "margin", "elements", "reruns", "reproduced",
             "distinct_outputs", "samples", "fingerprints", "source", "truncated"}


def check_vtask(ck: Check, i: int, v, version: int = FORMAT_VERSION) -> tuple[dict, dict]:
    """Validate one manifest vTask entry of a bundle of format ``version``; returns (entry, role →
    tensor name)."""
    w = f"vtasks[{i}]"
    kind = v.get("kind") if isinstance(v, dict) else None
    v = ck.obj(v, w, {"id", "kind", "check", "op", "attention" if kind == "attention" else "gemm", "tensors", "scale",
                      "threshold"}, {"case_id", "seed", "dist", "observed", "provenance", "extra"})
    ck.str_(v["id"], f"{w}.id", ID_RE)
    w = f"vTask {v['id']!r}"
    if v["kind"] not in KINDS:
        raise ck.fail(f"{w}: kind {short(v['kind'])} is not supported by this aegis (supported: {', '.join(KINDS)})")
    ck.str_(v["op"], f"{w}: op")
    ck.opt(v.get("case_id"), ck.str_, f"{w}: case_id")
    ck.opt(v.get("seed"), ck.int_, f"{w}: seed", 0, 2**63 - 1)
    ck.opt(v.get("dist"), ck.str_, f"{w}: dist")
    if kind == "attention" and version < 2:
        raise ck.fail(f"{w}: kind 'attention' is new in format_version 2; this bundle says {version}")
    names = check_attention(ck, w, v) if kind == "attention" else _check_gemm(ck, w, v, version)
    _check_common(ck, w, v)
    return v, names


def _check_gemm(ck: Check, w: str, v: dict, version: int) -> dict:
    """The gemm-specific fields of entry ``v`` of a bundle of format ``version``; returns role → tensor name."""
    ck.str_(v["check"], f"{w}: check", choices=GEMM_CHECKS)
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
    ck.exponents(v["scale"], f"{w}: scale", "ea, eb")
    # version 1 knew only "abs-product" (docs/bundle-format.md §7)
    th = ck.threshold(v["threshold"], f"{w}: threshold", TAU_RANGE, NORMALISATIONS if version >= 2 else NORMALISATIONS[:1])
    if th.get("normalisation", "abs-product") == "abs-product":  # a difference is never more than 1·s off
        ck.num(th["tau"], f"{w}: threshold.tau (abs-product)", TAU_RANGE[0], 0.999999)
    names = ck.tensor_names(v["tensors"], f"{w}: tensors", {"a", "b"}, set(GEMM_ROLES) - {"a", "b"})
    if "row_sums" in names and g.get("cols") is not None:
        raise ck.fail(f"{w}: tensors.row_sums is only allowed when gemm.cols is null")
    if "col_sums" in names and g.get("rows") is not None:
        raise ck.fail(f"{w}: tensors.col_sums is only allowed when gemm.rows is null")
    return names


def _check_common(ck: Check, w: str, v: dict) -> None:
    """observed, provenance and extra: the same for every kind."""
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


class InputCheck:
    """The inputs' rules (spec §3.2): finite operands whose products cannot overflow fp32 in any
    partial sum of C or of its checksums. Beyond that an inf in C or in a sum is arithmetic, not
    a fault, and a replay would call every device FAULTY.

    Work is done once per stored tensor (keys name them), not per vTask: many vTasks may share
    one tensor, and redoing the checks for each let a small bundle keep a reader busy for hours.
    A pair of operands is first bounded from per-tensor maxima along K (Σ_k max_i|A_ik|·max_j|B_kj|
    bounds every output); only a pair that bound cannot clear gets numerics.overflow_bound,
    the tighter one the spec names, so what is accepted does not change."""

    def __init__(self, ck: Check):
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
        roles = ATTENTION_INPUTS if vt.kind == "attention" else ("a", "b")
        check_vtask(Check(""), 0, vt.manifest_entry({r: r for r in roles}))
    except BundleError as exc:
        return str(exc).removeprefix("bundle : ")
    return None


def spec_of(v: dict) -> GemmSpec | AttentionSpec:
    """The object of a checked entry's kind."""
    return AttentionSpec.from_json(v["attention"]) if v["kind"] == "attention" else GemmSpec.from_json(v["gemm"])


def vtask_from_entry(v: dict, spec: GemmSpec | AttentionSpec, tensors: dict[str, torch.Tensor]) -> VTask:
    th = v["threshold"]
    attention = v["kind"] == "attention"
    obs = {k: (float(x) if k in ("max_normalised_diff", "margin") and x is not None else x)
           for k, x in (v.get("observed") or {}).items()}
    return VTask(id=v["id"], kind=v["kind"], check=v["check"], op=v["op"], gemm=None if attention else spec,
                 attention=spec if attention else None, tensors=tensors,
                 tau=float(th["tau"]), confirm_margin=float(th.get("confirm_margin", 4.0)),
                 normalisation=th.get("normalisation", "rounding-spread" if attention else "abs-product"), scale=(v["scale"][0], v["scale"][1]),
                 case_id=v.get("case_id") or "", seed=v.get("seed"), dist=v.get("dist"), observed=obs,
                 provenance=dict(v.get("provenance") or {}), extra=dict(v.get("extra") or {}))
