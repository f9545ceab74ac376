"""Case ids (ops/case.py): one parser for every shape the probes give, byte-identical round trips."""

from __future__ import annotations

import random

import pytest

from aegis_cli.backends import resolve_devices
from aegis_cli.ops.case import CaseId, op_site, rescaled, split_scale
from aegis_cli.ops.errors import ConfigError
from aegis_cli.ops.workloads import load
from aegis_cli.probes import case_probe, determinism, load_all, pow2
from aegis_cli.probes.computations import COMPUTATIONS, sizes_for
from aegis_cli.probes.crossdevice import case_ids as crossdevice_ids
from aegis_cli.probes.gemm_scan import plan_cases
from tests.helpers import run_cli


def every_probe_id() -> list[str]:
    """The case ids the probes give on a CPU, one or more of each shape."""
    cpu = resolve_devices("cpu:0")[0]
    wl = load("cpu-quick")
    gemm = [c.case_id(ea, eb) for c in plan_cases(wl, 7) for ea, eb in wl.scan.scales]
    return [*gemm, *(pow2.case_id(cpu, impl) for impl in pow2.IMPLS),
            *(determinism.case_id(n, sizes_for(cpu)) for n in COMPUTATIONS),
            *(i for n in COMPUTATIONS for i in crossdevice_ids(n)), "memory/pass0", "memory/nvml", "golden/checked_gemm"]


def test_every_probe_id_round_trips_byte_for_byte():
    load_all()
    ids = every_probe_id()
    assert any(":" in i for i in ids) and any(i.endswith("/s-16-16") for i in ids)  # crossdevice inputs, scales
    for text in ids:
        cid = CaseId.parse(text)
        assert str(cid) == text and CaseId.parse(str(cid)) == cid
        assert case_probe(text) == (cid.prefix if cid.prefix != "cpu-quick" else "gemm")


def test_gemm_ids_carry_their_scale_and_group():
    case = random.choice(plan_cases(load("cpu-quick"), random.randrange(2**31)))
    ea, eb = random.randint(-40, 40), random.randint(-40, 40)
    cid = CaseId.parse(case.case_id(ea, eb))
    s = case.shape
    assert cid == CaseId("cpu-quick", (s.op, s.layout.value, case.dist, f"{s.m}x{s.n}x{s.k}"), (ea, eb))
    assert cid.group == case.group_id and cid.group.scale is None and cid.extends(case.group_id)
    assert str(cid.with_scale(0, 0)) == case.case_id(0, 0) and cid.with_scale(ea, eb) == cid
    assert not case.group_id.extends(case.group_id) and not case.group_id.extends(cid)


def test_parts_and_scale_tokens():
    assert CaseId.parse("memory/pass3").part("memory") == "pass3" and CaseId.parse("memory/pass3").part("pow2") is None
    assert CaseId.parse("pow2").part("pow2") is None
    assert CaseId.parse("x/s-3+12").scale == (-3, 12) and str(CaseId("x", (), [-3, 12])) == "x/s-3+12"
    # scale tokens not written as aegis writes them are plain parts: read as scales they would print back otherwise
    for text in ("w/op/s+03+0", "w/op/s-0+0", "w/op/sXYZ", "w/op/s+1+1x"):
        cid = CaseId.parse(text)
        assert cid.scale is None and str(cid) == text


@pytest.mark.parametrize(("text", "needle"), [
    ("", "case id '' is empty"),
    ("cpu-quick//fwd", "an empty part"),
    ("/memory", "an empty part"),
    ("memory/", "an empty part"),
    ("/s+0+0", "an empty part"),
])
def test_bad_ids_are_refused(text, needle):
    with pytest.raises(ConfigError, match=needle):
        CaseId.parse(text)


def test_ids_that_could_not_round_trip_cannot_be_made():
    with pytest.raises(ConfigError, match="holds a /"):
        CaseId("my/workload", ("qkv",))
    with pytest.raises(ConfigError, match="reads as a scale"):
        CaseId("w", ("qkv", "s+0+0"))
    with pytest.raises(ConfigError, match="is not text"):
        CaseId.parse(None)


def test_a_bad_case_is_refused_before_any_work(capsys):
    code, _, err = run_cli(capsys, "scan", "-q", "--case", "cpu-quick/qkv//normal/192x384x256/s+0+0")
    assert code == 3 and "case id 'cpu-quick/qkv//normal/192x384x256/s+0+0': an empty part" in err


def test_op_ids_of_any_producer():
    """Launch op ids and other producers' case ids need not be CaseIds: the scale is still found."""
    assert split_scale("a//b/s+1-2") == ("a//b", (1, -2)) and split_scale("s+1-2") == ("s+1-2", None)
    assert rescaled("a//b/s+1-2", 3, 4) == "a//b/s+3+4" and rescaled("vt-id", 0, -8) == "vt-id/s+0-8"
    assert op_site("w/qkv/fwd/normal/1x2x3/s+16+16") == op_site("w/qkv/fwd/normal/1x2x3/s+0+0") == "w/qkv/fwd/normal/1x2x3"
    assert op_site("w/a/s-8+8:chunk0001") == "w/a:chunk0001"
    assert op_site("crossdevice/matmul/input:a") == "crossdevice/matmul/input:a"
    assert op_site("pow2/matmul/64x96x128/a+3b-3") == "pow2/matmul/64x96x128/a+3b-3"
