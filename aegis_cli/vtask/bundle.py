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
import json
import os
import stat
import struct
from datetime import datetime, timezone
from pathlib import Path

import torch

from aegis_cli.ops.errors import AegisError, BundleError
from aegis_cli.vtask.attention_entry import input_problem
from aegis_cli.vtask.manifest import HEX64, ID_RE, Check, InputCheck, check_vtask, loads, short, spec_of, tree_problem, vtask_from_entry
from aegis_cli.vtask.model import (
    ATTENTION_INPUTS,
    DTYPES,
    FORMAT,
    FORMAT_VERSION,
    MAX_DEPTH,
    MAX_DIM,
    READABLE_VERSIONS,
    TORCH_DTYPE_NAME,
    Bundle,
    Limits,
    VTask,
)


# -- reading ---------------------------------------------------------------------------------
def parse_bundle(data: bytes, label: str, limits: Limits) -> Bundle:
    """Validate a whole bundle held in memory, then load its tensors with safetensors."""
    ck = Check(label)
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
        header = loads(raw.decode("utf-8"))
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
        raise ck.fail(f"unknown format_version {short(meta['format_version'])} (this aegis reads {', '.join(map(str, READABLE_VERSIONS))})")
    mtext = meta["manifest"]
    try:  # a JSON escape like \ud800 decodes to a lone surrogate, which has no UTF-8 bytes to hash
        mbytes = mtext.encode("utf-8")
    except UnicodeEncodeError:
        raise ck.fail("__metadata__.manifest is not valid Unicode text (a lone surrogate)") from None
    if hashlib.sha256(mbytes).hexdigest() != meta["manifest_sha256"]:
        raise ck.fail("manifest fails its SHA-256 check (corrupt bundle)")
    try:
        manifest = loads(mtext)
    except RecursionError:
        raise ck.fail("manifest JSON is nested too deeply") from None
    except ValueError as exc:
        raise ck.fail(f"manifest is not valid JSON ({str(exc)[:120]})") from None
    problem = tree_problem(manifest, MAX_DEPTH)
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
            raise ck.fail(f"tensor {name!r} has dtype {short(e['dtype'])}; bundles hold only {', '.join(DTYPES)}")
        if not isinstance(e["shape"], list) or len(e["shape"]) != 2:
            raise ck.fail(f"tensor {name!r} must be 2-D, shape is {short(e['shape'])}")
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
        v, names = check_vtask(ck, i, v, int(meta["format_version"]))
        if v["id"] in seen:
            raise ck.fail(f"duplicate vTask id {v['id']!r}")
        seen.add(v["id"])
        spec = spec_of(v)
        what = (f"a {spec.layout.value} GEMM of {spec.m_sub}x{spec.n_sub}x{spec.k}" if v["kind"] == "gemm" else
                f"attention of batch {spec.batch}, {spec.q_heads}/{spec.kv_heads} heads, seq {spec.seq}, head dim {spec.head_dim}")
        for role, name in names.items():
            if name not in header:
                raise ck.fail(f"vTask {v['id']!r}: tensor {name!r} (role {role}) is not in the file")
            dt, shape = spec.expected(role)
            e = header[name]
            if e["dtype"] != dt or tuple(e["shape"]) != shape:
                raise ck.fail(f"vTask {v['id']!r}: tensor {name!r} (role {role}) is {e['dtype']} {e['shape']}, "
                              f"expected {dt} {list(shape)} for {what}")
            used.add(name)
        entries.append((v, names, spec))
    unused = sorted(set(header) - used)
    if unused:
        raise ck.fail(f"tensor {unused[0]!r} is not used by any vTask")
    base = 8 + hlen
    for begin, end, name in spans:
        h = hashes[name]
        if not isinstance(h, str) or not HEX64.fullmatch(h):
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
    inputs = InputCheck(ck)
    attention_inputs: dict[tuple, str | None] = {}
    for v, names, spec in entries:
        ts = {role: tensors[name] for role, name in names.items()}
        if v["kind"] == "attention":
            key = tuple(names[r] for r in ATTENTION_INPUTS)
            if key not in attention_inputs:  # once per set of stored inputs, however many vTasks share it
                attention_inputs[key] = input_problem(ts)
            problem = attention_inputs[key]
            if problem:
                raise ck.fail(f"vTask {v['id']!r}: {problem}")
        else:
            inputs.check(v["id"], ts, names, spec.layout)
        vtasks.append(vtask_from_entry(v, spec, ts))
    return Bundle(label, int(meta["format_version"]), created, producer, vtasks)


def read_bundle(path: str | os.PathLike, limits: Limits | None = None) -> Bundle:
    """Read and validate a bundle; BundleError (naming the file) on any problem."""
    limits = limits or Limits.from_env()
    return parse_bundle(read_bytes(path, limits), str(path), limits)


def read_bytes(path: str | os.PathLike, limits: Limits) -> bytes:
    """A bundle file's bytes, unchecked (``parse_bundle`` checks them): BundleError for a file
    that is missing, no regular file, over the size limit or unreadable (never opened then: a
    FIFO would block, a huge file would take the device's time)."""
    ck = Check(str(path))
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
        raise ck.fail(f"file is {st.st_size} bytes, over the limit of {limits.max_bytes} ({limits.source})")
    try:  # the size it has, not the limit: a raised limit must not allocate that much
        with open(path, "rb") as fh:
            data = fh.read(st.st_size + 1)
    except OSError as exc:
        raise ck.fail(f"cannot read ({exc.strerror})") from None
    if len(data) > st.st_size:  # BundleWriter renames a finished file into place; it never grows
        raise ck.fail(f"file grew past its {st.st_size} bytes while being read (still being written?)")
    return data


# -- writing ---------------------------------------------------------------------------------
class BundleWriter:
    """Append vTasks, then ``finalise()`` (or leave the ``with`` block) to write the bundle
    atomically: temp file in the same directory, fsync, rename. Nothing appears under
    ``path`` until then, and nothing at all when the block raises."""

    def __init__(self, path: str | os.PathLike, producer: dict[str, str] | None = None, created: str | None = None):
        from aegis_cli.ops.provenance import tool_version

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
        ck = Check(str(self.path))
        if vt.id in self._ids:
            raise ck.fail(f"duplicate vTask id {vt.id!r}")
        if len(self._vtasks) >= Limits().max_vtasks:
            raise ck.fail(f"a bundle holds at most {Limits().max_vtasks} vTasks (what readers accept); save the rest in another")
        check_vtask(ck, len(self._vtasks), vt.manifest_entry({r: "x" for r in vt.tensors}))
        for role, t in vt.tensors.items():
            dt, shape = vt.spec.expected(role)
            if TORCH_DTYPE_NAME.get(t.dtype) != dt or tuple(t.shape) != shape:
                raise ck.fail(f"vTask {vt.id!r}: tensor {role} is {t.dtype} {list(t.shape)}, expected {dt} {list(shape)}")
        if vt.kind == "attention":
            problem = input_problem(vt.tensors)
            if problem:
                raise ck.fail(f"vTask {vt.id!r}: {problem}")
        else:
            InputCheck(ck).check(vt.id, vt.tensors, {"a": "a", "b": "b"}, vt.gemm.layout)
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
        from aegis_cli.ops.files import atomic_write

        data = self.to_bytes()
        # the header and count limits no reader can raise; the file-size limit it can (--max-bundle-size)
        limits = dataclasses.replace(Limits(), max_bytes=max(len(data), 16))
        (hlen,) = struct.unpack("<Q", data[:8])
        if hlen > limits.max_header:
            raise Check(str(self.path)).fail(
                f"its {len(self._vtasks)} vTasks need a {hlen}-byte header, over the {limits.max_header} bytes readers "
                "accept; save fewer vTasks per bundle")
        parse_bundle(data, str(self.path), limits)
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
