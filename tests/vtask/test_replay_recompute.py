"""Replay judges a reproducible checksum flag as the scan does: FAULTY only when recomputing its
flagged checksums in fp64 shows bits beyond any rounding (checks/recompute.py)."""

from __future__ import annotations

import json
from pathlib import Path

from aegis_cli.ops.numerics import Thresholds
from aegis_cli.vtask import replay
from aegis_cli.vtask.replay import ReplayOptions, run_replay
from tests.helpers import run_cli

CASE = "cpu-quick/qkv/fwd/normal/192x384x256/s+0+0"


def _capture(capsys, tmp_path: Path, *argv: str) -> Path:
    bundle = tmp_path / "b.aegis"
    run_cli(capsys, "scan", "--device", "cpu", "--case", CASE, "--reruns", "1", "--probes", "gemm",
            "--save-vtasks", str(bundle), "--format", "json", "-o", str(tmp_path / "scan.json"), "-q", *argv)
    return bundle


def _outcomes(rep) -> list[dict]:
    return rep.devices[0].probe_stats["replay"]["outcomes"]


def test_an_injected_accumulator_fault_replays_beyond_the_bound(capsys, tmp_path):
    bundle = _capture(capsys, tmp_path, "--inject", "bitflip:target=acc,bit=exp")
    rep = run_replay(ReplayOptions(bundles=[str(bundle)], devices="cpu", repeat=1, inject="bitflip:target=acc,bit=exp"))
    assert rep.exit_code == 2
    for o in _outcomes(rep):
        assert o["severity"] == "FAULTY" and o["recompute"]["beyond_bound"] >= 1
    doc = json.loads(json.dumps(rep.to_dict(), default=str))
    assert all(e["recompute"]["beyond_bound"] >= 1 for e in doc["devices"][0]["evidence"] if e["check"].endswith("checksum"))


def test_the_scans_own_draw_flagged_by_a_too_tight_threshold_is_suspect_naming_numerics(capsys, tmp_path, monkeypatch):
    # the calibrated floor keeps replay above clean rounding; lowered here, the scan's own inputs
    # (whose τ calibration holds, so no rounding doubt is raised) flag on a healthy CPU every run
    bundle = _capture(capsys, tmp_path, "--threshold", "1e-10")
    monkeypatch.setattr(replay, "FLOOR", Thresholds(tau=1e-10))
    rep = run_replay(ReplayOptions(bundles=[str(bundle)], devices="cpu", repeat=2))
    outs = _outcomes(rep)
    assert rep.exit_code == 1 and outs
    for o in outs:
        assert o["outcome"] == "reproduced" and o["severity"] == "SUSPECT" and o["recompute"]["beyond_bound"] == 0
        assert any(n.startswith("numerics: threshold too tight for this input?") for n in o["notes"])

