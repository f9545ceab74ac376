"""benchmarks/attention_coverage.py on the CPU at small counts: the clean runs take the probe's
path (scales, bit-exact expectations, repeats), the catalog shapes are the per-GPU ones, a fault
trial goes through the device's fault path, and each device's section of the doc is kept."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

from aegis_cli.backends.cpu import CpuDevice

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "attention_coverage.py"
_spec = importlib.util.spec_from_file_location("attention_coverage", _PATH)
cov = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cov)


@pytest.fixture(scope="module")
def dev():
    return CpuDevice()


def test_catalog_shapes_are_the_per_gpu_ones():
    shapes = dict(((label, s[3], s[5]), s) for label, s in cov.catalog_shapes())
    assert shapes[("llama3-70b TP=8", 509, True)] == (1, 8, 1, 509, 128, True)
    assert shapes[("llama3-8b TP=2", 2048, False)] == (1, 16, 4, 2048, 128, False)
    assert shapes[("llama3-1b TP=1", 1000, True)][1:3] + shapes[("llama3-1b TP=1", 1000, True)][4:5] == (32, 8, 64)
    assert {s[4] for s in shapes.values()} == {64, 128} and {s[5] for s in shapes.values()} == {True, False}


def test_clean_runs_take_the_probes_path(dev, monkeypatch):
    monkeypatch.setattr(cov, "CATALOG", (("llama3-70b", (8,)), ("llama3-1b", (2,))))
    groups = cov.clean_groups("cuda", 0, seqs=(40, 33))  # the GPU's catalog order, run on the CPU reference
    acc = cov.clean_campaign(dev, groups, target_runs=7, max_seconds=60)
    assert acc["runs"] >= 7 and acc["groups"] == acc["repeats"] >= 3
    assert acc["false_positives"] == 0 and acc["repeat_mismatch"] == 0
    assert acc["runs"] + acc["skipped_scales"] == 3 * acc["groups"]  # base and two scaled runs per group
    assert set(acc["worst_seq"]) <= {"40", "33"} and set(acc["worst"]) <= {"llama3-70b TP=8", "llama3-1b TP=2"}
    for worst in [*acc["worst"].values(), *acc["worst_seq"].values()]:
        assert set(worst) == {"o_rowsum", "lse", "dv_colsum", "dk_colsum", "dq_rowsum"}
        assert all(0 < worst[n] < cov.TH.tau[n] for n in worst)
    first = next(cov.clean_groups("cpu", 1))
    assert first == ("B1 Hq4 Hkv2 S64 D64 causal", cov.SHAPES[0], "normal", 0.25, 1000)


def test_a_fault_trial_goes_through_the_device(dev):
    rows = [cov.trial(dev, "lse", t, np.random.default_rng([19, 4])) for t in range(2)]
    assert {r["outcome"] for r in rows} <= {"benign", "invariant", "pow2 only", "escaped"}
    caught = [r for r in rows if r["outcome"] == "invariant"]
    assert caught and all("attention.lse" in r["fired"] for r in caught)


def test_each_device_keeps_its_own_section(tmp_path):
    trials = [{"stage": "dv", "trial": 0, "bit": 30, "outcome": "invariant", "fired": ["attention.dv_colsum"], "change": 0.0},
              {"stage": "dv", "trial": 1, "bit": 3, "outcome": "escaped", "fired": [], "change": 1e-3}]
    clean = {"groups": 1, "runs": 3, "repeats": 1, "repeat_mismatch": 0, "skipped_scales": 0, "false_positives": 0,
             "flagged": {}, "seconds": 1.0, "group_counts": {"x": 1}, "worst": {"x": dict.fromkeys(cov.sums.INVARIANTS, 0.5)},
             "worst_seq": {"64": dict.fromkeys(cov.sums.INVARIANTS, 0.25)}}
    doc = lambda backend, name: {"backend": backend, "device": name, "driver": None, "commit": "abc", "date": "2026-12-01",
                                 "seconds": 2.0, "command": "c", "clean": clean, "trials": trials, "trials_per_stage": 2}
    out = tmp_path / "cov.md"
    cov.write_doc(out, doc("cuda", "NVIDIA H200") | {"clean_long": clean})
    cov.write_doc(out, doc("cpu", "AMD EPYC"))
    cov.write_doc(out, doc("cpu", "Intel Xeon"))  # replaces the CPU section only
    text = out.read_text()
    assert text.count("<!-- section:cpu -->") == text.count("<!-- section:cuda -->") == 1
    assert text.index("## CPU reference") < text.index("## NVIDIA H200 (CUDA kernels)")
    assert text.count("| S = 64 |  | 0.25 |") == 2  # the GPU's two clean campaigns, by sequence length
    assert "### Clean runs at training sequence lengths" in text
    assert "Intel Xeon" in text and "AMD EPYC" not in text and "| dv | 0% | 50% | 0% | 50% | 0.001 |" in text
    other = [dict(t, outcome="invariant") for t in trials]
    assert cov.agreement(trials, other, "CPU reference") == {"other": "CPU reference", "n": 2, "same": 1,
                                                           "differ": "escaped here, invariant there (1)"}
