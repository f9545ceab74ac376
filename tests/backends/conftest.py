"""The checked-GEMM tests' device: one CudaDevice per kernel this GPU runs (wgmma on sm_90 only)."""

from __future__ import annotations

import pytest
import torch


def cuda_kernels() -> list[str]:
    if not torch.cuda.is_available():
        return ["mma"]
    return ["mma", "wgmma"] if torch.cuda.get_device_capability(0) == (9, 0) else ["mma"]


@pytest.fixture(scope="module", params=["mma", "wgmma"])
def dev(request):
    from aegis_cli.backends.cuda import CudaDevice

    if request.param not in cuda_kernels():
        pytest.skip("wgmma needs sm_90")
    return CudaDevice(0, kernel=request.param)
