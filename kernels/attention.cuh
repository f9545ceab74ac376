// attention.cuh — shared pieces of the checked flash-attention kernels (attention_fwd.cu,
// attention_bwd.cu), mma.sync path (sm_80+).
//
// Contract (aegis_cli/backends/cuda_attention.py launches these; ops/attention.py is the reference):
//   Q (B,Hq,S,D), K and V (B,Hkv,S,D) bf16 contiguous, query head h reads KV head h / (Hq/Hkv),
//   D in {64, 128}, any S >= 1 (ragged tiles are zero-filled and masked).
//   forward:  O bf16, lse fp32 (natural log of the row's sum of exp(scale·q·k) over allowed keys),
//             o_rowsum fp32 = Σ_d of the normalised fp32 O accumulator before rounding.
//   backward: dQ bf16 and dq_rowsum (Σ_d of the fp32 dQ accumulator); dK, dV bf16 summed over the
//             query heads of a KV group in head order, and per key block the column partials of
//             the fp32 dK / dV accumulators (Σ over the block's keys), reduced over blocks in order
//             by the host. No atomics anywhere: repeats are bit-identical.
// Layout of a warp's tile: mma.sync m16n8k16 with 16 rows per warp; operands go through shared
// memory rows padded by 16 bytes (PITCH = D + 8) so ldmatrix rows land in distinct banks.
// -DAEGIS_INJECT compiles the one-element fault of AttnFault into every stage; -DAEGIS_NOSUMS
// drops the fused invariant sums (benchmarks: their cost).
#pragma once
#include "common.cuh"

#define ATTN_LOG2E 1.4426950408889634f
#define ATTN_LN2 0.6931471805599453f
#define ATTN_NEG_INF (-__int_as_float(0x7f800000))  // NVRTC has no math.h INFINITY

// Fault stages (aegis_cli/faults/kernel_params.py ATTN_STAGES mirrors these codes).
enum {
    AF_NONE = 0, AF_LOAD_Q = 1, AF_SCORES = 2, AF_SOFTMAX = 3, AF_PV = 4, AF_LSE = 5,
    AF_DV = 6, AF_DK = 7, AF_DQ = 8, AF_DP = 9, AF_RECOMPUTE_P = 10
};

// One fault: the fp32 value at flat index `index` of stage `stage`'s tensor gets its bits XORed
// with xor_bits, then `add` added. Passed by value to every kernel; only the injection build reads it.
struct AttnFault {
    int stage;
    int pad;
    long long index;
    unsigned xor_bits;
    float add;
};

__device__ __forceinline__ float attn_fault_value(float v, const AttnFault& f) {
    return __uint_as_float(__float_as_uint(v) ^ f.xor_bits) + f.add;
}

#ifdef AEGIS_INJECT
#define ATTN_INJECT(f, st, flat, v) \
    do { if ((f).stage == (st) && (f).index == (long long)(flat)) (v) = attn_fault_value((v), (f)); } while (0)
#else
#define ATTN_INJECT(f, st, flat, v) do { } while (0)
#endif
// Flat index of (row i, col j) of an (S x S) slice, -1 (no element) for padding rows or columns:
// a padding position's flat index would alias a real element of the next row or head.
#define ATTN_FLAT_SS(bh, i, j, S) (((i) < (S) && (j) < (S)) ? ((long long)(bh) * (S) + (i)) * (S) + (j) : -1LL)

// ---- PTX wrappers ----------------------------------------------------------------
// cp.async of 16 bytes; src_bytes 0 zero-fills the chunk (rows past S).
__device__ __forceinline__ void attn_cp16(uint32_t dst, const void* src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(src_bytes));
}
__device__ __forceinline__ void attn_commit() { asm volatile("cp.async.commit_group;"); }
template <int N>
__device__ __forceinline__ void attn_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N)); }

__device__ __forceinline__ void attn_ldsm4(uint32_t addr, uint32_t* r) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
__device__ __forceinline__ void attn_ldsm4_t(uint32_t addr, uint32_t* r) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
// d += a·b, m16n8k16, bf16 in, fp32 accumulate
__device__ __forceinline__ void attn_mma(float* d, const uint32_t* a, uint32_t b0, uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                 "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ uint32_t attn_pack(float lo, float hi) {
    __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&h);
}

// acc[m·STRIDE + j] += a[m]·(n8 tile b[0..1]) and acc[m·STRIDE + j + 1] += a[m]·(n8 tile b[2..3]),
// for each of MT m-tiles: one B fragment read from shared memory feeds them all.
template <int MT, int STRIDE>
__device__ __forceinline__ void attn_mma2(float (*acc)[4], int j, const uint32_t (*a)[4], const uint32_t* b) {
#pragma unroll
    for (int m = 0; m < MT; ++m) {
        attn_mma(acc[m * STRIDE + j], a[m], b[0], b[1]);
        attn_mma(acc[m * STRIDE + j + 1], a[m], b[2], b[3]);
    }
}

template <int N>
__device__ __forceinline__ void attn_zero(float (*x)[4]) {
#pragma unroll
    for (int i = 0; i < N; ++i) x[i][0] = x[i][1] = x[i][2] = x[i][3] = 0.f;
}

// ---- tiles --------------------------------------------------------------------------
// ROWS rows of D bf16 from g (row stride D) starting at row r0 into s (pitch D+8); rows >= S zero.
template <int ROWS, int D, int NT>
__device__ __forceinline__ void attn_load_rows(bf16* s, const bf16* g, int r0, int S) {
    constexpr int CPR = D / 8;  // 16-byte chunks per row
#pragma unroll
    for (int c = threadIdx.x; c < ROWS * CPR; c += NT) {
        const int r = c / CPR, k = (c % CPR) * 8;
        const bool ok = r0 + r < S;
        const bf16* src = ok ? g + (long long)(r0 + r) * D + k : g;
        attn_cp16(smem_u32(s + r * (D + 8) + k), src, ok ? 16 : 0);
    }
}

// A fragment (16 rows x 16 cols starting at col k0) of a row-major smem tile, rows row0..row0+15.
template <int D>
__device__ __forceinline__ void attn_frag_a(const bf16* s, int row0, int k0, uint32_t* a) {
    const int lane = threadIdx.x & 31;
    const int r = row0 + (lane & 7) + ((lane >> 3) & 1) * 8, c = k0 + (lane >> 4) * 8;
    attn_ldsm4(smem_u32(s + r * (D + 8) + c), a);
}
// B fragments of two n8 tiles (rows n0..n0+15 of a tile stored [n][k], k0..k0+15): b[0..1] tile 0, b[2..3] tile 1.
template <int D>
__device__ __forceinline__ void attn_frag_b_nk(const bf16* s, int n0, int k0, uint32_t* b) {
    const int lane = threadIdx.x & 31;
    const int r = n0 + (lane & 7) + (lane >> 4) * 8, c = k0 + ((lane >> 3) & 1) * 8;
    attn_ldsm4(smem_u32(s + r * (D + 8) + c), b);
}
// B fragments of two n8 tiles (cols n0..n0+15) from a tile stored [k][n], rows k0..k0+15.
template <int D>
__device__ __forceinline__ void attn_frag_b_kn(const bf16* s, int k0, int n0, uint32_t* b) {
    const int lane = threadIdx.x & 31;
    const int r = k0 + (lane & 7) + ((lane >> 3) & 1) * 8, c = n0 + (lane >> 4) * 8;
    attn_ldsm4_t(smem_u32(s + r * (D + 8) + c), b);
}

// acc (MT m-tiles of 16 x 8·NT, C fragments, tile m·NT + n) += A (16·MT x 16·KT, smem rows row0..,
// row-major) · Bᵀ where B is stored [n][k] (n rows nb0.., k contiguous): S = Q·Kᵀ and dP = dO·Vᵀ.
// Each B fragment read from shared memory feeds MT m-tiles.
template <int D, int KT, int NT, int MT = 1>
__device__ __forceinline__ void attn_mm_abt(float (*acc)[4], const bf16* sa, int row0, const bf16* sb, int nb0) {
#pragma unroll
    for (int kk = 0; kk < KT; ++kk) {
        uint32_t a[MT][4];
#pragma unroll
        for (int m = 0; m < MT; ++m) attn_frag_a<D>(sa, row0 + 16 * m, kk * 16, a[m]);
#pragma unroll
        for (int np = 0; np < NT / 2; ++np) {
            uint32_t b[4];
            attn_frag_b_nk<D>(sb, nb0 + np * 16, kk * 16, b);
            attn_mma2<MT, NT>(acc, 2 * np, a, b);
        }
    }
}

// acc (MT m-tiles of 16 x D, tile m·D/8 + n) += P (16·MT x 16·KT, C fragments in registers, tile
// m·2KT + n, rounded to bf16) · B where B is stored [k][n] (k rows kb0.., D columns):
// O += P·V, dQ += dS·K, dV += Pᵀ·dO, dK += dSᵀ·Q.
template <int D, int KT, int MT = 1>
__device__ __forceinline__ void attn_mm_pb(float (*acc)[4], const float (*p)[4], const bf16* sb, int kb0) {
#pragma unroll
    for (int kk = 0; kk < KT; ++kk) {
        uint32_t a[MT][4];
#pragma unroll
        for (int m = 0; m < MT; ++m) {
            const float (*pm)[4] = p + m * 2 * KT;
            a[m][0] = attn_pack(pm[2 * kk][0], pm[2 * kk][1]);
            a[m][1] = attn_pack(pm[2 * kk][2], pm[2 * kk][3]);
            a[m][2] = attn_pack(pm[2 * kk + 1][0], pm[2 * kk + 1][1]);
            a[m][3] = attn_pack(pm[2 * kk + 1][2], pm[2 * kk + 1][3]);
        }
#pragma unroll
        for (int dn = 0; dn < D / 16; ++dn) {
            uint32_t b[4];
            attn_frag_b_kn<D>(sb, kb0 + kk * 16, dn * 16, b);
            attn_mma2<MT, D / 8>(acc, 2 * dn, a, b);
        }
    }
}

// ---- the loops and epilogues the forward and backward kernels share ------------------------
// K and V rows n0..n0+ROWS-1 of one KV head (kg, vg) into sK, sV.
template <int ROWS, int D, int NT>
__device__ __forceinline__ void attn_load_kv(bf16* sK, bf16* sV, const bf16* kg, const bf16* vg, int n0, int S) {
    attn_load_rows<ROWS, D, NT>(sK, kg, n0, S);
    attn_load_rows<ROWS, D, NT>(sV, vg, n0, S);
}

// The wait of one step of a two-stage cp.async ring, after the next step's loads were issued
// into the other stage when `more`: this step's stage complete and visible to the whole CTA.
__device__ __forceinline__ void attn_ring_wait(bool more) {
    if (more) {
        attn_commit();
        attn_wait<1>();
    } else {
        attn_wait<0>();
    }
    __syncthreads();
}

// f(m, nt, e) for each value of a warp's MT x NB score tiles (C fragments of m16n8): element e of
// n8 tile nt of m-tile m, that is fragment row r = 2m + (e >> 1) (row g or g + 8 of the m-tile),
// column nt·8 + 2t + (e & 1) of the block.
template <int MT, int NB, class F>
__device__ __forceinline__ void attn_each_score(F&& f) {
#pragma unroll
    for (int m = 0; m < MT; ++m) {
#pragma unroll
        for (int nt = 0; nt < NB; ++nt) {
#pragma unroll
            for (int e = 0; e < 4; ++e) f(m, nt, e);
        }
    }
}

// A forward or dQ CTA's query block: BM rows from m0 of (batch, query head) bh = blockIdx.y, the
// heaviest (causal) blocks first; kg and vg the K and V of its KV head, n_end key blocks of BN,
// streamed through a two-stage ring in shared memory from `ring` (K [2][BN][D + 8], then V alike);
// its loads by NT threads (cp.async, rows past S zero-filled).
template <int D, int BM, int BN, int NT>
struct AttnQueryBlock {
    static constexpr int STAGE = BN * (D + 8);
    int bh, m0, n_end, S;
    const bf16* kg;
    const bf16* vg;
    bf16* sK;
    bf16* sV;
    __device__ __forceinline__ AttnQueryBlock(bf16* ring, const bf16* k, const bf16* v, int Hq, int Hkv, int S_, int causal)
        : S(S_), sK(ring), sV(ring + 2 * STAGE) {
        bh = blockIdx.y;
        const int b = bh / Hq, kvh = bh % Hq / (Hq / Hkv);
        m0 = (gridDim.x - 1 - blockIdx.x) * BM;
        kg = k + ((long long)b * Hkv + kvh) * S * D;
        vg = v + ((long long)b * Hkv + kvh) * S * D;
        n_end = causal ? (min(S, m0 + BM) + BN - 1) / BN : (S + BN - 1) / BN;
    }
    // the block's rows of a (B·Hq, S, D) tensor (Q, dO) into s
    __device__ __forceinline__ void load_rows(bf16* s, const bf16* x) const {
        attn_load_rows<BM, D, NT>(s, x + (long long)bh * S * D, m0, S);
    }
    // keys n0..n0+BN-1 of K and V into ring stage `st`
    __device__ __forceinline__ void load_kv(int st, int n0) const {
        attn_load_kv<BN, D, NT>(sK + st * STAGE, sV + st * STAGE, kg, vg, n0, S);
    }
    __device__ __forceinline__ const bf16* k_at(int st) const { return sK + st * STAGE; }
    __device__ __forceinline__ const bf16* v_at(int st) const { return sV + st * STAGE; }
};

// Epilogue of a warp's MT m-tiles of 16 query rows x D (C fragments; query row qi[r] for fragment
// row r; t = lane & 3): each fp32 value times mul[r] (a fault of `stage` at its flat index in the (B·H, S, D)
// output) and added to rs[r] (the caller's zeros: the row's Σ_d, in-thread and then over the quad
// in a fixed order; none with AEGIS_NOSUMS), the rows below S stored to `out` in bf16, then done(r)
// for each of them.
template <int D, int MT, class F>
__device__ __forceinline__ void attn_rows_out(float (*acc)[4], const float* mul, float* rs, const int* qi, int t, int bh,
                                              int S, int stage, const AttnFault& fault, bf16* out, F&& done) {
    constexpr int ND = D / 8, R = 2 * MT;
#pragma unroll
    for (int i = 0; i < MT * ND; ++i) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int r = 2 * (i / ND) + (e >> 1), col = (i % ND) * 8 + 2 * t + (e & 1);
            (void)col;
            float x = acc[i][e] * mul[r];
            ATTN_INJECT(fault, stage, qi[r] < S ? ((long long)bh * S + qi[r]) * D + col : -1LL, x);
            acc[i][e] = x;
#ifndef AEGIS_NOSUMS
            rs[r] += x;
#endif
        }
    }
#pragma unroll
    for (int r = 0; r < R; ++r) {
        const int m = r >> 1, hf = r & 1;
#ifndef AEGIS_NOSUMS
        rs[r] += __shfl_xor_sync(0xffffffffu, rs[r], 1);
        rs[r] += __shfl_xor_sync(0xffffffffu, rs[r], 2);
#endif
        if (qi[r] < S) {
            bf16* row = out + ((long long)bh * S + qi[r]) * D;
#pragma unroll
            for (int i = 0; i < ND; ++i)
                *reinterpret_cast<uint32_t*>(row + i * 8 + 2 * t) = attn_pack(acc[m * ND + i][2 * hf], acc[m * ND + i][2 * hf + 1]);
            done(r);
        }
    }
}
