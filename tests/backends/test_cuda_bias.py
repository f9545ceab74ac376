"""Tier 2 (GPU): the checked GEMMs' bias epilogue (``CudaDevice.prepare(bias=…)``) gives the bits of
torch's bf16 add of the bias to the kernel's C, and leaves C's checksums those of A·B; the cached
TMA descriptors are the ones a fresh encoding gives; the outputs keep their dtypes whatever torch's
default dtype."""

from __future__ import annotations

import ctypes

import pytest
import torch

from aegis_cli.ops.errors import DeviceError
from aegis_cli.ops.gemm import Layout
from tests.helpers import cuda_kernels

pytestmark = pytest.mark.gpu
SHAPES = [(256, 512, 320), (129, 258, 72), (77, 1001, 264), (300, 6, 40), (64, 40, 13)]  # odd N, N % 4 = 2, no TMA


def _run(dev, a, b, layout, bias=None):
    with torch.cuda.device(dev.torch_device):
        launch = dev.prepare(a, b, layout, bias=bias)
        launch.run()
    torch.cuda.synchronize()
    return launch


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32)


@pytest.mark.parametrize("layout", list(Layout), ids=[x.value for x in Layout])
@pytest.mark.parametrize("shape", SHAPES, ids=["x".join(map(str, s)) for s in SHAPES])
def test_bias_epilogue_is_torchs_add_and_keeps_the_sums(dev, layout, shape):
    m, n, k = shape
    seed = m + 3 * n + 7 * k
    a = dev.generate(layout.a_stored_shape(m, k), "normal", seed)
    b = dev.generate(layout.b_stored_shape(k, n), "normal", seed + 1)
    bias = dev.generate((n + 1,), "normal", seed + 2)[1:]  # 2 bytes off: prepare aligns it
    plain = _run(dev, a, b, layout)
    dev.poison = True  # every element of C must be written with the bias too
    try:
        fused = _run(dev, a, b, layout, bias)
    finally:
        dev.poison = False
    assert fused.kernel == plain.kernel
    c0, rs0, cs0, _ = plain.outputs
    c1, rs1, cs1, sm1 = fused.outputs
    assert torch.equal(_bits(c1), _bits(c0 + bias))
    assert not torch.equal(_bits(c1), _bits(c0))  # the bias is there
    assert torch.equal(_bits(rs1), _bits(rs0)) and torch.equal(_bits(cs1), _bits(cs0))
    assert int(sm1.min()) >= 0  # every tile's SM written (tile_sm is no longer filled first)


def test_a_bias_of_the_wrong_shape_or_dtype_is_refused(dev):
    a = dev.generate((64, 32), "normal", 1)
    b = dev.generate((48, 32), "normal", 2)
    for bias in (torch.zeros(47, dtype=torch.bfloat16, device=dev.torch_device),
                 torch.zeros(48, dtype=torch.float32, device=dev.torch_device), torch.zeros(48, dtype=torch.bfloat16)):
        with pytest.raises(DeviceError, match="bias"):
            dev.prepare(a, b, Layout.FWD, bias=bias)


def test_cached_tensor_maps_are_the_encoded_ones():
    from aegis_cli.backends import cuda

    if "wgmma" not in cuda_kernels():
        pytest.skip("TMA needs sm_90")
    x = torch.zeros(512, 256, dtype=torch.bfloat16, device="cuda:0")
    first = cuda._tensor_map(x, 64, 128)
    assert cuda._tensor_map(x, 64, 128) is first  # the same key: encoded once
    fresh = cuda._encode_map(x, 64, 128)
    assert bytes(first) == bytes(fresh)
    other = cuda._tensor_map(x[128:], 64, 128)  # another address and shape: another descriptor
    assert other is not first and bytes(other) == bytes(cuda._encode_map(x[128:], 64, 128))
    assert bytes(cuda._tensor_map(x, 64, 64)) != bytes(first)  # the box is part of the key
    assert ctypes.addressof(first) % 64 == 0


def test_outputs_keep_their_dtypes_under_a_float64_default(dev):
    """A training script may set torch's default dtype to float64: the sums the kernel writes as fp32
    must still land in fp32 buffers (the same bits as under float32's default)."""
    a = dev.generate((256, 96), "normal", 11)
    b = dev.generate((96, 320), "normal", 12)
    c0, rs0, cs0, _ = _run(dev, a, b, Layout.DGRAD).outputs
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        c1, rs1, cs1, sm1 = _run(dev, a, b, Layout.DGRAD).outputs
    finally:
        torch.set_default_dtype(old)
    assert (rs1.dtype, cs1.dtype, c1.dtype, sm1.dtype) == (torch.float32, torch.float32, torch.bfloat16, torch.int32)
    assert torch.equal(_bits(rs1), _bits(rs0)) and torch.equal(_bits(cs1), _bits(cs0)) and torch.equal(_bits(c1), _bits(c0))
