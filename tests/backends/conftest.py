"""The checked-GEMM tests' device: one CudaDevice per kernel this GPU runs (wgmma on sm_90 only)."""

from __future__ import annotations

import pytest

from tests.helpers import cuda_kernels


@pytest.fixture(scope="module", params=["mma", "wgmma"])
def dev(request):
    from aegis_cli.backends.cuda import CudaDevice

    if request.param not in cuda_kernels():
        pytest.skip("wgmma needs sm_90")
    return CudaDevice(0, kernel=request.param)
