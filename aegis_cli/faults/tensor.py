"""Torch implementations of the fault models of ``faults/spec.py`` (CPU reference path).

The CPU backend calls ``apply_operands`` on the operand tiles it feeds the product,
``apply_acc`` on the fp32 accumulator before the fused checksums, and ``apply_out`` on the
bf16 output. The CUDA backend applies the same models inside its kernels.
"""

from __future__ import annotations

import numpy as np
import torch

from aegis_cli.faults.spec import BIT_CLASSES, KSTEP, FaultPlan, FaultSpec, LaunchContext

_INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}
_BIT_RANGES = {  # element bits → {class: (lo, hi) inclusive}
    32: {"sign": (31, 31), "exp": (23, 30), "mant": (0, 22), "hi-mant": (16, 22), "lo-mant": (0, 6)},
    16: {"sign": (15, 15), "exp": (7, 14), "mant": (0, 6), "hi-mant": (4, 6), "lo-mant": (0, 2)},
    64: {"sign": (63, 63), "exp": (52, 62), "mant": (0, 51), "hi-mant": (40, 51), "lo-mant": (0, 6)},
}
MAX_RECORDED = 16


def signed(mask: int, bits: int) -> int:
    """An unsigned ``bits``-wide mask as the signed integer torch's int views take."""
    mask &= (1 << bits) - 1
    return mask - (1 << bits) if mask >= 1 << (bits - 1) else mask


def pick_bit(spec: str, bits: int, rng: np.random.Generator) -> int:
    """A bit index from a class name (drawn from its range; any bit for integer elements,
    which have no classes) or an explicit index."""
    if spec in BIT_CLASSES:
        lo, hi = _BIT_RANGES.get(bits, {}).get(spec, (0, bits - 1))
        return int(rng.integers(lo, hi + 1))
    return int(spec, 0) % bits


def _xor_flat(x: torch.Tensor, flat_idx: torch.Tensor, masks: torch.Tensor) -> None:
    """x.flat[idx] ^= masks (masks already as the signed int view dtype)."""
    iv = x.view(_INT_VIEW[x.dtype]).reshape(-1)
    iv[flat_idx] = iv[flat_idx] ^ masks


def positions(f: FaultSpec, shape: tuple[int, int], rng: np.random.Generator, count: int) -> np.ndarray:
    """Flat indices of ``count`` distinct elements; row=/col= pin one coordinate."""
    m, n = shape
    rows = np.full(count, f.as_int("row") % m) if f.get("row") else rng.integers(0, m, count)
    cols = np.full(count, f.as_int("col") % n) if f.get("col") else rng.integers(0, n, count)
    return np.unique(rows * n + cols)


def replace_run(f: FaultSpec, shape: tuple[int, int], rng: np.random.Generator) -> np.ndarray:
    """Flat indices a ``replace`` fault overwrites: one element, an aligned run of 16 or 64,
    or a random span up to the whole tensor."""
    numel = shape[0] * shape[1]
    span = f.get("span", "1")
    if span == "random":
        start = int(rng.integers(0, numel))
        return np.arange(start, start + int(rng.integers(1, numel - start + 1)))
    length = int(span)
    anchor = positions(f, shape, rng, 1)[0]
    start = int(anchor - anchor % length)
    return np.arange(start, min(start + length, numel))


def lane_run(f: FaultSpec, numel: int) -> tuple[int, np.ndarray]:
    """(stride, flat indices) of a stuck lane: every ``stride``-th element from ``offset``."""
    stride, offset = f.as_int("stride", "32"), f.as_int("offset", "0")
    return stride, np.arange(offset % stride, numel, stride)


def record(plan: FaultPlan, f: FaultSpec, ctx: LaunchContext, shape, flat: np.ndarray, before: torch.Tensor | None = None,
            after: torch.Tensor | None = None, **what) -> None:
    """Log what was corrupted: element count, flat range, first positions and their values."""
    n = shape[1]
    pos = [[int(i // n), int(i % n)] for i in flat[:MAX_RECORDED]]
    if before is not None and after is not None:
        what["values"] = [[float(b), float(a)] for b, a in zip(before[:MAX_RECORDED].tolist(), after[:MAX_RECORDED].tolist(), strict=True)]
    span = [int(flat.min()), int(flat.max()) + 1] if flat.size else []
    plan.record(f, ctx, target=f.target, elements=int(flat.size), positions=pos, flat_range=span, **what)


def _elementwise(plan: FaultPlan, f: FaultSpec, rng: np.random.Generator, ctx: LaunchContext, x: torch.Tensor) -> None:
    """bitflip / mask / stuck-lane / replace on a 2-D fp32 or bf16 tensor, in place."""
    assert x.is_contiguous(), "corruptions act on contiguous tensors"
    bits = x.element_size() * 8
    numel = x.numel()
    xf = x.reshape(-1)
    snap = lambda flat: xf[torch.from_numpy(flat[:MAX_RECORDED])].float().clone()
    if f.model in ("bitflip", "mask"):
        flat = positions(f, tuple(x.shape), rng, f.as_int("count", "1"))
        if f.model == "bitflip":
            masks = [1 << pick_bit(f.get("bit", "exp"), bits, rng) for _ in flat]
        else:
            masks = [f.as_int("mask")] * flat.size
        m = torch.tensor([signed(v, bits) for v in masks], dtype=_INT_VIEW[x.dtype])
        before = snap(flat)
        _xor_flat(x, torch.from_numpy(flat), m)
        record(plan, f, ctx, x.shape, flat, before, snap(flat), masks=[f"0x{v & ((1 << bits) - 1):x}" for v in masks[:MAX_RECORDED]])
    elif f.model == "stuck-lane":
        stride, flat = lane_run(f, numel)
        mask = f.as_int("mask")
        before = snap(flat)
        _xor_flat(x, torch.from_numpy(flat), torch.full((flat.size,), signed(mask, bits), dtype=_INT_VIEW[x.dtype]))
        record(plan, f, ctx, x.shape, flat, before, snap(flat), masks=[f"0x{mask & ((1 << bits) - 1):x}"], stride=stride)
    elif f.model == "replace":
        span = f.get("span", "1")
        flat = replace_run(f, tuple(x.shape), rng)
        before = snap(flat)
        how = f.get("value", "flip")
        idx = torch.from_numpy(flat)
        if how == "zero":
            xf[idx] = 0
        elif how == "copy":
            src = rng.integers(0, numel, flat.size)
            xf[idx] = xf[torch.from_numpy(src)].clone()
        elif how == "random":
            raw = rng.integers(0, 1 << bits, flat.size, dtype=np.uint64)
            exp_hi = 1 << (bits - 2)  # top exponent bit: clearing it keeps the value finite
            raw = np.where((raw >> np.uint64(bits - 9 if bits == 32 else 7)) & np.uint64(0xFF) == 0xFF, raw & ~np.uint64(exp_hi), raw)
            vals = torch.tensor([signed(int(v), bits) for v in raw], dtype=_INT_VIEW[x.dtype])
            x.view(_INT_VIEW[x.dtype]).reshape(-1)[idx] = vals
        else:  # flip: one random bit in each element of the run
            masks = torch.tensor([signed(1 << int(b), bits) for b in rng.integers(0, bits, flat.size)], dtype=_INT_VIEW[x.dtype])
            _xor_flat(x, idx, masks)
        record(plan, f, ctx, x.shape, flat, before, snap(flat), span=span, value=how)


def apply_operands(plan: FaultPlan, ctx: LaunchContext, a_mk: torch.Tensor, b_kn: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Operand faults: corrupt copies of the tiles fed to the matrix unit (A: M×K, B: K×N)."""
    for f, rng in plan.active(ctx, "operands"):
        # a contiguous copy of the logical (M, K) / (K, N) operand: positions are [row, col] of it
        if f.target == "a":
            a_mk = a_mk.clone(memory_format=torch.contiguous_format)
            _elementwise(plan, f, rng, ctx, a_mk)
        else:
            b_kn = b_kn.clone(memory_format=torch.contiguous_format)
            _elementwise(plan, f, rng, ctx, b_kn)
    return a_mk, b_kn


def perturb_draw(plan: FaultPlan, f: FaultSpec, rng: np.random.Generator, numel: int) -> tuple[np.ndarray, np.ndarray]:
    """The accumulator elements a perturb fault hits on this launch, and their signs (both
    backends): a fresh draw per launch (a transient-rate fault), seeded through ``rng`` by the
    fault's place in the spec, so two perturb faults with one seed do not hit the same elements."""
    prng = np.random.default_rng([int(rng.integers(1 << 62)), plan.launches, 0x9E7])
    # the law of one Bernoulli(rate) draw per element (a binomial count, then that many distinct
    # positions, uniformly) without a random number per element: for a 70B-shape C that was 67M
    # draws, seconds of host time per launch, and a perturbed scan took 3× a healthy one
    hit = np.sort(prng.choice(numel, prng.binomial(numel, float(f.get("rate", "2e-4"))), replace=False))
    return hit, prng.choice([-1.0, 1.0], hit.size)


def skipped_kblock(f: FaultSpec, k: int, rng: np.random.Generator) -> int:
    """The k-block a skipk tile fault drops (both backends): ``kstep=``, else drawn, modulo the
    k-blocks of a K-deep product, as the CUDA kernels take it."""
    kblocks = max(1, -(-k // KSTEP))
    return (f.as_int("kstep") if f.get("kstep") else int(rng.integers(0, kblocks))) % kblocks


def tiles_for(f: FaultSpec, ctx: LaunchContext, tiles: tuple[int, int], rng: np.random.Generator) -> list[tuple[int, int]]:
    tm_n, tn_n = tiles
    total = tm_n * tn_n
    if f.get("tile"):
        i, j = (int(x) for x in f.get("tile").split("."))
        return [(i % tm_n, j % tn_n)]
    if f.get("every"):
        return [divmod(lin, tn_n) for lin in range(0, total, f.as_int("every"))]
    if f.get("sm") is not None:
        if ctx.tile_sm is None:
            return []
        sm = f.as_int("sm")
        return [(int(i), int(j)) for i, j in zip(*np.nonzero(ctx.tile_sm == sm), strict=True)]
    return [divmod(int(rng.integers(0, total)), tn_n)]


def apply_acc(plan: FaultPlan, ctx: LaunchContext, acc: torch.Tensor, a_mk: torch.Tensor, b_kn: torch.Tensor) -> None:
    """Accumulator faults, in place on the fp32 (M, N) accumulator, before the checksums."""
    m, n = acc.shape
    tm, tn = ctx.tile
    for f, rng in plan.active(ctx, "acc"):
        if f.model in ("bitflip", "mask", "stuck-lane", "replace"):
            _elementwise(plan, f, rng, ctx, acc)
        elif f.model == "perturb":
            if ctx.clean_median is None:
                raise RuntimeError("perturb fault needs the clean median checksum difference")
            r = float(f.get("r"))
            hit, signs = perturb_draw(plan, f, rng, m * n)
            delta = torch.from_numpy(signs * r * ctx.clean_median).to(acc.dtype)
            acc.reshape(-1)[torch.from_numpy(hit)] += delta
            record(plan, f, ctx, acc.shape, hit, magnitude=r * ctx.clean_median)
        elif f.model == "row":
            i = f.as_int("row") % m if f.get("row") else int(rng.integers(0, m))
            acc[i] = 0.0 if f.get("mode", "zero") == "zero" else float(f.get("value", "1.0"))
            record(plan, f, ctx, acc.shape, np.arange(i * n, (i + 1) * n), row=i, mode=f.get("mode", "zero"))
        elif f.model == "tile":
            mode = f.get("mode", "zero")
            if mode == "shift" and m <= tm:
                # one row of tiles: "one tile further down" wraps back into the same tile, no
                # wrong-address read at all; as on CUDA, not injected and not recorded
                continue
            if mode == "skipk":
                kb = skipped_kblock(f, a_mk.shape[1], rng)
                ks = slice(kb * KSTEP, (kb + 1) * KSTEP)
            tiles = tiles_for(f, ctx, (-(-m // tm), -(-n // tn)), rng)
            for ti, tj in tiles:
                rs, cs = slice(ti * tm, min(m, (ti + 1) * tm)), slice(tj * tn, min(n, (tj + 1) * tn))
                if mode == "zero":
                    acc[rs, cs] = 0.0
                elif mode == "stuck":
                    acc[rs, cs] = float(f.get("value", "1.0"))
                elif mode == "shift":  # wrong-address read: the A block one tile further down
                    rows = (torch.arange(rs.start, rs.stop) + tm) % m
                    acc[rs, cs] = a_mk[rows].float() @ b_kn[:, cs].float()
                else:  # skipk: one k-block never accumulated
                    acc[rs, cs] -= a_mk[rs, ks].float() @ b_kn[ks, cs].float()
            plan.record(f, ctx, target="acc", mode=mode, tiles=[list(t) for t in tiles[:MAX_RECORDED]], n_tiles=len(tiles),
                        sms=sorted({int(ctx.tile_sm[t]) for t in tiles})[:MAX_RECORDED] if ctx.tile_sm is not None else None,
                        **({"kstep": kb} if mode == "skipk" else {}))


def apply_out(plan: FaultPlan, ctx: LaunchContext, c: torch.Tensor) -> None:
    """Output faults, in place on the bf16 (M, N) output after the epilogue."""
    for f, rng in plan.active(ctx, "out"):
        _elementwise(plan, f, rng, ctx, c)
