"""vTasks of kind attention: a scan's flagged attention case saved and replayed (reproduced with
the injection, not without), and hostile attention entries refused with one line, exit 3."""

from __future__ import annotations

import hashlib
import struct
from pathlib import Path

import pytest

from aegis_cli.ops.verdict import Verdict
from aegis_cli.scan import ScanOptions, run_scan
from aegis_cli.vtask import from_scan
from aegis_cli.vtask.bundle import read_bundle
from aegis_cli.vtask.replay import ReplayOptions, run_replay
from tests.helpers import TINY, run_cli
from tests.vtask.test_bundle_bad_input import _edit_manifest, _manifest, _set_manifest, _split, assert_rejected

FAULT = "perturb:target=attn.dv,r=1000,index=70"
CASE = "attention/normal/b1h4k2s160d64c/s+0+0"


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("att") / "att.aegis"
    rep = run_scan(ScanOptions(devices="cpu:0", workload=TINY, probes=("attention",), case=CASE, reruns=1, inject=FAULT,
                               keep_flagged=True))
    assert rep.devices[0].verdict is Verdict.FAULTY
    assert from_scan.save_scan_vtasks(rep, path) == len(rep.devices[0].evidence) >= 1
    return path


def test_saved_vtask_holds_the_case(bundle):
    vt = read_bundle(bundle).vtasks[0]
    assert vt.kind == "attention" and vt.check == "attention.dv_colsum" and vt.case_id == CASE
    assert vt.attention.to_json() == {"batch": 1, "q_heads": 4, "kv_heads": 2, "seq": 160, "head_dim": 64, "causal": True,
                                      "scale": 0.125}
    assert vt.full("q").shape == (1, 4, 160, 64) and vt.full("dv_colsum").shape == (1, 2, 64)
    assert vt.provenance["injected"] is True and vt.normalisation == "rounding-spread"


def test_replay_reproduces_with_the_injection_not_without(bundle):
    with_fault = run_replay(ReplayOptions(bundles=[str(bundle)], devices="cpu:0", repeat=2, inject=FAULT)).devices[0]
    assert with_fault.verdict is Verdict.FAULTY
    out = with_fault.probe_stats["replay"]["outcomes"][0]
    assert out["outcome"] == "reproduced" and out["matches_capture"] is True and "attention.dv_colsum" in out["checks_fired"]
    clean = run_replay(ReplayOptions(bundles=[str(bundle)], devices="cpu:0", repeat=2)).devices[0]
    assert clean.verdict is Verdict.HEALTHY and clean.probe_stats["replay"]["not_reproduced"] >= 1
    assert clean.probe_stats["replay"]["outcomes"][0]["matches_capture"] is False


def _poison(role: str, bits: int):
    """Set the first element of an input (bf16 bits) and re-seal every hash."""
    def make(data: bytes) -> bytes:
        header, body = _split(data)
        m = _manifest(header)
        name = m["vtasks"][0]["tensors"][role]
        begin, end = header[name]["data_offsets"]
        body = body[:begin] + struct.pack("<H", bits) + body[begin + 2:]
        m["tensor_sha256"][name] = hashlib.sha256(body[begin:end]).hexdigest()
        _set_manifest(header, m)
        import json

        h = json.dumps(header).encode()
        return struct.pack("<Q", len(h)) + h + body
    return make


def _att(fn):
    return _edit_manifest(lambda m: [fn(v) for v in m["vtasks"]])


HOSTILE = {
    "attention object missing": (_att(lambda v: v.pop("attention")), "lacks required field(s) attention"),
    "gemm object beside it": (_att(lambda v: v.update(gemm={})), "unknown field(s) gemm"),
    "heads that cannot share": (_att(lambda v: v["attention"].update(q_heads=3)), "not a multiple of kv_heads"),
    "causal not a bool": (_att(lambda v: v["attention"].update(causal=1)), "attention.causal must be true or false"),
    "scale out of range": (_att(lambda v: v["attention"].update(scale=1e30)), "attention.scale must be a number"),
    "a GEMM check": (_att(lambda v: v.update(check="gemm.row_checksum")), "check is 'gemm.row_checksum'"),
    "a GEMM normalisation": (_att(lambda v: v["threshold"].update(normalisation="abs-product")), "normalisation is 'abs-product'"),
    "tau out of range": (_att(lambda v: v["threshold"].update(tau=1e9)), "threshold.tau must be a number"),
    "an input missing": (_att(lambda v: v["tensors"].pop("do")), "lacks required field(s) do"),
    "an unknown role": (_att(lambda v: v["tensors"].update(p="t0")), "unknown field(s) p"),
    "shapes that lie": (_att(lambda v: v["attention"].update(seq=80)), "expected BF16 [320, 64]"),
    "NaN in Q": (_poison("q", 0x7FC0), "input q contains NaN or Inf"),
    "huge V": (_poison("v", 0x4F80), "input v holds |x| = 4.29e+09, over the limit"),
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_attention_entries(bundle, tmp_path, capsys, name):
    make, fragment = HOSTILE[name]
    bad = tmp_path / "bad.aegis"
    bad.write_bytes(make(bundle.read_bytes()))
    code, out, err = run_cli(capsys, "replay", str(bad), "--device", "cpu", "-o", str(tmp_path / "r.txt"))
    assert_rejected(code, out, err, bad, fragment, tmp_path / "r.txt")
