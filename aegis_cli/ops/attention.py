"""Checked attention: data types, the tiled flash-attention reference and its fp64 reference
(docs/attention.md).

Convention (kernels/attention_*.cu take the same): Q (B, Hq, S, D), K and V (B, Hkv, S, D),
bf16; query head h reads KV head h // (Hq / Hkv) (grouped-query attention); softmax scale
``scale``; causal: query i sees keys j ≤ i. The forward writes O (bf16), the log-sum-exp LSE
(fp32, natural log) and the row sums of its fp32 O accumulator; the backward writes dQ, dK, dV
(bf16; dK and dV summed over each KV head's query heads) and the fused sums of their fp32
accumulators: dQ·1 per query, and Σ over keys of dK and dV per head-dim column.

``flash_forward`` / ``flash_backward`` are the reference the CPU backend runs: flash attention
(FlashAttention-2's loop order) in torch, fp32 accumulators, with the kernels' operand roundings
(P and dS to bf16 before their products), so the clean noise of every invariant is the
kernels' own. Deterministic: fixed block order, dQ summed over key blocks in order, dK and dV
over a group's query heads in order. An ``AttentionFault`` acts on one fp32 value of one stage,
as the kernels' injection build does. ``reference`` is plain softmax attention in fp64.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from aegis_cli.ops.errors import ConfigError, InjectSpecError

BLOCK = 64  # query and key block of the tiled reference (the kernels' tile edge)
F32 = torch.float32  # the reference's accumulators, the kernels' (never torch's default dtype)
MAX_SEQ = 1 << 17

# stage → which tensor its index addresses: dims named from (B, Hq|Hkv, S, S|D)
STAGES = {
    "load_q": ("q", "s", "d"), "scores": ("q", "s", "s"), "softmax": ("q", "s", "s"), "pv": ("q", "s", "d"),
    "lse": ("q", "s"), "dv": ("kv", "s", "d"), "dk": ("kv", "s", "d"), "dq": ("q", "s", "d"),
    "dp": ("q", "s", "s"), "recompute_p": ("q", "s", "s"),
}
FORWARD_STAGES = ("load_q", "scores", "softmax", "pv", "lse")
BACKWARD_STAGES = ("recompute_p", "dp", "dv", "dk", "dq")


@dataclass(frozen=True)
class AttentionShape:
    batch: int
    q_heads: int
    kv_heads: int
    seq: int
    head_dim: int
    causal: bool = True

    def __post_init__(self) -> None:
        for name in ("batch", "q_heads", "kv_heads", "seq", "head_dim"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= MAX_SEQ:
                raise ConfigError(f"attention {name} = {v!r} is outside 1…{MAX_SEQ}")
        if self.q_heads % self.kv_heads:
            raise ConfigError(f"attention: {self.q_heads} query heads are not a multiple of {self.kv_heads} KV heads")

    @classmethod
    def of(cls, q: torch.Tensor, k: torch.Tensor, causal: bool) -> AttentionShape:
        """The shape of Q (B, Hq, S, D) and K (B, Hkv, S, D); ConfigError for tensors that do not fit."""
        if q.dim() != 4 or k.dim() != 4 or q.shape[0] != k.shape[0] or q.shape[2:] != k.shape[2:]:
            raise ConfigError(f"attention: Q {tuple(q.shape)} and K {tuple(k.shape)} are not (B, H, S, D) of one B, S, D")
        return cls(q.shape[0], q.shape[1], k.shape[1], q.shape[2], q.shape[3], causal)

    @property
    def group(self) -> int:
        """Query heads per KV head."""
        return self.q_heads // self.kv_heads

    @property
    def scale(self) -> float:
        """The softmax scale training uses, 1/√D."""
        return 1.0 / math.sqrt(self.head_dim)

    def token(self) -> str:
        """The shape part of a case id: ``b1h8k2s192d32c`` (``c`` causal, ``f`` full)."""
        return f"b{self.batch}h{self.q_heads}k{self.kv_heads}s{self.seq}d{self.head_dim}{'c' if self.causal else 'f'}"

    def stage_shape(self, stage: str) -> tuple[int, ...]:
        size = {"q": self.q_heads, "kv": self.kv_heads, "s": self.seq, "d": self.head_dim}
        return (self.batch, *(size[x] for x in STAGES[stage]))

    @property
    def flops(self) -> int:
        """Multiply-adds ×2 of forward (2 products) plus backward (5), halved when causal."""
        full = 2 * self.batch * self.q_heads * self.seq * self.seq * self.head_dim * 7
        return full // 2 if self.causal else full


@dataclass
class AttentionOperands:
    q: torch.Tensor  # (B, Hq, S, D) bf16
    k: torch.Tensor  # (B, Hkv, S, D) bf16
    v: torch.Tensor  # (B, Hkv, S, D) bf16
    do: torch.Tensor  # (B, Hq, S, D) bf16, the upstream gradient
    causal: bool = True

    @property
    def shape(self) -> AttentionShape:
        return AttentionShape.of(self.q, self.k, self.causal)


@dataclass
class AttentionForward:
    o: torch.Tensor  # (B, Hq, S, D) bf16
    lse: torch.Tensor  # (B, Hq, S) fp32
    o_rowsum: torch.Tensor  # (B, Hq, S) fp32: Σ_d of the normalised fp32 O accumulator
    kernel: str = ""


@dataclass
class AttentionBackward:
    dq: torch.Tensor  # (B, Hq, S, D) bf16
    dk: torch.Tensor  # (B, Hkv, S, D) bf16
    dv: torch.Tensor  # (B, Hkv, S, D) bf16
    dq_rowsum: torch.Tensor  # (B, Hq, S) fp32
    dk_colsum: torch.Tensor  # (B, Hkv, D) fp32
    dv_colsum: torch.Tensor  # (B, Hkv, D) fp32
    kernel: str = ""

    def tensors(self) -> dict[str, torch.Tensor]:
        return {k: getattr(self, k) for k in ("dq", "dk", "dv", "dq_rowsum", "dk_colsum", "dv_colsum")}


@dataclass(frozen=True)
class AttentionFault:
    """One corrupted fp32 value of one stage: its bits XOR ``xor``, then ``add`` added
    (the contract of the kernels' injection build: ``as_tuple()``)."""

    stage: str
    index: int
    xor: int = 0
    add: float = 0.0

    def __post_init__(self) -> None:
        if self.stage not in STAGES:
            raise InjectSpecError(f"attention fault stage {self.stage!r} is unknown (known: {', '.join(STAGES)})")
        if not 0 <= self.xor < 1 << 32 or self.index < 0 or not math.isfinite(self.add):
            raise InjectSpecError(f"attention fault {self}: xor must be a 32-bit mask, index ≥ 0, add finite")

    def check(self, shape: AttentionShape) -> AttentionFault:
        n = math.prod(shape.stage_shape(self.stage))
        if self.index >= n:
            raise InjectSpecError(f"attention fault at {self.stage}[{self.index}]: the stage has {n} values")
        return self

    def as_tuple(self) -> tuple[str, int, int, float]:
        return (self.stage, self.index, self.xor, self.add)

    def moved(self, shape: AttentionShape, to: AttentionShape) -> AttentionFault:
        """The same value's fault in a tensor of shape ``to`` (a head dim padded with zeros)."""
        index = 0
        for c, n in zip(self.coords(shape), to.stage_shape(self.stage), strict=True):
            index = index * n + c
        return AttentionFault(self.stage, index, self.xor, self.add)

    def coords(self, shape: AttentionShape) -> tuple[int, ...]:
        out, rest = [], self.index
        for n in reversed(shape.stage_shape(self.stage)):
            rest, r = divmod(rest, n)
            out.append(r)
        return tuple(reversed(out))


def apply_fault(fault: AttentionFault | None, stage: str, shape: AttentionShape, tile: torch.Tensor,
                starts: tuple[int, ...] = ()) -> bool:
    """Corrupt ``tile`` (fp32, in place) where ``fault`` hits it: ``tile`` holds the stage's
    tensor from offset ``starts`` in each dim (none: the whole tensor). True if it hit."""
    if fault is None or fault.stage != stage:
        return False
    at = fault.coords(shape)
    starts = starts or (0,) * len(at)
    local = [c - s for c, s in zip(at, starts, strict=True)]
    if not all(0 <= x < n for x, n in zip(local, tile.shape, strict=True)):
        return False
    cell = tile[tuple(local)].reshape(1)
    bits = cell.view(torch.int32)
    x = fault.xor - (1 << 32) if fault.xor >= 1 << 31 else fault.xor
    cell = (bits ^ x).view(torch.float32) + fault.add
    tile[tuple(local)] = cell[0]
    return True


def _bf16(x: torch.Tensor) -> torch.Tensor:
    """x rounded to bf16 as a kernel rounds a matrix-unit operand, kept in fp32."""
    return x.to(torch.bfloat16).float()


def _expand(t: torch.Tensor, group: int) -> torch.Tensor:
    return t.repeat_interleave(group, dim=1) if group > 1 else t


def _mask(s: torch.Tensor, i0: int, j0: int) -> torch.Tensor:
    """Causal mask of one (query block from i0, key block from j0) tile: True where j > i."""
    bq, bk = s.shape[-2:]
    i = torch.arange(i0, i0 + bq, device=s.device).unsqueeze(1)
    j = torch.arange(j0, j0 + bk, device=s.device).unsqueeze(0)
    return j > i


def flash_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, scale: float,
                  fault: AttentionFault | None = None, block: int = BLOCK) -> AttentionForward:
    """Tiled online-softmax forward (the reference of kernels/attention_fwd): per query block,
    key blocks in order; P rounded to bf16 for P·V, its fp32 value summed into the row sum."""
    shape = AttentionShape.of(q, k, causal)
    q32 = q.float().contiguous()
    if apply_fault(fault, "load_q", shape, q32):
        q32 = _bf16(q32)  # a Q element is bf16 as loaded: the kernels round the corrupted value back
    k32, v32 = _expand(k.float(), shape.group), _expand(v.float(), shape.group)
    b, h, s, d = q32.shape
    o = torch.empty((b, h, s, d), device=q.device, dtype=F32)
    lse = torch.empty((b, h, s), device=q.device, dtype=F32)
    for i0 in range(0, s, block):
        i1 = min(s, i0 + block)
        qi = q32[:, :, i0:i1]
        m = torch.full((b, h, i1 - i0), -math.inf, device=q.device, dtype=F32)
        l_sum = torch.zeros((b, h, i1 - i0), device=q.device, dtype=F32)
        acc = torch.zeros((b, h, i1 - i0, d), device=q.device, dtype=F32)
        for j0 in range(0, i1 if causal else s, block):
            j1 = min(s, j0 + block)
            sc = (qi @ k32[:, :, j0:j1].transpose(-1, -2)) * scale
            apply_fault(fault, "scores", shape, sc, (0, 0, i0, j0))
            if causal:
                sc = sc.masked_fill(_mask(sc, i0, j0), -math.inf)
            m_new = torch.maximum(m, sc.amax(-1))
            p = torch.exp(sc - m_new.unsqueeze(-1))
            apply_fault(fault, "softmax", shape, p, (0, 0, i0, j0))
            alpha = torch.exp(m - m_new)
            l_sum = l_sum * alpha + p.sum(-1)
            acc = acc * alpha.unsqueeze(-1) + _bf16(p) @ v32[:, :, j0:j1]
            m = m_new
        oi = acc / l_sum.unsqueeze(-1)
        apply_fault(fault, "pv", shape, oi, (0, 0, i0, 0))
        li = m + torch.log(l_sum)
        apply_fault(fault, "lse", shape, li, (0, 0, i0))
        o[:, :, i0:i1], lse[:, :, i0:i1] = oi, li
    return AttentionForward(o.to(torch.bfloat16), lse, o.sum(-1), kernel="cpu-flash")


def flash_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor,
                   do: torch.Tensor, *, causal: bool, scale: float, fault: AttentionFault | None = None,
                   block: int = BLOCK) -> AttentionBackward:
    """Tiled backward (the reference of kernels/attention_bwd): per key block, query blocks in
    order; P recomputed from the saved LSE, D_i = dO_i·O_i from the bf16 O, dS = P∘(dP − D);
    P and dS rounded to bf16 for their products, fp32 accumulators."""
    shape = AttentionShape.of(q, k, causal)
    g = shape.group
    q32, do32 = q.float(), do.float()
    k32, v32 = _expand(k.float(), g), _expand(v.float(), g)
    b, h, s, d = q32.shape
    delta = (do32 * o.float()).sum(-1)  # (B, Hq, S)
    dq = torch.zeros((b, h, s, d), device=q.device, dtype=F32)
    dk = torch.empty((b, h, s, d), device=q.device, dtype=F32)
    dv = torch.empty((b, h, s, d), device=q.device, dtype=F32)
    for j0 in range(0, s, block):
        j1 = min(s, j0 + block)
        kj, vj = k32[:, :, j0:j1], v32[:, :, j0:j1]
        dk_acc = torch.zeros((b, h, j1 - j0, d), device=q.device, dtype=F32)
        dv_acc = torch.zeros((b, h, j1 - j0, d), device=q.device, dtype=F32)
        for i0 in range((j0 // block) * block if causal else 0, s, block):
            i1 = min(s, i0 + block)
            sc = (q32[:, :, i0:i1] @ kj.transpose(-1, -2)) * scale
            if causal:
                sc = sc.masked_fill(_mask(sc, i0, j0), -math.inf)
            p = torch.exp(sc - lse[:, :, i0:i1].unsqueeze(-1))
            apply_fault(fault, "recompute_p", shape, p, (0, 0, i0, j0))
            dv_acc += _bf16(p).transpose(-1, -2) @ do32[:, :, i0:i1]
            dp = do32[:, :, i0:i1] @ vj.transpose(-1, -2)
            apply_fault(fault, "dp", shape, dp, (0, 0, i0, j0))
            ds = _bf16(p * (dp - delta[:, :, i0:i1].unsqueeze(-1)))
            dk_acc += ds.transpose(-1, -2) @ q32[:, :, i0:i1]
            dq[:, :, i0:i1] += ds @ kj
        dk[:, :, j0:j1], dv[:, :, j0:j1] = dk_acc * scale, dv_acc
    dq *= scale
    # a KV head's gradients: its query heads' contributions, summed in head order
    dk = dk.reshape(b, shape.kv_heads, g, s, d).sum(2)
    dv = dv.reshape(b, shape.kv_heads, g, s, d).sum(2)
    apply_fault(fault, "dq", shape, dq)
    apply_fault(fault, "dk", shape, dk)
    apply_fault(fault, "dv", shape, dv)
    return AttentionBackward(dq.to(torch.bfloat16), dk.to(torch.bfloat16), dv.to(torch.bfloat16),
                             dq.sum(-1), dk.sum(-2), dv.sum(-2), kernel="cpu-flash")


@dataclass
class AttentionReference:
    """Plain softmax attention in fp64: the reference sides of the invariants whose magnitudes
    need P or dS (docs/attention.md: the expensive ones), and, where asked for, the outputs."""

    o_rowsum: torch.Tensor  # (B, Hq, S): O·1 = P·(V·1)
    lse: torch.Tensor  # (B, Hq, S)
    dq_rowsum: torch.Tensor  # (B, Hq, S): dQ·1 = scale·dS·(K·1)
    o_rowsum_scale: torch.Tensor  # (B, Hq, S): Σ_j P_ij·Σ_d|V_jd|
    dq_rowsum_scale: torch.Tensor  # (B, Hq, S): scale·Σ_j P_ij(A_ij + Ā_i)·Σ_d|K_jd|, A = |dO|·|V|ᵀ
    o_rowsum_sigma: torch.Tensor  # (B, Hq, S): the bf16 rounding of P's spread in O·1 (attention_sums)
    dq_rowsum_sigma: torch.Tensor  # (B, Hq, S): that of dS and D_i in dQ·1
    p_rms: torch.Tensor  # (B, Hq, S): ‖P_i‖₂, the spread of the bf16 rounding of P's row sum (÷ 2⁻⁹)
    ds_rms: torch.Tensor  # (B, Hq, S): ‖dS_i‖₂ + r_i, that of dS's row sum (÷ 2⁻⁹)
    p_min: float  # the smallest P_ij a query may attend to (0.0: some underflows fp64, or Q or K is not finite)
    o: torch.Tensor | None = None  # (B, Hq, S, D): the outputs, with ``reference(outputs=True)``
    dq: torch.Tensor | None = None  # (B, Hq, S, D)
    dk: torch.Tensor | None = None  # (B, Hkv, S, D)
    dv: torch.Tensor | None = None  # (B, Hkv, S, D)

    def rescaled(self, ev: int, edo: int) -> AttentionReference:
        """The reference for V·2^ev and dO·2^edo (exact in fp64): O·2^ev, dV·2^edo, dQ and dK
        by 2^(ev+edo); LSE unchanged."""
        fv, fdo = 2.0**ev, 2.0**edo
        times = lambda t, f: None if t is None else t * f
        return AttentionReference(self.o_rowsum * fv, self.lse, self.dq_rowsum * (fv * fdo), self.o_rowsum_scale * fv,
                                  self.dq_rowsum_scale * (fv * fdo), self.o_rowsum_sigma * fv,
                                  self.dq_rowsum_sigma * (fv * fdo), self.p_rms, self.ds_rms * (fv * fdo), self.p_min,
                                  times(self.o, fv), times(self.dq, fv * fdo), times(self.dk, fv * fdo), times(self.dv, fdo))


ROW_SIDES = ("o_rowsum", "lse", "dq_rowsum", "os", "dqs", "osg", "dqsg", "prms", "dsrms")


def reference(ops: AttentionOperands, scale: float, *, rows: int = 256, outputs: bool = False) -> AttentionReference:
    """Attention forward and backward in fp64, ``rows`` queries at a time over the keys they may
    attend to (memory O(rows·S) per head): P = softmax(scale·QKᵀ) (causal mask), O = P·V,
    dP = dO·Vᵀ, D_i = dO_i·O_i, dS = P∘(dP − D). The invariants need row sums and spreads only, so
    dS is never multiplied by a matrix: dQ·1 = scale·dS·(K·1), O·1 = P·(V·1), and Σ_j P_ij·A_ij·…
    from P·|V| (A = |dO|·|V|ᵀ is never formed). The products of D are QKᵀ, dO·Vᵀ and
    P·[V, |V|, ‖K‖₁∘|V|]. P is kept unnormalised, p = exp(s − max), and each product of P (of P², dS,
    dS²) is divided by the row's Σp (its square) after it: one pass over the scores fewer. ``outputs``
    adds dQ = scale·dS·K, dK = scale·dSᵀ·Q and dV = Pᵀ·dO (the tests compare O, dQ, dK, dV with
    torch's autograd)."""
    shape = ops.shape
    g = shape.group
    q, do = ops.q.double(), ops.do.double()
    k, v = _expand(ops.k.double(), g), _expand(ops.v.double(), g)
    b, h, s, d = q.shape
    v_abs = v.abs()
    kabs = k.abs().sum(-1)
    v1, k1 = v.sum(-1), k.sum(-1)
    one = torch.ones_like(v1)
    # P· these: O, P|V|, P(‖K‖₁∘|V|), then O·1, Σ_j P_ij‖V_j‖₁, Σ_j P_ij K_j·1, Σ_j P_ij‖K_j‖₁
    by_p = torch.cat((v, v_abs, v_abs * kabs.unsqueeze(-1), torch.stack((v1, v_abs.sum(-1), k1, kabs), -1)), -1)
    by_p2 = torch.stack((v1.square(), one), -1)  # P²· these: ‖P_i∘(V·1)‖², ‖P_i‖²
    by_ds2 = torch.stack((k1.square(), one), -1)  # dS²· these
    # the scores are finite unless the inputs are not (bf16 products of D ≤ 256 stay far inside fp64);
    # with a non-finite Q or K no P is known: p_min 0, so no exact power-of-two scaling is assumed
    finite = bool(torch.isfinite(q).all() and torch.isfinite(k).all())
    out = {n: torch.empty((b, h, s), dtype=torch.float64, device=q.device) for n in ROW_SIDES}
    o_full = torch.empty((b, h, s, d), dtype=torch.float64, device=q.device) if outputs else None
    dq = torch.empty_like(o_full) if outputs else None
    dk = torch.zeros((b, h, s, d), dtype=torch.float64, device=q.device) if outputs else None
    dv = torch.zeros_like(dk) if outputs else None
    p_min = torch.ones((), dtype=torch.float64, device=q.device)  # read once at the end: a read per block would stall the queue
    for i0 in range(0, s, rows):
        i1 = min(s, i0 + rows)
        n = i1 if ops.causal else s  # the keys this block's queries may attend to
        qi, doi, keys = q[:, :, i0:i1], do[:, :, i0:i1], slice(0, n)
        p = (qi @ k[:, :, keys].transpose(-1, -2)) * scale  # the scores, then p in place
        masked = _mask(p[..., i0:], i0, i0) if ops.causal else None  # only the block's own keys can be masked
        if masked is not None:
            p[..., i0:].masked_fill_(masked, -math.inf)
        m = p.amax(-1, keepdim=True)
        p.sub_(m).exp_()  # ≤ 1, the row's largest 1
        l = p.sum(-1, keepdim=True)  # noqa: E741  (P = p ÷ l)
        lse = (m + l.log()).squeeze(-1)
        if masked is not None:  # masked entries are 0: read as 1, above any seen p
            seen_min = torch.minimum(p[..., :i0].amin(-1, keepdim=True) if i0 else torch.ones_like(l),
                                     p[..., i0:].masked_fill(masked, 1.0).amin(-1, keepdim=True))
        else:
            seen_min = p.amin(-1, keepdim=True)
        p_min = torch.minimum(p_min, (seen_min / l).min())
        pw = (p @ by_p[:, :, keys]) / l
        o, p_vabs, p_kvabs, rs = pw[..., :d], pw[..., d:2 * d], pw[..., 2 * d:3 * d], pw[..., 3 * d:]
        buf = torch.mul(p, p)
        p2 = (buf @ by_p2[:, :, keys]).sqrt() / l
        dp = doi @ v[:, :, keys].transpose(-1, -2)
        do_o = doi * o
        dd = do_o.sum(-1, keepdim=True)  # D_i = Σ_j P_ij dP_ij
        torch.mul(p, dp, out=buf)
        r = (torch.linalg.vector_norm(buf, dim=-1, keepdim=True) / l).squeeze(-1) + do_o.square().sum(-1).sqrt()
        ds = buf.addcmul_(p, dd, value=-1.0)  # l·dS
        dsk = (ds @ k1[:, :, keys].unsqueeze(-1)).squeeze(-1) / l.squeeze(-1)
        if outputs:
            o_full[:, :, i0:i1] = o
            dq[:, :, i0:i1] = (ds @ k[:, :, keys]) * scale / l
            dk[:, :, keys] += ((ds / l).transpose(-1, -2) @ qi) * scale
            dv[:, :, keys] += (p / l).transpose(-1, -2) @ doi
        ds2 = (torch.mul(ds, ds, out=dp) @ by_ds2[:, :, keys]).sqrt() / l
        del p, buf, dp, ds
        # rounding spreads (docs/attention.md §3): each bf16 rounding of P or dS moves its product by
        # at most 2⁻⁹ of it, independently; D_i's error (from the bf16 O and P) shifts a row's dS together
        blk = {"o_rowsum": rs[..., 0], "lse": lse, "dq_rowsum": scale * dsk, "os": rs[..., 1],
               "dqs": scale * ((doi.abs() * p_kvabs).sum(-1) + (doi.abs() * p_vabs).sum(-1) * rs[..., 3]),
               "osg": 2.0**-8 * (p2[..., 0] + p2[..., 1] * rs[..., 0].abs()),
               "dqsg": scale * 2.0**-8 * (ds2[..., 0] + r * rs[..., 2].abs()), "prms": p2[..., 1], "dsrms": ds2[..., 1] + r}
        for name, t in blk.items():
            out[name][:, :, i0:i1] = t
    fold = lambda t: None if t is None else t.reshape(b, shape.kv_heads, g, s, d).sum(2)
    return AttentionReference(out["o_rowsum"], out["lse"], out["dq_rowsum"], out["os"], out["dqs"], out["osg"],
                              out["dqsg"], out["prms"], out["dsrms"], float(p_min) if finite else 0.0, o_full, dq, fold(dk),
                              fold(dv))
