"""How the sensors' overhead benchmarks turn timings into figures, on the CPU: sensors_overhead's
paired rounds and its coverage mode, abft_floor's per-step totals, overhead_regression's fit (the GPU
parts need CUDA), and its attention parts (mode, noise study, clean run)."""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import numpy as np
import pytest

from aegis_cli.ops import attention_sums

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import abft_floor
import overhead_regression as reg
import sensors_overhead


def _window(times: list[float]) -> dict:
    return {"times": times}


def test_overhead_is_the_mean_of_paired_round_ratios():
    plain = [_window([1.0, 1.0]), _window([2.0, 2.0]), _window([1.0, 3.0])]  # drifting between rounds
    mode = [_window([1.1, 1.1]), _window([2.0, 2.4]), _window([2.2, 2.2])]
    got = sensors_overhead.paired(mode, plain)
    ratios = [0.1, 0.1, 0.1]  # each round against its own plain window, whatever the drift
    assert got["round_overheads"] == pytest.approx(ratios)
    assert got["overhead"] == pytest.approx(0.1) and got["overhead_se"] == pytest.approx(0.0, abs=1e-12)
    uneven = sensors_overhead.paired([*mode[:2], _window([2.6, 2.6])], plain)
    assert uneven["overhead_se"] == pytest.approx(statistics.stdev([0.1, 0.1, 0.3]) / 3**0.5)
    assert sensors_overhead.paired(mode[:1], plain)["overhead_se"] is None  # one round: no spread
    assert sensors_overhead.paired([], plain) == {"overhead": None}


def test_the_coverage_mode_checks_each_operator_from_its_phase(tmp_path):
    res = sensors_overhead.main(["--device", "cpu", "--preset", "tiny", "--dtype", "float32", "--modes", "plain,coverage",
                                 "--warmup", "1", "--steps", "2", "--rounds", "2", "--clean-steps", "0", "--out", str(tmp_path)])
    cov = res["interleaved"]["coverage"]
    assert [len(w["times"]) for w in (res["interleaved"]["plain"], cov)] == [4, 4]  # the skipped first steps left out
    assert len(cov["round_overheads"]) == 2 and cov["overhead_se"] is not None
    stats = cov["stats"]
    # p = 0: only the floor checks, each operator first at its phase (from the seed and its name): every
    # window, a fresh handle with the same seed, checks the same few of its launches and raises nothing
    assert len({s["checked"] for s in stats}) == 1 and all(s["checked"] < s["launches"] for s in stats)
    assert all(s["raised"] == 0 for s in stats)
    # step by step, which operators it checked: as many lists as timed steps, no more checks than counted
    assert len(cov["checked_ops"]) == len(cov["times"]) and sum(map(len, cov["checked_ops"])) <= sum(s["checked"] for s in stats)
    assert "checked_ops" not in res["interleaved"]["plain"]
    assert (tmp_path / "sensors_overhead.json").exists()


def test_the_attention_parts_sense_every_sdpa_call_and_say_which_invariant_runs_close(tmp_path):
    res = sensors_overhead.main(["--device", "cpu", "--preset", "tiny", "--dtype", "float32", "--modes",
                                 "plain,attention,coverage_attention", "--warmup", "1", "--steps", "2", "--rounds", "1",
                                 "--clean-steps", "3", "--clean-attention",
                                 "--attention-noise-steps", "2", "--out", str(tmp_path)])
    layers = sensors_overhead.PRESETS["tiny"].layers
    assert res["interleaved"]["attention"]["stats"][0]["checked"] == 0  # routed, nothing sampled
    cov = res["interleaved"]["coverage_attention"]  # the floor with SDPA among the operators
    assert cov["overhead"] is not None and cov["stats"][0]["raised"] == 0
    assert {op.split("/")[0] for ops in cov["checked_ops"] for op in ops} <= {"sdpa"} | {f"blocks.{i}" for i in range(layers)} | {"head"}
    noise = res["attention_noise"]
    st = noise["stats"]  # every call once, nothing verified (a flag is dropped, never queued)
    assert noise["calls"] == 2 * layers and st["cleared"] == st["confirmed"] == 0 and st["raised"] == st["dropped"]
    inv = noise["invariants"]
    assert set(inv) == set(attention_sums.INVARIANTS)
    assert all(g["calls"] == 2 * layers and 0 <= g["p50"] <= g["max"] and g["over_tau"] == 0 for g in inv.values())
    clean = res["clean"]
    assert clean["attention_launches"] == 3 * layers and clean["confirmed"] == 0
    assert set(clean["attention_clean_max"]) == set(inv) and clean["closest_operators"]


def test_abft_floor_sums_a_step_with_the_launch_counts():
    acc = {"c_same": True, "observed_err": 1e-8, "expected_err": 1e-8, "pre_err": 1e-8, "expected_vs_observed": 3e-9}

    def row(op, count, wgrad, **ms):
        base = {"cublas": 1.0, "plain": 0.99, "checked": 1.0, "rows": 1.0, "tc": 1.0, "abft": 1.5, "pre": 1.01}
        if wgrad:
            base.update(cols=1.0, both=1.01, tcboth=1.02)
        return {"op": op, "m": 8, "n": 8, "k": 8, "count": count, "ms": {**base, **ms}, "b_pass_ms": 0.1,
                "a_pass_ms": 0.05 if wgrad else 0.0, "accuracy": acc}

    rows = [row("l/fwd", 22, False), row("l/wgrad", 22, True), row("head/fwd", 1, False, cublas=2.0, tc=2.2, abft=3.0)]
    tot = abft_floor.totals(rows, 100.0)
    assert tot["cublas"] == pytest.approx(22 + 22 + 2)
    assert tot["passes"] == pytest.approx(22 * 0.1 + 22 * 0.15 + 0.1)
    # everything on the tensor cores: tc for rows, wgrad's tcboth; against cuBLAS
    assert tot["tensor_cores_ms"] == pytest.approx(22 * 1.0 + 22 * 1.02 + 2.2 - 46)
    # the row check built, wgrad's column check as its probes' extra (tcboth − tc)
    assert tot["in_kernel_ms"] == pytest.approx(22 * 1.5 + 22 * (1.5 + 0.02) + 3.0 - 46)
    # pieces made before the kernel: its time, wgrad's column MMAs (both − rows) and a pass over B
    assert tot["pre_ms"] == pytest.approx(22 * 1.11 + 22 * (1.11 + 0.01) + 1.11 - 46)
    text = abft_floor.table(rows, tot)
    assert "same" in text and "% of a 100.0 ms step" in text


def test_abft_pieces_hold_the_tile_sums_in_the_swizzled_stage_layout():
    """``abft_floor.pieces``: undoing the 128-byte swizzle of each 1 KB block gives rows 3·tile +
    piece whose hi + mid + lo is each 128-column tile sum of B to fp32's precision, zero beyond K
    and N and in rows 6 and 7."""
    import torch

    k, n = 200, 300  # ragged: a partial k-block and a partial 256-column block
    b = torch.randn(k, n, generator=torch.Generator().manual_seed(3)).bfloat16()
    p = abft_floor.pieces(b)
    assert p.shape == (2, 4, 8, 64) and p.dtype == torch.bfloat16
    r, kk = torch.arange(8)[:, None], torch.arange(64)[None, :]
    logical = torch.gather(p, -1, (((kk >> 3) ^ r) * 8 + (kk & 7)).expand(p.shape))
    assert not logical[:, :, 6:].any()
    got = logical[:, :, :6].double().view(2, 4, 2, 3, 64).sum(3).permute(1, 3, 0, 2).reshape(256, 4)
    want = torch.zeros(256, 512, dtype=torch.float64)
    want[:k, :n] = b.double()
    want = want.view(256, 4, 128).sum(-1)
    assert torch.allclose(got, want, rtol=2**-23, atol=0) and not got[k:].any() and got[:k, 3].abs().max() == 0


def test_settle_runs_plain_steps_before_the_rounds(tmp_path):
    """--settle: plain steps (whole windows of 10) until the time is up, before round 0; none by
    default on the CPU."""
    args = ["--device", "cpu", "--preset", "tiny", "--dtype", "float32", "--modes", "plain", "--warmup", "1",
            "--steps", "1", "--rounds", "1", "--clean-steps", "0", "--out", str(tmp_path)]
    res = sensors_overhead.main([*args, "--settle", "0.001"])
    assert res["settle"]["steps"] == 10 and "settle" in res["seconds"]
    assert "settle" not in sensors_overhead.main(args) and sensors_overhead.parse(args).settle == 0.0


def test_the_regression_recovers_the_checks_price_and_a_per_step_one():
    """overhead_regression.fit: steps that cost 1.2× their checks' isolated time plus 0.3 ms, over
    rounds whose plain steps drift, give back slope 1.2 and 0.3 ms beyond the checks."""
    costs = {"mlp.fc/fwd": 0.26, "mlp.fc/wgrad": 0.44, "head/fwd": 0.88}
    ops = ["blocks.0.mlp.fc/fwd", "blocks.7.mlp.fc/wgrad", "head/fwd"]
    rng = np.random.default_rng(3)
    rounds, steps = 3, 60
    checked = [list(rng.choice(ops, size=rng.integers(0, 4))) for _ in range(rounds * steps)]
    drift = np.repeat([140.0, 142.5, 141.7], steps)
    x = np.array([sum(costs[reg.kind(op)] for op in s) for s in checked])
    noise = lambda: rng.normal(0, 0.05, rounds * steps)
    run = {"interleaved": {
        "plain": {"times": list((drift + noise()) / 1e3)},
        "coverage": {"times": list((drift + 1.2 * x + 0.3 + noise()) / 1e3), "checked_ops": checked,
                     "stats": [{}] * rounds}}}
    got = reg.fit(run, costs)
    assert abs(got["slope"] - 1.2) < 4 * got["slope_se"] + 0.02
    assert abs(got["extra_ms"] - 0.3) < 0.05 and len(got["extra_ms_per_round"]) == rounds
    with pytest.raises(KeyError, match="head/fwd"):
        reg.fit(run, {k: v for k, v in costs.items() if k != "head/fwd"} | {"attn.qkv/fwd": 0.2})
