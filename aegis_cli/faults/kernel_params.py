"""Accumulator faults packed for the CUDA GEMM kernels' ``AEGIS_INJECT`` build (docs/design.md §9).

The kernels read one ``InjectParams`` block (kernels/common.cuh) by value: per-element edits
(XOR, set or add on the fp32 accumulator, sorted into CSR by checksum tile), a mode per
checksum tile, one SM-pinned tile fault, one stuck value, one skipped k-step and up to
``MAX_LANES`` dense stuck lanes. ``acc_faults`` turns a launch's FaultPlan into those
parameters with the same seeded draws as faults/tensor.py, so a fault lands where it lands on
the CPU backend; ``inject_params`` packs and uploads them. Operand and output faults need
none of this: the CUDA backend applies faults/tensor.py to host copies.

No CUDA here: the arrays go to whatever torch device the caller names.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field

import numpy as np
import torch

from aegis_cli.faults import tensor as corrupt
from aegis_cli.faults.spec import FaultPlan, FaultSpec, LaunchContext
from aegis_cli.ops.attention import FORWARD_STAGES
from aegis_cli.ops.errors import DeviceError, InjectSpecError
from aegis_cli.ops.gemm import GemmOperands

EDIT_XOR, EDIT_SET, EDIT_ADD = 0, 1, 2
TILE_CODES = {"zero": 1, "stuck": 2, "shift": 3, "skipk": 4}
MAX_LANES = 4  # stuck-lane patterns one launch takes (AEGIS_MAX_LANES in kernels/common.cuh)
_LANE_AS_EDITS = 4096  # a stuck lane hitting at most this many elements goes in as edits instead


class InjectParams(ctypes.Structure):  # mirrors InjectParams in kernels/common.cuh
    _fields_ = [
        ("edit_idx", ctypes.c_void_p), ("edit_off", ctypes.c_void_p), ("edit_val", ctypes.c_void_p),
        ("edit_op", ctypes.c_void_p), ("tile_mode", ctypes.c_void_p),
        ("sm_target", ctypes.c_int), ("sm_mode", ctypes.c_int), ("tile_value", ctypes.c_float), ("kstep", ctypes.c_int),
        ("lane_stride", ctypes.c_int * MAX_LANES), ("lane_offset", ctypes.c_int * MAX_LANES),
        ("lane_mask", ctypes.c_uint * MAX_LANES), ("n_lanes", ctypes.c_int), ("n_edits", ctypes.c_int),
    ]


def no_inject() -> InjectParams:
    """The parameter block of a launch without faults (the plain builds ignore it)."""
    return InjectParams(sm_target=-1)


@dataclass
class AccFaults:
    """One launch's accumulator faults as the kernels take them, before packing (inject_params)."""

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


def _elementwise_acc(acc: AccFaults, plan: FaultPlan, f: FaultSpec, rng: np.random.Generator, ctx: LaunchContext,
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


def acc_faults(plan: FaultPlan, ctx: LaunchContext, ops: GemmOperands, cta: tuple[int, int]) -> AccFaults | None:
    """Translate this launch's accumulator faults into kernel parameters (None: none fire); ``ops``
    are the operands the kernel multiplies."""
    active = plan.active(ctx, "acc")
    if not active:
        return None
    m, n, k = ops.mnk
    tm, tn = ctx.tile
    tiles = (-(-m // tm), -(-n // tn))
    acc = AccFaults()
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


def _tile_fault(acc: AccFaults, plan: FaultPlan, f: FaultSpec, rng: np.random.Generator, ctx: LaunchContext,
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


def inject_params(acc: AccFaults, m: int, n: int, tile: tuple[int, int], device: torch.device) -> tuple[InjectParams, list]:
    """Pack edits per checksum tile (CSR) and upload them; returns the struct and what it points into."""
    tm, tn = tile
    tiles_n = -(-n // tn)
    n_tiles = -(-m // tm) * tiles_n
    p = InjectParams(sm_target=acc.sm_target, sm_mode=acc.sm_mode, tile_value=1.0 if acc.tile_value is None else acc.tile_value,
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


# ---- attention kernels (kernels/attention.cuh) ---------------------------------------------
# One fault per launch: the fp32 value at a flat index of one stage's tensor has its bits XORed,
# then a number added, before any fused invariant sum reads it.
ATTN_STAGES = {"load_q": 1, "scores": 2, "softmax": 3, "pv": 4, "lse": 5,
               "dv": 6, "dk": 7, "dq": 8, "dp": 9, "recompute_p": 10}
ATTN_FWD_STAGES = frozenset(FORWARD_STAGES)


class AttnFault(ctypes.Structure):  # mirrors AttnFault in kernels/attention.cuh
    _fields_ = [("stage", ctypes.c_int), ("pad", ctypes.c_int), ("index", ctypes.c_longlong),
                ("xor_bits", ctypes.c_uint), ("add", ctypes.c_float)]


def attn_fault(fault: tuple[str, int, int, float] | None, sizes: dict[str, int]) -> AttnFault:
    """Pack ``(stage, index, xor, add)`` for the attention kernels; ``sizes`` gives the element count
    of each stage's tensor for this launch. None: the block of a launch without a fault."""
    if fault is None:
        return AttnFault(stage=0)
    try:
        stage, index, xor, add = fault
        code = ATTN_STAGES[stage]
        index, xor, add = int(index), int(xor), float(add)
    except (TypeError, ValueError, KeyError) as exc:
        raise InjectSpecError(f"attention fault {fault!r}: want (stage, index, xor, add) with stage one of "
                              f"{', '.join(ATTN_STAGES)}") from exc
    if not 0 <= index < sizes[stage]:
        raise InjectSpecError(f"attention fault index {index} outside {stage} ({sizes[stage]} elements)")
    if not 0 <= xor <= 0xFFFFFFFF:
        raise InjectSpecError(f"attention fault xor mask {xor:#x} is not 32 bits")
    return AttnFault(stage=code, index=index, xor_bits=xor, add=add)
