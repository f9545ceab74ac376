"""The CUDA device's checked attention (backends/cuda.py over backends/cuda_attention.py) against
the library's references: fp64 attention within bf16 tolerance, the attention checks clean,
repeats bit-identical, the zero-padded head dims, and each stage's fault seen where the CPU
reference's hook sees it. GPU tier: skipped without CUDA and CuPy."""

from __future__ import annotations

import pytest
import torch

from aegis_cli.checks import attention as checks
from aegis_cli.faults.spec import FaultPlan
from aegis_cli.ops import attention as A
from aegis_cli.ops import attention_sums as sums
from aegis_cli.ops.fingerprint import int_view
from aegis_cli.ops.verdict import Verdict
from tests.attention_helpers import draw

pytestmark = pytest.mark.gpu

SHAPES = [(1, 8, 1, 1024, 128, True), (2, 4, 2, 333, 64, True), (1, 4, 4, 200, 64, False), (1, 8, 2, 192, 32, True),
          (1, 2, 1, 1, 128, True)]


def _device():
    from aegis_cli.backends.cuda import CudaDevice

    return CudaDevice(0)


def _on(ops: A.AttentionOperands, dev) -> A.AttentionOperands:
    return A.AttentionOperands(*(t.to(dev.torch_device) for t in (ops.q, ops.k, ops.v, ops.do)), ops.causal)


def _run(dev, ops, fault=None, op="gpu-test"):
    sc = ops.shape.scale
    f = dev.attention_forward(ops.q, ops.k, ops.v, causal=ops.causal, scale=sc, fault=fault, op=f"{op}:fwd")
    b = dev.attention_backward(ops.q, ops.k, ops.v, f.o, f.lse, ops.do, causal=ops.causal, scale=sc, fault=fault, op=f"{op}:bwd")
    return f, b


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dist", ["normal", "heavy"])
def test_matches_fp64_checks_clean_and_repeats(shape, dist):
    dev = _device()
    ops = _on(draw(*shape, dist=dist, seed=sum(shape)), dev)
    ref = A.reference(ops, ops.shape.scale, outputs=True)
    f, b = _run(dev, ops)
    for got, want in ((f.o, ref.o), (b.dq, ref.dq), (b.dk, ref.dk), (b.dv, ref.dv)):
        assert float((got.double() - want).abs().max() / (want.abs().max() + 1e-3)) < 2e-2
    c = checks.check_attention(ops, f, b, ref, ops.shape.scale, sums.AttentionThresholds())
    assert not c.signals, [(s.check, s.max_value) for s in c.signals]
    f2, b2 = _run(dev, ops)
    for x, y in zip(checks.outputs_of(f, b).values(), checks.outputs_of(f2, b2).values(), strict=True):
        assert torch.equal(int_view(x), int_view(y))


@pytest.mark.parametrize("stage", list(A.STAGES))
def test_each_stage_fault_fires_where_the_reference_says(stage):
    dev = _device()
    host = draw(1, 4, 2, 192, 64, seed=5)
    ops = _on(host, dev)
    spec = f"perturb:target=attn.{stage},r={'1e4' if stage == 'dp' else '8'},seed=2"
    f, b = _run(dev, ops, FaultPlan.parse(spec), op="attention/normal/x/s+0+0")
    from aegis_cli.backends.cpu import CpuDevice

    # the same spec lands on the same value on both backends (faults/attention.py's seeded draw)
    cf, cb = _run(CpuDevice(), host, FaultPlan.parse(spec), op="attention/normal/x/s+0+0")
    ref = A.reference(ops, ops.shape.scale)
    gpu = {s.check for s in checks.check_attention(ops, f, b, ref, ops.shape.scale, sums.AttentionThresholds()).signals}
    cpu = {s.check for s in checks.check_attention(host, cf, cb, A.reference(host, host.shape.scale), host.shape.scale,
                                                   sums.AttentionThresholds()).signals}
    assert cpu and gpu & cpu, (gpu, cpu)  # the sets may differ where a check sits near its τ


def test_scan_on_the_gpu_is_healthy_and_catches_a_fault():
    from aegis_cli.scan import ScanOptions, run_scan
    from tests.helpers import TINY

    rep = run_scan(ScanOptions(devices="cuda:0", workload=TINY, probes=("attention",), reruns=1))
    assert rep.devices[0].verdict is Verdict.HEALTHY
    rep = run_scan(ScanOptions(devices="cuda:0", workload=TINY, probes=("attention",), reruns=1,
                               inject="perturb:target=attn.dv,r=1000,index=70"))
    assert rep.devices[0].verdict is Verdict.FAULTY
