"""The --inject grammar: what parses, and one clear message for what does not."""

from __future__ import annotations

import numpy as np
import pytest

from aegis_cli.faults.spec import FaultPlan, parse_spec
from aegis_cli.ops.errors import InjectSpecError


@pytest.mark.parametrize(
    "spec",
    [
        "bitflip",
        "bitflip:bit=sign,target=acc,count=3",
        "bitflip:bit=7,target=out,row=1,col=2",
        "mask:mask=0x00ff,target=b",
        "mask:mask=0xffffffff",
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
        ("bitflip:count=0", "count=0 must lie in [1, "),
        ("bitflip:count=1000000000000", "count=1000000000000 must lie in [1, 16777216]"),  # was a MemoryError
        ("stuck-lane:mask=0x1,stride=99999999999999999999", "stride=99999999999999999999 must lie in"),  # was a TypeError
        ("tile:mode=zero,sm=4294967299", "sm=4294967299 must lie in"),  # would have wrapped to SM 3 in the kernel
        ("mask:mask=0x10000000000000000", "must lie in [1, 0xffffffffffffffff]"),
        # bits beyond the element were dropped: the fault flipped nothing and the scan said HEALTHY
        ("mask:mask=0x10000,target=out", "mask=0x10000 has bits above bit 15; target=out elements have 16"),
        ("stuck-lane:mask=0xffff0000,target=out", "has bits above bit 15"),
        ("mask:mask=0x1ffff,target=a", "has bits above bit 15"),
        ("mask:mask=0x100000001", "has bits above bit 31; target=acc elements have 32"),
        ("tile:mode=zero,tile=1.\u00b2", "tile=ROW.COL"),  # a Unicode digit: isdigit() but not int()
        ("bitflip:prob=2", "prob=2 must lie in"),
        ("perturb:rate=0.1", "perturb needs r="),
        ("mask:target=acc", "needs mask="),
        ("tile:mode=zero,tile=1", "tile=ROW.COL"),
        ("tile:mode=zero,tile=0.0,sm=1", "at most one of"),
        ("replace:span=7", "span must be one of"),
        ("replace:span=random,row=3", "span=random draws its own start"),  # row=3 was ignored: it landed anywhere
        ("replace:span=random,col=0,target=out", "span=random draws its own start"),
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


def test_shared_fault_lands_in_the_same_place_on_every_device():
    """A fault without device= is one fault of the node: its positions and its coin must not
    depend on which device-specific faults came before it in the spec (for_device drops those)."""
    import torch

    from aegis_cli.faults import tensor as corrupt
    from aegis_cli.faults.spec import LaunchContext

    shared = "bitflip:count=4,bit=exp,prob=0.5"
    plan = FaultPlan.parse(f"bitflip:device=cpu:1,bit=sign,seed=9; {shared}")
    acc0 = torch.randn(96, 160, dtype=torch.float32, generator=torch.Generator().manual_seed(0))
    a, b = torch.randn(96, 64).to(torch.bfloat16), torch.randn(64, 160).to(torch.bfloat16)
    seen = {}
    for dev in ("cpu:0", "cpu:1"):
        p = plan.for_device(dev)
        for launch in range(12):
            p.launches = launch
            corrupt.apply_acc(p, LaunchContext(dev, "w/op/fwd/normal/96x160x64/s+0+0", (64, 128), np.zeros((2, 2), dtype=np.int32)),
                              acc0.clone(), a, b)
        seen[dev] = [(r["launch"], r["positions"], r["masks"]) for r in p.injected if r["fault"] == shared]
    assert 0 < len(seen["cpu:0"]) < 12  # the coin fired on some launches, not all
    assert seen["cpu:0"] == seen["cpu:1"]
    assert plan.for_device("cpu:1").slots == [0, 1] and plan.for_device("cpu:0").slots == [1]


@pytest.mark.parametrize("spec", ["stuck-lane:mask=0x400000,stride=0x20,offset=0x3", "tile:mode=zero,every=0x3",
                                  "tile:mode=skipk,kstep=0x1,tile=0.0", "row:row=0x11", "bitflip:count=0x2,seed=1"])
def test_integer_parameters_read_as_checked(spec):
    """The grammar accepts 0x… integers for every integer key; applying the fault must read them
    the same way (a base-10 int() raised ValueError with a traceback for stride=0x20)."""
    import torch

    from aegis_cli.faults import tensor as corrupt
    from aegis_cli.faults.spec import LaunchContext

    plan = FaultPlan.parse(spec)
    acc = torch.randn(96, 160, dtype=torch.float32, generator=torch.Generator().manual_seed(0))
    a, b = torch.randn(96, 64).to(torch.bfloat16), torch.randn(64, 160).to(torch.bfloat16)
    before = acc.clone()
    corrupt.apply_acc(plan, LaunchContext("cpu:0", "t", (64, 128), np.zeros((2, 2), dtype=np.int32)), acc, a, b)
    assert plan.injected and not torch.equal(acc, before)


def test_cuda_stuck_lanes_pack_into_lane_slots_or_edits():
    """Host side of CUDA stuck-lane faults (no GPU needed): dense lanes take kernel lane slots (at
    most MAX_LANES per launch, a clear error beyond), sparse ones go in as ordinary XOR edits."""
    import torch

    from aegis_cli.faults import kernel_params
    from aegis_cli.faults.spec import LaunchContext
    from aegis_cli.ops.gemm import GemmOperands, Layout

    m, n, k = 1024, 512, 64  # a stride-32 lane hits 16 Ki elements
    ops = GemmOperands(torch.ones(m, k, dtype=torch.bfloat16), torch.ones(n, k, dtype=torch.bfloat16), Layout.FWD)
    ctx = LaunchContext("cuda:0", "t", (64, 128))
    dense = [f"stuck-lane:mask=0x{1 << (20 + i):x},stride=32,offset={i}" for i in range(kernel_params.MAX_LANES)]
    sparse = "stuck-lane:mask=0x80000000,stride=300000,offset=7"  # 2 of the 512 Ki elements
    acc = kernel_params.acc_faults(FaultPlan.parse("; ".join([*dense, sparse])), ctx, ops, (2, 2))
    assert acc.lanes == [(32, i, 1 << (20 + i)) for i in range(kernel_params.MAX_LANES)]
    (flat, op, bits), = acc.edits
    assert flat.tolist() == [7, 300007] and op == kernel_params.EDIT_XOR and bits.tolist() == [0x80000000] * 2
    params, _keep = kernel_params.inject_params(acc, m, n, (64, 128), torch.device("cpu"))
    assert params.n_lanes == kernel_params.MAX_LANES and list(params.lane_offset) == list(range(kernel_params.MAX_LANES))
    assert params.n_edits == 2
    with pytest.raises(InjectSpecError, match="at most 4 dense stuck-lane"):
        kernel_params.acc_faults(FaultPlan.parse("; ".join([*dense, "stuck-lane:mask=0x1,stride=64,offset=9"])), ctx, ops, (2, 2))


def test_cuda_tile_faults_that_change_nothing_are_never_fired():
    """Host side of CUDA tile faults: a shift with one row of CTA tiles is not injected and an
    SM-pinned fault whose SM ran no tile hits nothing; both must be named as never fired."""
    import torch

    from aegis_cli.faults import kernel_params
    from aegis_cli.faults.spec import LaunchContext
    from aegis_cli.ops.gemm import GemmOperands, Layout

    m, n, k = 128, 512, 64  # 2×4 checksum tiles, one row of 128-row CTA tiles
    ops = GemmOperands(torch.ones(m, k, dtype=torch.bfloat16), torch.ones(n, k, dtype=torch.bfloat16), Layout.FWD)
    ctx = LaunchContext("cuda:0", "t", (64, 128))
    plan = FaultPlan.parse("tile:mode=shift,tile=0.0; tile:mode=zero,sm=9; tile:mode=stuck,tile=1.3")
    acc = kernel_params.acc_faults(plan, ctx, ops, (2, 2))
    for record in acc.after:  # what checked_gemm does once the launch reported each tile's SM
        record(np.arange(8, dtype=np.int32).reshape(2, 4))
    assert plan.never_fired() == ["tile:mode=shift,tile=0.0", "tile:mode=zero,sm=9"]


@pytest.mark.parametrize(("spec", "what"), [
    ("tile:mode=zero,sm=3; tile:mode=zero,sm=5", "one SM-pinned tile fault per launch"),
    ("tile:mode=zero,sm=3; tile:mode=stuck,sm=3", "one SM-pinned tile fault per launch"),
    ("tile:mode=stuck,value=2,tile=0.0; tile:mode=stuck,value=7,tile=1.1", "one stuck tile value per launch"),
    ("tile:mode=skipk,kstep=0,tile=0.0; tile:mode=skipk,kstep=1,tile=1.1", "one skipped k-step per launch"),
    ("tile:mode=zero,tile=0.0; tile:mode=stuck,tile=0.0", "one mode for tile 0.0 per launch"),
])
def test_cuda_tile_faults_the_kernels_cannot_take_together_are_refused(spec, what):
    """The kernels' parameter block has one SM pin, one stuck value, one k-step and one mode per
    tile: a second, different one silently replaced the first, which was still recorded as
    injected (two SM-pinned faults corrupted only the last SM's tiles)."""
    import torch

    from aegis_cli.faults import kernel_params
    from aegis_cli.faults.spec import LaunchContext
    from aegis_cli.ops.gemm import GemmOperands, Layout

    m, n, k = 256, 256, 128
    ops = GemmOperands(torch.ones(m, k, dtype=torch.bfloat16), torch.ones(n, k, dtype=torch.bfloat16), Layout.FWD)
    ctx = LaunchContext("cuda:0", "t", (64, 128))
    with pytest.raises(InjectSpecError, match=what):
        kernel_params.acc_faults(FaultPlan.parse(spec), ctx, ops, (2, 2))
    # the same pin, value or k-step twice, or two tiles apart, are one kernel setting each
    same = "tile:mode=zero,sm=3; tile:mode=zero,sm=3; tile:mode=stuck,value=2,tile=0.0; tile:mode=stuck,value=2.0,tile=1.1"
    acc = kernel_params.acc_faults(FaultPlan.parse(same + "; tile:mode=skipk,kstep=1,tile=2.0; tile:mode=skipk,kstep=3,tile=2.1"), ctx, ops, (2, 2))
    params, _keep = kernel_params.inject_params(acc, m, n, (64, 128), torch.device("cpu"))
    assert (params.sm_target, params.sm_mode, params.tile_value, params.kstep) == (3, kernel_params.TILE_CODES["zero"], 2.0, 1)


def test_recent_injections_names_the_case_at_any_scale_and_either_pass():
    """One rule for every producer of evidence: a GEMM case's records at any of its scales, an
    attention case's forward and backward passes (``CASE:fwd``, ``CASE:bwd``), no one else's."""
    from aegis_cli.faults.spec import recent_injections

    plan = FaultPlan.parse("bitflip:bit=exp")
    ops = ["w/qkv/fwd/normal/8x8x8/s+0+0", "attention/normal/b1h8k2s192d32c/s+0+0:fwd", "w/mlp/fwd/normal/8x8x8/s+0+0",
           "attention/normal/b1h8k2s192d32c/s+8-8:bwd", "attention/uniform/b1h8k2s192d32c/s+0+0:fwd",
           "w/qkv/fwd/normal/8x8x8/s-8+8", "train/sdpa#1/b1h8k2s192d32c:fwd", "train/sdpa#1/b1h8k2s192d32c:bwd"]
    plan.injected += [{"op": op} for op in ops]
    ops_of = lambda **k: [r["op"] for r in recent_injections(plan, **k)]
    assert ops_of(case="attention/normal/b1h8k2s192d32c/s-8+8") == [ops[1], ops[3]]
    assert ops_of(case="w/qkv/fwd/normal/8x8x8/s+16+16") == [ops[0], ops[5]]
    assert ops_of(case="train/sdpa#1/b1h8k2s192d32c") == ops[6:]  # a training call's site has no scale
    assert ops_of(case="train/sdpa#1/b1h8k2s192d32c", n=1) == ops[7:]
    assert ops_of() == ops[-4:] and recent_injections(None, case=ops[0]) == []
