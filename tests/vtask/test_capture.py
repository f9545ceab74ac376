"""vTask capture from tensors: what a training loop would hand over, with no scan behind it."""

from __future__ import annotations

import random
import sys

import pytest
import torch

from aegis_cli.backends import resolve_devices
from aegis_cli.ops.gemm import GemmOperands, Layout
from aegis_cli.ops.verdict import Evidence, Verdict
from aegis_cli.vtask import capture
from aegis_cli.vtask.bundle import BundleWriter, read_bundle
from aegis_cli.vtask.replay import ReplayOptions, run_replay


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32)


def _training_step(row: int) -> tuple[capture.ObservedGemm, Evidence]:
    """A layer's forward GEMM of one step (activations × weights, no seeded draw) whose
    accumulator row ``row`` was corrupted, and the row-checksum finding a sensor made of it."""
    dev = resolve_devices("cpu:0")[0]
    x = (torch.randn(64, 96) * 0.5).bfloat16()  # (tokens, in)
    w = (torch.randn(128, 96) * 0.1).bfloat16()  # (out, in): fwd stores B as W
    ops = GemmOperands(x, w, Layout.FWD)
    res = dev.checked_gemm(ops)
    res.row_sums[row, 0] += 100.0
    ev = Evidence(check="gemm.row_checksum", severity=Verdict.FAULTY, case_id="train/step17/layer3.mlp_up",
                  summary="row checksum over τ", elements=1, samples=[{"row": row, "col_tile": 0}])
    return capture.ObservedGemm(ops, res, case_id=ev.case_id, op="mlp_up"), ev


@pytest.mark.parametrize("full_limit", [capture.FULL_OPERANDS_LIMIT, 0])
def test_a_training_loop_captures_a_flagged_gemm(tmp_path, monkeypatch, full_limit):
    monkeypatch.setattr(capture, "FULL_OPERANDS_LIMIT", full_limit)
    row = random.randrange(64)
    run, ev = _training_step(row)
    prov = {"device_id": "cpu:0", "host": "trainer-7", "gpu_uuid": "none", "command_line": ["train.py", "--lr", "3e-4"],
            "job": "pretrain step 17", "injected": False}
    (vt,) = capture.capture_gemm(run, [ev], tau=1e-6, confirm_margin=1.0, provenance=prov)
    assert vt.id == "cpu:0/train/step17/layer3.mlp_up/gemm.row_checksum" and vt.op == "mlp_up"
    assert vt.case_id == "train/step17/layer3.mlp_up" and vt.seed is None and vt.dist is None and vt.scale == (0, 0)
    assert vt.gemm.flagged_rows == [row] and vt.observed["source"] == "observed"
    assert {k: vt.provenance[k] for k in prov} == prov and vt.provenance["kernel"] == run.result.kernel
    if full_limit:  # the tensors as handed over, bit for bit
        assert vt.gemm.subset == "full"
        for role, t in (("a", run.operands.a), ("b", run.operands.b), ("c", run.result.c), ("row_sums", run.result.row_sums)):
            assert torch.equal(_bits(vt.tensors[role]), _bits(t)), role
    else:  # only the flagged row of A and its outputs
        assert vt.gemm.subset == "rows" and vt.gemm.rows == [row]
        assert torch.equal(_bits(vt.tensors["a"]), _bits(run.operands.a[row:row + 1]))
    # a bundle any replay reads: the corruption was in the observed sums, not in this device
    path = tmp_path / "train.aegis"
    with BundleWriter(path) as w:
        w.add(vt)
    (back,) = read_bundle(path).vtasks
    assert back.provenance["job"] == "pretrain step 17"
    (o,) = run_replay(ReplayOptions(bundles=[str(path)], devices="cpu", repeat=1)).devices[0].probe_stats["replay"]["outcomes"]
    assert o["outcome"] == "not_reproduced" and o["matches_capture"] is False


def test_capture_holds_no_scan_and_no_device():
    """Capture is the API a training loop calls: it imports neither the scan nor a backend."""
    import subprocess

    code = ("import sys, aegis_cli.vtask.capture; "
            "bad = [m for m in sys.modules if m in ('aegis_cli.scan',) or m.startswith('aegis_cli.backends')]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)
