"""CUDA backend: checked GEMMs in our own kernels (kernels/gemm_*.cu) on torch CUDA tensors.

Same contract as the CPU reference backend (cpu.py): bf16 operands stored as training
stores them, fp32 accumulation, bf16 output, row/column checksums of the fp32 accumulator
per (64, 128) checksum tile in a fixed order, and the SM that ran each tile. (64-row tiles:
one consumer warpgroup of the wgmma kernel, one warp row of the mma kernel, so no two warp
groups wait on each other to finish a column sum; finer tiles also localise better.)

Kernels: ``gemm_wgmma.cu`` (TMA + wgmma, sm_90a) on Hopper when both operands suit TMA
(16-byte aligned rows), otherwise ``gemm_mma.cu`` (mma.sync, any sm_80+ GPU, any pitch).
Launches go through the CuPy driver API on torch's current stream, with the kernel
parameters packed here (the TMA descriptors are passed by value as ``__grid_constant__``).

Fault injection (DESIGN §4): accumulator faults run in the ``AEGIS_INJECT`` build of the
same kernel, so the fused checksums see them as they would see hardware; this module turns
the FaultPlan into that build's parameter block, drawing positions with the same seeded
generators as corrupt.py so a fault lands where it lands on the CPU backend. Operand
(target=a|b) and output (target=out) faults reuse corrupt.py on host copies.

Importing this module touches neither CuPy nor CUDA.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import os
import threading
from dataclasses import dataclass, field

import numpy as np
import torch

from aegis_cli.backends import loader, nvml
from aegis_cli.backends.base import Backend, Device, DeviceIdentity, node_name
from aegis_cli.faults import tensor as corrupt
from aegis_cli.faults.spec import FaultPlan, FaultSpec, LaunchContext
from aegis_cli.ops import fingerprint, numerics
from aegis_cli.ops.errors import ConfigError, DeviceError, InjectSpecError
from aegis_cli.ops.gemm import GemmOperands, GemmResult, Layout, ReferenceChecksums

CHECK_TILE = (64, 128)  # checksum tile of both kernels
CTA_TILES = {"wgmma": (2, 2), "mma": (2, 1)}  # checksum tiles per CTA tile (128x256, 128x128)
_MMA_SMEM = 3 * 2 * (128 * 40) * 2  # STAGES · (A + B) · stage elements · 2 B (gemm_mma.cu)
_WGMMA_STAGES = 4
_WGMMA_SMEM = _WGMMA_STAGES * (128 * 64 * 2 + 256 * 64 * 2) + 16 * _WGMMA_STAGES + 2 * 8 * 256 * 4 + 1024
WGMMA_DEFINES: dict[str, object] = {}  # extra -D for gemm_wgmma.cu (experiments)
_LOCK = threading.Lock()
_FUNCS: dict[tuple, int] = {}

EDIT_XOR, EDIT_SET, EDIT_ADD = 0, 1, 2
TILE_CODES = {"zero": 1, "stuck": 2, "shift": 3, "skipk": 4}
MAX_DIM = (1 << 31) - (1 << 16)  # M, N, K: room for the kernels' 32-bit (K + BK - 1) / BK
MAX_LANES = 4  # stuck-lane patterns one launch takes (AEGIS_MAX_LANES in kernels/common.cuh)
_LANE_AS_EDITS = 4096  # a stuck lane hitting at most this many elements goes in as edits instead


class _Inject(ctypes.Structure):  # mirrors InjectParams in kernels/common.cuh
    _fields_ = [
        ("edit_idx", ctypes.c_void_p), ("edit_off", ctypes.c_void_p), ("edit_val", ctypes.c_void_p),
        ("edit_op", ctypes.c_void_p), ("tile_mode", ctypes.c_void_p),
        ("sm_target", ctypes.c_int), ("sm_mode", ctypes.c_int), ("tile_value", ctypes.c_float), ("kstep", ctypes.c_int),
        ("lane_stride", ctypes.c_int * MAX_LANES), ("lane_offset", ctypes.c_int * MAX_LANES),
        ("lane_mask", ctypes.c_uint * MAX_LANES), ("n_lanes", ctypes.c_int), ("n_edits", ctypes.c_int),
    ]


def _no_inject() -> _Inject:
    return _Inject(sm_target=-1)


# ---------------------------------------------------------------------------- launching
def _function(kind: str, entry: str, variant: str, device_id: int) -> int:
    """CUfunction handle of one kernel entry, compiled (once) through the loader."""
    key = (kind, entry, variant, device_id, tuple(sorted(WGMMA_DEFINES.items())) if kind == "wgmma" else ())
    with _LOCK:
        ptr = _FUNCS.get(key)
    if ptr is not None:
        return ptr
    import cupy

    defines: dict[str, object] = {"inject": {"AEGIS_INJECT": 1}, "nosums": {"AEGIS_NOSUMS": 1}, "": {}}[variant]
    if kind == "wgmma":
        defines = {**defines, **WGMMA_DEFINES}
    try:
        with cupy.cuda.Device(device_id):
            mod = loader.get_module(f"gemm_{kind}.cu", defines=defines, device_id=device_id, need_sm90a=kind == "wgmma")
            fn = mod.get_function(f"gemm_{kind}_{entry}")
            fn.max_dynamic_shared_size_bytes = _WGMMA_SMEM if kind == "wgmma" else _MMA_SMEM
            ptr = fn.kernel.ptr
    except Exception as exc:
        raise DeviceError(f"cuda:{device_id}: cannot build gemm_{kind}.cu ({entry}, {variant or 'plain'}): {exc}") from exc
    with _LOCK:
        _FUNCS[key] = ptr
    return ptr


def _launch(func: int, grid: tuple[int, int], block: int, smem: int, stream: int, args: list) -> None:
    import cupy

    ptrs = (ctypes.c_void_p * len(args))(*[ctypes.addressof(a) for a in args])
    cupy.cuda.driver.launchKernel(func, grid[0], grid[1], 1, block, 1, 1, smem, stream, ctypes.addressof(ptrs), 0)


_LIBCUDA = None


def _tensor_map(t: torch.Tensor, box_inner: int, box_outer: int):
    """128-byte TMA descriptor of a row-major bf16 matrix, 128B swizzle, zero fill outside."""
    global _LIBCUDA
    if _LIBCUDA is None:
        _LIBCUDA = ctypes.CDLL("libcuda.so.1")
    outer, inner = t.shape
    # the driver wants the 128-byte descriptor 64-byte aligned; ctypes gives 16
    raw = (ctypes.c_uint8 * 192)()
    desc = (ctypes.c_uint64 * 16).from_address(ctypes.addressof(raw) + (-ctypes.addressof(raw)) % 64)
    desc._keep = raw
    dims = (ctypes.c_uint64 * 2)(inner, outer)
    strides = (ctypes.c_uint64 * 1)(t.stride(0) * 2)
    box = (ctypes.c_uint32 * 2)(box_inner, box_outer)
    elem = (ctypes.c_uint32 * 2)(1, 1)
    # enums from cuda.h: BFLOAT16 = 9, INTERLEAVE_NONE = 0, SWIZZLE_128B = 3, L2_PROMOTION_256B = 3, OOB_FILL_NONE = 0
    rc = _LIBCUDA.cuTensorMapEncodeTiled(desc, 9, 2, ctypes.c_void_p(t.data_ptr()), dims, strides, box, elem, 0, 3, 3, 0)
    if rc != 0:
        raise DeviceError(f"cuTensorMapEncodeTiled failed (CUresult {rc}) for a {tuple(t.shape)} tensor, stride {t.stride()}")
    return desc


def _row_major(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(1) == 1 and t.stride(0) >= max(1, t.shape[1]) else t.contiguous()


def _tma_ok(t: torch.Tensor) -> bool:
    return t.data_ptr() % 16 == 0 and t.stride(0) % 8 == 0 and min(t.shape) > 0


@dataclass
class _Launch:
    """One prepared launch: outputs allocated, arguments packed. ``run()`` only enqueues."""

    kernel: str
    func: int
    grid: tuple[int, int]
    block: int
    smem: int
    args: list
    keep: list = field(default_factory=list)  # tensors the arguments point into
    stream: int = 0

    def run(self) -> None:
        _launch(self.func, self.grid, self.block, self.smem, self.stream, self.args)

    @property
    def outputs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """C, row sums, column sums and the SM of each checksum tile, as the last run left them."""
        return tuple(self.keep[2:6])


# ---------------------------------------------------------------------------- fault plans
@dataclass
class _AccFaults:
    edits: list[tuple[np.ndarray, int, np.ndarray]] = field(default_factory=list)  # (flat, op, bits)
    tile_mode: np.ndarray | None = None
    sm_target: int = -1
    sm_mode: int = 0
    tile_value: float | None = None  # one stuck value, one SM pin and one k-step per launch (InjectParams)
    kstep: int | None = None
    lanes: list[tuple[int, int, int]] = field(default_factory=list)  # (stride, offset, mask) per stuck lane
    after: list = field(default_factory=list)  # callables(tile_sm ndarray) recording tile faults

    def add(self, flat: np.ndarray, op: int, bits) -> None:
        flat = np.asarray(flat, dtype=np.int64)
        self.edits.append((flat, op, np.broadcast_to(np.asarray(bits, dtype=np.uint32), flat.shape)))


def _u32(x: float) -> int:
    return int(np.array([x], dtype=np.float32).view(np.uint32)[0])


def _clean_values(ops: GemmOperands, flat: np.ndarray) -> np.ndarray:
    """fp32 bits of the clean product at each flat index i·N + j: A[i, :]·B[:, j] summed in fp64,
    then rounded, i.e. the accumulator's value up to its own accumulation noise (what a
    ``replace:value=copy`` writes on CUDA, where the kernel cannot read another tile's accumulator)."""
    m, n, k = ops.mnk
    a, b = ops.a_mk, ops.b_kn
    idx = torch.from_numpy(flat).to(a.device)
    if flat.size * max(k, 1) > (1 << 28) and flat.size > m * n // 8:  # many elements: one fp64 GEMM
        out = (a.double() @ b.double()).reshape(-1)[idx]
    else:
        out = torch.empty(flat.size, dtype=torch.float64, device=a.device)
        step = max(1, (1 << 24) // max(k, 1))  # ≤ 16 Mi fp64 products per chunk
        for s in range(0, flat.size, step):
            r, c = idx[s:s + step] // n, idx[s:s + step] % n
            out[s:s + step] = (a[r].double() * b[:, c].t().double()).sum(1)
    return out.float().cpu().numpy().view(np.uint32)


def _elementwise_acc(acc: _AccFaults, plan: FaultPlan, f: FaultSpec, rng: np.random.Generator, ctx: LaunchContext,
                     ops: GemmOperands) -> None:
    """bitflip / mask / stuck-lane / replace on the (M, N) fp32 accumulator: the same draws as
    corrupt._elementwise, emitted as kernel edits instead of applied to a tensor."""
    m, n, _ = ops.mnk
    shape = (m, n)
    numel = m * n
    if f.model in ("bitflip", "mask"):
        flat = corrupt.positions(f, shape, rng, f.as_int("count", "1"))
        if f.model == "bitflip":
            masks = [1 << corrupt.pick_bit(f.get("bit", "exp"), 32, rng) for _ in flat]
        else:
            masks = [f.as_int("mask") & 0xFFFFFFFF] * flat.size
        acc.add(flat, EDIT_XOR, masks)
        corrupt.record(plan, f, ctx, shape, flat, masks=[f"0x{v:x}" for v in masks[: corrupt.MAX_RECORDED]])
    elif f.model == "stuck-lane":
        stride, flat = corrupt.lane_run(f, numel)
        mask = f.as_int("mask") & 0xFFFFFFFF
        if flat.size <= _LANE_AS_EDITS or stride > 0x7FFFFFFF:  # a sparse lane: plain edits, no lane slot
            acc.add(flat, EDIT_XOR, mask)
        elif len(acc.lanes) == MAX_LANES:
            raise InjectSpecError(f"the CUDA kernels take at most {MAX_LANES} dense stuck-lane faults per launch "
                                  f"(more than {_LANE_AS_EDITS} elements each)")
        else:
            acc.lanes.append((stride, int(flat[0]), mask))
        corrupt.record(plan, f, ctx, shape, flat, masks=[f"0x{mask:x}"], stride=stride)
    elif f.model == "replace":
        span = f.get("span", "1")
        flat = corrupt.replace_run(f, shape, rng)
        how = f.get("value", "flip")
        if how == "zero":
            acc.add(flat, EDIT_SET, 0)
        elif how == "random":
            raw = rng.integers(0, 1 << 32, flat.size, dtype=np.uint64)
            raw = np.where((raw >> np.uint64(23)) & np.uint64(0xFF) == 0xFF, raw & ~np.uint64(1 << 30), raw)
            acc.add(flat, EDIT_SET, raw.astype(np.uint32))
        elif how == "flip":
            acc.add(flat, EDIT_XOR, (np.uint64(1) << rng.integers(0, 32, flat.size).astype(np.uint64)).astype(np.uint32))
        else:  # copy: another element's clean value (the same source draw as corrupt._elementwise)
            acc.add(flat, EDIT_SET, _clean_values(ops, rng.integers(0, numel, flat.size)))
        corrupt.record(plan, f, ctx, shape, flat, span=span, value=how)


def _acc_faults(plan: FaultPlan, ctx: LaunchContext, ops: GemmOperands, cta: tuple[int, int]) -> _AccFaults | None:
    """Translate this launch's accumulator faults into kernel parameters (None: none fire); ``ops``
    are the operands the kernel multiplies."""
    active = plan.active(ctx, "acc")
    if not active:
        return None
    m, n, k = ops.mnk
    tm, tn = ctx.tile
    tiles = (-(-m // tm), -(-n // tn))
    acc = _AccFaults()
    for f, rng in active:
        if f.model in ("bitflip", "mask", "stuck-lane", "replace"):
            _elementwise_acc(acc, plan, f, rng, ctx, ops)
        elif f.model == "perturb":
            if ctx.clean_median is None:
                raise DeviceError("perturb fault needs the clean median checksum difference")
            r = float(f.get("r"))
            hit, signs = corrupt.perturb_draw(plan, f, rng, m * n)
            delta = (signs * r * ctx.clean_median).astype(np.float32)
            acc.add(hit, EDIT_ADD, delta.view(np.uint32))
            corrupt.record(plan, f, ctx, (m, n), hit, magnitude=r * ctx.clean_median)
        elif f.model == "row":
            i = f.as_int("row") % m if f.get("row") else int(rng.integers(0, m))
            mode = f.get("mode", "zero")
            flat = np.arange(i * n, (i + 1) * n)
            acc.add(flat, EDIT_SET, 0 if mode == "zero" else _u32(float(f.get("value", "1.0"))))
            corrupt.record(plan, f, ctx, (m, n), flat, row=i, mode=mode)
        elif f.model == "tile":
            _tile_fault(acc, plan, f, rng, ctx, tiles, k, cta)
    return acc


def _tile_fault(acc: _AccFaults, plan: FaultPlan, f: FaultSpec, rng: np.random.Generator, ctx: LaunchContext,
                tiles: tuple[int, int], k: int, cta: tuple[int, int]) -> None:
    mode = f.get("mode", "zero")
    code = TILE_CODES[mode]
    if mode == "shift" and -(-tiles[0] // cta[0]) < 2:
        # the kernels read the A block of the next CTA tile (128 rows down, wrapping): with one
        # row of CTA tiles that is the same block, so nothing would change. Not injected, and
        # not recorded as injected (the CPU model shifts by one 128-row CPU tile instead)
        return
    # the kernels take one of each per launch: a second, different one overwrote the first, which
    # was still recorded as injected (two SM-pinned faults corrupted only the last SM's tiles)
    def one(what: str, have, want):
        if have is not None and have != want:
            raise InjectSpecError(f"the CUDA kernels take one {what} per launch; {f} asks for another")
        return want

    if mode == "stuck":
        value = float(np.float32(f.get("value", "1.0")))
        acc.tile_value = one("stuck tile value", acc.tile_value, value)
    if mode == "skipk":
        acc.kstep = one("skipped k-step", acc.kstep, corrupt.skipped_kblock(f, k, rng))
    if f.get("sm") is not None:  # which tiles land on the SM is known only after the launch
        pin = one("SM-pinned tile fault", (acc.sm_target, acc.sm_mode) if acc.sm_target >= 0 else None, (f.as_int("sm"), code))
        acc.sm_target, acc.sm_mode = pin
        chosen = None
    else:
        chosen = corrupt.tiles_for(f, ctx, tiles, rng)
        if mode in ("shift", "skipk"):  # a main-loop fault hits every checksum tile of the CTA tile
            rs, cs = cta
            chosen = sorted({(i - i % rs + di, j - j % cs + dj) for i, j in chosen for di in range(rs) for dj in range(cs)
                             if i - i % rs + di < tiles[0] and j - j % cs + dj < tiles[1]})
        if acc.tile_mode is None:
            acc.tile_mode = np.zeros(tiles[0] * tiles[1], dtype=np.int8)
        for i, j in chosen:
            acc.tile_mode[i * tiles[1] + j] = one(f"mode for tile {i}.{j}", acc.tile_mode[i * tiles[1] + j] or None, code)
    sm = acc.sm_target if chosen is None else None

    def record(tile_sm: np.ndarray, chosen=chosen) -> None:
        hit = chosen if chosen is not None else [(int(i), int(j)) for i, j in zip(*np.nonzero(tile_sm == sm), strict=True)]
        extra = {"kstep": acc.kstep} if mode == "skipk" else {}
        plan.record(f, ctx, target="acc", mode=mode, tiles=[list(t) for t in hit[: corrupt.MAX_RECORDED]], n_tiles=len(hit),
                    sms=sorted({int(tile_sm[t]) for t in hit})[: corrupt.MAX_RECORDED], **extra)

    acc.after.append(record)


def _inject_params(acc: _AccFaults, m: int, n: int, tile: tuple[int, int], device: torch.device) -> tuple[_Inject, list]:
    """Pack edits per checksum tile (CSR) and upload them; returns the struct and what it points into."""
    tm, tn = tile
    tiles_n = -(-n // tn)
    n_tiles = -(-m // tm) * tiles_n
    p = _Inject(sm_target=acc.sm_target, sm_mode=acc.sm_mode, tile_value=1.0 if acc.tile_value is None else acc.tile_value,
                kstep=acc.kstep or 0, n_lanes=len(acc.lanes))
    for i, (stride, offset, mask) in enumerate(acc.lanes):
        p.lane_stride[i], p.lane_offset[i], p.lane_mask[i] = stride, offset, mask
    keep: list[torch.Tensor] = []
    if acc.tile_mode is not None:
        t = torch.from_numpy(acc.tile_mode).to(device)
        keep.append(t)
        p.tile_mode = t.data_ptr()
    if acc.edits:
        flat = np.concatenate([e[0] for e in acc.edits])
        ops = np.concatenate([np.full(e[0].size, e[1], dtype=np.uint8) for e in acc.edits])
        bits = np.concatenate([e[2] for e in acc.edits]).astype(np.uint32)
        tid = (flat // n // tm) * tiles_n + (flat % n) // tn
        order = np.argsort(tid, kind="stable")  # keeps the faults' order within a tile
        off = np.searchsorted(tid[order], np.arange(n_tiles + 1)).astype(np.int32)
        arrays = (flat[order], off, bits[order].view(np.int32), ops[order])
        ts = [torch.from_numpy(np.ascontiguousarray(a)).to(device) for a in arrays]
        keep += ts
        p.edit_idx, p.edit_off, p.edit_val, p.edit_op = (t.data_ptr() for t in ts)
        p.n_edits = int(flat.size)
    return p, keep


# ---------------------------------------------------------------------------- device
def _nvml_identity(pci: str, uuid: str) -> dict:
    """Name, UUID, serial, bus id and driver from NVML, matched by PCI bus id, else by CUDA's UUID;
    {} if NVML is unusable or knows neither. Never by index: NVML counts every GPU in the node,
    CUDA only the visible ones (fastest first), so the same index can be another card."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:
        return {}
    out: dict = {}
    try:
        h = nvml.handle_by_bus_id(pynvml, pci)
        if h is None:
            with contextlib.suppress(Exception):
                h = pynvml.nvmlDeviceGetHandleByUUID(uuid)
        if h is None:
            return {}

        def get(fn, *args):
            try:
                v = fn(*args)
                return v.decode() if isinstance(v, bytes) else v
            except Exception:
                return None

        out = {"name": get(pynvml.nvmlDeviceGetName, h), "uuid": get(pynvml.nvmlDeviceGetUUID, h),
               "serial": get(pynvml.nvmlDeviceGetSerial, h), "driver": get(pynvml.nvmlSystemGetDriverVersion)}
        mig = get(pynvml.nvmlDeviceGetMigMode, h)  # (current, pending); the bus id names the whole GPU
        out["mig"] = bool(mig and mig[0] == 1)
        info = get(pynvml.nvmlDeviceGetPciInfo, h)
        if info is not None:
            bus = info.busId
            out["pci_bus_id"] = bus.decode() if isinstance(bus, bytes) else bus
    finally:
        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()
    return {k: v for k, v in out.items() if v}


def _identity(index: int) -> DeviceIdentity:
    props = torch.cuda.get_device_properties(index)
    pci = (f"{props.pci_domain_id:08X}:{props.pci_bus_id:02X}:{props.pci_device_id:02X}.0"
           if hasattr(props, "pci_domain_id") else "")  # older torch: NVML finds the card by UUID
    nv = _nvml_identity(pci, f"GPU-{props.uuid}")
    extra = {"cc": f"{props.major}.{props.minor}", "sms": str(props.multi_processor_count),
             "memory_gib": f"{props.total_memory / 2**30:.1f}", "identity_source": "nvml" if nv else "torch"}
    uuid, name = nv.get("uuid") or f"GPU-{props.uuid}", nv.get("name") or props.name
    if nv.get("mig"):
        # a MIG slice: NVML's handle by bus id is the parent GPU, whose UUID every slice would share
        # (one history for all of them) and whose name keys golden records and fingerprint classes of
        # the whole GPU (more SMs: torch's RNG and cuBLAS give other bits). The slice's own keep it apart
        uuid, name = f"MIG-{props.uuid}", props.name if "MIG" in props.name else f"{props.name} MIG {props.multi_processor_count} SMs"
        extra["parent_uuid"] = nv.get("uuid") or ""
    return DeviceIdentity(backend="cuda", index=index, name=name, uuid=uuid, host=node_name(), serial=nv.get("serial"),
                          pci_bus_id=nv.get("pci_bus_id") or pci or None, driver=nv.get("driver"), extra=extra)


class CudaDevice(Device):
    """One CUDA GPU. ``kernel`` is "wgmma" on sm_90 and "mma" elsewhere (AEGIS_CUDA_KERNEL overrides).
    ``poison`` fills outputs with NaN before each launch (tests: every element must be written)."""

    def __init__(self, index: int = 0, kernel: str | None = None):
        if not 0 <= index < torch.cuda.device_count():
            raise DeviceError(f"no device cuda:{index} (torch sees {torch.cuda.device_count()} CUDA devices)")
        self.index = index
        self.torch_device = torch.device("cuda", index)
        self.cc = torch.cuda.get_device_capability(index)
        kernel = kernel or os.environ.get("AEGIS_CUDA_KERNEL") or ("wgmma" if self.cc == (9, 0) else "mma")
        if kernel not in ("wgmma", "mma"):
            raise DeviceError(f"unknown CUDA GEMM kernel {kernel!r} (wgmma, mma)")
        if kernel == "wgmma" and self.cc != (9, 0):
            raise DeviceError(f"the wgmma kernel needs sm_90 (Hopper); cuda:{index} is sm_{self.cc[0]}{self.cc[1]}")
        self.kernel = kernel
        self.tile = CHECK_TILE
        self.poison = False
        self.sms = torch.cuda.get_device_properties(index).multi_processor_count
        self.identity = _identity(index)

    # -- data ----------------------------------------------------------------------
    def generate(self, shape: tuple[int, ...], dist: str, seed: int) -> torch.Tensor:
        return numerics.generate_bf16(shape, dist, seed, self.torch_device)

    def memory_bytes(self) -> int | None:
        return int(torch.cuda.get_device_properties(self.index).total_memory)

    def memory_free(self) -> int | None:
        free, _ = torch.cuda.mem_get_info(self.index)
        # what torch's caching allocator holds for this process is ours to reuse
        return int(free + torch.cuda.memory_reserved(self.index) - torch.cuda.memory_allocated(self.index))

    def reference_checksums(self, ops: GemmOperands, tile: tuple[int, int]) -> ReferenceChecksums:
        return numerics.reference_checksums(ops, tile)

    def fingerprint(self, t: torch.Tensor) -> int:
        return fingerprint.device_fingerprint(t)  # the GPU kernel for CUDA tensors, same value as the CPU twin

    def accumulation_bound(self, k: int) -> float:
        # mma.sync / wgmma accumulate fp32 truncating: each 16-deep MMA step may lose up to an ulp
        # (≤ 2⁻²³·s) of the running sum and one of its largest product. This charges one such ulp
        # per step, (K/16)·2⁻²³ = (K/8)·2⁻²⁴, plus ≤ 128 half-ulps for the epilogue's fp32 sum of
        # 128 accumulators, in units of s: a calibrated bound, half the strict worst case of two
        # ulps per step, which H200 measurements clear by 21× (docs/calibration.md).
        return (k / 8 + 128) * 2.0**-24

    def synchronize(self) -> None:
        try:
            torch.cuda.synchronize(self.torch_device)
        except Exception as exc:
            raise DeviceError(f"cuda:{self.index}: asynchronous failure: {exc}") from exc

    # -- the checked GEMM ------------------------------------------------------------
    def prepare(self, a: torch.Tensor, b: torch.Tensor, layout: Layout, *, variant: str = "", kernel: str | None = None,
                inject: _Inject | None = None) -> _Launch:
        """Allocate outputs and pack one launch of C = A·B from the stored operands (no sync).
        ``variant``: "" (checksums), "nosums" (benchmark baseline) or "inject"."""
        ops = GemmOperands(a, b, layout)
        m, n, k = ops.mnk
        if max(m, n, k) > MAX_DIM:  # the kernels index and count k-blocks in 32-bit ints
            raise ConfigError(f"GEMM {m}x{n}x{k}: the CUDA kernels take dimensions up to {MAX_DIM}")
        a, b = _row_major(a), _row_major(b)
        kind = self.kernel_for(a, b, k, kernel)
        tm, tn = self.tile
        dev = self.torch_device
        fill = float("nan") if self.poison else None
        c = torch.full((m, n), fill, dtype=torch.bfloat16, device=dev) if fill else torch.empty((m, n), dtype=torch.bfloat16, device=dev)
        rs_shape, cs_shape = (m, -(-n // tn)), (-(-m // tm), n)
        row_sums = torch.full(rs_shape, fill, device=dev) if fill else torch.empty(rs_shape, device=dev)
        col_sums = torch.full(cs_shape, fill, device=dev) if fill else torch.empty(cs_shape, device=dev)
        tile_sm = torch.full((cs_shape[0], rs_shape[1]), -1, dtype=torch.int32, device=dev)
        entry = layout.value
        func = _function(kind, entry, variant, self.index)
        outs = [ctypes.c_void_p(t.data_ptr()) for t in (c, row_sums, col_sums, tile_sm)]
        inj = inject if inject is not None else _no_inject()
        if kind == "wgmma":
            a_box = (64, 128) if layout is not Layout.WGRAD else (64, 64)
            b_box = (64, 256) if layout is Layout.FWD else (64, 64)
            args = [_tensor_map(a, *a_box), _tensor_map(b, *b_box), *outs,
                    ctypes.c_int(m), ctypes.c_int(n), ctypes.c_int(k), inj]
            n_ctas = -(-m // 128) * -(-n // 256)
            grid, block, smem = (min(self.sms, n_ctas), 1), 384, _WGMMA_SMEM
        else:
            vec = [int(t.data_ptr() % 16 == 0 and t.stride(0) % 8 == 0) for t in (a, b)]
            args = [ctypes.c_void_p(a.data_ptr()), ctypes.c_void_p(b.data_ptr()), *outs,
                    ctypes.c_int(m), ctypes.c_int(n), ctypes.c_int(k), ctypes.c_longlong(a.stride(0)),
                    ctypes.c_longlong(b.stride(0)), ctypes.c_int(vec[0]), ctypes.c_int(vec[1]), inj]
            grid, block, smem = (-(-n // 128), -(-m // 128)), 256, _MMA_SMEM  # one CTA per 128x128 output tile
        if grid[1] > 65535:
            raise DeviceError(f"M = {m} exceeds the mma kernel's grid limit")
        stream = torch.cuda.current_stream(dev).cuda_stream
        return _Launch(kind, func, grid, block, smem, args, keep=[a, b, c, row_sums, col_sums, tile_sm], stream=stream)

    def kernel_for(self, a: torch.Tensor, b: torch.Tensor, k: int, kernel: str | None = None) -> str:
        """The kernel a launch will use: wgmma needs TMA-able operands (16-byte aligned rows)."""
        kind = kernel or self.kernel
        if kind == "wgmma" and not (k > 0 and _tma_ok(_row_major(a)) and _tma_ok(_row_major(b))):
            return "mma"
        return kind

    def checked_gemm(self, ops: GemmOperands, fault: FaultPlan | None = None, *, op: str = "",
                     clean_median: float | None = None) -> GemmResult:
        m, n, k = ops.mnk
        for name, t in (("A", ops.a), ("B", ops.b)):
            if t.dtype != torch.bfloat16 or t.device != self.torch_device or t.dim() != 2:
                raise DeviceError(f"cuda:{self.index}: operand {name} must be a 2-D bf16 tensor on {self.torch_device}, "
                                  f"got {t.dtype} {tuple(t.shape)} on {t.device}")
        if m == 0 or n == 0:
            raise DeviceError(f"cuda:{self.index}: empty GEMM {m}x{n}x{k}")
        a, b = ops.a, ops.b
        ctx = acc = None
        keep: list = []
        inj = None
        if fault is not None:
            ctx = LaunchContext(self.identity.id, op, self.tile, None, clean_median)
            a, b = self._operand_faults(fault, ctx, ops)
            acc = _acc_faults(fault, ctx, GemmOperands(a, b, ops.layout), CTA_TILES[self.kernel_for(a, b, k)])
            if acc is not None:
                inj, keep = _inject_params(acc, m, n, self.tile, self.torch_device)
        with torch.cuda.device(self.torch_device):
            launch = self.prepare(a, b, ops.layout, variant="inject" if inj is not None else "", inject=inj)
            try:
                launch.run()
                torch.cuda.synchronize(self.torch_device)
            except Exception as exc:
                raise DeviceError(f"cuda:{self.index}: gemm_{launch.kernel} {ops.layout.value} {m}x{n}x{k} failed: {exc}") from exc
        del keep
        c, row_sums, col_sums, tile_sm_dev = launch.outputs
        tile_sm = tile_sm_dev.cpu()
        if fault is not None:
            ctx.tile_sm = tile_sm.numpy()
            for record in acc.after if acc is not None else ():
                record(ctx.tile_sm)
            if fault.active(ctx, "out"):
                c_host = c.cpu()
                corrupt.apply_out(fault, ctx, c_host)
                c.copy_(c_host)
            fault.launches += 1
        return GemmResult(c=c, row_sums=row_sums, col_sums=col_sums, tile=self.tile, tile_sm=tile_sm,
                          kernel=f"gemm_{launch.kernel}" + ("+inject" if inj is not None else ""), injected=fault is not None)

    def _operand_faults(self, plan: FaultPlan, ctx: LaunchContext, ops: GemmOperands) -> tuple[torch.Tensor, torch.Tensor]:
        """target=a|b: corrupt host copies of the operands (corrupt.py) and feed those to the kernel;
        the reference keeps reading the originals."""
        if not plan.active(ctx, "operands"):
            return ops.a, ops.b
        a_mk, b_kn = ops.a_mk.cpu(), ops.b_kn.cpu()
        a2, b2 = corrupt.apply_operands(plan, ctx, a_mk, b_kn)
        a, b = ops.a, ops.b
        if a2 is not a_mk:
            a = (a2.t() if ops.layout is Layout.WGRAD else a2).contiguous().to(self.torch_device)
        if b2 is not b_kn:
            b = (b2.t() if ops.layout is Layout.FWD else b2).contiguous().to(self.torch_device)
        return a, b

    def describe(self) -> dict:
        info: dict = {"torch": torch.__version__, "kernel": f"gemm_{self.kernel}", "tile": list(self.tile),
                      "kernel_cache": loader.cache_dir(), "kernel_hashes": loader.kernel_hashes(),
                      "compile_log": list(loader.COMPILE_LOG)}
        try:
            import cupy

            info["cupy"] = cupy.__version__
            info["cuda_runtime"] = cupy.cuda.runtime.runtimeGetVersion()
            info["cuda_driver"] = cupy.cuda.runtime.driverGetVersion()
            info["nvrtc"] = ".".join(map(str, cupy.cuda.nvrtc.getVersion()))
        except Exception as exc:  # describe never fails: it is for reports
            info["cupy_error"] = str(exc)
        info["driver"] = self.identity.driver
        return info


class CudaBackend(Backend):
    name = "cuda"

    def available(self) -> bool:
        if importlib.util.find_spec("cupy") is None:
            return False
        try:
            return torch.cuda.is_available() and torch.cuda.device_count() > 0
        except Exception:
            return False

    def devices(self) -> list[Device]:
        return [CudaDevice(i) for i in range(torch.cuda.device_count())] if self.available() else []

    def device(self, index: int) -> Device:
        if not self.available():
            raise DeviceError("no CUDA device available (needs CuPy and a GPU visible to torch)")
        return CudaDevice(index)
