// attention_fwd.cu — checked flash-attention forward, mma.sync (sm_80+); contract in attention.cuh.
//
// One CTA: BM = 16·NW query rows of one (batch, query head); each warp owns 16 rows and keeps its
// O accumulator (16 x D fp32) and online-softmax state (row max in log2 units, row sum) in
// registers. K/V blocks of BN = 64 keys stream through a two-stage cp.async ring. Causal CTAs stop
// at the diagonal and only the blocks that cross it are masked; the heaviest query blocks start
// first. Epilogue: O / l, lse = ln Σ exp, and the invariant o_rowsum[i] = Σ_d O[i, d] taken from
// the fp32 values before bf16 rounding (quad shuffles in a fixed order).
#include "attention.cuh"

#ifndef ATTN_FWD_WARPS
#define ATTN_FWD_WARPS 4
#endif
#ifndef ATTN_FWD_MT  // m-tiles (16 rows each) per warp: each K/V fragment read from shared memory feeds MT of them
#define ATTN_FWD_MT 2
#endif
#define FWD_BN 64

template <int D, int NW, int MT>
__device__ __forceinline__ void attn_fwd_body(const bf16* __restrict__ q, const bf16* __restrict__ k,
                                              const bf16* __restrict__ v, bf16* __restrict__ o, float* __restrict__ lse,
                                              float* __restrict__ o_rowsum, int Hq, int Hkv, int S, float scale,
                                              int causal, const AttnFault& fault) {
    constexpr int BM = 16 * NW * MT, BN = FWD_BN, NT = NW * 32, P = D + 8, NB = BN / 8, ND = D / 8, R = 2 * MT;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    bf16* sQ = reinterpret_cast<bf16*>(smem_raw);

    const AttnQueryBlock<D, BM, BN, NT> blk(sQ + BM * P, k, v, Hq, Hkv, S, causal);  // the K/V ring after the Q rows
    const int bh = blk.bh, m0 = blk.m0, n_end = blk.n_end;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;

    blk.load_rows(sQ, q);
    blk.load_kv(0, 0);
    attn_commit();

    // a warp's rows: m-tile m holds rows row0 + 16m + g (r = 2m) and + 8 (r = 2m + 1)
    float acc[MT * ND][4];
    attn_zero<MT * ND>(acc);
    float mrow[R], lrow[R];
    int qi[R];
    const int row0 = warp * 16 * MT;
#pragma unroll
    for (int r = 0; r < R; ++r) {
        mrow[r] = ATTN_NEG_INF;
        lrow[r] = 0.f;
        qi[r] = m0 + row0 + 16 * (r >> 1) + g + 8 * (r & 1);
    }
    const float sl2 = scale * ATTN_LOG2E;
    (void)sl2;

    for (int j = 0; j < n_end; ++j) {
        const int st = j & 1, n0 = j * BN;
        if (j + 1 < n_end) blk.load_kv(st ^ 1, n0 + BN);
        attn_ring_wait(j + 1 < n_end);
#ifdef AEGIS_INJECT
        if (j == 0 && fault.stage == AF_LOAD_Q && threadIdx.x == 0) {  // the Q element as loaded
            const long long base = ((long long)bh * S + m0) * D;
            const long long off = fault.index - base;
            if (off >= 0 && off < (long long)min(BM, S - m0) * D) {
                bf16* e = sQ + (off / D) * P + off % D;
                *e = __float2bfloat16_rn(attn_fault_value(__bfloat162float(*e), fault));
            }
        }
        if (j == 0) __syncthreads();
#endif
        const bf16* kt = blk.k_at(st);
        const bf16* vt = blk.v_at(st);
        float s[MT * NB][4];
        attn_zero<MT * NB>(s);
        attn_mm_abt<D, D / 16, NB, MT>(s, sQ, row0, kt, 0);

        const bool edge = n0 + BN > S || (causal && n0 + BN - 1 > m0 + row0);
        float mnew[R];
#pragma unroll
        for (int r = 0; r < R; ++r) mnew[r] = mrow[r];
#pragma unroll
        for (int m = 0; m < MT; ++m) {
#pragma unroll
            for (int nt = 0; nt < NB; ++nt) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int r = 2 * m + (e >> 1);
                    const int col = n0 + nt * 8 + 2 * t + (e & 1), row = qi[r];
                    float x;
#ifdef AEGIS_INJECT
                    x = s[m * NB + nt][e] * scale;
                    ATTN_INJECT(fault, AF_SCORES, ATTN_FLAT_SS(bh, row, col, S), x);
                    x *= ATTN_LOG2E;
#else
                    x = s[m * NB + nt][e] * sl2;
#endif
                    if (edge && (col >= S || (causal && col > row))) x = ATTN_NEG_INF;
                    s[m * NB + nt][e] = x;
                    mnew[r] = fmaxf(mnew[r], x);
                }
            }
        }
        float alpha[R], mb[R], psum[R];
#pragma unroll
        for (int r = 0; r < R; ++r) {
            psum[r] = 0.f;
            mnew[r] = fmaxf(mnew[r], __shfl_xor_sync(0xffffffffu, mnew[r], 1));
            mnew[r] = fmaxf(mnew[r], __shfl_xor_sync(0xffffffffu, mnew[r], 2));
            mb[r] = mnew[r] == ATTN_NEG_INF ? 0.f : mnew[r];
            alpha[r] = exp2f(mrow[r] - mb[r]);
            mrow[r] = mnew[r];
        }
        attn_each_score<MT, NB>([&](int m, int nt, int e) {
            const int r = 2 * m + (e >> 1);
            float p = exp2f(s[m * NB + nt][e] - mb[r]);
            ATTN_INJECT(fault, AF_SOFTMAX, ATTN_FLAT_SS(bh, qi[r], n0 + nt * 8 + 2 * t + (e & 1), S), p);
            s[m * NB + nt][e] = p;
            psum[r] += p;
        });
#pragma unroll
        for (int r = 0; r < R; ++r) lrow[r] = lrow[r] * alpha[r] + psum[r];
#pragma unroll
        for (int i = 0; i < MT * ND; ++i) {
            const int r = 2 * (i / ND);
            acc[i][0] *= alpha[r];
            acc[i][1] *= alpha[r];
            acc[i][2] *= alpha[r + 1];
            acc[i][3] *= alpha[r + 1];
        }
        attn_mm_pb<D, BN / 16, MT>(acc, s, vt, 0);
        __syncthreads();  // the next iteration's loads overwrite this stage
    }

    // epilogue: the row sums of l are per thread partials over its columns; finish over the quad
#pragma unroll
    for (int r = 0; r < R; ++r) {
        lrow[r] += __shfl_xor_sync(0xffffffffu, lrow[r], 1);
        lrow[r] += __shfl_xor_sync(0xffffffffu, lrow[r], 2);
    }
    float inv[R], rs[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
        inv[r] = 1.f / lrow[r];
        rs[r] = 0.f;
    }
    attn_rows_out<D, MT>(acc, inv, rs, qi, t, bh, S, AF_PV, fault, o, [&](int r) {
        if (t == 0) {
            const int row = qi[r];
            float l = (mrow[r] + log2f(lrow[r])) * ATTN_LN2;
            ATTN_INJECT(fault, AF_LSE, (long long)bh * S + row, l);
            lse[(long long)bh * S + row] = l;
#ifndef AEGIS_NOSUMS
            o_rowsum[(long long)bh * S + row] = rs[r];
#endif
        }
    });
}

#define ATTN_FWD_ENTRY(DIM)                                                                                        \
    extern "C" __global__ void __launch_bounds__(ATTN_FWD_WARPS * 32, 8 / ATTN_FWD_WARPS)                        \
        attn_fwd_d##DIM(const bf16* q, const bf16* k, const bf16* v, bf16* o, float* lse, float* o_rowsum, int Hq, \
                        int Hkv, int S, float scale, int causal, AttnFault fault) {                               \
        attn_fwd_body<DIM, ATTN_FWD_WARPS, ATTN_FWD_MT>(q, k, v, o, lse, o_rowsum, Hq, Hkv, S, scale, causal, fault);          \
    }
ATTN_FWD_ENTRY(64)
ATTN_FWD_ENTRY(128)
