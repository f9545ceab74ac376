// attention_sides.cu — the sides of the attention invariants that need P or dS (the row sides of
// ops/attention.py `reference`, which computes the same with torch in fp64 and is this kernel's
// reference), without any S x S tensor in global memory. Contract of the operands as in
// attention.cuh; `stats` holds per key (Σ_d V, Σ_d |V|, Σ_d K, Σ_d |K|) in fp32 (B·Hkv, S, 4).
//
// One CTA: 64 queries of one (batch, query head), 16 per warp, two passes over its keys through a
// two-stage ring in shared memory.
// Pass 1 (online softmax): the scores on the tensor cores, each k16 product added in fp64 (the LSE
//   is compared at 1e-6 of its scale, and one fp32 chain over D would take a tenth of that);
//   p = 2^(x − m) in fp32 from an fp64 argument; the row sums of p·(v1, ‖V‖₁, k1, ‖K‖₁), p·dP,
//   p·A, p·A·‖K‖₁ (A = |dO|·|V|ᵀ, the bf16 operands without their sign bits), p² and p²·v1²:
//   each key block's partials in fp32, their running sums in fp64, rescaled by 2^(m_old − m_new)
//   in fp64 (the ratios the outputs take cancel a common factor; the LSE takes m and Σp).
//   O = P·V with P rounded to bf16: only ‖dO∘O‖ reads it, a spread.
// Pass 2 (m, l and D_i = Σ p·dP ÷ l final): dS·l = p·(dP − D_i), dP's k16 products added in fp64
//   as the scores' (where dP barely varies along a row, dS is a small difference of it), and the
//   row sums of dS·k1, (dS·k1)², dS² and (p·dP)².
// Output: out[k·B·Hq·S + bh·S + i] in fp64, k over ops/attention.py ROW_SIDES, then the row's
// smallest P (p_min). Fixed reduction order (in-thread, then the quad by xor 1, 2): repeats are
// bit-identical.
#include "attention.cuh"

#define SIDES_WARPS 4
#ifndef SIDES_BN  // keys per stage; 64 spills
#define SIDES_BN 32
#endif
#ifndef SIDES_KK_UNROLL  // k16 steps unrolled: the full unroll hoists every fragment and spills
#define SIDES_KK_UNROLL 1
#endif
#define SIDES_NEG_INF (-__longlong_as_double(0x7ff0000000000000LL))
#define SIDES_INF (__longlong_as_double(0x7ff0000000000000LL))

// the pass-1 sums of a row: linear in p (rescaled by α), then quadratic (by α²)
enum { S_L, S_V1, S_VA, S_K1, S_KA, S_PDP, S_PA, S_PAK, S_P2, S_P2V1, S_N };
enum { S_NLIN = S_P2 };
// the pass-2 sums
enum { T_DSK, T_DS2K, T_DS2, T_R1, T_N };

__device__ __forceinline__ double sides_quad_sum(double x) {
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// One pass over n_end blocks of BN keys through the two-stage ring: load(stage, first key) fills a
// stage, body(stage, first key) reads it.
template <int BN, class Load, class Body>
__device__ __forceinline__ void sides_sweep(int n_end, Load&& load, Body&& body) {
    load(0, 0);
    attn_commit();
    for (int j = 0; j < n_end; ++j) {
        const int st = j & 1, n0 = j * BN;
        if (j + 1 < n_end) load(st ^ 1, n0 + BN);
        attn_ring_wait(j + 1 < n_end);
        body(st, n0);
        __syncthreads();  // the next block's loads overwrite this stage
    }
}

template <int D>
__device__ __forceinline__ void attn_sides_body(const bf16* __restrict__ q, const bf16* __restrict__ k,
                                                const bf16* __restrict__ v, const bf16* __restrict__ dO,
                                                const float4* __restrict__ stats, double* __restrict__ out, int Hq,
                                                int Hkv, int S, double scale, int causal) {
    constexpr int NW = SIDES_WARPS, BM = 16 * NW, BN = SIDES_BN, NT = NW * 32, P = D + 8, NB = BN / 8, ND = D / 8,
                  KT = D / 16, KK_UNROLL = SIDES_KK_UNROLL;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    bf16* sQ = reinterpret_cast<bf16*>(smem_raw);
    bf16* sdO = sQ + BM * P;
    const AttnQueryBlock<D, BM, BN, NT> blk(sdO + BM * P, k, v, Hq, Hkv, S, causal);
    float4* sSt = reinterpret_cast<float4*>(sdO + BM * P + 4 * blk.STAGE);  // [2][BN]
    const float4* stg = stats + (blk.kg - k) / D;  // this KV head's keys
    const int bh = blk.bh, m0 = blk.m0, n_end = blk.n_end;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3, row0 = warp * 16;
    const int qi[2] = {m0 + row0 + g, m0 + row0 + g + 8};
    const double sl2 = scale * 1.4426950408889634;

    auto load = [&](int st, int n0) {
        blk.load_kv(st, n0);
        for (int c = threadIdx.x; c < BN; c += NT) {
            const bool ok = n0 + c < S;
            attn_cp16(smem_u32(sSt + st * BN + c), ok ? stg + n0 + c : stg, ok ? 16 : 0);
        }
    };
    // c = A·Bᵀ of the warp's 16 rows of sa (Q or dO) and the stage's keys of sb (K or V): each k16
    // product of the tensor cores added in fp64
    auto products64 = [&](double (*c)[4], const bf16* sa, const bf16* sb) {
#pragma unroll
        for (int nt = 0; nt < NB; ++nt) c[nt][0] = c[nt][1] = c[nt][2] = c[nt][3] = 0.0;
#pragma unroll KK_UNROLL
        for (int kk = 0; kk < KT; ++kk) {
            uint32_t a[4];
            attn_frag_a<D>(sa, row0, kk * 16, a);
#pragma unroll
            for (int np = 0; np < NB / 2; ++np) {
                uint32_t b[4];
                attn_frag_b_nk<D>(sb, np * 16, kk * 16, b);
                float c0[4] = {0.f, 0.f, 0.f, 0.f}, c1[4] = {0.f, 0.f, 0.f, 0.f};
                attn_mma(c0, a, b[0], b[1]);
                attn_mma(c1, a, b[2], b[3]);
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    c[2 * np][e] += c0[e];
                    c[2 * np + 1][e] += c1[e];
                }
            }
        }
    };
    // x = scale·log2(e)·q·k of the warp's 16 rows and the stage's keys, −∞ where masked
    auto scores = [&](double (*x)[4], const bf16* kt, int n0) {
        products64(x, sQ, kt);
        const bool edge = n0 + BN > S || (causal && n0 + BN - 1 > m0 + row0);
#pragma unroll
        for (int nt = 0; nt < NB; ++nt) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int col = n0 + nt * 8 + 2 * t + (e & 1);
                x[nt][e] = edge && (col >= S || (causal && col > qi[e >> 1])) ? SIDES_NEG_INF : x[nt][e] * sl2;
            }
        }
    };
    // c = (dO & mask)·(V & mask)ᵀ over the stage's keys: dP, or with mask 0x7fff7fff (the bf16
    // pairs without their sign bits) A = |dO|·|V|ᵀ
    auto dov = [&](float (*c)[4], const bf16* vt, uint32_t mask) {
        attn_zero<NB>(c);
#pragma unroll KK_UNROLL
        for (int kk = 0; kk < KT; ++kk) {
            uint32_t a[4];
            attn_frag_a<D>(sdO, row0, kk * 16, a);
#pragma unroll
            for (int i = 0; i < 4; ++i) a[i] &= mask;
#pragma unroll
            for (int np = 0; np < NB / 2; ++np) {
                uint32_t b[4];
                attn_frag_b_nk<D>(vt, np * 16, kk * 16, b);
                attn_mma(c[2 * np], a, b[0] & mask, b[1] & mask);
                attn_mma(c[2 * np + 1], a, b[2] & mask, b[3] & mask);
            }
        }
    };

    blk.load_rows(sQ, q);
    blk.load_rows(sdO, dO);

    // ---- pass 1 -------------------------------------------------------------------------------
    double sum[2][S_N], mrow[2] = {SIDES_NEG_INF, SIDES_NEG_INF}, smin[2] = {SIDES_INF, SIDES_INF};
#pragma unroll
    for (int r = 0; r < 2; ++r)
#pragma unroll
        for (int i = 0; i < S_N; ++i) sum[r][i] = 0.0;
    sides_sweep<BN>(n_end, load, [&](int st, int n0) {
        float p[NB][4];
        double alpha[2];
        {
            double x[NB][4];
            scores(x, blk.k_at(st), n0);
            double mnew[2] = {mrow[0], mrow[1]};
#pragma unroll
            for (int nt = 0; nt < NB; ++nt) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int r = e >> 1;
                    mnew[r] = fmax(mnew[r], x[nt][e]);
                    if (x[nt][e] != SIDES_NEG_INF) smin[r] = fmin(smin[r], x[nt][e]);
                }
            }
            double mb[2];
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                mnew[r] = fmax(mnew[r], __shfl_xor_sync(0xffffffffu, mnew[r], 1));
                mnew[r] = fmax(mnew[r], __shfl_xor_sync(0xffffffffu, mnew[r], 2));
                mb[r] = mnew[r] == SIDES_NEG_INF ? 0.0 : mnew[r];
                alpha[r] = exp2(mrow[r] - mb[r]);
                mrow[r] = mnew[r];
            }
#pragma unroll
            for (int nt = 0; nt < NB; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) p[nt][e] = exp2f(static_cast<float>(x[nt][e] - mb[e >> 1]));
        }
#pragma unroll
        for (int r = 0; r < 2; ++r) {
#pragma unroll
            for (int i = 0; i < S_N; ++i) sum[r][i] *= i < S_NLIN ? alpha[r] : alpha[r] * alpha[r];
        }
        {
            float part[2][7] = {};  // L, v1, ‖V‖₁, k1, ‖K‖₁, p², p²·v1²
#pragma unroll
            for (int nt = 0; nt < NB; ++nt) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const float4 kv = sSt[st * BN + nt * 8 + 2 * t + (e & 1)];  // v1, ‖V‖₁, k1, ‖K‖₁
                    const float pe = p[nt][e], p2 = pe * pe;
                    float* pr = part[e >> 1];
                    pr[0] += pe;
                    pr[1] += pe * kv.x;
                    pr[2] += pe * kv.y;
                    pr[3] += pe * kv.z;
                    pr[4] += pe * kv.w;
                    pr[5] += p2;
                    pr[6] += p2 * kv.x * kv.x;
                }
            }
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                sum[r][S_L] += part[r][0];
                sum[r][S_V1] += part[r][1];
                sum[r][S_VA] += part[r][2];
                sum[r][S_K1] += part[r][3];
                sum[r][S_KA] += part[r][4];
                sum[r][S_P2] += part[r][5];
                sum[r][S_P2V1] += part[r][6];
            }
        }
        {
            float c[NB][4], part[2] = {0.f, 0.f};
            dov(c, blk.v_at(st), 0xffffffffu);
#pragma unroll
            for (int nt = 0; nt < NB; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) part[e >> 1] += p[nt][e] * c[nt][e];
            sum[0][S_PDP] += part[0];
            sum[1][S_PDP] += part[1];
        }
        {
            float c[NB][4], part[2][2] = {};
            dov(c, blk.v_at(st), 0x7fff7fffu);
#pragma unroll
            for (int nt = 0; nt < NB; ++nt) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const float pa = p[nt][e] * c[nt][e];
                    part[e >> 1][0] += pa;
                    part[e >> 1][1] += pa * sSt[st * BN + nt * 8 + 2 * t + (e & 1)].w;
                }
            }
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                sum[r][S_PA] += part[r][0];
                sum[r][S_PAK] += part[r][1];
            }
        }
    });
    double dd[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
#pragma unroll
        for (int i = 0; i < S_N; ++i) sum[r][i] = sides_quad_sum(sum[r][i]);
        smin[r] = fmin(smin[r], __shfl_xor_sync(0xffffffffu, smin[r], 1));
        smin[r] = fmin(smin[r], __shfl_xor_sync(0xffffffffu, smin[r], 2));
        dd[r] = sum[r][S_PDP] / sum[r][S_L];
    }
    // ---- pass 2 -------------------------------------------------------------------------------
    double tsum[2][T_N];
#pragma unroll
    for (int r = 0; r < 2; ++r)
#pragma unroll
        for (int i = 0; i < T_N; ++i) tsum[r][i] = 0.0;
    float o[ND][4];
    attn_zero<ND>(o);
    const double mb[2] = {mrow[0] == SIDES_NEG_INF ? 0.0 : mrow[0], mrow[1] == SIDES_NEG_INF ? 0.0 : mrow[1]};
    sides_sweep<BN>(n_end, load, [&](int st, int n0) {
        float p[NB][4];
        {
            double x[NB][4];
            scores(x, blk.k_at(st), n0);
#pragma unroll
            for (int nt = 0; nt < NB; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) p[nt][e] = exp2f(static_cast<float>(x[nt][e] - mb[e >> 1]));
        }
        double dp[NB][4];  // in fp64 chunks: dS·l = p·(dP − D_i) may be far smaller than p·dP
        float part[2][T_N];
        products64(dp, sdO, blk.v_at(st));
#pragma unroll
        for (int r = 0; r < 2; ++r)
#pragma unroll
            for (int i = 0; i < T_N; ++i) part[r][i] = 0.f;
#pragma unroll
        for (int nt = 0; nt < NB; ++nt) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int r = e >> 1;
                const float k1 = sSt[st * BN + nt * 8 + 2 * t + (e & 1)].z;
                const float pe = p[nt][e], pdp = pe * static_cast<float>(dp[nt][e]);
                const float ds = pe * static_cast<float>(dp[nt][e] - dd[r]);  // dS·l
                const float dsk = ds * k1;
                part[r][T_DSK] += dsk;
                part[r][T_DS2K] += dsk * dsk;
                part[r][T_DS2] += ds * ds;
                part[r][T_R1] += pdp * pdp;
            }
        }
#pragma unroll
        for (int r = 0; r < 2; ++r)
#pragma unroll
            for (int i = 0; i < T_N; ++i) tsum[r][i] += part[r][i];
        attn_mm_pb<D, BN / 16, 1>(o, p, blk.v_at(st), 0);  // unnormalised, P in bf16
    });
    double dooq[2];
    // ‖dO_i∘O_i‖², O normalised
    {
        const float inv[2] = {static_cast<float>(1.0 / sum[0][S_L]), static_cast<float>(1.0 / sum[1][S_L])};
        float part[2] = {0.f, 0.f};
#pragma unroll
        for (int i = 0; i < ND; ++i) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int r = e >> 1, col = i * 8 + 2 * t + (e & 1);
                const float y = __bfloat162float(sdO[(row0 + g + 8 * r) * P + col]) * (o[i][e] * inv[r]);
                part[r] += y * y;
            }
        }
#pragma unroll
        for (int r = 0; r < 2; ++r) dooq[r] = sides_quad_sum(part[r]);
    }


    // ---- the row's sides ------------------------------------------------------------------------
    const long long plane = (long long)gridDim.y * S;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
#pragma unroll
        for (int i = 0; i < T_N; ++i) tsum[r][i] = sides_quad_sum(tsum[r][i]);
        if (t != 0 || qi[r] >= S) continue;
        const double* s1 = sum[r];
        const double* s2 = tsum[r];
        const double inv = 1.0 / s1[S_L];
        const double o_rowsum = s1[S_V1] * inv, rs2 = s1[S_K1] * inv, rs3 = s1[S_KA] * inv;
        const double p2_0 = sqrt(s1[S_P2V1]) * inv, p2_1 = sqrt(s1[S_P2]) * inv;
        const double rr = sqrt(s2[T_R1]) * inv + sqrt(dooq[r]);
        const double ds2_0 = sqrt(s2[T_DS2K]) * inv, ds2_1 = sqrt(s2[T_DS2]) * inv;
        const double side[10] = {
            o_rowsum,
            (mrow[r] + log2(s1[S_L])) * 0.6931471805599453,
            scale * s2[T_DSK] * inv,
            s1[S_VA] * inv,
            scale * (s1[S_PAK] + rs3 * s1[S_PA]) * inv,
            0x1p-8 * (p2_0 + p2_1 * fabs(o_rowsum)),
            scale * 0x1p-8 * (ds2_0 + rr * fabs(rs2)),
            p2_1,
            ds2_1 + rr,
            exp2(smin[r] - mrow[r]) * inv,
        };
        double* dst = out + (long long)bh * S + qi[r];
#pragma unroll
        for (int i = 0; i < 10; ++i) dst[i * plane] = side[i];
    }
}

#define ATTN_SIDES_ENTRY(DIM)                                                                                  \
    extern "C" __global__ void __launch_bounds__(SIDES_WARPS * 32)                                           \
        attn_sides_d##DIM(const bf16* q, const bf16* k, const bf16* v, const bf16* dO, const float4* stats,   \
                          double* out, int Hq, int Hkv, int S, double scale, int causal) {                     \
        attn_sides_body<DIM>(q, k, v, dO, stats, out, Hq, Hkv, S, scale, causal);                             \
    }
ATTN_SIDES_ENTRY(64)
ATTN_SIDES_ENTRY(128)
