// sensor_reference.cu — the in-training sensors' checksum reference (docs/sensors.md §2.1), twin
// of aegis_cli/ops/numerics.py `lean_side` (the torch reference, which the CPU path runs).
//
// For a bf16 left operand L (R, K), any strides, and the tile statistics of the right operand
// R (K, N) over tiles of t columns (nt = ceil(N/t) of them):
//     sums[i, j] = Σ_k L[i,k] · rt[k,j]        rt  = Σ_{c∈tile j} R[k,c]     (fp64)
//     s[i, j]    = Σ_k |L[i,k]| · rta[k,j]     rta = Σ_{c∈tile j} |R[k,c]|
//     rho[i, j]  = sqrt(Σ_k L[i,k]² · rtq[k,j]) rtq = Σ_{c∈tile j} R[k,c]²
// one pass over L (2 bytes an element, never an fp64 copy), three launches:
//
// aegis_sr_stats   rt, rta, rtq (K, nt) fp64 from the bf16 right operand (any strides): one warp
//                  per (k, tile) where columns are contiguous (lanes in order, then a fixed
//                  shuffle tree), else one thread per (k, tile), columns in order. Exact sums of bf16 values (their exponents
//                  span less than fp64's 53 bits in any tile of real data), else one fp64 rounding each.
// aegis_sr_main    one CTA: SR_ROWS rows × SR_TT tiles × one split of K (a multiple of SR_BK);
//                  each thread SR_TR rows × SR_TT tiles. sums: fp64 FMAs in k order, error of
//                  order K·2⁻⁵³·s as the torch reference's. s and ρ²: fp32 FMAs over each SR_BK-deep
//                  stage (|L|, L² exact in fp32; rta, rtq rounded to fp32), added to fp64 after each
//                  stage: relative error ≤ (SR_BK + 3)·2⁻²⁴ ≈ 4·10⁻⁶. A stage whose fp32 s or ρ² is
//                  not finite (overflow, or NaN/Inf inputs) or, with s nonzero, below SR_LOW = 2⁻¹⁰⁰
//                  is recomputed in fp64 from the same values; above it, squares and products that
//                  fall below fp32's normal range (2⁻¹²⁶, flushed) add at most 2⁻²⁰·(1 + rta or rtq)
//                  relative; a stage whose fp32 s is 0 has every product below 2⁻¹²⁶, an absolute
//                  error within the GEMM kernels' own flushing (their floor, subnormal_slack).
//                  Partial results go to part[3][splits][R][nt]. aegis_sr_main_norho: the same
//                  without ρ² (left 0), for callers that use no ρ.
// aegis_sr_reduce  sums, s, rho (R, nt) fp64: the splits added in split order, then sqrt.
//
// Deterministic: every sum has a fixed order (no atomics); the split count is the host's, from
// the shape only (backends/cuda_reference.py), so the bits repeat on any device for a shape.

typedef unsigned short u16;
typedef unsigned int u32;
typedef long long i64;

#define SR_THREADS 128
#define SR_TR 4                            // rows per thread
#define SR_TT 4                            // tiles per CTA (each thread computes all of them)
#define SR_BK 64                           // k per stage (fp32 partials of s and ρ²)
#define SR_KV 8                            // k per register load
#define SR_ROWS (SR_THREADS * SR_TR)       // rows per CTA
#define SR_LOW 0x1p-100f                  // fp32 s or ρ² of a stage below this: recomputed in fp64
#define SR_STAT_THREADS 256
#define SR_RED_THREADS 256

// load modes of the left operand (host-checked alignment)
#define SR_SCALAR 0   // any strides: one element at a time
#define SR_VEC_K 1    // k contiguous, rows 16-byte aligned: 8 k per 16-byte load
#define SR_VEC_R 2    // rows contiguous, 8-byte aligned: 4 rows per 8-byte load

__device__ __forceinline__ float bf16_to_f32(u32 bits) { return __uint_as_float(bits << 16); }

// rt, rta, rtq of (k, tile j) into slot k·nt + j.
__device__ __forceinline__ void put_stats(double* rt, double* rta, double* rtq, i64 o, double sum, double sa, double sq) {
    rt[o] = sum;
    rta[o] = sa;
    rtq[o] = sq;
}

extern "C" __global__ void __launch_bounds__(SR_STAT_THREADS)
aegis_sr_stats(const u16* __restrict__ right, i64 K, i64 N, i64 sk, i64 sn, int t, int nt, int k_fastest,
               double* __restrict__ rt, double* __restrict__ rta, double* __restrict__ rtq) {
    const i64 total = K * (i64)nt;
    if (!k_fastest) {
        // columns contiguous: one warp per (k, tile), lanes over its columns, then a fixed shuffle tree
        const int lane = threadIdx.x & 31;
        const i64 warps = (i64)gridDim.x * (blockDim.x >> 5);
        for (i64 w = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5; w < total; w += warps) {
            const i64 k = w / nt;
            const int j = (int)(w % nt);
            const i64 c0 = (i64)j * t;
            const i64 c1 = min(c0 + t, N);
            double sum = 0.0, sa = 0.0, sq = 0.0;
            for (i64 c = c0 + lane; c < c1; c += 32) {
                const double v = (double)bf16_to_f32(right[k * sk + c * sn]);
                sum += v;
                sa += fabs(v);
                sq = fma(v, v, sq);
            }
#pragma unroll
            for (int o = 16; o; o >>= 1) {
                sum += __shfl_xor_sync(0xffffffffu, sum, o);
                sa += __shfl_xor_sync(0xffffffffu, sa, o);
                sq += __shfl_xor_sync(0xffffffffu, sq, o);
            }
            if (lane == 0) put_stats(rt, rta, rtq, k * nt + j, sum, sa, sq);
        }
        return;
    }
    // rows contiguous: one thread per (k, tile), consecutive threads on consecutive k (coalesced)
    for (i64 idx = (i64)blockIdx.x * blockDim.x + threadIdx.x; idx < total; idx += (i64)gridDim.x * blockDim.x) {
        const i64 k = idx % K;
        const int j = (int)(idx / K);
        const i64 c0 = (i64)j * t;
        const i64 c1 = min(c0 + t, N);
        double sum = 0.0, sa = 0.0, sq = 0.0;
        const u16* p = right + k * sk;
        for (i64 c = c0; c < c1; ++c) {
            const double v = (double)bf16_to_f32(p[c * sn]);
            sum += v;
            sa += fabs(v);
            sq = fma(v, v, sq);
        }
        put_stats(rt, rta, rtq, k * nt + j, sum, sa, sq);
    }
}

// L[r, k0..k0+SR_KV) of this thread's SR_TR rows into a[r][kv] as fp32 (exact); zero outside.
__device__ __forceinline__ void load_left(float (&a)[SR_TR][SR_KV], const u16* __restrict__ left, i64 R, i64 k_end,
                                          i64 sr, i64 sk, i64 r0, i64 k0, int mode) {
    if (mode == SR_VEC_K && k0 + SR_KV <= k_end) {
#pragma unroll
        for (int r = 0; r < SR_TR; ++r) {
            uint4 v = make_uint4(0u, 0u, 0u, 0u);
            if (r0 + r < R) v = __ldg(reinterpret_cast<const uint4*>(left + (r0 + r) * sr + k0));
            const u32 w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                a[r][2 * q] = __uint_as_float(w[q] << 16);
                a[r][2 * q + 1] = __uint_as_float(w[q] & 0xffff0000u);
            }
        }
        return;
    }
    if (mode == SR_VEC_R && r0 + SR_TR <= R) {
#pragma unroll
        for (int kv = 0; kv < SR_KV; ++kv) {
            uint2 v = make_uint2(0u, 0u);
            if (k0 + kv < k_end) v = __ldg(reinterpret_cast<const uint2*>(left + r0 + (k0 + kv) * sk));
            a[0][kv] = __uint_as_float(v.x << 16);
            a[1][kv] = __uint_as_float(v.x & 0xffff0000u);
            a[2][kv] = __uint_as_float(v.y << 16);
            a[3][kv] = __uint_as_float(v.y & 0xffff0000u);
        }
        return;
    }
#pragma unroll
    for (int r = 0; r < SR_TR; ++r)
#pragma unroll
        for (int kv = 0; kv < SR_KV; ++kv)
            a[r][kv] = (r0 + r < R && k0 + kv < k_end) ? bf16_to_f32(left[(r0 + r) * sr + (k0 + kv) * sk]) : 0.0f;
}

// RHO false: sums and s only (ρ² left 0), for callers that use no ρ (the sensors' wgrad σ follows s)
template <bool RHO>
__device__ __forceinline__ void sr_main(const u16* __restrict__ left, i64 R, i64 K, i64 sr, i64 sk, int mode,
                                        const double* __restrict__ rt, const double* __restrict__ rta,
                                        const double* __restrict__ rtq, int nt, i64 k_split, double* __restrict__ part) {
    __shared__ __align__(16) double s_rt[SR_BK][SR_TT];  // read as double2, float4
    __shared__ double s_rta64[SR_BK][SR_TT];
    __shared__ double s_rtq64[SR_BK][SR_TT];
    __shared__ __align__(16) float s_rta[SR_BK][SR_TT];
    __shared__ __align__(16) float s_rtq[SR_BK][SR_TT];
    __shared__ double s_s[SR_TR * SR_TT][SR_THREADS];  // fp64 s of each thread's outputs
    __shared__ double s_q[SR_TR * SR_TT][SR_THREADS];  // fp64 ρ²

    const int tid = threadIdx.x;
    const i64 r0 = (i64)blockIdx.x * SR_ROWS + (i64)tid * SR_TR;
    const int j0 = blockIdx.y * SR_TT;
    const int split = blockIdx.z;
    const i64 kb = (i64)split * k_split;
    const i64 ke = min(kb + k_split, K);

    double sum[SR_TR][SR_TT];
#pragma unroll
    for (int r = 0; r < SR_TR; ++r)
#pragma unroll
        for (int t = 0; t < SR_TT; ++t) {
            sum[r][t] = 0.0;
            s_s[r * SR_TT + t][tid] = 0.0;
            s_q[r * SR_TT + t][tid] = 0.0;
        }

    for (i64 ks = kb; ks < ke; ks += SR_BK) {
        __syncthreads();  // the previous stage's statistics are no longer read
        for (int e = tid; e < SR_BK * SR_TT; e += SR_THREADS) {
            const int kk = e / SR_TT, t = e % SR_TT;
            const i64 k = ks + kk;
            const bool ok = k < ke && j0 + t < nt;
            const i64 g = k * nt + j0 + t;
            const double v = ok ? rt[g] : 0.0, va = ok ? rta[g] : 0.0, vq = ok ? rtq[g] : 0.0;
            s_rt[kk][t] = v;
            s_rta64[kk][t] = va;
            s_rtq64[kk][t] = vq;
            s_rta[kk][t] = (float)va;
            s_rtq[kk][t] = (float)vq;
        }
        __syncthreads();

        float s32[SR_TR][SR_TT], q32[SR_TR][SR_TT];
#pragma unroll
        for (int r = 0; r < SR_TR; ++r)
#pragma unroll
            for (int t = 0; t < SR_TT; ++t) s32[r][t] = q32[r][t] = 0.0f;

        const i64 kend = min(ks + SR_BK, ke);
        float a[SR_TR][SR_KV];
        load_left(a, left, R, kend, sr, sk, r0, ks, mode);
#pragma unroll 1
        for (int kk = 0; kk < SR_BK; kk += SR_KV) {
            float an[SR_TR][SR_KV];  // the next chunk, in flight while this one is multiplied
            if (kk + SR_KV < SR_BK) load_left(an, left, R, kend, sr, sk, r0, ks + kk + SR_KV, mode);
#pragma unroll
            for (int kv = 0; kv < SR_KV; ++kv) {
                const double2 v01 = *reinterpret_cast<const double2*>(&s_rt[kk + kv][0]);
                const double2 v23 = *reinterpret_cast<const double2*>(&s_rt[kk + kv][2]);
                const float4 va = *reinterpret_cast<const float4*>(&s_rta[kk + kv][0]);
                const float4 vq = *reinterpret_cast<const float4*>(&s_rtq[kk + kv][0]);
                const double vt[SR_TT] = {v01.x, v01.y, v23.x, v23.y};
                const float vat[SR_TT] = {va.x, va.y, va.z, va.w};
                const float vqt[SR_TT] = {vq.x, vq.y, vq.z, vq.w};
#pragma unroll
                for (int r = 0; r < SR_TR; ++r) {
                    const float x = a[r][kv];
                    const double xd = (double)x;
                    const float xa = fabsf(x), x2 = x * x;
#pragma unroll
                    for (int t = 0; t < SR_TT; ++t) {
                        sum[r][t] = fma(xd, vt[t], sum[r][t]);
                        s32[r][t] = fmaf(xa, vat[t], s32[r][t]);
                        if (RHO) q32[r][t] = fmaf(x2, vqt[t], q32[r][t]);
                    }
                }
            }
            if (kk + SR_KV < SR_BK) {
#pragma unroll
                for (int r = 0; r < SR_TR; ++r)
#pragma unroll
                    for (int kv = 0; kv < SR_KV; ++kv) a[r][kv] = an[r][kv];
            }
        }
#pragma unroll
        for (int r = 0; r < SR_TR; ++r)
#pragma unroll
            for (int t = 0; t < SR_TT; ++t) {
                const float sv = s32[r][t], qv = q32[r][t];
                double ds = (double)sv, dq = (double)qv;
                // rare: fp32 overflowed (or NaN/Inf inputs), or products may have fallen below its
                // normal range: recompute the stage in fp64
                if (!isfinite(sv) || !isfinite(qv) || (sv != 0.0f && fminf(sv, RHO ? qv : sv) < SR_LOW)) {
                    ds = dq = 0.0;
                    for (i64 k = ks; k < kend; ++k) {
                        const double x = r0 + r < R ? (double)bf16_to_f32(left[(r0 + r) * sr + k * sk]) : 0.0;
                        ds = fma(fabs(x), s_rta64[k - ks][t], ds);
                        if (RHO) dq = fma(x * x, s_rtq64[k - ks][t], dq);
                    }
                }
                s_s[r * SR_TT + t][tid] += ds;
                s_q[r * SR_TT + t][tid] += dq;
            }
    }

    const i64 plane = (i64)gridDim.z * R * nt;  // one of the three outputs, every split
#pragma unroll
    for (int r = 0; r < SR_TR; ++r) {
        const i64 row = r0 + r;
        if (row >= R) continue;
#pragma unroll
        for (int t = 0; t < SR_TT; ++t) {
            if (j0 + t >= nt) continue;
            const i64 o = ((i64)split * R + row) * nt + j0 + t;
            part[o] = sum[r][t];
            part[plane + o] = s_s[r * SR_TT + t][tid];
            part[2 * plane + o] = s_q[r * SR_TT + t][tid];
        }
    }
}

extern "C" __global__ void __launch_bounds__(SR_THREADS)
aegis_sr_main(const u16* __restrict__ left, i64 R, i64 K, i64 sr, i64 sk, int mode, const double* __restrict__ rt,
              const double* __restrict__ rta, const double* __restrict__ rtq, int nt, i64 k_split, double* __restrict__ part) {
    sr_main<true>(left, R, K, sr, sk, mode, rt, rta, rtq, nt, k_split, part);
}

extern "C" __global__ void __launch_bounds__(SR_THREADS)
aegis_sr_main_norho(const u16* __restrict__ left, i64 R, i64 K, i64 sr, i64 sk, int mode, const double* __restrict__ rt,
                    const double* __restrict__ rta, const double* __restrict__ rtq, int nt, i64 k_split,
                    double* __restrict__ part) {
    sr_main<false>(left, R, K, sr, sk, mode, rt, rta, rtq, nt, k_split, part);
}

extern "C" __global__ void __launch_bounds__(SR_RED_THREADS)
aegis_sr_reduce(const double* __restrict__ part, int splits, i64 n, double* __restrict__ sums, double* __restrict__ s,
                double* __restrict__ rho) {
    const i64 plane = (i64)splits * n;
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        double a = 0.0, b = 0.0, c = 0.0;
        for (int z = 0; z < splits; ++z) {  // split order, whatever the grid
            a += part[(i64)z * n + i];
            b += part[plane + (i64)z * n + i];
            c += part[2 * plane + (i64)z * n + i];
        }
        sums[i] = a;
        s[i] = b;
        rho[i] = sqrt(c);
    }
}
