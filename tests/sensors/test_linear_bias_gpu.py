"""Tier 2 (GPU): a Linear's bias in a pinned step. An unsampled pinned forward adds it in the checked
kernel's epilogue, a sampled one after the GEMM (its C is compared and verified): the bits of the
output and of every gradient must not depend on which, since a fingerprinted region's forward and
recompute may be sampled differently."""

from __future__ import annotations

import pytest
import torch

from aegis_cli.backends.cuda import CudaDevice
from aegis_cli.sensors import SensorConfig, instrument, uninstrument

pytestmark = pytest.mark.gpu
NEVER = {"sample_prob": 0.0, "overhead_budget": None, "coverage_steps": 10**9}
EVERY = {"sample_prob": 1.0, "overhead_budget": None}


def _step(cfg: dict, dtype: torch.dtype, autocast: bool):
    """One pinned forward and backward of a ragged Linear with a bias: ((y, dx, dw, db), handle, (x, W, b))."""
    torch.manual_seed(3)
    lin = torch.nn.Linear(264, 1000).to("cuda:0", dtype)
    with torch.no_grad():
        lin.bias.normal_()  # a bias as large as the outputs: the rounding of the add shows
    x = torch.randn(2, 150, 264, device="cuda:0").to(dtype).requires_grad_()
    gy = torch.randn(2, 150, 1000, device="cuda:0").to(torch.bfloat16)
    h = instrument(lin, SensorConfig(**cfg))
    try:
        with h.pin():  # forward and backward, as in a pinned step
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
                y = lin(x)
            y.backward(gy)
        h.step()
    finally:
        uninstrument(lin)
    return (y.detach(), x.grad, lin.weight.grad, lin.bias.grad), h, (x.detach(), lin.weight.detach(), lin.bias.detach())


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t.view(torch.int32)


@pytest.mark.parametrize("dtype, autocast", [(torch.bfloat16, False), (torch.float32, True)], ids=["bf16", "autocast"])
def test_fused_bias_gives_the_bits_of_the_sampled_path(monkeypatch, dtype, autocast):
    fused = []
    prepare = CudaDevice.prepare

    def spy(self, *args, **kw):  # the real prepare; records whether the launch carried the bias
        fused.append(kw.get("bias") is not None)
        return prepare(self, *args, **kw)

    monkeypatch.setattr(CudaDevice, "prepare", spy)
    never, h0, inputs = _step(NEVER, dtype, autocast)
    assert fused == [True, False, False] and h0.stats.checked == 0  # forward fused; dgrad, wgrad without
    fused.clear()
    every, h1, _ = _step(EVERY, dtype, autocast)
    assert fused == [False, False, False] and h1.stats.checked == 3 and h1.stats.confirmed == 0
    assert never[0].dtype == torch.bfloat16
    for got, want in zip(never, every, strict=True):
        assert got.dtype == want.dtype and torch.equal(_bits(got), _bits(want))
    ref = torch.nn.functional.linear(*(t.to(torch.bfloat16).double() for t in inputs))  # fp64, the bias in
    assert float((never[0].double() - ref).norm() / ref.norm()) < 1e-2
