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

from aegis_cli import cli
from aegis_cli.backends.base import Layout
from aegis_cli.bundle import BundleWriter, read_bundle
from aegis_cli.errors import BundleError
from aegis_cli.vtask import Limits
from tests.test_vtask import make_vtask


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
    "unknown schema version": (_metadata("format_version", "2"), "unknown format_version '2'"),
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


def run_cli(argv: list[str], capsys) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    out, err = capsys.readouterr()
    return exc.value.code, out, err


def assert_rejected(code: int, out: str, err: str, path: Path, fragment: str, report: Path) -> None:
    assert code == 3
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"Error: bundle {path}: "), lines[0]
    assert fragment in lines[0]
    assert out == ""
    assert not report.exists()


@pytest.mark.parametrize("case", list(CASES))
def test_bad_bundle_exit_3_one_line_no_output(case, tmp_path, capsys):
    make, fragment = CASES[case]
    path = tmp_path / "bad.aegis"
    path.write_bytes(make(_valid(tmp_path / "good.aegis")))
    report = tmp_path / "report.json"
    code, out, err = run_cli(["replay", str(path), "--device", "cpu", "--format", "json", "-o", str(report)], capsys)
    assert_rejected(code, out, err, path, fragment, report)


def test_directory(tmp_path, capsys):
    d = tmp_path / "adir"
    d.mkdir()
    code, out, err = run_cli(["replay", str(d), "--device", "cpu", "-o", str(tmp_path / "r.txt")], capsys)
    assert_rejected(code, out, err, d, "is a directory", tmp_path / "r.txt")


def test_missing_file(tmp_path, capsys):
    p = tmp_path / "nope.aegis"
    code, out, err = run_cli(["replay", str(p), "--device", "cpu", "-o", str(tmp_path / "r.txt")], capsys)
    assert_rejected(code, out, err, p, "no such file", tmp_path / "r.txt")


def test_not_a_regular_file(tmp_path, capsys):
    code, out, err = run_cli(["replay", "/dev/zero", "--device", "cpu", "-o", str(tmp_path / "r.txt")], capsys)
    assert_rejected(code, out, err, Path("/dev/zero"), "is not a regular file", tmp_path / "r.txt")


def test_file_over_the_configured_limit(tmp_path, capsys):
    good = tmp_path / "good.aegis"
    size = len(_valid(good))
    code, out, err = run_cli(["replay", str(good), "--device", "cpu", "--max-bundle-size", "1000", "-o", str(tmp_path / "r")], capsys)
    assert_rejected(code, out, err, good, f"file is {size} bytes, over the limit of 1000", tmp_path / "r")


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
    code, out, err = run_cli(["replay", str(good), str(bad), "--device", "cpu", "--format", "json", "-o", str(report)], capsys)
    assert_rejected(code, out, err, bad, "empty file", report)


def test_empty_bundle_has_nothing_to_replay(tmp_path, capsys):
    path = tmp_path / "empty.aegis"
    assert BundleWriter(path).finalise() == 0
    assert read_bundle(path).vtasks == []
    code, _, err = run_cli(["replay", str(path), "--device", "cpu"], capsys)
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
