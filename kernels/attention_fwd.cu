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
    bf16* sK = sQ + BM * P;      // [2][BN][P]
    bf16* sV = sK + 2 * BN * P;  // [2][BN][P]

    const int bh = blockIdx.y, h = bh % Hq, b = bh / Hq;
    const int kvh = h / (Hq / Hkv);
    const int m_block = gridDim.x - 1 - blockIdx.x;  // heavy (causal) blocks first
    const int m0 = m_block * BM;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const bf16* qg = q + (long long)bh * S * D;
    const bf16* kg = k + ((long long)b * Hkv + kvh) * S * D;
    const bf16* vg = v + ((long long)b * Hkv + kvh) * S * D;

    const int n_end = causal ? (min(S, m0 + BM) + BN - 1) / BN : (S + BN - 1) / BN;

    attn_load_rows<BM, D, NT>(sQ, qg, m0, S);
    attn_load_rows<BN, D, NT>(sK, kg, 0, S);
    attn_load_rows<BN, D, NT>(sV, vg, 0, S);
    attn_commit();

    // a warp's rows: m-tile m holds rows row0 + 16m + g (r = 2m) and + 8 (r = 2m + 1)
    float acc[MT * ND][4];
#pragma unroll
    for (int i = 0; i < MT * ND; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
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
        if (j + 1 < n_end) {
            attn_load_rows<BN, D, NT>(sK + (st ^ 1) * BN * P, kg, n0 + BN, S);
            attn_load_rows<BN, D, NT>(sV + (st ^ 1) * BN * P, vg, n0 + BN, S);
            attn_commit();
            attn_wait<1>();
        } else {
            attn_wait<0>();
        }
        __syncthreads();
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
        const bf16* kt = sK + st * BN * P;
        const bf16* vt = sV + st * BN * P;
        float s[MT * NB][4];
#pragma unroll
        for (int i = 0; i < MT * NB; ++i) s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.f;
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
#pragma unroll
        for (int m = 0; m < MT; ++m) {
#pragma unroll
            for (int nt = 0; nt < NB; ++nt) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int r = 2 * m + (e >> 1);
                    float p = exp2f(s[m * NB + nt][e] - mb[r]);
                    ATTN_INJECT(fault, AF_SOFTMAX, ATTN_FLAT_SS(bh, qi[r], n0 + nt * 8 + 2 * t + (e & 1), S), p);
                    s[m * NB + nt][e] = p;
                    psum[r] += p;
                }
            }
        }
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
    (void)rs;
#pragma unroll
    for (int r = 0; r < R; ++r) {
        inv[r] = 1.f / lrow[r];
        rs[r] = 0.f;
    }
#pragma unroll
    for (int i = 0; i < MT * ND; ++i) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int r = 2 * (i / ND) + (e >> 1), col = (i % ND) * 8 + 2 * t + (e & 1);
            (void)col;
            float x = acc[i][e] * inv[r];
            ATTN_INJECT(fault, AF_PV, qi[r] < S ? ((long long)bh * S + qi[r]) * D + col : -1LL, x);
            acc[i][e] = x;
#ifndef AEGIS_NOSUMS
            rs[r] += x;
#endif
        }
    }
#pragma unroll
    for (int r = 0; r < R; ++r) {
        const int row = qi[r], m = r >> 1, hf = r & 1;
#ifndef AEGIS_NOSUMS
        rs[r] += __shfl_xor_sync(0xffffffffu, rs[r], 1);
        rs[r] += __shfl_xor_sync(0xffffffffu, rs[r], 2);
#endif
        if (row < S) {
            bf16* orow = o + ((long long)bh * S + row) * D;
#pragma unroll
            for (int i = 0; i < ND; ++i)
                *reinterpret_cast<uint32_t*>(orow + i * 8 + 2 * t) =
                    attn_pack(acc[m * ND + i][2 * hf], acc[m * ND + i][2 * hf + 1]);
            if (t == 0) {
                float l = (mrow[r] + log2f(lrow[r])) * ATTN_LN2;
                ATTN_INJECT(fault, AF_LSE, (long long)bh * S + row, l);
                lse[(long long)bh * S + row] = l;
#ifndef AEGIS_NOSUMS
                o_rowsum[(long long)bh * S + row] = rs[r];
#endif
            }
        }
    }
}

#define ATTN_FWD_ENTRY(DIM)                                                                                        \
    extern "C" __global__ void __launch_bounds__(ATTN_FWD_WARPS * 32, 8 / ATTN_FWD_WARPS)                        \
        attn_fwd_d##DIM(const bf16* q, const bf16* k, const bf16* v, bf16* o, float* lse, float* o_rowsum, int Hq, \
                        int Hkv, int S, float scale, int causal, AttnFault fault) {                               \
        attn_fwd_body<DIM, ATTN_FWD_WARPS, ATTN_FWD_MT>(q, k, v, o, lse, o_rowsum, Hq, Hkv, S, scale, causal, fault);          \
    }
ATTN_FWD_ENTRY(64)
ATTN_FWD_ENTRY(128)
