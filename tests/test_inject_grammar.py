"""The --inject grammar: what parses, and one clear message for what does not."""

from __future__ import annotations

import pytest

from aegis_cli.errors import InjectSpecError
from aegis_cli.inject import FaultPlan, parse_spec


@pytest.mark.parametrize(
    "spec",
    [
        "bitflip",
        "bitflip:bit=sign,target=acc,count=3",
        "bitflip:bit=7,target=out,row=1,col=2",
        "mask:mask=0x00ff0000,target=b",
        "stuck-lane:mask=0x400000,stride=32,offset=5",
        "replace:span=64,value=random,target=a",
        "replace:span=random,value=copy,target=out",
        "perturb:r=1000,rate=2e-4",
        "tile:mode=shift,tile=1.0",
        "tile:mode=skipk,kstep=2,every=3",
        "tile:mode=zero,sm=7",
        "row:mode=stuck,row=4,value=2.5",
        "bitflip:prob=0.5,seed=9,device=cpu:1,op=mlp_down; tile:mode=zero",
    ],
)
def test_valid_specs_parse(spec):
    faults = parse_spec(spec)
    assert faults and all(f.model for f in faults)
    assert FaultPlan.parse(spec).describe() == [str(f) for f in faults]


@pytest.mark.parametrize(
    ("spec", "needle"),
    [
        ("", "empty fault spec"),
        ("laser", "unknown fault model 'laser'"),
        ("bitflip:bit", "expected KEY=VALUE"),
        ("bitflip:bit=exp,bit=sign", "given twice"),
        ("bitflip:colour=red", "unknown key 'colour'"),
        ("bitflip:bit=40", "must be 0..31"),
        ("bitflip:count=0", "count=0 must be ≥ 1"),
        ("bitflip:prob=2", "prob=2 must lie in"),
        ("perturb:rate=0.1", "perturb needs r="),
        ("mask:target=acc", "needs mask="),
        ("tile:mode=zero,tile=1", "tile=ROW.COL"),
        ("tile:mode=zero,tile=0.0,sm=1", "at most one of"),
        ("replace:span=7", "span must be one of"),
        ("stuck-lane:mask=0x1,target=a", "target=a not valid"),
        ("row:mode=shift", "row mode must be"),
        ("bitflip:row=x", "is not an integer"),
    ],
)
def test_invalid_specs_name_the_problem(spec, needle):
    with pytest.raises(InjectSpecError) as exc:
        parse_spec(spec)
    assert needle in str(exc.value)
    assert "\n" not in str(exc.value)


def test_plan_for_device_keeps_only_its_faults():
    plan = FaultPlan.parse("bitflip:device=cpu:1; tile:mode=zero")
    assert len(plan.for_device("cpu:1").faults) == 2
    assert len(plan.for_device("cpu:0").faults) == 1
    assert FaultPlan.parse("bitflip:device=cpu:1").for_device("cpu:0") is None
