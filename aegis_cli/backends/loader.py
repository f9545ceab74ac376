"""The one loader and launcher for CUDA kernels: ``kernels/*.cu`` → CuPy RawModule → launch.

Kernels are real source files (never Python strings). Modules are compiled once per
(source hash, defines, options, name expressions) in this process, and CuPy caches the
binaries on disk (``cache_dir()``), keyed by source and options. The source hash of
every kernel is stamped in reports (``kernel_hashes``).

Every kernel (GEMM, fingerprint, …) is fetched with ``get_function`` (a CUfunction handle,
cached per entry, defines and device) and started with ``launch`` (the CUDA driver's
cuLaunchKernel on a given stream, so it orders with the torch work around it); both turn
a failure into a DeviceError naming the device and the kernel. ``run`` does both for a
one-off launch on torch's current stream of a tensor's device (``device_index``,
``current_stream``); a launch prepared once and run many times (the GEMMs) keeps its handle.

Importing this module does not import CuPy or touch CUDA.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import threading
import time
from functools import cache
from pathlib import Path

from aegis_cli.ops.errors import DeviceError
from aegis_cli.ops.paths import kernel_dir

_LOCK = threading.Lock()
_MODULES: dict[tuple, object] = {}
_FUNCS_LOCK = threading.Lock()  # apart from _LOCK: get_function calls get_module, which takes _LOCK
_FUNCS: dict[tuple, int] = {}
COMPILE_LOG: list[dict] = []  # one entry per compilation: name, seconds, options


def kernel_path(name: str) -> Path:
    path = kernel_dir() / name
    if not path.is_file():
        raise FileNotFoundError(f"kernel source {name} not found in {kernel_dir()}")
    return path


@cache
def source_hash(name: str) -> str:
    """SHA-256 of a kernel file plus the headers of kernels/ it may include."""
    h = hashlib.sha256()
    h.update(kernel_path(name).read_bytes())
    for hdr in sorted(kernel_dir().glob("*.cuh")):
        h.update(hdr.name.encode())
        h.update(hdr.read_bytes())
    return h.hexdigest()


def kernel_hashes() -> dict[str, str]:
    """{file: sha256[:16]} for every kernel source shipped (a fresh dict each call)."""
    return dict(_kernel_hashes())


@cache
def _kernel_hashes() -> tuple[tuple[str, str], ...]:
    """Fixed for the life of the process, like source_hash: the directory is listed once."""
    try:
        d = kernel_dir()
    except FileNotFoundError:
        return ()
    return tuple((p.name, source_hash(p.name)[:16]) for p in sorted(d.glob("*.cu")))


def cache_dir() -> str:
    """Where CuPy keeps compiled kernels on disk."""
    return os.environ.get("CUPY_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".cupy", "kernel_cache"))


def arch_options(device_id: int, need_sm90a: bool = False) -> tuple[str, ...]:
    """``-arch`` for the device; sm_90a (wgmma, setmaxnreg) only when asked and available."""
    import cupy

    cc = cupy.cuda.Device(device_id).compute_capability  # e.g. "90"
    if need_sm90a:
        if cc != "90":
            raise RuntimeError(f"kernel needs sm_90a (Hopper), device has sm_{cc}")
        return ("-arch=sm_90a",)
    return (f"-arch=sm_{cc}",)


def get_module(name: str, *, defines: dict[str, object] | None = None, options: tuple[str, ...] = (),
               name_expressions: tuple[str, ...] = (), device_id: int = 0, need_sm90a: bool = False):
    """Compiled RawModule for ``kernels/<name>`` with ``#define``s prepended.

    Compile errors surface as the CuPy exception with NVRTC's log. The first compile of
    each variant is timed into COMPILE_LOG.
    """
    import cupy

    defs = tuple(sorted((defines or {}).items()))
    arch = arch_options(device_id, need_sm90a)
    key = (name, source_hash(name), defs, options, arch, name_expressions, device_id)
    with _LOCK:
        mod = _MODULES.get(key)
        if mod is not None:
            return mod
        # the source hash covers the included headers; CuPy's disk cache keys on this text only,
        # so without it a header change would run a stale binary built for the old header
        code = (f"// aegis source {source_hash(name)}\n" + "".join(f"#define {k} {v}\n" for k, v in defs)
                + kernel_path(name).read_text(encoding="utf-8"))
        opts = ("--std=c++17", f"-I{kernel_dir()}", *arch, *options)
        t0 = time.perf_counter()
        with cupy.cuda.Device(device_id):
            mod = cupy.RawModule(code=code, options=opts, name_expressions=name_expressions or None)
            mod.compile()
        COMPILE_LOG.append({"kernel": name, "defines": dict(defs), "seconds": round(time.perf_counter() - t0, 3),
                            "options": list(opts)})
        _MODULES[key] = mod
        return mod


def get_function(name: str, entry: str, *, device_id: int, defines: dict[str, object] | None = None,
                 need_sm90a: bool = False, max_dynamic_smem: int = 0, label: str = "") -> int:
    """CUfunction handle of ``entry`` in ``kernels/<name>`` built with ``defines`` for ``device_id``,
    compiled and loaded once per process. ``max_dynamic_smem``: the dynamic shared memory its
    launches ask for (above 48 KiB the driver wants it declared). ``label`` names the build in
    the DeviceError (default: the entry)."""
    key = (name, entry, device_id, tuple(sorted((defines or {}).items())), need_sm90a, max_dynamic_smem)
    with _FUNCS_LOCK:
        ptr = _FUNCS.get(key)
    if ptr is not None:
        return ptr
    import cupy

    try:
        with cupy.cuda.Device(device_id):
            fn = get_module(name, defines=defines, device_id=device_id, need_sm90a=need_sm90a).get_function(entry)
            if max_dynamic_smem:
                fn.max_dynamic_shared_size_bytes = max_dynamic_smem
            ptr = fn.kernel.ptr
    except Exception as exc:
        raise DeviceError(f"cuda:{device_id}: cannot build {name} ({label or entry}): {exc}") from exc
    with _FUNCS_LOCK:
        _FUNCS[key] = ptr
    return ptr


def launch(func: int, grid: tuple[int, ...], block: int, args: list, *, device_id: int, stream: int, smem: int = 0,
           label: str = "") -> None:
    """Enqueue one launch of ``func`` (from get_function) on ``stream`` (a CUstream handle, e.g.
    torch's ``current_stream(dev).cuda_stream``); no sync. ``grid``: 1 to 3 dimensions, ``block``:
    threads in x. ``args``: one ctypes object per kernel parameter, in order (structs by value).
    A refused launch raises DeviceError naming ``label``; faults while the kernel runs surface
    at the caller's next synchronisation."""
    import cupy

    gx, gy, gz = (*grid, 1, 1)[:3]
    ptrs = (ctypes.c_void_p * len(args))(*[ctypes.addressof(a) for a in args])
    try:
        with cupy.cuda.Device(device_id):
            cupy.cuda.driver.launchKernel(func, gx, gy, gz, block, 1, 1, smem, stream, ctypes.addressof(ptrs), 0)
    except Exception as exc:
        raise DeviceError(f"cuda:{device_id}: {label or 'kernel'} launch failed: {exc}") from exc


def device_index(where) -> int:
    """CUDA index of ``where``: a torch tensor or device (a bare "cuda": torch's current device)."""
    import torch

    dev = where.device if isinstance(where, torch.Tensor) else torch.device(where)
    if dev.type != "cuda":
        raise DeviceError(f"a CUDA kernel cannot run on {dev}")
    return dev.index if dev.index is not None else torch.cuda.current_device()


def current_stream(device_id: int) -> int:
    """CUstream handle of torch's current stream on ``device_id``: launches there order with torch's work."""
    import torch

    return torch.cuda.current_stream(device_id).cuda_stream


def run(name: str, entry: str, grid: tuple[int, ...], block: int, args: list, *, on, smem: int = 0,
        defines: dict[str, object] | None = None, need_sm90a: bool = False, label: str = "") -> None:
    """Enqueue one launch of ``entry`` of ``kernels/<name>`` (built with ``defines``) on torch's
    current stream of ``on``'s device (a tensor or torch device); no sync. ``smem``: its dynamic
    shared memory. A refused build or launch raises DeviceError naming ``label`` (default: the
    entry) and, for a build, its defines."""
    dev = device_index(on)
    label = label or entry
    func = get_function(name, entry, device_id=dev, defines=defines, need_sm90a=need_sm90a, max_dynamic_smem=smem,
                        label=label + ("+" + ",".join(defines) if defines else ""))
    launch(func, grid, block, args, device_id=dev, stream=current_stream(dev), smem=smem, label=label)
