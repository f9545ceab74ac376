"""vTask model and bundle format: round trips, atomic writes, the golden bundle, and a
bundle written by an independent program that follows only docs/bundle-format.md."""

from __future__ import annotations

import json
import math
import os
import re
import struct
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aegis_cli.checks.gemm import GEMM_CHECKS
from aegis_cli.ops import numerics
from aegis_cli.ops.errors import BundleError
from aegis_cli.ops.gemm import GemmOperands, Layout
from aegis_cli.vtask import model as vtask
from aegis_cli.vtask.bundle import BundleWriter, read_bundle
from aegis_cli.vtask.model import GemmSpec, VTask

GOLDEN = Path(__file__).resolve().parents[1] / "golden"
GOLDEN_BUNDLE = GOLDEN / "bundle-v1.aegis"
GOLDEN_V2 = GOLDEN / "bundle-v2.aegis"  # written by today's writer
GOLDEN_CREATED = "2026-01-01T00:00:00+00:00"


def make_vtask(vid: str = "v0", layout: Layout = Layout.FWD, m: int = 6, n: int = 10, k: int = 8, rows=None, cols=None,
               tile=(4, 4), scale=(0, 0), seed: int = 1, observed: bool = True, **kw) -> VTask:
    """A valid vTask with seeded bf16 operands and its clean observed outputs."""
    spec = GemmSpec(layout=layout, m=m, n=n, k=k, tile=tile, rows=rows, cols=cols,
                    flagged_rows=list(rows or [])[:2], flagged_cols=list(cols or [])[:2])
    a = numerics.generate_bf16(spec.expected("a")[1], "normal", seed, "cpu")
    b = numerics.generate_bf16(spec.expected("b")[1], "normal", seed + 1, "cpu")
    tensors = {"a": a, "b": b}
    if observed:
        ops = GemmOperands(a, b, layout)
        acc = ops.a_mk.float() @ ops.b_kn.float()
        tensors["c"] = acc.to(torch.bfloat16)
        if cols is None:
            tensors["row_sums"] = numerics.sum_col_tiles(acc.double(), tile[1]).float()
        if rows is None:
            tensors["col_sums"] = numerics.sum_row_tiles(acc.double(), tile[0]).float()
    return VTask(id=vid, check=kw.pop("check", "gemm.row_checksum"), op=kw.pop("op", "qkv"), gemm=spec, tensors=tensors,
                 tau=kw.pop("tau", 5e-7), scale=scale, seed=seed, dist="normal",
                 case_id=kw.pop("case_id", f"test/qkv/{layout.value}/normal/{m}x{n}x{k}/s+0+0"), **kw)


def assert_same(v1: VTask, v2: VTask) -> None:
    assert set(v1.tensors) == set(v2.tensors)
    for role, t in v1.tensors.items():
        u = v2.tensors[role]
        assert t.dtype == u.dtype and t.shape == u.shape, role
        view = {2: torch.int16, 4: torch.int32}[t.element_size()]
        assert torch.equal(t.contiguous().view(view), u.contiguous().view(view)), role
    for f in ("id", "kind", "check", "op", "tau", "confirm_margin", "normalisation", "case_id", "seed", "dist", "provenance", "extra"):
        assert getattr(v1, f) == getattr(v2, f), f
    assert tuple(v1.scale) == tuple(v2.scale)
    assert v1.spec.to_json() == v2.spec.to_json()
    for key, x in v1.observed.items():
        y = v2.observed[key]
        if isinstance(x, float) and math.isnan(x):
            assert math.isnan(y)
        else:
            assert x == y, key


# -- round trip ------------------------------------------------------------------------------
def _subset(draw, size: int):
    if draw(st.booleans()):
        return None
    return sorted(draw(st.sets(st.integers(0, size - 1), min_size=1, max_size=size)))


@st.composite
def vtasks(draw):
    n_tasks = draw(st.integers(1, 3))
    out = []
    for i in range(n_tasks):
        layout = draw(st.sampled_from(list(Layout)))
        m, n, k = draw(st.integers(1, 12)), draw(st.integers(1, 12)), draw(st.integers(1, 12))
        rows, cols = _subset(draw, m), _subset(draw, n)
        tile = (draw(st.integers(1, 8)), draw(st.integers(1, 8)))
        scale = (draw(st.integers(-40, 40)), draw(st.integers(-40, 40)))
        finite = st.floats(allow_nan=False, allow_infinity=False, width=64)
        obs = {"max_normalised_diff": draw(st.one_of(finite, st.just(math.inf), st.just(math.nan))),
               "elements": draw(st.integers(0, 10**6)), "severity": draw(st.sampled_from(vtask.SEVERITIES)),
               "summary": draw(st.text(max_size=40)), "fingerprints": {"c": f"{draw(st.integers(0, 2**64 - 1)):016x}"},
               "samples": [{"row": draw(st.integers(0, 99)), "observed": draw(finite), "tile": [1, 2]}]}
        prov = {"host": draw(st.text(max_size=20)), "gpu_uuid": draw(st.text(max_size=40)), "rank": draw(st.integers(0, 1024)),
                "step": draw(st.integers(0, 10**9)), "versions": {"aegis": "0.1", "torch": draw(st.text(max_size=10))},
                "injected": draw(st.booleans())}
        vt = make_vtask(f"task-{i}/{layout.value}", layout, m, n, k, rows, cols, tile, scale, seed=draw(st.integers(0, 2**31)),
                        observed=draw(st.booleans()), check=draw(st.sampled_from(GEMM_CHECKS)), tau=draw(st.floats(1e-12, 0.5)))
        if draw(st.booleans()):  # values at the edge of bf16's range
            vt.tensors["a"] = numerics.pow2_scale(vt.tensors["a"], draw(st.integers(-100, 100)))
        vt.observed, vt.provenance = obs, prov
        vt.extra = {"note": draw(st.text(max_size=30))}
        out.append(vt)
    return out


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(vtasks())
def test_round_trip_random_vtasks(vts):
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "b.aegis"
        with BundleWriter(path) as w:
            for vt in vts:
                w.add(vt)
        back = read_bundle(path)
        assert back.format_version == vtask.FORMAT_VERSION
        assert [v.id for v in back.vtasks] == [v.id for v in vts]
        for v1, v2 in zip(vts, back.vtasks, strict=True):
            assert_same(v1, v2)
        assert os.listdir(d) == ["b.aegis"]  # no temp files left behind


def test_identical_tensors_are_stored_once(tmp_path):
    row = make_vtask("row", check="gemm.row_checksum")
    col = VTask(**{**row.__dict__, "id": "col", "check": "gemm.col_checksum"})
    with BundleWriter(tmp_path / "b.aegis") as w:
        w.add(row)
        w.add(col)
    back = read_bundle(tmp_path / "b.aegis")
    assert back.vtasks[0].tensors["a"] is back.vtasks[1].tensors["a"]
    data = (tmp_path / "b.aegis").read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    assert len(json.loads(data[8:8 + n])) - 1 == len(row.tensors)  # five tensors, not ten


# -- atomic writes ---------------------------------------------------------------------------
def test_writer_leaves_nothing_when_the_block_raises(tmp_path):
    path = tmp_path / "b.aegis"
    with pytest.raises(RuntimeError), BundleWriter(path) as w:
        w.add(make_vtask())
        raise RuntimeError("crash while collecting vTasks")
    assert list(tmp_path.iterdir()) == []


def test_writer_rejects_bad_vtasks_before_writing(tmp_path):
    path = tmp_path / "b.aegis"
    w = BundleWriter(path)
    w.add(make_vtask("x"))
    with pytest.raises(BundleError, match="duplicate vTask id 'x'"):
        w.add(make_vtask("x"))
    bad = make_vtask("nan")
    bad.tensors["b"] = bad.tensors["b"].clone()
    bad.tensors["b"][0, 0] = float("nan")
    with pytest.raises(BundleError, match="input b contains NaN or Inf"):
        w.add(bad)
    wrong = make_vtask("shape")
    wrong.tensors["a"] = wrong.tensors["a"][:, :3]
    with pytest.raises(BundleError, match=r"tensor a is torch\.bfloat16"):
        w.add(wrong)
    assert not path.exists()
    assert w.finalise() == 1 and len(read_bundle(path).vtasks) == 1


def test_crash_during_rename_keeps_the_old_bundle(tmp_path, monkeypatch):
    path = tmp_path / "b.aegis"
    with BundleWriter(path) as w:
        w.add(make_vtask("old"))
    before = path.read_bytes()

    def boom(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", boom)
    w = BundleWriter(path)
    w.add(make_vtask("new"))
    with pytest.raises(BundleError, match="cannot write"):
        w.finalise()
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["b.aegis"]


# -- golden bundle: the format cannot drift silently ---------------------------------------------
def golden_vtasks(version: int = 1) -> list[VTask]:
    """The content of tests/golden/bundle-v<version>.aegis (regenerate the newest: python
    tests/vtask/test_model.py). Version 2 adds a τ in units of the device's noise."""
    full = make_vtask("golden/fwd/full/gemm.row_checksum", Layout.FWD, 6, 10, 8, tile=(4, 4), seed=11)
    full.observed = {"severity": "FAULTY", "max_normalised_diff": math.inf, "elements": 1, "samples": [{"row": 2, "col_tile": 1}],
                     "fingerprints": {"c": "0123456789abcdef"}}
    full.provenance = {"host": "golden-host", "gpu_name": "Golden GPU", "gpu_uuid": "GPU-golden", "rank": 3, "step": 42,
                       "versions": {"aegis": "0.1.0"}, "injected": False}
    rows = make_vtask("golden/wgrad/rows/gemm.row_checksum", Layout.WGRAD, 7, 5, 9, rows=[1, 5], tile=(4, 4), scale=(-8, 8), seed=12)
    cols = make_vtask("golden/dgrad/cols/gemm.col_checksum", Layout.DGRAD, 5, 9, 6, cols=[0, 3, 8], tile=(2, 4), seed=13,
                      check="gemm.col_checksum")
    if version >= 2:
        cols.tau, cols.normalisation = 3.5, "device-noise"
    return [full, rows, cols]


def golden_vtasks_v2() -> list[VTask]:
    """The content of tests/golden/bundle-v2.aegis: version 2's GEMM vTasks, and one attention vTask
    (inputs only: B 1, 2 query heads sharing 1 KV head, S 8, D 4, causal, at V·2^8, dO·2^-8)."""
    from aegis_cli.ops.numerics import generate_bf16
    from aegis_cli.vtask.model import AttentionSpec

    g = lambda rows, i: generate_bf16((rows, 4), "normal", 20 + i, "cpu")
    att = VTask(id="golden/attention/attention.dv_colsum", check="attention.dv_colsum", op="attention", gemm=None,
                attention=AttentionSpec(1, 2, 1, 8, 4, True, 0.5), kind="attention",
                tensors={"q": g(16, 0), "k": g(8, 1), "v": g(8, 2), "do": g(16, 3)}, tau=10.0, normalisation="rounding-spread",
                confirm_margin=1.0, scale=(8, -8), case_id="attention/normal/b1h2k1s8d4c/s+8-8", seed=14, dist="normal",
                observed={"severity": "FAULTY", "max_normalised_diff": 1e9, "samples": [{"kv_head": 0, "column": 2}]},
                provenance={"host": "golden-host", "injected": True})
    return [*golden_vtasks(2), att]


def write_golden(path: Path) -> None:
    with BundleWriter(path, producer={"name": "aegis", "version": "golden"}, created=GOLDEN_CREATED) as w:
        for vt in golden_vtasks_v2():
            w.add(vt)


@pytest.mark.parametrize(("path", "version", "content"), [(GOLDEN_BUNDLE, 1, golden_vtasks), (GOLDEN_V2, 2, golden_vtasks_v2)])
def test_golden_bundle_still_reads(path, version, content):
    back = read_bundle(path)
    assert back.format_version == version and back.created == GOLDEN_CREATED
    expected = content()
    assert len(back.vtasks) == len(expected)
    for v1, v2 in zip(expected, back.vtasks, strict=True):
        assert_same(v1, v2)
    readme = (GOLDEN / "README.md").read_text(encoding="utf-8")
    assert re.search(rf"format_version:\s*{version}\b", readme)


def test_a_version_1_bundle_cannot_claim_a_tau_in_noise_units():
    from aegis_cli.vtask.manifest import Check, check_vtask

    entry = golden_vtasks(2)[2].manifest_entry({"a": "a", "b": "b"})
    check_vtask(Check(""), 0, entry, 2)
    with pytest.raises(BundleError, match="normalisation is 'device-noise', expected one of abs-product"):
        check_vtask(Check(""), 0, entry, 1)


def test_writer_output_matches_golden_layout(tmp_path):
    """Today's writer still produces the golden file's header, manifest and tensor bytes."""
    write_golden(tmp_path / "now.aegis")

    def split(p: Path):
        data = p.read_bytes()
        (n,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8:8 + n])
        return header, json.loads(header["__metadata__"]["manifest"]), data[8 + n:]

    (h1, m1, d1), (h2, m2, d2) = split(GOLDEN_V2), split(tmp_path / "now.aegis")
    assert m1 == m2
    assert {k: v for k, v in h1.items() if k != "__metadata__"} == {k: v for k, v in h2.items() if k != "__metadata__"}
    assert d1 == d2


# -- an independent writer following only the spec -------------------------------------------------
def test_independent_writer_bundle_is_accepted(tmp_path):
    from tests.independent_bundle_writer import write_bundle

    path = tmp_path / "ind.aegis"
    write_bundle(str(path))
    back = read_bundle(path)
    assert [v.id for v in back.vtasks] == ["independent/dgrad-full/gemm.row_checksum", "independent/fwd-rows/gemm.row_checksum"]
    assert back.vtasks[0].observed["max_normalised_diff"] == math.inf
    assert back.vtasks[1].gemm.subset == "rows" and back.vtasks[1].tensors["a"].shape == (2, 8)


def test_limits_from_env(monkeypatch):
    monkeypatch.setenv("AEGIS_BUNDLE_MAX_BYTES", "12345")
    assert vtask.Limits.from_env().max_bytes == 12345
    assert vtask.Limits.from_env(999).max_bytes == 999
    monkeypatch.setenv("AEGIS_BUNDLE_MAX_BYTES", "lots")
    with pytest.raises(BundleError, match="AEGIS_BUNDLE_MAX_BYTES"):
        vtask.Limits.from_env()


if __name__ == "__main__":  # regenerate the golden bundle (only with a format_version bump!)
    write_golden(GOLDEN_V2)
    print(f"wrote {GOLDEN_V2}")
