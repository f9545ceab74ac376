"""Fresh inputs over time (issue 18): derived sweep seeds, scale dithering that visits every
exponent pair of the exact range, and ``aegis history --coverage``."""

from __future__ import annotations

import io
import itertools
import json
import shlex
import subprocess

import pytest
from rich.console import Console

from aegis_cli import render
from aegis_cli.backends.cpu import CpuBackend
from aegis_cli.fleet import coverage
from aegis_cli.fleet.config import load_config
from aegis_cli.fleet.history import History
from aegis_cli.fleet.summary import history_csv, show_history
from aegis_cli.fleet.sweep import run_sweep
from aegis_cli.ops import dither, numerics
from aegis_cli.ops.case import CaseId, case_seed
from aegis_cli.ops.errors import ConfigError
from aegis_cli.ops.gemm import GemmOperands, Layout
from aegis_cli.probes import ProbeConfig, ProbeContext, load_all
from aegis_cli.probes import pow2 as pow2_probe
from tests.fleet_helpers import aegis, env, write_config


def _pow2_magnitudes(seed: int) -> numerics.Magnitudes:
    """The operands the pow2 probe draws on a CPU device, as it measures them."""
    dev = CpuBackend(n_devices=1).device(0)
    m, n, k = pow2_probe.CPU_SHAPE
    a = dev.generate((m, k), "normal", case_seed(seed, "pow2", "A"))
    b = dev.generate((n, k), "normal", case_seed(seed, "pow2", "B"))
    return numerics.magnitudes(GemmOperands(a, b, Layout.FWD))


@pytest.mark.parametrize("sweeps", [16, 256])
def test_dithering_visits_every_pair_of_the_exact_range(sweeps):
    """Within the configured number of sweeps the pow2 grid has held every exponent pair that
    the exactness rule allows, each exactly once: a brute-force scan far beyond the bf16 range
    finds no exact pair the schedule missed."""
    mag = _pow2_magnitudes(7)
    step = dither.step_for(sweeps, pow2_probe.MAX_STEP)
    assert step * step == sweeps
    visited: list[tuple[int, int]] = []
    for i in range(sweeps):
        ga, gb = pow2_probe.exponent_grids(mag, step, dither.offset(i, step))
        visited += [(a, b) for a in ga for b in gb if numerics.pow2_exact_safe(mag, a, b)]
    exact = {(a, b) for a in range(-300, 301) for b in range(-300, 301) if numerics.pow2_exact_safe(mag, a, b)}
    assert len(exact) > 1000 and set(visited) == exact and len(visited) == len(exact)  # all of them, none twice
    # the offsets are a permutation of the grid's residues, and both move every sweep
    offs = [dither.offset(i, step) for i in range(sweeps)]
    assert len(set(offs)) == sweeps and offs[0] == (0, 0) and all(p[0] != q[0] and p[1] != q[1] for p, q in itertools.pairwise(offs))


def test_pow2_probe_runs_the_dithered_grid():
    """The probe checks exactly the grid the schedule names at its offset (index 0: the old grid)."""
    load_all()
    dev = CpuBackend(n_devices=1).device(0)
    mag = _pow2_magnitudes(3)
    for off in [(0, 0), (5, 11)]:
        ctx = ProbeContext(config=ProbeConfig(seed=3, probes=("pow2",), probe_options={"pow2.step": "16", "pow2.offset": f"{off[0]},{off[1]}"}),
                           fault=None, progress=lambda *a, **k: None)
        assert pow2_probe.pow2_probe(dev, ctx) == []
        ga, gb = pow2_probe.exponent_grids(mag, 16, off)
        want = sum(numerics.pow2_exact_safe(mag, a, b) for a in ga for b in gb if (a, b) != (0, 0))
        st = ctx.stats["pow2"]
        assert st["offset"] == list(off) and st["implementations"]["checked_gemm"]["tested"] == want
    assert pow2_probe.exponent_grids(mag, 16, (0, 0))[0][:2] == [-112, -96]  # the undithered grid as before


def test_gemm_shift_moves_every_scale_but_the_base():
    assert dither.shifted([[0, 0], [-16, -16], [16, 16], [-8, 8]], (3, -2)) == [[0, 0], [-13, -18], [19, 14], [-5, 6]]
    assert dither.shifted([[0, 0], [-3, 2]], (3, -2)) == [[0, 0]]  # a pair moved onto the base is the base: dropped
    assert [dither.centred(dither.offset(i, 16), 16) for i in (0, 1, 8)] == [(0, 0), (1, 1), (-8, -8)]
    with pytest.raises(ValueError, match="two integers"):
        dither.parse_pair("3")


def test_config_seed_and_dithering_options(tmp_path):
    cfg = load_config(write_config(tmp_path))
    assert cfg.seed is None and cfg.dither_sweeps == 256 and cfg.vtasks is None  # derived seeds, dithered, no replays
    assert load_config(write_config(tmp_path, seed=5, dither_sweeps=0)).seed == 5
    with pytest.raises(ConfigError, match="dither_sweeps must lie in 0…3136"):
        load_config(write_config(tmp_path, dither_sweeps=4000))
    with pytest.raises(ConfigError, match=r"vtasks: .* is not a directory"):
        load_config(write_config(tmp_path, vtasks="no-such-dir"))


def test_chosen_seeds_differ_and_follow_the_day(tmp_path):
    """Every node's first sweep of a UTC day shares a seed (reports of independent nodes still
    compare); the next sweep of a node takes the next one; a pinned seed stays."""
    cfg = load_config(write_config(tmp_path))
    doc = {"kind": "sweep", "host": "n1", "devices": []}
    with History(tmp_path / "h.sqlite") as h:
        first = coverage.choose(cfg, h, "n1", 86400 * 20000 + 5)
        assert first == {**first, "seed": coverage.derive_seed("2024-10-04", 0), "seed_derived": True, "dither_index": 0}
        h.record_sweep({**doc, "seed": first["seed"], "sweep": {"coverage": first}})
        second = coverage.choose(cfg, h, "n1", 86400 * 20000 + 60)
        assert second["seed"] == coverage.derive_seed("2024-10-04", 1) != first["seed"] and second["dither_index"] == 1
        assert coverage.choose(cfg, h, "n2", 86400 * 20000 + 60)["seed"] == first["seed"]  # another node's first of the day
        cfg.seed = 42
        assert coverage.choose(cfg, h, "n1", 86400 * 20001)["seed"] == 42


@pytest.fixture(scope="module")
def two_sweeps(tmp_path_factory):
    """Two drill sweeps of one CPU device with a permanent injected fault and no pinned seed."""
    tmp = tmp_path_factory.mktemp("fresh")
    path = write_config(tmp, drill=True, inject="bitflip:bit=exp,device=cpu:0", fingerprint_cases=0,
                        exports={"quarantine_list": None, "prometheus_textfile": None})
    docs = []
    for _ in range(2):
        p = subprocess.run(aegis("sweep", "--config", str(path)), env=env(1), capture_output=True, text=True, timeout=120)
        assert p.returncode == 2, p.stderr
        docs.append(json.loads((tmp / "report.json").read_text()))
    return tmp, docs


def test_consecutive_sweeps_check_other_inputs_and_record_their_seeds(two_sweeps):
    tmp, docs = two_sweeps
    seeds = [d["seed"] for d in docs]
    assert seeds[0] != seeds[1]
    for d in docs:
        assert d["sweep"]["coverage"]["seed_derived"] is True and d["devices"][0]["coverage"]["seed"] == d["seed"]
        assert d["sweep"]["rerun"] and f"--seed {d['seed']} " in d["sweep"]["rerun"][0]
    # other inputs: the same case's expected bits differ between the sweeps
    def bits(d):
        ev = next(e for e in d["devices"][0]["evidence"] if CaseId.parse(e["case_id"]).scale == (0, 0))
        return ev["case_id"], [s.get("expected") for s in ev["samples"]]
    assert bits(docs[0])[0] == bits(docs[1])[0] and bits(docs[0])[1] != bits(docs[1])[1]
    assert docs[1]["options"]["probe_options"] == {"gemm.shift": "1,1", "pow2.step": "16", "pow2.offset": "1,1"}  # sweep 1
    with History(tmp / "history.sqlite") as h:
        assert [r.seed for r in h.results()] == seeds
        assert [r.coverage["index"] for r in h.results()] == [0, 1] and all(r.launches and r.failures for r in h.results())


@pytest.mark.parametrize("which", [0, 1])
def test_a_case_from_either_sweep_replays_bit_exactly(two_sweeps, which):
    """The report's re-run command, with the sweep's seed, its case at a dithered scale and its
    gemm shift, finds the very same bits."""
    _, docs = two_sweeps
    doc = docs[which]
    dev = doc["devices"][0]
    ev = next(e for e in dev["evidence"] if CaseId.parse(e["case_id"]).scale != (0, 0))
    assert ev["scale"] == ([-8, 8] if which == 0 else [-7, 9])  # the workload's (-8, 8), shifted by (1, 1) in sweep 1
    cmd = shlex.split(doc["sweep"]["rerun"][0])
    cmd[cmd.index("--case") + 1] = ev["case_id"]  # any case id of the device can take the first one's place
    assert cmd[:2] == ["aegis", "scan"]
    p = subprocess.run(aegis(*cmd[1:], "--format", "json"), env=env(1), capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stderr
    found = lambda evs: sorted((e["check"], e["seed"], e["elements"], json.dumps(e["samples"])) for e in evs if e["case_id"] == ev["case_id"])
    again = found(json.loads(p.stdout)["devices"][0]["evidence"])
    assert again and again == found(dev["evidence"]) and again[0][1] == doc["seed"]


def test_history_coverage_view(two_sweeps):
    tmp, docs = two_sweeps
    doc, _ = show_history(str(tmp / "history.sqlite"))
    (d,) = doc["devices"]
    c = d["coverage"]
    assert c["sweeps"] == 2 and c["seeds"] == 2 and c["last_seed"] == docs[1]["seed"]
    assert c["bands"] == 256 and c["gemm_bands"] == 2 and c["pow2_bands"] == 2
    assert c["launches"] == sum(x["devices"][0]["coverage"]["launches"] for x in docs) and c["failures"] > 0
    rows = history_csv(doc, coverage=True).splitlines()
    assert rows[0].startswith("uuid,last_host,last_id,sweeps,seeds,last_seed,bands") and f",2,2,{docs[1]['seed']},256," in rows[1]
    out = io.StringIO()
    render.coverage_table(Console(file=out, width=200), doc)
    assert "2/256 (1%)" in out.getvalue() and str(docs[1]["seed"]) in out.getvalue()
    p = subprocess.run(aegis("history", "--db", str(tmp / "history.sqlite"), "--coverage", "--device", "cpu:0"), env=env(1, COLUMNS="200"),
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and f"seed {docs[0]['seed']}" in p.stdout and "gemm shift [1, 1]" in p.stdout, p.stderr


def test_priority_cases_rerun_with_their_seed_and_shift(tmp_path, monkeypatch):
    """A case that failed at a dithered scale under an older seed re-runs as it was judged."""
    from aegis_cli.fleet.worker import _as_judged
    from aegis_cli.scan import ScanOptions

    (tmp_path / "wl.yaml").write_text("name: w\nmodel: {hidden: 64, ffn: 128, heads: 2, kv_heads: 1, seq_len: 64, micro_batch: 1, tp: 1}\n"
                                      "scan: {ops: [mlp_down], layouts: [fwd], distributions: [normal], scales: [[0, 0], [-8, 8]]}\n")
    dev = CpuBackend(n_devices=1).device(0)
    opts = ScanOptions(devices="cpu:0", workload=str(tmp_path / "wl.yaml"), seed=9, probes=("gemm",), probe_options={"gemm.shift": "2,2"})
    o = _as_judged(opts, "w/mlp_down/fwd/normal/64x64x128/s-5+11", 77, dev)
    assert o.seed == 77 and o.probe_options["gemm.shift"] == "3,3" and o.case.endswith("s-5+11")
    assert _as_judged(opts, "w/mlp_down/fwd/normal/64x64x128/s-6+10", 77, dev).probe_options["gemm.shift"] == "2,2"


def test_in_process_sweep_uses_the_resolved_seed(tmp_path, monkeypatch):
    monkeypatch.setenv("AEGIS_CPU_DEVICES", "1")
    cfg = load_config(write_config(tmp_path, seed=11, dither_sweeps=0, fingerprint_cases=0))
    out = run_sweep(cfg, environ={})
    assert out.doc["seed"] == 11 and out.doc["sweep"]["coverage"]["seed_derived"] is False and out.doc["options"]["probe_options"] == {}
    assert cfg.seed == 11 and cfg.probe_options == {}  # the caller's config is left as it was
