"""CUDA backend: checked GEMMs in our own kernels (kernels/gemm_*.cu) on torch CUDA tensors.

Same contract as the CPU reference backend (cpu.py): bf16 operands stored as training
stores them, fp32 accumulation, bf16 output, row/column checksums of the fp32 accumulator
per (64, 128) checksum tile in a fixed order, and the SM that ran each tile. (64-row tiles:
one consumer warpgroup of the wgmma kernel, one warp row of the mma kernel, so no two warp
groups wait on each other to finish a column sum; finer tiles also localise better.)

Kernels: ``gemm_wgmma.cu`` (TMA + wgmma, sm_90a) on Hopper when both operands suit TMA
(16-byte aligned rows), otherwise ``gemm_mma.cu`` (mma.sync, any sm_80+ GPU, any pitch).
Launches go through the one loader/launcher (loader.py) on torch's current stream, with the
kernel parameters packed here (the TMA descriptors are passed by value as ``__grid_constant__``).
Who the device is (NVML, MIG) lives in cuda_identity.py.

Fault injection (docs/design.md §9): accumulator faults run in the ``AEGIS_INJECT`` build of the
same kernel, so the fused checksums see them as they would see hardware; faults/kernel_params.py
turns the FaultPlan into that build's parameter block. Operand (target=a|b) and output
(target=out) faults reuse faults/tensor.py on host copies.

Importing this module touches neither CuPy nor CUDA.
"""

from __future__ import annotations

import ctypes
import dataclasses
import importlib.util
import os
from dataclasses import dataclass, field

import torch

from aegis_cli.backends import cuda_attention, cuda_reference, fingerprint_cuda, loader
from aegis_cli.backends.base import Backend, Device, DeviceIdentity
from aegis_cli.backends.cuda_identity import device_identity
from aegis_cli.faults import tensor as corrupt
from aegis_cli.faults.attention import pass_fault
from aegis_cli.faults.kernel_params import InjectParams, acc_faults, inject_params, no_inject
from aegis_cli.faults.spec import FaultPlan, LaunchContext
from aegis_cli.ops import attention, numerics
from aegis_cli.ops.errors import ConfigError, DeviceError
from aegis_cli.ops.gemm import GemmOperands, GemmResult, Layout

CHECK_TILE = (64, 128)  # checksum tile of both kernels
# tensor cores chop each fp32 partial sum the same way step after step, so the error grows with K
# (power 1). unit: the largest clean |Δ|/(K·ρ) of the calibration run on an H200, rounded up
# (docs/calibration.md); the cap is set per K by noise_model
_H200 = "on an H200 (driver 580.159.04) of clean launches of the cpu-quick, llama3-8b and 70b GEMMs × 3 inputs × scales, 2026-12-01"
CUDA_NOISE = {"wgmma": numerics.NoiseModel(unit=8e-9, power=1.0, cap=numerics.S_FLOOR,
                                           source=f"largest 7.9e-9 of 1,728 (llama3-1b too, 3 seeds) {_H200}"),
              "mma": numerics.NoiseModel(unit=8e-9, power=1.0, cap=numerics.S_FLOOR, source=f"largest 7.6e-9 of 432 {_H200}")}
CTA_TILES = {"wgmma": (2, 2), "mma": (2, 1)}  # checksum tiles per CTA tile (128x256, 128x128)
_MMA_SMEM = 3 * 2 * (128 * 40) * 2  # STAGES · (A + B) · stage elements · 2 B (gemm_mma.cu)
_WGMMA_STAGES = 4
_WGMMA_SMEM = _WGMMA_STAGES * (128 * 64 * 2 + 256 * 64 * 2) + 16 * _WGMMA_STAGES + 2 * 8 * 256 * 4 + 2 * 2 * 256 * 2 + 1024
WGMMA_DEFINES: dict[str, object] = {}  # extra -D for gemm_wgmma.cu (experiments)
MAX_DIM = (1 << 31) - (1 << 16)  # M, N, K: room for the kernels' 32-bit (K + BK - 1) / BK


def _wgmma_smem() -> int:
    """The wgmma kernel's dynamic shared memory: the ring, its scratch and the staged bias, plus the row check's
    selector and checksum columns (gemm_wgmma.cu ABFT_SMEM) in the AEGIS_ABFT_ROWS experiment build."""
    return _WGMMA_SMEM + (6 * 1024 if "AEGIS_ABFT_ROWS" in WGMMA_DEFINES else 0)


# ---------------------------------------------------------------------------- launching
def _function(kind: str, entry: str, variant: str, device_id: int) -> int:
    """CUfunction handle of one GEMM kernel entry through the loader (compiled once per build)."""
    defines: dict[str, object] = {"inject": {"AEGIS_INJECT": 1}, "nosums": {"AEGIS_NOSUMS": 1}, "": {}}[variant]
    if kind == "wgmma":
        defines = {**defines, **WGMMA_DEFINES}
    return loader.get_function(f"gemm_{kind}.cu", f"gemm_{kind}_{entry}", device_id=device_id, defines=defines,
                               need_sm90a=kind == "wgmma", max_dynamic_smem=_wgmma_smem() if kind == "wgmma" else _MMA_SMEM,
                               label=f"{entry}, {variant or 'plain'}")


_LIBCUDA = None
_MAPS: dict[tuple, object] = {}  # encoded TMA descriptors by (device, address, shape, row stride, box)
_MAPS_MAX = 4096  # a training step's distinct operands are a few hundred; beyond this the cache starts over


def _tensor_map(t: torch.Tensor, box_inner: int, box_outer: int):
    """128-byte TMA descriptor of a row-major bf16 matrix, 128B swizzle, zero fill outside. A
    descriptor is a function of its key alone (it holds the address, not the tensor), and launches
    copy it by value, so each key is encoded once (a ctypes driver call per operand per launch
    otherwise: a training step launches the same few hundred operands every step)."""
    key = (t.device.index, t.data_ptr(), *t.shape, t.stride(0), box_inner, box_outer)
    desc = _MAPS.get(key)
    if desc is None:
        if len(_MAPS) >= _MAPS_MAX:
            _MAPS.clear()
        desc = _MAPS[key] = _encode_map(t, box_inner, box_outer)
    return desc


def _encode_map(t: torch.Tensor, box_inner: int, box_outer: int):
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


# where prepare puts the outputs (C, row sums, column sums, tile→SM) in a launch's args and keep;
# the burn-in (soak_cuda.py) repoints exactly these
OUTS = slice(2, 6)


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
    device_id: int = 0
    label: str = ""  # names the launch in errors

    def run(self, args: list | None = None) -> None:
        """Enqueue it (no sync); ``args``: these arguments instead of its own (the burn-in's slab slots)."""
        loader.launch(self.func, self.grid, self.block, self.args if args is None else args, device_id=self.device_id,
                      stream=self.stream, smem=self.smem, label=self.label)

    @property
    def outputs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """C, row sums, column sums and the SM of each checksum tile, as the last run left them."""
        return tuple(self.keep[OUTS])


# ---------------------------------------------------------------------------- device
class CudaDevice(Device):
    """One CUDA GPU. ``kernel`` is "wgmma" on sm_90 and "mma" elsewhere (AEGIS_CUDA_KERNEL overrides).
    ``poison`` fills outputs with NaN before each launch (tests: every element must be written).
    ``identity``: who the GPU is, when already read (device_identity: NVML) for this index."""

    def __init__(self, index: int = 0, kernel: str | None = None, identity: DeviceIdentity | None = None):
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
        self.identity = identity if identity is not None else device_identity(index)

    # -- data ----------------------------------------------------------------------
    def generate(self, shape: tuple[int, ...], dist: str, seed: int) -> torch.Tensor:
        return numerics.generate_bf16(shape, dist, seed, self.torch_device)

    def memory_bytes(self) -> int | None:
        return int(torch.cuda.get_device_properties(self.index).total_memory)

    def memory_free(self) -> int | None:
        free, _ = torch.cuda.mem_get_info(self.index)
        # what torch's caching allocator holds for this process is ours to reuse
        return int(free + torch.cuda.memory_reserved(self.index) - torch.cuda.memory_allocated(self.index))

    def noise_model(self, k: int) -> numerics.NoiseModel:
        return CUDA_NOISE[self.kernel].capped_at(self.accumulation_bound(k))

    def fingerprint(self, t: torch.Tensor) -> int:
        return fingerprint_cuda.gpu_fingerprint(t)  # the GPU kernel for CUDA tensors, same value as the CPU twin

    def lean_side(self, left: torch.Tensor, right: torch.Tensor, t: int, rho: bool = True):
        # one pass over the bf16 operand in a kernel, enqueued without a sync; torch's elsewhere
        if cuda_reference.applies(left, right):
            return cuda_reference.lean_side(left, right, t, rho)
        return super().lean_side(left, right, t, rho)

    def tile_abs_sums(self, x: torch.Tensor, t: int) -> torch.Tensor:
        if x.is_cuda and x.dtype == torch.bfloat16 and x.dim() == 2 and x.numel():
            return cuda_reference.tile_abs_sums(x, t)
        return super().tile_abs_sums(x, t)

    def accumulation_bound(self, k: int) -> float:
        # mma.sync / wgmma accumulate fp32 truncating: each 16-deep MMA step may lose up to an ulp
        # (≤ 2⁻²³·s) of the running sum and one of its largest product. This charges one such ulp
        # per step, (K/16)·2⁻²³ = (K/8)·2⁻²⁴, plus ≤ 128 half-ulps for the epilogue's fp32 sum of
        # 128 accumulators, in units of s: a calibrated bound, half the strict worst case of two
        # ulps per step, which H200 measurements clear by 21× (docs/calibration.md).
        return (k / 8 + 128) * 2.0**-24

    def synchronize(self) -> None:
        self.wait()

    def wait(self, event: torch.cuda.Event | None = None) -> None:
        """Until ``event`` is done (the whole device without one): an asynchronous failure of the
        work before it (a fault while a kernel ran) surfaces here, as a DeviceError naming the device."""
        try:
            if event is None:
                torch.cuda.synchronize(self.torch_device)
            else:
                event.synchronize()
        except Exception as exc:
            raise DeviceError(f"cuda:{self.index}: asynchronous failure: {exc}") from exc

    # -- the checked GEMM ------------------------------------------------------------
    def prepare(self, a: torch.Tensor, b: torch.Tensor, layout: Layout, *, variant: str = "", kernel: str | None = None,
                inject: InjectParams | None = None, bias: torch.Tensor | None = None) -> _Launch:
        """Allocate outputs and pack one launch of C = A·B from the stored operands (no sync).
        ``variant``: "" (checksums), "nosums" (benchmark baseline) or "inject". ``bias`` (bf16, one
        per column of C): C = bf16(bf16(A·B) + bias) in the epilogue, the bits of adding it to C
        with torch; the checksums stay those of the accumulator, A·B (docs/kernels.md)."""
        ops = GemmOperands(a, b, layout)
        m, n, k = ops.mnk
        if max(m, n, k) > MAX_DIM:  # the kernels index and count k-blocks in 32-bit ints
            raise ConfigError(f"GEMM {m}x{n}x{k}: the CUDA kernels take dimensions up to {MAX_DIM}")
        a, b = _row_major(a), _row_major(b)
        kind = self.kernel_for(a, b, k, kernel)
        tm, tn = self.tile
        dev = self.torch_device

        def out(shape, poison, dtype):  # every element is written by the kernel: filled only when poisoning
            return torch.full(shape, poison, dtype=dtype, device=dev) if self.poison else torch.empty(shape, dtype=dtype, device=dev)

        nan = float("nan")
        mt, nt = -(-m // tm), -(-n // tn)
        c = out((m, n), nan, torch.bfloat16)
        row_sums, col_sums = out((m, nt), nan, torch.float32), out((mt, n), nan, torch.float32)  # never torch's default dtype
        tile_sm = out((mt, nt), -1, torch.int32)
        bias = self._bias(bias, n)
        entry = layout.value
        func = _function(kind, entry, variant, self.index)
        outs = [ctypes.c_void_p(t.data_ptr()) for t in (c, row_sums, col_sums, tile_sm)]
        outs.append(ctypes.c_void_p(bias.data_ptr() if bias is not None else 0))
        inj = inject if inject is not None else no_inject()
        if kind == "wgmma":
            a_box = (64, 128) if layout is not Layout.WGRAD else (64, 64)
            b_box = (64, 256) if layout is Layout.FWD else (64, 64)
            args = [_tensor_map(a, *a_box), _tensor_map(b, *b_box), *outs,
                    ctypes.c_int(m), ctypes.c_int(n), ctypes.c_int(k), inj]
            n_ctas = -(-m // 128) * -(-n // 256)
            grid, block, smem = (min(self.sms, n_ctas), 1), 384, _wgmma_smem()
        else:
            vec = [int(t.data_ptr() % 16 == 0 and t.stride(0) % 8 == 0) for t in (a, b)]
            args = [ctypes.c_void_p(a.data_ptr()), ctypes.c_void_p(b.data_ptr()), *outs,
                    ctypes.c_int(m), ctypes.c_int(n), ctypes.c_int(k), ctypes.c_longlong(a.stride(0)),
                    ctypes.c_longlong(b.stride(0)), ctypes.c_int(vec[0]), ctypes.c_int(vec[1]), inj]
            grid, block, smem = (-(-n // 128), -(-m // 128)), 256, _MMA_SMEM  # one CTA per 128x128 output tile
        if grid[1] > 65535:
            raise DeviceError(f"M = {m} exceeds the mma kernel's grid limit")
        return _Launch(kind, func, grid, block, smem, args, keep=[a, b, c, row_sums, col_sums, tile_sm, bias],
                       stream=loader.current_stream(self.index), device_id=self.index, label=f"gemm_{kind} {layout.value} {m}x{n}x{k}")

    def _bias(self, bias: torch.Tensor | None, n: int) -> torch.Tensor | None:
        """The epilogue's bias as the kernels read it: N bf16 values on this device, 4-byte aligned."""
        if bias is None:
            return None
        if bias.dtype != torch.bfloat16 or bias.device != self.torch_device or tuple(bias.shape) != (n,):
            raise DeviceError(f"cuda:{self.index}: the GEMM's bias must be a bf16 vector of {n} on {self.torch_device}, "
                              f"got {bias.dtype} {tuple(bias.shape)} on {bias.device}")
        return bias if bias.is_contiguous() and bias.data_ptr() % 4 == 0 else bias.clone(memory_format=torch.contiguous_format)

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
            acc = acc_faults(fault, ctx, GemmOperands(a, b, ops.layout), CTA_TILES[self.kernel_for(a, b, k)])
            if acc is not None:
                inj, keep = inject_params(acc, m, n, self.tile, self.torch_device)
        with torch.cuda.device(self.torch_device):
            launch = self.prepare(a, b, ops.layout, variant="inject" if inj is not None else "", inject=inj)
            try:
                launch.run()
                torch.cuda.synchronize(self.torch_device)
            except DeviceError:  # a refused build or launch: its message names the kernel and device
                raise
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

    # -- checked attention (kernels/attention_*.cu through backends/cuda_attention.py) ------------
    def _attention_run(self, what: str, shape: attention.AttentionShape, tensors: dict, af, call, sync: bool = True):
        """Check the inputs, pad the head dim to one the kernels take (64 or 128: zeros in Q, K,
        V and dO change no score and no sum), run ``call(padded tensors, fault tuple)`` and
        synchronise the device (``sync``; else ``call`` reads its results on the host, which
        waits for its own stream only); DeviceError names the launch."""
        for name, t in tensors.items():
            if t.device != self.torch_device or (name not in ("lse",) and t.dtype != torch.bfloat16):
                raise DeviceError(f"cuda:{self.index}: attention {name} must be a bf16 tensor on {self.torch_device}, "
                                  f"got {t.dtype} on {t.device}")
        d = shape.head_dim
        if d > 128:
            raise ConfigError(f"attention head dim {d}: the CUDA kernels take head dims up to 128")
        dp = 64 if d <= 64 else 128
        padded = {n: (t if n == "lse" or dp == d else torch.nn.functional.pad(t, (0, dp - d))).contiguous()
                  for n, t in tensors.items()}
        if af is not None and dp != d:
            af = af.moved(shape, dataclasses.replace(shape, head_dim=dp))
        try:
            with torch.cuda.device(self.torch_device):
                out = call(padded, af.as_tuple() if af is not None else None)
                if sync:
                    torch.cuda.synchronize(self.torch_device)
        except (DeviceError, ConfigError):
            raise
        except Exception as exc:
            raise DeviceError(f"cuda:{self.index}: attention {what} {shape.token()} failed: {exc}") from exc
        return out, d

    def attention_forward(self, q, k, v, *, causal: bool, scale: float, fault: FaultPlan | None = None,
                          op: str = "") -> attention.AttentionForward:

        shape = attention.AttentionShape.of(q, k, causal)
        af = pass_fault(fault, self.identity.id, op, shape, attention.FORWARD_STAGES)
        call = lambda t, f: cuda_attention.attention_forward(t["q"], t["k"], t["v"], causal=causal, scale=scale, fault=f)
        (o, lse, o_rowsum), d = self._attention_run("forward", shape, {"q": q, "k": k, "v": v}, af, call)
        return attention.AttentionForward(o[..., :d].contiguous(), lse, o_rowsum,
                                          kernel="attention_fwd" + ("+inject" if af is not None else ""))

    def attention_backward(self, q, k, v, o, lse, do, *, causal: bool, scale: float, fault: FaultPlan | None = None,
                           op: str = "") -> attention.AttentionBackward:

        shape = attention.AttentionShape.of(q, k, causal)
        af = pass_fault(fault, self.identity.id, op, shape, attention.BACKWARD_STAGES)
        call = lambda t, f: cuda_attention.attention_backward(t["q"], t["k"], t["v"], t["o"], t["lse"], t["do"],
                                                              causal=causal, scale=scale, fault=f)
        (dq, dk, dv, dq_rs, dk_cs, dv_cs), d = self._attention_run(
            "backward", shape, {"q": q, "k": k, "v": v, "o": o, "lse": lse, "do": do}, af, call)
        cut = lambda t: t[..., :d].contiguous()
        return attention.AttentionBackward(cut(dq), cut(dk), cut(dv), dq_rs, cut(dk_cs), cut(dv_cs),
                                           kernel="attention_bwd" + ("+inject" if af is not None else ""))

    def attention_reference(self, ops: attention.AttentionOperands, scale: float) -> attention.AttentionReference:
        """The sides in one kernel (kernels/attention_sides.cu) for bf16 operands on this device
        with head dims up to 128; torch's fp64 reference otherwise: where an operand is not finite
        (its NaN and Inf semantics are the reference's own) or max|Q|·max|K| > 2¹⁰⁰ (fp32 scores)."""
        t = {"q": ops.q, "k": ops.k, "v": ops.v, "do": ops.do}
        if ops.shape.head_dim <= 128 and all(x.device == self.torch_device and x.dtype == torch.bfloat16 for x in t.values()):
            call = lambda p, _f: cuda_attention.sides_and_flags(p["q"], p["k"], p["v"], p["do"], causal=ops.causal, scale=scale)
            (sides, (ok, p_min)), _ = self._attention_run("reference", ops.shape, t, None, call, sync=False)
            if ok:
                return attention.AttentionReference(*sides[:9], p_min=p_min)
        return attention.reference(ops, scale)

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

    def device(self, index: int, identity: DeviceIdentity | None = None) -> Device:
        if not self.available():
            raise DeviceError("no CUDA device available (needs CuPy and a GPU visible to torch)")
        return CudaDevice(index, identity=identity)
