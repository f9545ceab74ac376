"""Launches the checked flash-attention kernels (kernels/attention_fwd.cu, attention_bwd.cu).

The contract (kernels/attention.cuh; ops/attention.py is the reference): bf16 Q (B,Hq,S,D),
K and V (B,Hkv,S,D), contiguous on one CUDA device, Hq a multiple of Hkv, D 64 or 128, any S.

- ``attention_forward`` → O bf16 (B,Hq,S,D), lse fp32 (B,Hq,S) (natural log of the softmax
  denominator), o_rowsum fp32 (B,Hq,S): Σ_d of the normalised fp32 O accumulator.
- ``attention_backward`` → dQ bf16, dK and dV bf16 (B,Hkv,S,D) (summed over each KV group's
  query heads in order), dq_rowsum fp32 (B,Hq,S), dk_colsum and dv_colsum fp32 (B,Hkv,D): Σ over
  keys of the fp32 dK / dV accumulators. No atomics: repeats are bit-identical.
- ``attention_sides`` (kernels/attention_sides.cu) → the reference's row sides of the invariants
  (ops/attention.ROW_SIDES, then each row's smallest P), fp64 (10, B, Hq, S), from Q, K, V, dO
  alone: what ops/attention.reference computes with torch, without its S x S blocks.

``fault`` = (stage, flat index, xor, add) runs the injection build (``AEGIS_INJECT``), which
edits that one fp32 value of the stage's tensor (faults/kernel_params.py ATTN_STAGES); a fault
of the other pass's stages leaves a launch clean. ``variant="nosums"`` runs the build without
the invariant sums (``AEGIS_NOSUMS``, benchmarks; the sums come back as NaN). Everything goes
through the one loader and launcher (backends/loader.py); no sync here: outputs are ordered on
torch's current stream.
"""

from __future__ import annotations

import ctypes
import functools
import math

import torch

from aegis_cli.backends import loader
from aegis_cli.faults.kernel_params import ATTN_FWD_STAGES, AttnFault, attn_fault
from aegis_cli.ops.attention import STAGES
from aegis_cli.ops.errors import ConfigError

# The kernels' tile defines and their defaults (benchmarks/attention.py --tune tries others): warps per
# CTA, m-tiles of 16 rows per warp in the forward and dQ kernels, keys per dQ step, the dK/dV grid order
DEFAULT_TUNE = {"ATTN_FWD_WARPS": 4, "ATTN_BWD_WARPS": 4, "ATTN_FWD_MT": 2, "ATTN_DQ_MT": 2, "ATTN_DQ_BN": 32,
                "ATTN_DKDV_HEAVY_FIRST": 1}
TUNE = dict(DEFAULT_TUNE)
FWD_BN = 64    # keys per forward step


def _bwd_bq(d: int) -> int:  # ATTN_BWD_BQ(D): query rows per dK/dV step
    return 32 if d == 128 else 64


def _check(name: str, t, shape: tuple[int, ...] | None, dtype: torch.dtype, device: torch.device | None) -> None:
    if not isinstance(t, torch.Tensor):
        raise ConfigError(f"attention: {name} is not a tensor")
    if t.device.type != "cuda" or (device is not None and t.device != device):
        raise ConfigError(f"attention: {name} is on {t.device}, want {device or 'a CUDA device'}")
    if t.dtype != dtype:
        raise ConfigError(f"attention: {name} is {t.dtype}, want {dtype}")
    if shape is not None and tuple(t.shape) != shape:
        raise ConfigError(f"attention: {name} has shape {tuple(t.shape)}, want {shape}")
    if not t.is_contiguous() or t.data_ptr() % 16:
        raise ConfigError(f"attention: {name} must be contiguous and 16-byte aligned")


def _shapes(q, k, v) -> tuple[int, int, int, int, int]:
    """(B, Hq, Hkv, S, D) after validating Q, K, V; ConfigError (one line) otherwise."""
    _check("q", q, None, torch.bfloat16, None)
    if q.dim() != 4:
        raise ConfigError(f"attention: q must be (B, Hq, S, D), got shape {tuple(q.shape)}")
    b, hq, s, d = q.shape
    if not isinstance(k, torch.Tensor) or k.dim() != 4:
        raise ConfigError("attention: k must be a (B, Hkv, S, D) tensor")
    hkv = k.shape[1]
    if d not in (64, 128):
        raise ConfigError(f"attention: head dim {d} not supported (64 or 128)")
    if min(b, hq, hkv, s) < 1 or hq % hkv:
        raise ConfigError(f"attention: {hq} query heads cannot share {hkv} KV heads (B={b}, S={s})")
    if b * max(hq, hkv) > 65535:
        raise ConfigError(f"attention: B·H = {b * max(hq, hkv)} exceeds the grid limit 65535")
    _check("k", k, (b, hkv, s, d), torch.bfloat16, q.device)
    _check("v", v, (b, hkv, s, d), torch.bfloat16, q.device)
    return b, hq, hkv, s, d


def _fault_block(fault, b: int, hq: int, hkv: int, s: int, d: int, forward: bool) -> AttnFault | None:
    """The packed fault when it belongs to this pass, else None (run the clean build)."""
    if fault is None:
        return None
    dim = {"q": hq, "kv": hkv, "s": s, "d": d}
    sizes = {stage: b * math.prod(dim[x] for x in dims) for stage, dims in STAGES.items()}
    block = attn_fault(fault, sizes)
    return block if (fault[0] in ATTN_FWD_STAGES) == forward else None


def _defines(variant: str, inject: bool) -> dict[str, object]:
    if variant not in ("", "nosums"):
        raise ConfigError(f"attention: unknown kernel variant {variant!r} (want '' or 'nosums')")
    if inject and variant:
        raise ConfigError("attention: fault injection runs the checked build only")
    defs: dict[str, object] = {"AEGIS_INJECT": 1} if inject else {"AEGIS_NOSUMS": 1} if variant else {}
    return defs | {k: v for k, v in TUNE.items() if DEFAULT_TUNE[k] != v}


def _ptr(t: torch.Tensor) -> ctypes.c_void_p:
    return ctypes.c_void_p(t.data_ptr())


def _empty(shape, dtype, device, poison: bool) -> torch.Tensor:
    return torch.full(shape, math.nan, dtype=dtype, device=device) if poison else torch.empty(shape, dtype=dtype,
                                                                                                device=device)


def attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, scale: float, fault=None,
                      variant: str = "", poison: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(O, lse, o_rowsum) of softmax(scale·Q·Kᵀ [causal mask])·V; see the module docstring."""
    b, hq, hkv, s, d = _shapes(q, k, v)
    block = _fault_block(fault, b, hq, hkv, s, d, forward=True)
    run = functools.partial(loader.run, on=q.device, defines=_defines(variant, block is not None))
    o = _empty((b, hq, s, d), torch.bfloat16, q.device, poison)
    lse = _empty((b, hq, s), torch.float32, q.device, poison)
    rowsum = _empty((b, hq, s), torch.float32, q.device, poison or bool(variant))
    bm = 16 * TUNE["ATTN_FWD_WARPS"] * TUNE["ATTN_FWD_MT"]
    smem = (bm + 4 * FWD_BN) * (d + 8) * 2
    args = [_ptr(q), _ptr(k), _ptr(v), _ptr(o), _ptr(lse), _ptr(rowsum), ctypes.c_int(hq), ctypes.c_int(hkv),
            ctypes.c_int(s), ctypes.c_float(scale), ctypes.c_int(int(bool(causal))), block or AttnFault(stage=0)]
    run("attention_fwd.cu", f"attn_fwd_d{d}", (-(-s // bm), b * hq), 32 * TUNE["ATTN_FWD_WARPS"], args, smem=smem)
    return o, lse, rowsum


def attention_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor,
                       do: torch.Tensor, *, causal: bool, scale: float, fault=None, variant: str = "",
                       poison: bool = False) -> tuple[torch.Tensor, ...]:
    """(dQ, dK, dV, dq_rowsum, dk_colsum, dv_colsum) from the forward's O and lse; see the module docstring."""
    b, hq, hkv, s, d = _shapes(q, k, v)
    _check("o", o, (b, hq, s, d), torch.bfloat16, q.device)
    _check("do", do, (b, hq, s, d), torch.bfloat16, q.device)
    _check("lse", lse, (b, hq, s), torch.float32, q.device)
    block = _fault_block(fault, b, hq, hkv, s, d, forward=False)
    run = functools.partial(loader.run, on=q.device, defines=_defines(variant, block is not None))
    fb = block or AttnFault(stage=0)
    dev = q.device
    delta = torch.empty((b, hq, s), dtype=torch.float32, device=dev)
    rows = b * hq * s
    run("attention_bwd.cu", "attn_bwd_pre", (-(-rows // 8),), 256, [_ptr(o), _ptr(do), _ptr(delta), ctypes.c_longlong(rows),
                                                                   ctypes.c_int(d)])
    common = [ctypes.c_int(hq), ctypes.c_int(hkv), ctypes.c_int(s), ctypes.c_float(scale),
              ctypes.c_int(int(bool(causal))), fb]

    dq = _empty((b, hq, s, d), torch.bfloat16, dev, poison)
    dq_rowsum = _empty((b, hq, s), torch.float32, dev, poison or bool(variant))
    warps = TUNE["ATTN_BWD_WARPS"]
    bm = 16 * warps * TUNE["ATTN_DQ_MT"]
    smem = (2 * bm + 4 * TUNE["ATTN_DQ_BN"]) * (d + 8) * 2
    run("attention_bwd.cu", f"attn_bwd_dq_d{d}", (-(-s // bm), b * hq), 32 * warps,
        [_ptr(q), _ptr(k), _ptr(v), _ptr(do), _ptr(lse), _ptr(delta), _ptr(dq), _ptr(dq_rowsum), *common], smem=smem)

    dk = _empty((b, hkv, s, d), torch.bfloat16, dev, poison)
    dv = _empty((b, hkv, s, d), torch.bfloat16, dev, poison)
    bn, bq = 16 * warps, _bwd_bq(d)
    nkb = -(-s // bn)
    parts = _empty((2, b * hkv, nkb, d), torch.float32, dev, poison or bool(variant))
    smem = (2 * bn + 4 * bq) * (d + 8) * 2 + 4 * bq * 4
    grid = (b * hkv, nkb) if TUNE["ATTN_DKDV_HEAVY_FIRST"] else (nkb, b * hkv)
    run("attention_bwd.cu", f"attn_bwd_dkdv_d{d}", grid, 32 * warps,
        [_ptr(q), _ptr(k), _ptr(v), _ptr(do), _ptr(lse), _ptr(delta), _ptr(dk), _ptr(dv), _ptr(parts[0]),
         _ptr(parts[1]), *common], smem=smem)
    colsums = torch.empty((2, b, hkv, d), dtype=torch.float32, device=dev)
    if variant:
        colsums.fill_(math.nan)
    else:
        n = b * hkv * d
        for i in range(2):
            run("attention_bwd.cu", "attn_colsum_reduce", (-(-n // 256),), 256,
                [_ptr(parts[i]), _ptr(colsums[i]), ctypes.c_int(nkb), ctypes.c_int(d), ctypes.c_longlong(n)])
    return dq, dk, dv, dq_rowsum, colsums[0], colsums[1]


# kernels/attention_sides.cu's tile defines and their defaults (benchmarks try others): keys per
# stage, k16 steps unrolled
SIDES_DEFAULT = {"SIDES_BN": 32, "SIDES_KK_UNROLL": 1}
SIDES_TUNE = dict(SIDES_DEFAULT)


def _exponent(x: torch.Tensor) -> torch.Tensor:
    """e with x = m·2^e, ½ ≤ m < 1 (0 for 0), within −125…126: 2^±e is a normal number in bf16 and
    fp32 (bf16's subnormals are then scaled less, never to ∞)."""
    return torch.frexp(x.float()).exponent.clamp(-125, 126)


def _pow2(e: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """2^e exactly, built from its exponent bits (e within the dtype's normal exponents)."""
    if dtype == torch.float64:
        return ((e.to(torch.int64) + 1023) << 52).view(torch.float64)
    if dtype == torch.bfloat16:
        return ((e.to(torch.int16) + 127) << 7).view(torch.bfloat16)
    raise ValueError(f"_pow2: {dtype}")


def attention_sides(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor, *, causal: bool,
                    scale: float) -> torch.Tensor:
    """The invariants' row sides and p_min per row, fp64 (10, B, Hq, S); see the module docstring.

    The kernel sums squares in fp32, so V, each row of dO and the per-key sums of K go in scaled
    by powers of two to a largest magnitude in [½, 1) (exact), and each side comes back times its
    factors (ops/attention.AttentionReference.rescaled's rule, per dO row): their range is then
    fp32's whatever theirs. Q and K enter only the scores (the caller bounds max|Q|·max|K|)."""
    b, hq, hkv, s, d = _shapes(q, k, v)
    _check("do", do, (b, hq, s, d), torch.bfloat16, q.device)
    ev = _exponent(v.abs().amax())
    edo = _exponent(do.abs().amax(-1, keepdim=True))  # (B, Hq, S, 1)
    vs = v * _pow2(-ev, torch.bfloat16)  # exact: bf16 times a power of two, no full-size copy in another dtype
    dos = do * _pow2(-edo, torch.bfloat16)
    kabs = k.abs().sum(-1, dtype=torch.float64)
    ek = _exponent(kabs.amax())
    # per key (Σ V, Σ|V|, Σ K, Σ|K|): sums of the bf16 values accumulated in fp64, rounded once to fp32
    stats = torch.stack((vs.sum(-1, dtype=torch.float64), vs.abs().sum(-1, dtype=torch.float64),
                         k.sum(-1, dtype=torch.float64) * _pow2(-ek, torch.float64), kabs * _pow2(-ek, torch.float64)), -1)
    stats = stats.float().contiguous()
    del kabs
    out = torch.empty((10, b, hq, s), dtype=torch.float64, device=q.device)
    bm = 64
    bn = SIDES_TUNE["SIDES_BN"]
    smem = (2 * bm + 4 * bn) * (d + 8) * 2 + 2 * bn * 16
    args = [_ptr(q), _ptr(k), _ptr(vs), _ptr(dos), _ptr(stats), _ptr(out), ctypes.c_int(hq), ctypes.c_int(hkv),
            ctypes.c_int(s), ctypes.c_double(scale), ctypes.c_int(int(bool(causal)))]
    loader.run("attention_sides.cu", f"attn_sides_d{d}", (-(-s // bm), b * hq), 128, args, on=q.device, smem=smem,
               defines={k: v for k, v in SIDES_TUNE.items() if SIDES_DEFAULT[k] != v} or None)
    fv, fk, fdo = (_pow2(e, torch.float64) for e in (ev, ek, edo.squeeze(-1)))
    out[[0, 3, 5]] *= fv  # O·1, its scale and σ
    out[[2, 4, 6]] *= fv * fk * fdo  # dQ·1, its scale and σ
    out[8] *= fv * fdo  # ‖dS‖ + r
    return out


def sides_and_flags(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor, *, causal: bool,
                    scale: float) -> tuple[torch.Tensor, list[float]]:
    """``attention_sides`` and, in one host read, [1.0 where the kernel's sides stand (every
    operand finite, max|Q|·max|K| ≤ 2¹⁰⁰) else 0.0, the smallest P of any row]."""
    sides = attention_sides(q, k, v, do, causal=causal, scale=scale)
    reach = q.abs().amax().double() * k.abs().amax().double()  # NaN or ∞ where Q or K is not finite: not ok
    ok = (reach <= 2.0**100) & torch.isfinite(v).all() & torch.isfinite(do).all()
    return sides, torch.stack((ok.double(), sides[9].min())).tolist()
