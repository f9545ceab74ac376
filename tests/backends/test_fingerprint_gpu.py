"""GPU tier: the CUDA fingerprint equals the CPU one bit for bit, and the bitwise probes
detect and localise injected faults on a real GPU (run on an H200, see benchmarks/RESULTS.md)."""

from __future__ import annotations

import json

import pytest
import torch

from aegis_cli.faults.spec import FaultPlan
from aegis_cli.ops import fingerprint
from aegis_cli.probes import ProbeConfig, ProbeContext

pytestmark = pytest.mark.gpu

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int8, torch.uint8, torch.int32, torch.int64]
SIZES = [1, 2, 3, 7, 8, 9, 15, 16, 17, 255, 4097, 65536 + 5, (1 << 20) + 3]


def _random(n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator(device="cuda")
    g.manual_seed(seed)
    size = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (n * size,), dtype=torch.uint8, device="cuda", generator=g)
    return raw.view(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gpu_fingerprint_equals_cpu(dtype):
    from aegis_cli.backends.fingerprint_cuda import gpu_block_fingerprints, gpu_fingerprint

    for i, n in enumerate(SIZES):
        t = _random(n, dtype, 100 + i)
        assert gpu_fingerprint(t) == fingerprint.fingerprint(t.cpu()), (dtype, n)
        for block in (8, 24, 4096, 1 << 16):
            assert gpu_block_fingerprints(t, block) == fingerprint.block_fingerprints(t.cpu(), block), (dtype, n, block)


def test_gpu_fingerprint_of_views_and_unaligned_storage():
    from aegis_cli.backends.fingerprint_cuda import gpu_fingerprint

    base = _random(1 << 20, torch.bfloat16, 7)
    for t in (base[1:], base[3:1001], base.view(1024, 1024).t(), base.view(1024, 1024)[:, 5:77]):
        assert gpu_fingerprint(t) == fingerprint.fingerprint(t.cpu())


def test_gpu_fingerprint_sees_single_flip_and_swap():
    from aegis_cli.backends.fingerprint_cuda import gpu_block_fingerprints, gpu_fingerprint

    t = _random(1 << 22, torch.bfloat16, 9)
    h = gpu_fingerprint(t)
    blocks = gpu_block_fingerprints(t, 4096)
    u = t.clone()
    u.view(torch.int16)[123457] ^= 1 << 3
    assert gpu_fingerprint(u) != h
    assert fingerprint.differing_blocks(blocks, gpu_block_fingerprints(u, 4096)) == [123457 // 4096]
    w = t.clone()
    i, j = 5, 3_000_001
    assert t[i].view(torch.int16) != t[j].view(torch.int16)
    w[i], w[j] = t[j], t[i]
    assert gpu_fingerprint(w) != h


def _cuda_device():
    from aegis_cli.backends import get_backend

    return get_backend("cuda").device(0)


def _ctx(spec: str | None = None, **probe_options) -> ProbeContext:
    return ProbeContext(config=ProbeConfig(probe_options={k.replace("__", "."): str(v) for k, v in probe_options.items()}),
                        fault=FaultPlan.parse(spec) if spec else None, progress=lambda *a, **k: None)


def test_determinism_probe_on_gpu_reports_and_localises_a_flipped_run():
    from aegis_cli.probes.determinism import determinism_probe

    dev = _cuda_device()
    ctx = _ctx()
    assert determinism_probe(dev, ctx) == []
    print("DETERMINISM", json.dumps({k: {"deterministic": v["deterministic"], "distinct": v["distinct"], "seconds": v["seconds"]}
                                     for k, v in ctx.stats["determinism"]["computations"].items()}))
    ctx = _ctx("memflip:op=checked_gemm/run2,bit=exp", determinism__only="checked_gemm")
    ev = determinism_probe(dev, ctx)
    assert len(ev) == 1 and ev[0].check == "determinism.mismatch" and ev[0].severity.value == "FAULTY"
    inj = ctx.fault.injected[0]
    s = ev[0].samples[0]
    assert s["run"] == 2 and s["index"] == inj["positions"][0] and int(s["xor"], 16) == int(inj["masks"][0], 16)


def test_pow2_probe_on_gpu_is_exact():
    from aegis_cli.probes.pow2 import pow2_probe

    ctx = _ctx()
    assert pow2_probe(_cuda_device(), ctx) == []
    print("POW2", json.dumps(ctx.stats["pow2"]))


def test_memory_probe_on_gpu_finds_flip_and_swap_with_addresses():
    from aegis_cli.probes.memory import memory_probe

    dev = _cuda_device()
    for spec in ("memflip:bit=13", "swap"):
        ctx = _ctx(spec, memory__fraction=0.1, memory__hold=0)
        ev = memory_probe(dev, ctx)
        assert [e.check for e in ev] == ["memory.bitflip"], spec
        s = next(x for x in ev[0].samples if "offset" in x)
        assert s["address"].startswith("0x") and int(s["xor"], 16) != 0
        if spec.startswith("memflip"):
            assert int(s["xor"], 16) == 1 << (13 % 8) << 8 * (ctx.fault.injected[0]["positions"][0] % 8)
        assert ev[0].reproduced == 1


def test_memory_probe_quick_covers_free_memory_within_30s():
    import time

    from aegis_cli.probes.memory import memory_probe

    ctx = _ctx()
    t0 = time.perf_counter()
    assert memory_probe(_cuda_device(), ctx) == []
    took = time.perf_counter() - t0
    st = ctx.stats["memory"]
    print("MEMORY", json.dumps({k: v for k, v in st.items() if k != "nvml"}), "NVML", json.dumps(st["nvml"]["after"]), f"{took:.1f}s")
    assert st["coverage_of_free"] >= 0.85 and took < 30
