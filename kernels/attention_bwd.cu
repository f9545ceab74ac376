// attention_bwd.cu — checked flash-attention backward, mma.sync (sm_80+); contract in attention.cuh.
//
// Three launches, none with atomics, so repeats are bit-identical:
//   attn_bwd_pre     delta[i] = Σ_d dO[i, d]·O[i, d] (one warp per row, fixed shuffle order).
//   attn_bwd_dq      per block of BM = 16·NW query rows: P = exp(scale·q·k − lse) recomputed from
//                    the forward's lse, dP = dO·Vᵀ, dS = P∘(dP − delta), dQ = scale·Σ_keys dS·K in
//                    key order; dQ and its invariant dq_rowsum (Σ_d of the fp32 accumulator).
//   attn_bwd_dkdv    per block of BN = 16·NW keys of one KV head, looping over the query heads
//                    of its group in order and their query blocks in order: Pᵀ, dPᵀ = V·dOᵀ,
//                    dV += Pᵀ·dO, dK += scale·dSᵀ·Q; then the column partials of both fp32
//                    accumulators over the block's keys (the host reduces blocks in order).
// dQ has its own pass (recomputing QKᵀ and dO·Vᵀ: 7 matrix products instead of 5) because the
// one-pass schedule adds every key block's dQ share into shared rows, which needs float atomics
// or a serialising semaphore; this is the plain deterministic schedule.
#include "attention.cuh"

#ifndef ATTN_BWD_WARPS
#define ATTN_BWD_WARPS 4
#endif
#ifndef ATTN_BWD_BQ  // query rows per step of the dK/dV kernel: 64 at D = 128 spills (two 128-column accumulators)
#define ATTN_BWD_BQ(D) ((D) == 128 ? 32 : 64)
#endif
#ifndef ATTN_DKDV_HEAVY_FIRST
#define ATTN_DKDV_HEAVY_FIRST 1
#endif
#ifndef ATTN_DQ_BN
#define ATTN_DQ_BN 32   // keys per step of the dQ kernel
#endif
#ifndef ATTN_DQ_MT
#define ATTN_DQ_MT 2    // m-tiles (16 query rows each) per warp of the dQ kernel
#endif

extern "C" __global__ void attn_bwd_pre(const bf16* __restrict__ o, const bf16* __restrict__ dout, float* __restrict__ delta,
                                        long long rows, int D) {
    const long long row = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (row >= rows) return;
    float s = 0.f;
    for (int d = lane; d < D; d += 32) s += __bfloat162float(o[row * D + d]) * __bfloat162float(dout[row * D + d]);
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
    if (lane == 0) delta[row] = s;
}

// out[bh, d] = Σ_blk part[bh, blk, d], blocks in order: the dK / dV column sums over all keys.
extern "C" __global__ void attn_colsum_reduce(const float* __restrict__ part, float* __restrict__ out, int nblk, int D,
                                              long long n) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const long long bh = i / D, d = i % D;
    float s = 0.f;
    for (int blk = 0; blk < nblk; ++blk) s += part[(bh * nblk + blk) * D + d];
    out[i] = s;
}

template <int D, int NW, int MT>
__device__ __forceinline__ void attn_dq_body(const bf16* __restrict__ q, const bf16* __restrict__ k, const bf16* __restrict__ v,
                                             const bf16* __restrict__ dout, const float* __restrict__ lse,
                                             const float* __restrict__ delta, bf16* __restrict__ dq, float* __restrict__ dq_rowsum,
                                             int Hq, int Hkv, int S, float scale, int causal, const AttnFault& fault) {
    constexpr int BM = 16 * NW * MT, BN = ATTN_DQ_BN, NT = NW * 32, P = D + 8, NB = BN / 8, ND = D / 8, R = 2 * MT;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    bf16* sQ = reinterpret_cast<bf16*>(smem_raw);
    bf16* sO = sQ + BM * P;      // dO rows

    const AttnQueryBlock<D, BM, BN, NT> blk(sO + BM * P, k, v, Hq, Hkv, S, causal);  // the K/V ring after the dO rows
    const int bh = blk.bh, m0 = blk.m0, n_end = blk.n_end;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;

    blk.load_rows(sQ, q);
    blk.load_rows(sO, dout);
    blk.load_kv(0, 0);
    attn_commit();

    const int row0 = warp * 16 * MT;
    int qi[R];
    float l2[R], dl[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
        qi[r] = m0 + row0 + 16 * (r >> 1) + g + 8 * (r & 1);
        const bool ok = qi[r] < S;
        l2[r] = ok ? lse[(long long)bh * S + qi[r]] * ATTN_LOG2E : 0.f;
        dl[r] = ok ? delta[(long long)bh * S + qi[r]] : 0.f;
    }
    const float sl2 = scale * ATTN_LOG2E;
    float acc[MT * ND][4];
    attn_zero<MT * ND>(acc);

    for (int j = 0; j < n_end; ++j) {
        const int st = j & 1, n0 = j * BN;
        if (j + 1 < n_end) blk.load_kv(st ^ 1, n0 + BN);
        attn_ring_wait(j + 1 < n_end);
        const bf16* kt = blk.k_at(st);
        const bf16* vt = blk.v_at(st);
        float p[MT * NB][4], dp[MT * NB][4];
        attn_zero<MT * NB>(p);
        attn_zero<MT * NB>(dp);
        attn_mm_abt<D, D / 16, NB, MT>(p, sQ, row0, kt, 0);
        attn_mm_abt<D, D / 16, NB, MT>(dp, sO, row0, vt, 0);
        const bool edge = n0 + BN > S || (causal && n0 + BN - 1 > m0 + row0);
#pragma unroll
        for (int m = 0; m < MT; ++m) {
#pragma unroll
            for (int nt = 0; nt < NB; ++nt) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int col = n0 + nt * 8 + 2 * t + (e & 1), r = 2 * m + (e >> 1);
                    float x = exp2f(p[m * NB + nt][e] * sl2 - l2[r]);
                    if (edge && (col >= S || (causal && col > qi[r]))) x = 0.f;
                    float y = dp[m * NB + nt][e];
                    ATTN_INJECT(fault, AF_RECOMPUTE_P, ATTN_FLAT_SS(bh, qi[r], col, S), x);
                    ATTN_INJECT(fault, AF_DP, ATTN_FLAT_SS(bh, qi[r], col, S), y);
                    p[m * NB + nt][e] = x * (y - dl[r]);  // dS
                }
            }
        }
        attn_mm_pb<D, BN / 16, MT>(acc, p, kt, 0);
        __syncthreads();
    }

    float mul[R], rs[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
        mul[r] = scale;
        rs[r] = 0.f;
    }
    attn_rows_out<D, MT>(acc, mul, rs, qi, t, bh, S, AF_DQ, fault, dq, [&](int r) {
#ifndef AEGIS_NOSUMS
        if (t == 0) dq_rowsum[(long long)bh * S + qi[r]] = rs[r];
#else
        (void)r;
#endif
    });
}

// 4-byte cp.async with zero fill (lse/delta rows past S)
__device__ __forceinline__ void attn_cp4(uint32_t dst, const void* src, int src_bytes) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(dst), "l"(src), "r"(src_bytes));
}

// Column sums over the block's keys of one fp32 accumulator (16 keys per warp): in-thread, over the
// 8 row lanes (xor 4, 8, 16), then over the warps in order through red[NW][D].
template <int D, int NW>
__device__ __forceinline__ void attn_colsum(const float (*acc)[4], float* red, float* out) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, t = lane & 3;
#pragma unroll
    for (int i = 0; i < D / 8; ++i) {
#pragma unroll
        for (int c = 0; c < 2; ++c) {
            float s = acc[i][c] + acc[i][c + 2];
            s += __shfl_xor_sync(0xffffffffu, s, 4);
            s += __shfl_xor_sync(0xffffffffu, s, 8);
            s += __shfl_xor_sync(0xffffffffu, s, 16);
            if (lane < 4) red[warp * D + i * 8 + 2 * t + c] = s;
        }
    }
    __syncthreads();
    for (int d = threadIdx.x; d < D; d += NW * 32) {
        float s = 0.f;
        for (int w = 0; w < NW; ++w) s += red[w * D + d];
        out[d] = s;
    }
    __syncthreads();
}

template <int D, int NW>
__device__ __forceinline__ void attn_dkdv_body(const bf16* __restrict__ q, const bf16* __restrict__ k, const bf16* __restrict__ v,
                                               const bf16* __restrict__ dout, const float* __restrict__ lse,
                                               const float* __restrict__ delta, bf16* __restrict__ dk, bf16* __restrict__ dv,
                                               float* __restrict__ dk_part, float* __restrict__ dv_part, int Hq, int Hkv, int S,
                                               float scale, int causal, const AttnFault& fault) {
    constexpr int BN = 16 * NW, BQ = ATTN_BWD_BQ(D), NT = NW * 32, P = D + 8;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    bf16* sK = reinterpret_cast<bf16*>(smem_raw);
    bf16* sV = sK + BN * P;
    bf16* sQ = sV + BN * P;      // [2][BQ][P]
    bf16* sO = sQ + 2 * BQ * P;  // [2][BQ][P] dO rows
    float* sL = reinterpret_cast<float*>(sO + 2 * BQ * P);  // [2][BQ] lse (log2 units after load)
    float* sD = sL + 2 * BQ;                                 // [2][BQ] delta

#if ATTN_DKDV_HEAVY_FIRST  // grid (B·Hkv, key blocks): every head's heavy (causal) key blocks start first
    const int bhk = blockIdx.x, kb = blockIdx.y, nkb = gridDim.y;
#else  // grid (key blocks, B·Hkv): heavy first within each head only
    const int bhk = blockIdx.y, kb = blockIdx.x, nkb = gridDim.x;
#endif
    (void)nkb;
    const int kvh = bhk % Hkv, b = bhk / Hkv, G = Hq / Hkv;
    const int n0 = kb * BN;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const long long kvoff = ((long long)b * Hkv + kvh) * S * D;
    const int row0 = warp * 16;
    const int kj[2] = {n0 + row0 + g, n0 + row0 + g + 8};
    const int nq = (S + BQ - 1) / BQ, i0 = causal ? n0 / BQ : 0;
    const int per_head = nq - i0, iters = G * per_head;
    const float sl2 = scale * ATTN_LOG2E;

    auto load_step = [&](int it, int st) {
        const int hq = kvh * G + it / per_head, q0 = (i0 + it % per_head) * BQ;
        const long long bhq = (long long)b * Hq + hq;
        attn_load_rows<BQ, D, NT>(sQ + st * BQ * P, q + bhq * S * D, q0, S);
        attn_load_rows<BQ, D, NT>(sO + st * BQ * P, dout + bhq * S * D, q0, S);
        for (int r = threadIdx.x; r < 2 * BQ; r += NT) {
            const int rr = r % BQ;
            const bool ok = q0 + rr < S;
            const float* src = (r < BQ ? lse : delta) + bhq * S + (ok ? q0 + rr : 0);
            attn_cp4(smem_u32((r < BQ ? sL : sD) + st * BQ + rr), src, ok ? 4 : 0);
        }
    };

    attn_load_kv<BN, D, NT>(sK, sV, k + kvoff, v + kvoff, n0, S);
    if (iters > 0) load_step(0, 0);
    attn_commit();

    float dka[D / 8][4], dva[D / 8][4];
    attn_zero<D / 8>(dka);
    attn_zero<D / 8>(dva);

    for (int it = 0; it < iters; ++it) {
        const int st = it & 1;
        const int hq = kvh * G + it / per_head, q0 = (i0 + it % per_head) * BQ;
        const long long bhq = (long long)b * Hq + hq;
        (void)bhq;
        if (it + 1 < iters) load_step(it + 1, st ^ 1);
        attn_ring_wait(it + 1 < iters);
        const bf16* qt = sQ + st * BQ * P;
        const bf16* ot = sO + st * BQ * P;
        const float* lt = sL + st * BQ;
        const float* dt = sD + st * BQ;
        float p[BQ / 8][4];
        attn_zero<BQ / 8>(p);
        attn_mm_abt<D, D / 16, BQ / 8>(p, sK, row0, qt, 0);  // Sᵀ: keys x queries
        const bool edge = q0 + BQ > S || n0 + BN > S || (causal && n0 + row0 + 15 > q0);
#pragma unroll
        for (int nt = 0; nt < BQ / 8; ++nt) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int qc = nt * 8 + 2 * t + (e & 1), key = kj[e >> 1], qq = q0 + qc;
                float x = exp2f(p[nt][e] * sl2 - lt[qc] * ATTN_LOG2E);
                if (edge && (qq >= S || key >= S || (causal && key > qq))) x = 0.f;
                ATTN_INJECT(fault, AF_RECOMPUTE_P, ATTN_FLAT_SS(bhq, qq, key, S), x);
                p[nt][e] = x;
            }
        }
        attn_mm_pb<D, BQ / 16>(dva, p, ot, 0);  // dV += Pᵀ·dO
        {
            float dp[BQ / 8][4];
            attn_zero<BQ / 8>(dp);
            attn_mm_abt<D, D / 16, BQ / 8>(dp, sV, row0, ot, 0);  // dPᵀ = V·dOᵀ
#pragma unroll
            for (int nt = 0; nt < BQ / 8; ++nt) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int qc = nt * 8 + 2 * t + (e & 1);
                    float y = dp[nt][e];
                    ATTN_INJECT(fault, AF_DP, ATTN_FLAT_SS(bhq, q0 + qc, kj[e >> 1], S), y);
                    p[nt][e] = p[nt][e] * (y - dt[qc]);  // dSᵀ
                }
            }
        }
        attn_mm_pb<D, BQ / 16>(dka, p, qt, 0);  // dK += dSᵀ·Q (scale at the end)
        __syncthreads();
    }

    const long long ob = ((long long)b * Hkv + kvh) * S;
#pragma unroll
    for (int i = 0; i < D / 8; ++i) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const long long flat = kj[e >> 1] < S ? (ob + kj[e >> 1]) * D + i * 8 + 2 * t + (e & 1) : -1LL;
            float x = dka[i][e] * scale, y = dva[i][e];
            (void)flat;
            ATTN_INJECT(fault, AF_DK, flat, x);
            ATTN_INJECT(fault, AF_DV, flat, y);
            dka[i][e] = x;
            dva[i][e] = y;
        }
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        if (kj[r] < S) {
            bf16* krow = dk + (ob + kj[r]) * D;
            bf16* vrow = dv + (ob + kj[r]) * D;
#pragma unroll
            for (int i = 0; i < D / 8; ++i) {
                *reinterpret_cast<uint32_t*>(krow + i * 8 + 2 * t) = attn_pack(dka[i][2 * r], dka[i][2 * r + 1]);
                *reinterpret_cast<uint32_t*>(vrow + i * 8 + 2 * t) = attn_pack(dva[i][2 * r], dva[i][2 * r + 1]);
            }
        }
    }
#ifndef AEGIS_NOSUMS
    // rows past S hold zeros unless a fault hit them (then it must show): sum every row
    float* red = reinterpret_cast<float*>(sQ);  // the Q stages are free after the last barrier
    const long long slot = ((long long)bhk * nkb + kb) * D;
    attn_colsum<D, NW>(dka, red, dk_part + slot);
    attn_colsum<D, NW>(dva, red, dv_part + slot);
#else
    (void)dk_part;
    (void)dv_part;
#endif
}

#define ATTN_BWD_ENTRIES(DIM)                                                                                        \
    extern "C" __global__ void __launch_bounds__(ATTN_BWD_WARPS * 32, 8 / ATTN_BWD_WARPS) attn_bwd_dq_d##DIM(       \
        const bf16* q, const bf16* k, const bf16* v, const bf16* dout, const float* lse, const float* delta, bf16* dq,  \
        float* dq_rowsum, int Hq, int Hkv, int S, float scale, int causal, AttnFault fault) {                         \
        attn_dq_body<DIM, ATTN_BWD_WARPS, ATTN_DQ_MT>(q, k, v, dout, lse, delta, dq, dq_rowsum, Hq, Hkv, S, scale, causal, fault); \
    }                                                                                                                \
    extern "C" __global__ void __launch_bounds__(ATTN_BWD_WARPS * 32, 8 / ATTN_BWD_WARPS) attn_bwd_dkdv_d##DIM(     \
        const bf16* q, const bf16* k, const bf16* v, const bf16* dout, const float* lse, const float* delta, bf16* dk,  \
        bf16* dv, float* dk_part, float* dv_part, int Hq, int Hkv, int S, float scale, int causal, AttnFault fault) {  \
        attn_dkdv_body<DIM, ATTN_BWD_WARPS>(q, k, v, dout, lse, delta, dk, dv, dk_part, dv_part, Hq, Hkv, S, scale,    \
                                            causal, fault);                                                          \
    }
ATTN_BWD_ENTRIES(64)
ATTN_BWD_ENTRIES(128)
