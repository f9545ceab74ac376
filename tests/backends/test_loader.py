"""The one loader/launcher (backends/loader.py): functions cached per build, failures as one
DeviceError naming the device and kernel, launches packed for cuLaunchKernel. Tier 1 runs on a
fake CuPy; the GPU test launches the real fingerprint kernel."""

from __future__ import annotations

import contextlib
import ctypes
import sys
import types

import pytest

from aegis_cli.backends import loader
from aegis_cli.ops.errors import DeviceError


@pytest.fixture
def fake_cupy(monkeypatch):
    """A CuPy with a device context and a driver whose launches are recorded, not run."""
    launches: list[tuple] = []

    def launch_kernel(func, gx, gy, gz, bx, by, bz, smem, stream, params, extra):
        if gx == 0:
            raise RuntimeError("CUDA_ERROR_INVALID_VALUE")
        n = 2  # the tests pass two c_int64 arguments: read them back through the pointer array
        ptrs = (ctypes.c_void_p * n).from_address(params)
        launches.append((func, (gx, gy, gz), (bx, by, bz), smem, stream, [ctypes.c_int64.from_address(p).value for p in ptrs]))

    cuda = types.SimpleNamespace(Device=lambda i: contextlib.nullcontext(), driver=types.SimpleNamespace(launchKernel=launch_kernel))
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(cuda=cuda))
    monkeypatch.setattr(loader, "_FUNCS", {})
    return launches


def _fake_modules(monkeypatch, fail: str | None = None) -> list[tuple]:
    built: list[tuple] = []

    class Function:
        def __init__(self, entry: str):
            self.kernel = types.SimpleNamespace(ptr=1000 + len(built))
            self.max_dynamic_shared_size_bytes = 0

    class Module:
        def __init__(self, name, defines):
            self.name, self.defines = name, defines

        def get_function(self, entry):
            if entry == fail:
                raise RuntimeError(f"no entry {entry}")
            built.append((self.name, entry, tuple(sorted((self.defines or {}).items()))))
            return Function(entry)

    monkeypatch.setattr(loader, "get_module", lambda name, defines=None, device_id=0, need_sm90a=False: Module(name, defines))
    return built


def test_functions_are_built_once_per_kernel_entry_defines_and_device(fake_cupy, monkeypatch):
    built = _fake_modules(monkeypatch)
    f1 = loader.get_function("k.cu", "entry", device_id=0)
    assert loader.get_function("k.cu", "entry", device_id=0) == f1 and len(built) == 1
    loader.get_function("k.cu", "entry", device_id=1)
    loader.get_function("k.cu", "entry", device_id=0, defines={"AEGIS_INJECT": 1})
    loader.get_function("k.cu", "other", device_id=0)
    assert len(built) == 4 and len({loader.get_function("k.cu", "entry", device_id=d) for d in (0, 1)}) == 2


def test_a_build_failure_is_one_device_error_naming_device_kernel_and_build(fake_cupy, monkeypatch):
    _fake_modules(monkeypatch, fail="broken")
    with pytest.raises(DeviceError, match=r"cuda:3: cannot build k\.cu \(broken, inject\): no entry broken"):
        loader.get_function("k.cu", "broken", device_id=3, label="broken, inject")
    with pytest.raises(DeviceError, match=r"cannot build k\.cu \(broken\)"):  # the entry when no label
        loader.get_function("k.cu", "broken", device_id=3)


def test_launch_packs_grid_block_stream_and_arguments(fake_cupy):
    args = [ctypes.c_int64(7), ctypes.c_int64(-2)]
    loader.launch(42, (5,), 256, args, device_id=0, stream=99, smem=1024)
    loader.launch(42, (3, 4), 128, args, device_id=0, stream=0)
    assert fake_cupy == [(42, (5, 1, 1), (256, 1, 1), 1024, 99, [7, -2]), (42, (3, 4, 1), (128, 1, 1), 0, 0, [7, -2])]


def test_a_refused_launch_is_one_device_error_naming_the_kernel(fake_cupy):
    with pytest.raises(DeviceError, match=r"cuda:1: gemm_mma fwd 1x2x3 launch failed: CUDA_ERROR_INVALID_VALUE"):
        loader.launch(42, (0,), 32, [ctypes.c_int64(0), ctypes.c_int64(0)], device_id=1, stream=0, label="gemm_mma fwd 1x2x3")


def test_run_builds_once_and_launches_on_torchs_current_stream_of_the_tensors_device(fake_cupy, monkeypatch):
    import torch

    built = _fake_modules(monkeypatch)
    monkeypatch.setattr(loader, "current_stream", lambda dev: 500 + dev)  # no CUDA here: torch's stream handle per device
    args = [ctypes.c_int64(3), ctypes.c_int64(-4)]
    for _ in range(2):
        loader.run("k.cu", "entry", (2, 3), 64, args, on=torch.device("cuda", 1), smem=4096, defines={"X": 1})
    assert built == [("k.cu", "entry", (("X", 1),))]
    assert [x[1:] for x in fake_cupy] == [((2, 3, 1), (64, 1, 1), 4096, 501, [3, -4])] * 2
    _fake_modules(monkeypatch, fail="broken")
    with pytest.raises(DeviceError, match=r"cuda:2: cannot build k\.cu \(broken\+AEGIS_INJECT\)"):  # the build's defines
        loader.run("k.cu", "broken", (1,), 32, args, on=torch.device("cuda", 2), defines={"AEGIS_INJECT": 1})
    with pytest.raises(DeviceError, match="a CUDA kernel cannot run on cpu"):
        loader.run("k.cu", "entry", (1,), 32, args, on=torch.zeros(1))


@pytest.mark.gpu
def test_real_launch_of_the_fingerprint_kernel():
    """get_function + launch on a GPU give the CPU twin's block sums (fingerprint_cuda uses them)."""
    import torch

    from aegis_cli.backends import fingerprint_cuda
    from aegis_cli.ops import fingerprint

    t = torch.arange(4096, dtype=torch.int32, device="cuda")
    assert fingerprint_cuda.gpu_block_fingerprints(t, 1024) == fingerprint.block_fingerprints(t.cpu(), 1024)
    with pytest.raises(DeviceError, match="aegis_fp_sum launch failed"):  # a grid of 0 blocks is refused by the driver
        loader.run(fingerprint_cuda.KERNEL, "aegis_fp_sum", (0,), 1024, [ctypes.c_uint64(0)] * 3, on=t)
