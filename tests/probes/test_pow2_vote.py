"""The power-of-two vote in the gemm probe (docs/design.md §5): a broken
C(2^a·A, 2^b·B) = 2^(a+b)·C(A, B) is attributed to the run that is actually wrong, and
"failed k of n" counts that case's own runs whose bits differ from the majority.

Faults fire in exactly one launch: ``prob=`` with a seed whose per-launch coin comes up on
that launch alone, and ``op=`` naming one case. The same tests run on the CPU backend and,
marked gpu, on the CUDA kernels with their in-kernel accumulator injection."""

from __future__ import annotations

import pytest
import torch

from aegis_cli.backends.cpu import CpuDevice
from aegis_cli.faults.spec import FaultPlan, LaunchContext
from aegis_cli.ops import workloads
from aegis_cli.ops.numerics import Thresholds
from aegis_cli.ops.verdict import Verdict
from aegis_cli.probes.gemm import GemmCase, GemmProbe
from tests.helpers import cuda_kernels

POW2 = "gemm.pow2_exact"
SCALES = [[0, 0], [-16, -16], [16, 16], [-8, 8]]
RERUNS = 5
WL = workloads.load("cpu-quick")
SHAPE = WL.gemms()[0]  # qkv fwd 192x384x256: small on either backend
# one element of the accumulator (the in-kernel injection on CUDA), or of the bf16 output
# below any checksum's reach
ONE_SHOT = ["bitflip:target=acc,bit=exp", "bitflip:target=out,bit=lo-mant"]


def _case(seed: int = 0) -> GemmCase:
    return GemmCase(WL.name, SHAPE, "normal", seed)


def cid(ea: int, eb: int) -> str:
    return _case().case_id(ea, eb)


def once_at(spec: str, op: str, launch: int, horizon: int = 80, prob: float = 0.02) -> str:
    """``spec`` made to fire on launch ``launch`` of a probe's plan and on no other of the first
    ``horizon``: a seed whose coin for an intermittent fault comes up there alone."""
    for seed in range(1, 100_000):
        text = f"{spec},prob={prob},seed={seed},op={op}"
        plan = FaultPlan.parse(text)
        fired = []
        for n in range(horizon):
            plan.launches = n
            fired.append(bool(plan.active(LaunchContext("any", op, (128, 128)), "acc" if "acc" in spec else "out")))
        if fired[launch] and sum(fired) == 1:
            return text
    raise AssertionError("no seed fires once")


def run(dev, spec: str | None, scales=SCALES, reruns: int = RERUNS, keep: bool = False):
    plan = FaultPlan.parse(spec) if spec else None
    probe = GemmProbe(dev, Thresholds(), reruns=reruns, fault=plan, keep_flagged=keep)
    return probe.run(_case(), scales), plan, probe


def _pow2(ev):
    return [e for e in ev if e.check == POW2]


# -- the checks, on any device -----------------------------------------------------------

def base_fault_blames_the_base(dev, spec: str) -> None:
    base = cid(0, 0)
    ev, plan, probe = run(dev, once_at(spec, base, 0), keep=True)
    assert [r["launch"] for r in plan.injected] == [0] and plan.injected[0]["op"] == base
    assert ev and {e.case_id for e in ev} == {base}, [e.summary for e in ev]  # no scaled run is blamed
    (e,) = _pow2(ev)
    assert e.severity is Verdict.FAULTY and e.scale == [0, 0]
    assert (e.reruns, e.reproduced, e.distinct_outputs) == (RERUNS, 0, 2)
    assert f"failed 1 of {RERUNS + 1} runs" in e.summary and "4 of 4 scales" in e.summary
    assert e.elements >= 1 and e.samples and e.samples[0]["xor"] != "0x0000"
    pos = {tuple(p) for r in plan.injected for p in r.get("positions", [])}
    assert pos and pos <= {tuple(p) for p in e.localised}
    # the kept run is the corrupted one, as observed
    clean = dev.checked_gemm(_case().operands(dev))
    assert not torch.equal(probe.flagged_runs[base].c.view(torch.int16), clean.c.cpu().view(torch.int16))
    # extra launches only to vote: the base topped up to 1 + reruns runs, nothing else re-run
    assert probe.stats.gemms == len(SCALES) + RERUNS


def scaled_fault_blames_that_run(dev, spec: str) -> None:
    hit = cid(-16, -16)
    ev, plan, _ = run(dev, once_at(spec, hit, 1))  # launch 0 is the base run
    assert [r["op"] for r in plan.injected] == [hit]
    assert {e.case_id for e in ev} == {hit}, [e.summary for e in ev]
    (e,) = _pow2(ev)
    assert e.severity is Verdict.FAULTY and e.scale == [-16, -16]
    assert (e.reruns, e.reproduced) == (RERUNS, 0) and f"failed 1 of {RERUNS + 1} runs" in e.summary
    assert "of 4 scales agree" in e.summary  # 3, or 4 where its confirmation re-runs outvoted its first run


def permanent_faults_stay_faulty(dev) -> None:
    # in every launch of the base alone: the three scaled runs outvote its six alike runs
    ev, _, _ = run(dev, f"bitflip:target=out,bit=14,op={cid(0, 0)}")
    (e,) = _pow2(ev)
    assert e.case_id == cid(0, 0) and e.severity is Verdict.FAULTY
    assert e.reproduced == e.reruns == RERUNS and f"failed {RERUNS + 1} of {RERUNS + 1} runs" in e.summary
    # in every launch of every case: FAULTY wherever it shows, reproduced every time
    ev, _, _ = run(dev, "bitflip:bit=30,seed=3")
    assert ev and all(e.severity is Verdict.FAULTY for e in ev)
    assert all(e.reproduced == e.reruns == RERUNS for e in ev)


def no_mismatch_no_extra_launches(dev) -> None:
    _, _, probe = run(dev, None)
    assert probe.stats.gemms == len(SCALES)
    # a fault every scale scales exactly (a sign flip): confirmation re-runs, as before, no vote
    ev, _, probe = run(dev, "bitflip:bit=sign,count=4,seed=1")
    assert ev and not _pow2(ev) and probe.stats.gemms == len(SCALES) * (1 + RERUNS)


# -- CPU ---------------------------------------------------------------------------------

@pytest.mark.parametrize("spec", ONE_SHOT)
def test_a_fault_once_in_the_base_run_is_the_base_runs(spec):
    base_fault_blames_the_base(CpuDevice(), spec)


@pytest.mark.parametrize("spec", ONE_SHOT)
def test_a_fault_once_in_a_scaled_run_is_that_runs(spec):
    scaled_fault_blames_that_run(CpuDevice(), spec)


def test_permanent_faults_are_still_faulty():
    permanent_faults_stay_faulty(CpuDevice())


def test_the_vote_costs_nothing_without_a_mismatch():
    no_mismatch_no_extra_launches(CpuDevice())


def test_two_scales_that_disagree_fall_back_to_the_base_run():
    """With one scaled run, a disagreement has no majority: the scaled run is named as the check
    compared it, counting its runs off the base run's bits, and the summary says so."""
    hit = cid(-16, -16)
    ev, _, _ = run(CpuDevice(), once_at(ONE_SHOT[1], hit, 1), scales=[[0, 0], [-16, -16]])
    (e,) = _pow2(ev)
    assert e.case_id == hit and e.severity is Verdict.FAULTY and f"failed 1 of {RERUNS + 1} runs" in e.summary
    assert "could not say which run is wrong" in e.summary


# -- GPU: the same with the CUDA kernels (accumulator faults injected inside the kernel) -----

def cuda(kernel: str):
    from aegis_cli.backends.cuda import CudaDevice

    if kernel not in cuda_kernels():
        pytest.skip("wgmma needs sm_90")
    return CudaDevice(0, kernel=kernel)


KERNELS = pytest.mark.parametrize("kernel", ["mma", "wgmma"])


@pytest.mark.gpu
@KERNELS
@pytest.mark.parametrize("spec", ONE_SHOT)
def test_gpu_a_fault_once_in_the_base_run_is_the_base_runs(kernel, spec):
    base_fault_blames_the_base(cuda(kernel), spec)


@pytest.mark.gpu
@KERNELS
@pytest.mark.parametrize("spec", ONE_SHOT)
def test_gpu_a_fault_once_in_a_scaled_run_is_that_runs(kernel, spec):
    scaled_fault_blames_that_run(cuda(kernel), spec)


@pytest.mark.gpu
@KERNELS
def test_gpu_permanent_faults_are_still_faulty(kernel):
    permanent_faults_stay_faulty(cuda(kernel))


@pytest.mark.gpu
@KERNELS
def test_gpu_the_vote_costs_nothing_without_a_mismatch(kernel):
    no_mismatch_no_extra_launches(cuda(kernel))


def test_a_run_that_does_not_scale_back_exactly_shares_no_bits():
    """A corrupted element that leaves the exact range when scaled back (2^-120 · 2^-32 flushes
    to zero) must not come back equal to the base run and hide the mismatch from the vote."""
    from aegis_cli.ops.gemm import GemmResult
    from aegis_cli.probes.gemm_runs import GroupRuns

    def res(c):
        return GemmResult(c=c, row_sums=torch.zeros(2, 1), col_sums=torch.zeros(1, 2), tile=(128, 128))

    clean = torch.zeros(2, 2, dtype=torch.bfloat16)
    bad = clean.clone()
    bad[0, 0] = 2.0**-120
    runs = GroupRuns(CpuDevice())
    runs.first((0, 0), res(clean), mismatched=False)
    runs.first((16, 16), res(bad), mismatched=True)
    runs.first((-8, 8), res(clean), mismatched=False)
    assert runs.prints((16, 16)) != runs.prints((0, 0)) == runs.prints((-8, 8))
    v = runs.vote()
    assert v.decided and v.odd == ((1, 0),)
