"""The attention probe: clean → HEALTHY; each kind of injected attention fault → the right
verdict, with evidence naming the check, head and block; --case re-runs one case; the grammar
of attn.* faults."""

from __future__ import annotations

import pytest

from aegis_cli.faults.spec import FaultPlan, parse_spec
from aegis_cli.ops.errors import ConfigError, InjectSpecError
from aegis_cli.ops.verdict import Verdict
from aegis_cli.probes import DEFAULT_PROBES
from aegis_cli.scan import ScanOptions, run_scan
from tests.helpers import TINY

CASE = "attention/normal/b1h4k2s160d64c"  # tiny.yaml: 4 heads, 2 KV heads, head dim 64, seq 160


def scan(inject: str | None = None, case: str | None = None, reruns: int = 2):
    rep = run_scan(ScanOptions(devices="cpu:0", probes=("attention",), workload=TINY, inject=inject, case=case,
                               reruns=reruns))
    return rep.devices[0]


def test_default_and_clean_healthy():
    assert "attention" in DEFAULT_PROBES
    d = scan()
    assert d.verdict is Verdict.HEALTHY, [e.summary for e in d.evidence]
    st = d.probe_stats["attention"]
    assert st["cases"] == 1 and st["runs"] == 3 and st["shape"]["token"] == "b1h4k2s160d64c"
    assert 0 < st["clean_ratio"] < 1 and set(st["clean_max"]) == {"o_rowsum", "lse", "dv_colsum", "dk_colsum", "dq_rowsum"}


def test_large_dv_fault_is_faulty_and_located():
    d = scan("perturb:target=attn.dv,r=1000,index=70")  # (batch 0, KV head 0, key 1, column 6)
    assert d.verdict is Verdict.FAULTY
    ev = [e for e in d.evidence if e.check == "attention.dv_colsum"]
    assert ev and ev[0].case_id.startswith(CASE) and ev[0].samples[0]["kv_head"] == 0 and ev[0].samples[0]["column"] == 6
    assert ev[0].reproduced == ev[0].reruns and ev[0].injected and ev[0].injected[0]["stage"] == "dv"


def test_additive_fault_breaks_exact_scaling():
    d = scan("perturb:target=attn.dv,r=0.8,index=70")
    assert d.verdict is Verdict.FAULTY and any(e.check == "attention.pow2_exact" for e in d.evidence)
    # a case with two findings is one case given in full
    t = d.tally.probe("attention").to_dict()
    assert t["evidence_in_full"] == t["flagged_cases"] == len({e.case_id for e in d.evidence}) < len(d.evidence)
    assert t["failed_launches"] == t["launches"] == 3 * (1 + 2)  # a permanent fault: every run of every scale


def test_fail_fast_stops_at_the_case_that_confirmed_faulty():
    """A SUSPECT at the base scale, FAULTY at a later one: fail-fast names the FAULTY case."""
    events: list[tuple[str, dict]] = []
    rep = run_scan(ScanOptions(devices="cpu:0", probes=("attention",), workload=TINY, reruns=2, fail_fast=True,
                               inject="perturb:target=attn.dv,r=0.8,index=70"),
                   progress=lambda event, **info: events.append((event, info)))
    d = rep.devices[0]
    assert next(i["total"] for e, i in events if e == "start") == sum(e == "case" for e, _ in events)
    assert d.evidence[0].severity is Verdict.SUSPECT
    faulty = next(e for e in d.evidence if e.severity is Verdict.FAULTY)
    assert d.tally.stopped_at == faulty.case_id != d.evidence[0].case_id
    # the case's later scale is not run: named as skipped, and nothing after the FAULTY is shown
    assert d.tally.probe("attention").skipped == [CASE + "/s-8+8"] and d.evidence[-1].case_id == faulty.case_id


def test_flag_within_rounding_bound_stays_suspect():
    # over τ in units of the rounding spread, but within what bf16 rounding of P could do (at the
    # base scale alone: at the others, an added constant breaks the exact scaling, which is FAULTY)
    d = scan("perturb:target=attn.dv,r=0.8,index=70", case=CASE + "/s+0+0")
    assert d.verdict is Verdict.SUSPECT, [e.summary for e in d.evidence]
    assert all("could be rounding" in e.summary for e in d.evidence)


def test_intermittent_fault_differs_between_runs():
    d = scan("bitflip:target=attn.recompute_p,bit=30,prob=0.5,seed=4", reruns=4)  # seed 4: fires on some runs
    assert d.verdict is Verdict.FAULTY
    assert any(e.distinct_outputs > 1 for e in d.evidence)


def test_forward_fault_names_query_block():
    d = scan("perturb:target=attn.pv,r=50,index=" + str((1 * 160 + 100) * 64 + 3))  # head 1, query 100
    assert d.verdict is Verdict.FAULTY
    ev = next(e for e in d.evidence if e.check == "attention.o_rowsum")
    assert ev.samples[0]["head"] == 1 and ev.samples[0]["query"] == 100 and ev.samples[0]["query_block"] == 1
    assert [1, 1] in ev.tiles


def test_case_reruns_one_case_and_refuses_others():
    d = scan(case=CASE + "/s+8-8")
    assert d.verdict is Verdict.HEALTHY and d.probe_stats["attention"]["runs"] == 2  # the base scale and this one
    with pytest.raises(ConfigError):
        scan(case="attention/normal/b1h4k2s999d64c/s+0+0")
    with pytest.raises(ConfigError):
        scan(case=CASE + "/s+4+4")


@pytest.mark.parametrize("spec", ["bitflip:target=attn.dv,row=1", "bitflip:target=acc,index=3", "bitflip:target=attn.nope",
                                  "mask:target=attn.dk,mask=0x1,count=2", "perturb:target=attn.dq,rate=0.1,r=1"])
def test_grammar_refuses(spec):
    with pytest.raises(InjectSpecError):
        parse_spec(spec)


def test_grammar_accepts_and_gemm_ignores_attention_faults():
    plan = FaultPlan.parse("mask:target=attn.dk,mask=0x80000000;perturb:target=attn.scores,r=3;bitflip:target=attn.lse,index=5")
    assert [f.target for f in plan.faults] == ["attn.dk", "attn.scores", "attn.lse"]
    assert not plan.needs_clean_median()


def test_json_report_of_an_attention_finding_validates(capsys):
    import json
    from pathlib import Path

    from tests.helpers import run_cli

    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads((Path(__file__).resolve().parents[2] / "docs" / "report.schema.json").read_text())
    code, out, _ = run_cli(capsys, "scan", "-q", "--workload", TINY, "--probes", "attention", "--reruns", "1",
                           "--format", "json", "--inject", "perturb:target=attn.dq,r=1000,index=5")
    doc = json.loads(out)
    jsonschema.validate(doc, schema)
    assert code == 2 and {e["check"] for e in doc["devices"][0]["evidence"]} >= {"attention.dq_rowsum"}
    assert all(e["case_id"].startswith(CASE) for e in doc["devices"][0]["evidence"])
