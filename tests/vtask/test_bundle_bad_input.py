"""Hostile bundles: every bad input gives exit 3, one line naming the file and the problem,
and no output file (``aegis replay ... -o OUT`` writes nothing)."""

from __future__ import annotations

import hashlib
import json
import random
import struct
from pathlib import Path

import pytest
import torch

from aegis_cli.ops.errors import BundleError
from aegis_cli.ops.gemm import GemmOperands, Layout
from aegis_cli.vtask.bundle import BundleWriter, read_bundle
from aegis_cli.vtask.model import GemmSpec, Limits, VTask
from tests.helpers import run_cli
from tests.vtask.test_model import make_vtask


def _valid(path: Path) -> bytes:
    with BundleWriter(path) as w:
        w.add(make_vtask("v0", Layout.FWD, 6, 10, 8, tile=(4, 4)))
        w.add(make_vtask("v1", Layout.WGRAD, 5, 7, 9, rows=[0, 3], tile=(4, 4), check="gemm.row_checksum", seed=5))
    return path.read_bytes()


def _split(data: bytes):
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8:8 + n]), data[8 + n:]


def _join(header: dict, body: bytes) -> bytes:
    h = json.dumps(header).encode()
    return struct.pack("<Q", len(h)) + h + body


def _manifest(header: dict) -> dict:
    return json.loads(header["__metadata__"]["manifest"])


def _set_manifest(header: dict, m: dict) -> None:
    text = json.dumps(m)
    header["__metadata__"]["manifest"] = text
    header["__metadata__"]["manifest_sha256"] = hashlib.sha256(text.encode()).hexdigest()


def _edit_manifest(fn):
    """Change the manifest and re-seal its hash, so only the lie itself is left to find."""
    def make(data: bytes) -> bytes:
        header, body = _split(data)
        m = _manifest(header)
        fn(m)
        _set_manifest(header, m)
        return _join(header, body)
    return make


def _role(data: bytes, vid: str, role: str) -> str:
    m = _manifest(_split(data)[0])
    return next(v for v in m["vtasks"] if v["id"] == vid)["tensors"][role]


def _poison_input(bits: int):
    """Put a NaN/Inf into input a of v0 and re-seal every hash: only the value check can object."""
    def make(data: bytes) -> bytes:
        header, body = _split(data)
        name = _role(data, "v0", "a")
        begin, end = header[name]["data_offsets"]
        body = body[:begin] + struct.pack("<H", bits) + body[begin + 2:]
        m = _manifest(header)
        m["tensor_sha256"][name] = hashlib.sha256(body[begin:end]).hexdigest()
        _set_manifest(header, m)
        return _join(header, body)
    return make


def _flip_tensor_byte(data: bytes) -> bytes:
    b = bytearray(data)
    b[-3] ^= 0x10
    return bytes(b)


def _relabel_dtype(data: bytes) -> bytes:
    """row_sums of v0 (F32 [6, 3], 72 bytes) relabelled BF16 [6, 6]: the header stays
    self-consistent, the manifest's expectations do not."""
    header, body = _split(data)
    name = _role(data, "v0", "row_sums")
    header[name]["dtype"], header[name]["shape"] = "BF16", [6, 6]
    return _join(header, body)


def _shape_vs_bytes(data: bytes) -> bytes:
    header, body = _split(data)
    header[_role(data, "v0", "a")]["shape"] = [6, 9]
    return _join(header, body)


def _header_length(value: int):
    return lambda data: struct.pack("<Q", value) + data[8:]


def _metadata(key: str, value: str):
    def make(data: bytes) -> bytes:
        header, body = _split(data)
        header["__metadata__"][key] = value
        return _join(header, body)
    return make


def _dup_ids(m: dict) -> None:
    m["vtasks"][1]["id"] = m["vtasks"][0]["id"]


def _deep(m: dict) -> None:
    x: list = []
    for _ in range(50):
        x = [x]
    m["vtasks"][0]["extra"] = {"deep": x}


CASES = {
    "empty file": (lambda d: b"", "empty file"),
    "random bytes": (lambda d: random.Random(3).randbytes(4096), "not a bundle"),
    "text file": (lambda d: b"# notes\nthis is a text file, not a bundle\n" * 20, "not a bundle"),
    "truncated data": (lambda d: d[:-100], "truncated"),
    "truncated header": (lambda d: d[:60], "truncated"),
    "flipped byte in a tensor": (_flip_tensor_byte, "fails its SHA-256 check"),
    "flipped byte in the manifest": (lambda d: d.replace(b'\\"m\\":6', b'\\"m\\":7', 1), "manifest fails its SHA-256 check"),
    "manifest lies about shapes": (_edit_manifest(lambda m: m["vtasks"][0]["gemm"].update(m=7)), "expected BF16 [7, 8]"),
    "manifest lies about dtypes": (_relabel_dtype, "is BF16 [6, 6], expected F32 [6, 3]"),
    "shape disagrees with bytes": (_shape_vs_bytes, "is 108 bytes but data_offsets span 96"),
    "unknown schema version": (_metadata("format_version", "3"), "unknown format_version '3'"),
    "declared size larger than the file": (_header_length(1 << 40), "header declares 1099511627776 bytes but the file has only"),
    "NaN in inputs": (_poison_input(0x7FC0), "input a contains NaN or Inf"),
    "Inf in inputs": (_poison_input(0x7F80), "input a contains NaN or Inf"),
    "inputs that overflow fp32": (_poison_input(0x7F00), "vTask 'v0': its inputs can overflow fp32"),  # a = 2^127
    "duplicate vTask ids": (_edit_manifest(_dup_ids), "duplicate vTask id 'v0'"),
    "unknown kind": (_edit_manifest(lambda m: m["vtasks"][0].update(kind="attention")), "kind 'attention' is not supported"),
    "unknown field": (_edit_manifest(lambda m: m["vtasks"][0].update(evil="x")), "unknown field(s) evil"),
    "rich markup in a field": (_edit_manifest(lambda m: m["vtasks"][0].update(kind="[/][bold]x")), "kind '[/][bold]x' is not supported"),
    "deeply nested manifest": (_edit_manifest(_deep), "nested deeper"),
    "unused tensor": (_edit_manifest(lambda m: m["vtasks"].pop()), "is not used by any vTask"),
    "not an aegis bundle": (_metadata("format", "something-else"), "not an aegis vTask bundle"),
}


def assert_rejected(code: int, out: str, err: str, path: Path, fragment: str, report: Path) -> None:
    assert code == 3
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"Error: bundle {path}: "), lines[0]
    assert fragment in lines[0]
    assert out == ""
    assert not report.exists()


def test_directory(tmp_path, capsys):
    d = tmp_path / "adir"
    d.mkdir()
    code, out, err = run_cli(capsys, "replay", str(d), "--device", "cpu", "-o", str(tmp_path / "r.txt"))
    assert_rejected(code, out, err, d, "is a directory", tmp_path / "r.txt")


def test_missing_file(tmp_path, capsys):
    p = tmp_path / "nope.aegis"
    code, out, err = run_cli(capsys, "replay", str(p), "--device", "cpu", "-o", str(tmp_path / "r.txt"))
    assert_rejected(code, out, err, p, "no such file", tmp_path / "r.txt")


def test_not_a_regular_file(tmp_path, capsys):
    code, out, err = run_cli(capsys, "replay", "/dev/zero", "--device", "cpu", "-o", str(tmp_path / "r.txt"))
    assert_rejected(code, out, err, Path("/dev/zero"), "is not a regular file", tmp_path / "r.txt")


def test_file_over_the_configured_limit(tmp_path, capsys):
    good = tmp_path / "good.aegis"
    size = len(_valid(good))
    code, out, err = run_cli(capsys, "replay", str(good), "--device", "cpu", "--max-bundle-size", "1000", "-o", str(tmp_path / "r"))
    assert_rejected(code, out, err, good, f"file is {size} bytes, over the limit of 1000 (--max-bundle-size)", tmp_path / "r")


def test_file_over_the_limit_names_where_the_limit_came_from(tmp_path, capsys, monkeypatch):
    good = tmp_path / "good.aegis"
    size = len(_valid(good))
    monkeypatch.setenv("AEGIS_BUNDLE_MAX_BYTES", "1000")
    code, out, err = run_cli(capsys, "replay", str(good), "--device", "cpu", "-o", str(tmp_path / "r"))
    assert_rejected(code, out, err, good, f"file is {size} bytes, over the limit of 1000 (AEGIS_BUNDLE_MAX_BYTES)", tmp_path / "r")


def test_header_over_its_limit_is_refused_before_parsing(tmp_path):
    good = tmp_path / "good.aegis"
    _valid(good)
    with pytest.raises(BundleError, match=r"header declares \d+ bytes, over the limit of 100$"):
        read_bundle(good, Limits(max_header=100))


def test_one_bad_bundle_spoils_the_whole_replay(tmp_path, capsys):
    good = tmp_path / "good.aegis"
    _valid(good)
    bad = tmp_path / "bad.aegis"
    bad.write_bytes(b"")
    report = tmp_path / "r.json"
    code, out, err = run_cli(capsys, "replay", str(good), str(bad), "--device", "cpu", "--format", "json", "-o", str(report))
    assert_rejected(code, out, err, bad, "empty file", report)


def test_empty_bundle_has_nothing_to_replay(tmp_path, capsys):
    path = tmp_path / "empty.aegis"
    assert BundleWriter(path).finalise() == 0
    assert read_bundle(path).vtasks == []
    code, _, err = run_cli(capsys, "replay", str(path), "--device", "cpu")
    assert code == 3 and "holds no vTasks, nothing to replay" in err and len(err.strip().splitlines()) == 1


def test_writer_refuses_inputs_that_overflow(tmp_path):
    """Finite inputs whose products overflow fp32 would make every device's replay FAULTY."""
    vt = make_vtask("big", Layout.FWD, 8, 8, 64)
    vt.tensors["a"] = (vt.tensors["a"].float() * 2.0**100).to(torch.bfloat16)
    vt.tensors["b"] = (vt.tensors["b"].float() * 2.0**30).to(torch.bfloat16)
    with pytest.raises(BundleError, match="can overflow fp32"), BundleWriter(tmp_path / "b.aegis") as w:
        w.add(vt)
    assert not (tmp_path / "b.aegis").exists()
    # the same operands at a sane magnitude are fine
    with BundleWriter(tmp_path / "ok.aegis") as w:
        w.add(make_vtask("ok", Layout.FWD, 8, 8, 64))
    assert len(read_bundle(tmp_path / "ok.aegis").vtasks) == 1


# -- review fixes: each of these got past the reader, or crashed it ---------------------------------
def _header_edit(fn):
    """Change the header's JSON (not the manifest) and keep everything else."""
    def make(data: bytes) -> bytes:
        header, body = _split(data)
        fn(header)
        return _join(header, body)
    return make


def _dtype(value):
    def edit(header: dict) -> None:
        header[next(k for k in header if k != "__metadata__")]["dtype"] = value
    return _header_edit(edit)


def _manifest_text(fn):
    """Rewrite the manifest as text (for what json.dumps would not write) and re-seal its hash."""
    def make(data: bytes) -> bytes:
        header, body = _split(data)
        text = fn(header["__metadata__"]["manifest"])
        header["__metadata__"]["manifest"] = text
        header["__metadata__"]["manifest_sha256"] = hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()
        return _join(header, body)
    return make


def _nested(levels: int):
    # built as text: json.dumps itself recurses, and these depths are what json.loads still accepts
    return _manifest_text(lambda t: t[:-1] + ',"zz":' + "[" * levels + "]" * levels + "}")


def _pad_header(pad: bytes):
    def make(data: bytes) -> bytes:
        (n,) = struct.unpack("<Q", data[:8])
        h = data[8:8 + n].rstrip(b" ") + pad
        return struct.pack("<Q", len(h)) + h + data[8 + n:]
    return make


def _field(key: str, value):
    return _edit_manifest(lambda m: m["vtasks"][0].update({key: value}))


REVIEW_CASES = {
    "dtype is a list": (_dtype(["BF16"]), "has dtype ['BF16']; bundles hold only BF16, F32"),
    "dtype is an object": (_dtype({"x": 1}), "has dtype {'x': 1}; bundles hold only"),
    "confirm_margin null": (_edit_manifest(lambda m: m["vtasks"][0]["threshold"].update(confirm_margin=None)),
                            "threshold.confirm_margin must be a number"),
    "normalisation null": (_edit_manifest(lambda m: m["vtasks"][0]["threshold"].update(normalisation=None)),
                           "threshold.normalisation must be a string"),
    "lone surrogate in the manifest text": (_manifest_text(lambda t: t[:-1] + ',"x":"\ud800"}'),
                                            "__metadata__.manifest is not valid Unicode text"),
    "lone surrogate in a manifest string": (_field("op", "qkv\ud800"), "manifest holds a string that is not valid Unicode"),
    "manifest nested 500 deep": (_nested(500), "manifest is nested deeper than 8 levels"),
    "manifest nested 950 deep": (_nested(950), "nested"),
    "observed is a list": (_field("observed", []), "observed must be a JSON object"),
    "observed is 0": (_field("observed", 0), "observed must be a JSON object"),
    "observed is null": (_field("observed", None), "observed must be a JSON object"),
    "provenance is an empty string": (_field("provenance", ""), "provenance must be a JSON object"),
    "extra is false": (_field("extra", False), "extra must be an object"),
    "id with a trailing newline": (_field("id", "v0\n"), "vtasks[0].id 'v0\\n' is not valid"),
    "manifest format_version true": (_edit_manifest(lambda m: m.update(format_version=True)),
                                     "manifest.format_version must be an integer"),
    "manifest format_version 1.0": (_edit_manifest(lambda m: m.update(format_version=1.0)),
                                    "manifest.format_version must be an integer"),
    "header padded with a newline and a tab": (_pad_header(b"\n\t"), "padded at the end with spaces (0x20) only"),
}


@pytest.mark.parametrize("case", [*CASES, *REVIEW_CASES])
def test_bad_bundle_exit_3_one_line_no_output(case, tmp_path, capsys):
    make, fragment = {**CASES, **REVIEW_CASES}[case]
    path = tmp_path / "bad.aegis"
    path.write_bytes(make(_valid(tmp_path / "good.aegis")))
    report = tmp_path / "report.json"
    code, out, err = run_cli(capsys, "replay", str(path), "--device", "cpu", "--format", "json", "-o", str(report))
    assert_rejected(code, out, err, path, fragment, report)


def test_header_padded_with_spaces_is_fine(tmp_path):
    path = tmp_path / "padded.aegis"
    path.write_bytes(_pad_header(b" " * 13)(_valid(tmp_path / "good.aegis")))
    assert [v.id for v in read_bundle(path).vtasks] == ["v0", "v1"]


def test_empty_bundle_message_is_one_line_whatever_its_name(tmp_path, capsys):
    path = tmp_path / "empty\nsecond line.aegis"
    BundleWriter(path).finalise()
    code, out, err = run_cli(capsys, "replay", str(path), "--device", "cpu")
    assert code == 3 and out == ""
    assert err.strip().splitlines() == [f"Error: bundle {tmp_path}/empty?second line.aegis: holds no vTasks, nothing to replay"]


@pytest.mark.parametrize("limit", [str(1 << 40), str(1 << 36)])
def test_a_raised_size_limit_reads_only_the_file(limit, tmp_path, capsys):
    """--max-bundle-size sets what is refused, not how much is read: reading limit+1 bytes
    allocated the whole limit (MemoryError at 1 TiB)."""
    path = tmp_path / "good.aegis"
    _valid(path)
    code, out, err = run_cli(capsys, "replay", str(path), "--device", "cpu", "--repeat", "1", "--max-bundle-size", limit,
                              "--format", "json")
    assert code == 0 and err == "" and json.loads(out)["devices"][0]["verdict"] == "HEALTHY"


@pytest.mark.parametrize("limit", [str(10**20), str((1 << 40) + 1), "15", "-5"])
def test_size_limit_out_of_range_is_one_line(limit, tmp_path, capsys, monkeypatch):
    path = tmp_path / "good.aegis"
    _valid(path)
    code, out, err = run_cli(capsys, "replay", str(path), "--device", "cpu", "--max-bundle-size", limit)
    assert code == 3 and out == ""
    assert err.strip().splitlines() == [f"Error: --max-bundle-size {limit} is out of range: a bundle size limit lies in "
                                        f"16…{1 << 40} bytes"]
    monkeypatch.setenv("AEGIS_BUNDLE_MAX_BYTES", limit)
    code, out, err = run_cli(capsys, "replay", str(path), "--device", "cpu")
    assert code == 3 and f"AEGIS_BUNDLE_MAX_BYTES={limit} is out of range" in err and len(err.strip().splitlines()) == 1


def _shared_pair_bundle(path: Path, copies: int) -> None:
    """``copies`` vTasks that all name one stored pair of operands (fresh random inputs)."""
    vt = make_vtask("v0", Layout.FWD, 48, 40, 32, tile=(8, 8), seed=random.randrange(2**31), observed=False)
    with BundleWriter(path) as w:
        w.add(vt)
    header, body = _split(path.read_bytes())
    m = _manifest(header)
    m["vtasks"] = [dict(m["vtasks"][0], id=f"v{i}") for i in range(copies)]
    _set_manifest(header, m)
    path.write_bytes(_join(header, body))


def test_shared_tensors_are_checked_once(tmp_path, monkeypatch):
    """Finiteness and the overflow rule are properties of the stored tensors: a small bundle of
    many vTasks sharing them (hours to read, when checked per vTask) checks each tensor once."""
    from aegis_cli.ops import numerics

    calls = {"abs_max_along": 0, "overflow_bound": 0}

    def counting(name):
        real = getattr(numerics, name)

        def wrapper(*a, **k):
            calls[name] += 1
            return real(*a, **k)
        return wrapper

    for name in calls:
        monkeypatch.setattr(numerics, name, counting(name))
    path = tmp_path / "shared.aegis"
    _shared_pair_bundle(path, 300)
    calls.update(abs_max_along=0, overflow_bound=0)  # the writer's own checks aside
    assert len(read_bundle(path).vtasks) == 300
    assert calls == {"abs_max_along": 2, "overflow_bound": 0}  # A once, B once; cheap bounds clear them


def test_inputs_the_cheap_bounds_cannot_clear_get_the_spec_bound(tmp_path):
    """Per-tensor maxima only ever loosen the bound: a pair they cannot clear is judged by
    numerics.overflow_bound, so what the reader accepts does not change. Here every K has one
    huge A and one huge B (Σ_k max|A|·max|B| is K times too big), but never in the same output."""
    from aegis_cli.ops import numerics

    k = 64
    h = (numerics.SUM_LIMIT / numerics.CHECKSUM_SPAN / 4) ** 0.5 * random.uniform(0.5, 1.0)
    vt = make_vtask("diag", Layout.FWD, k, k, k, tile=(8, 8), seed=random.randrange(2**31), observed=False)
    a = vt.tensors["a"].float() * 2.0**-10
    w = vt.tensors["b"].float() * 2.0**-10  # fwd: B stored as W (N, K)
    a.fill_diagonal_(h)  # A_ik huge only at k = i
    w.fill_diagonal_(-h)  # W_jk huge only at k = j: one huge product per diagonal output
    vt.tensors["a"], vt.tensors["b"] = a.bfloat16(), w.bfloat16()
    ops = GemmOperands(vt.tensors["a"], vt.tensors["b"], Layout.FWD)
    kmax = (numerics.abs_max_along(ops.a_mk, 0) @ numerics.abs_max_along(ops.b_kn, 1)) * numerics.CHECKSUM_SPAN
    assert kmax >= numerics.SUM_LIMIT > numerics.overflow_bound(ops)
    path = tmp_path / "diag.aegis"
    with BundleWriter(path) as wr:
        wr.add(vt)
    assert read_bundle(path).vtasks[0].id == "diag"


def test_writer_refuses_a_header_readers_refuse(tmp_path):
    """Row subsets of a 2^20-row GEMM list their rows twice (rows, flagged_rows): 2400 of them
    make a header over the 32 MiB no reader option can raise. The writer wrote it; now it refuses."""
    m = 1 << 20
    rows = sorted(random.sample(range(m), 1024))
    b = torch.randn(8, 1).bfloat16()
    path = tmp_path / "big.aegis"
    w = BundleWriter(path)
    for i in range(2400):
        spec = GemmSpec(layout=Layout.FWD, m=m, n=8, k=1, tile=(128, 128), rows=rows, flagged_rows=rows)
        w.add(VTask(id=f"v{i}", check="gemm.row_checksum", op="qkv", gemm=spec, tau=1e-6,
                    tensors={"a": (torch.rand(1024, 1) + 0.5).bfloat16(), "b": b}))
    with pytest.raises(BundleError, match=r"its 2400 vTasks need a \d+-byte header, over the 33554432 bytes readers accept"):
        w.finalise()
    assert not path.exists()


def test_writer_refuses_more_vtasks_than_readers_accept(tmp_path):
    w = BundleWriter(tmp_path / "many.aegis")
    vt = make_vtask("v0", seed=random.randrange(2**31))
    w._vtasks = [vt] * Limits().max_vtasks  # as if added: adding 100 000 for real takes a while
    with pytest.raises(BundleError, match="a bundle holds at most 100000 vTasks"):
        w.add(make_vtask("one-more", seed=random.randrange(2**31)))
