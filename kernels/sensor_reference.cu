// sensor_reference.cu — the in-training sensors' checksum reference (docs/sensors.md §2.1), twin
// of aegis_cli/ops/lean.py `lean_side` (the torch reference, which the CPU path runs).
//
// For a bf16 left operand L (R, K), any strides, and the tile statistics of the right operand
// R (K, N) over tiles of t columns (nt = ceil(N/t) of them):
//     sums[i, j] = Σ_k L[i,k] · rt[k,j]        rt  = Σ_{c∈tile j} R[k,c]     (fp64)
//     s[i, j]    = Σ_k |L[i,k]| · rta[k,j]     rta = Σ_{c∈tile j} |R[k,c]|   (without ρ)
//     rho[i, j]  = sqrt(Σ_k L[i,k]² · rtq[k,j]) rtq = Σ_{c∈tile j} R[k,c]²
// and with ρ, in place of s, its stage bound (s only caps σ there; docs/sensors.md §2.1):
//     s[i, j]    = Σ_b (Σ_{k∈b} |L[i,k]|) · max_{k∈b} rta[k,j]   over stages b of SR_BK k
// one pass over L (2 bytes an element, never an fp64 copy), three or four launches:
//
// aegis_sr_stats   rt, rta, rtq (K, nt) fp64 from the bf16 right operand (any strides), at memory
//                  bandwidth where a dimension is contiguous and 16-byte aligned: columns
//                  contiguous (t a multiple of 8), G lanes per (k, tile) (about 4 vectors of 8
//                  columns a lane, G from t), 16-byte loads, then a xor tree over the G lanes; k
//                  contiguous (aegis_sr_stats_k), a warp per (64 k, tile), 8 k a lane by 16-byte
//                  loads, 4 column slices, then a xor tree over them. Else scalar loads: a warp
//                  per (k, tile) (lanes in order, then a shuffle tree), or a thread per (k, tile)
//                  along contiguous k. Exact sums of bf16 values (their exponents span less than
//                  fp64's 53 bits in any tile of real data), else one fp64 rounding each; the
//                  order follows the mode and t (the host's, from strides, alignment and t).
//                  aegis_sr_abs(_k): rta alone, the same bits (the sensors' Σ|c|: C is the
//                  largest tensor of a check). aegis_sr_stage_max (with ρ): each stage's max of
//                  rta into the stage's first row of rta, in place (the one row the products read).
// aegis_sr_main    the products on the fp64 tensor cores (DMMA: mma.sync f64, m16n8k8 on sm_90,
//                  pairs of m8n8k4 before). One CTA: SR_BM rows × SR_BN tiles × one split of K (a
//                  multiple of SR_BK), SR_WARPS warps of 32 rows × 16 tiles (4, 2 CTAs an SM on
//                  sm_90, 248 registers with ρ, 226 without; 8: one CTA an SM). L's bf16 tile of
//                  each SR_BK-deep stage is staged through shared memory (cp.async where rows or k
//                  are contiguous and aligned, else plain loads; SR_STAGES in flight; the k-major
//                  stage by 16-byte copies of 8 rows where rows are 16-byte aligned, and read 4
//                  adjacent rows at a time: SR_KM_PACK), then converted exactly to fp64 with its
//                  |·| or ·² (exact in fp64: 8-bit significands, exponents well inside fp64's
//                  range), so 2^±100 rows need nothing special and NaN/Inf stay in their rows. The
//                  products in fp64 with fp64 accumulation: sums within (K+1)·2⁻⁵³·s, s (without ρ)
//                  and ρ² within (K+1)·2⁻⁵³ relative (non-negative terms), as the torch reference's
//                  (which k goes to which MMA slot is a fixed permutation per layout: the order of
//                  the sum changes, not its precision). With ρ, each row's Σ|L| of a stage is added
//                  in fp32 (8 terms a lane, scaled by 2⁻⁸: exact terms, no overflow; then over the
//                  4 lanes of its k: within 9·2⁻²⁴ relative), and every 4 stages one m16n8k4 DMMA a
//                  block adds those sums times the stages' maxima to s. A CTA whose rows and tiles
//                  are all inside loads each whole stage of 16-byte L vectors from two running
//                  positions (load_whole), the rest through load_stage's general indexing: the same
//                  copies either way (SR_WHOLE=0 builds the former; a test compares their bits).
//                  Partial results go to part[3][splits][R][nt]. aegis_sr_main_norho: the same
//                  without ρ² (its MMAs skipped, part[2][splits][R][nt]), for callers that use no ρ.
//                  With one split the planes are the results (ρ, not ρ²) and nothing is reduced.
// aegis_sr_reduce  sums, s, rho (R, nt) fp64: the splits added in split order, then sqrt (no rho
//                  without the ρ² plane).
//
// Deterministic: every sum has a fixed order (no atomics); the split count is the host's, from
// the shape only (backends/cuda_reference.py), so the bits repeat for a shape on any device of
// one architecture (the MMA shape, and so its internal order, follows the architecture).

typedef unsigned short u16;
typedef unsigned int u32;
typedef long long i64;

#ifndef SR_WARPS
#define SR_WARPS 4                         // warps a CTA, stacked along rows (8: 256 rows, one CTA an SM)
#endif
#define SR_THREADS (32 * SR_WARPS)
#define SR_BM (32 * SR_WARPS)              // rows per CTA (32 per warp: two m16 blocks)
#define SR_BN 16                           // tiles per CTA (two n8 blocks, every warp)
#define SR_BK 32                           // k per stage (8 MMA k-steps of 4)
#define SR_KM_LD (SR_BM + 16)              // row stride of the k-major stage: k rows 8 banks apart (conflict-free reads)
#define SR_A_BYTES (SR_BK * SR_KM_LD * 2)  // one stage of L, either layout
#define SR_B_ELEMS (8 * 2 * 32)            // one statistic of one stage, in fragment order
#define SR_STAGES 3                        // stages in flight: two stream in while one is multiplied
#ifndef SR_CTAS
#define SR_CTAS (8 / SR_WARPS)             // CTAs an SM the products are built for (4 warps at 3: 168 registers, some spilled)
#endif
#define SR_STAGE_BYTES (SR_A_BYTES + 3 * SR_B_ELEMS * 8)
#define SR_SMEM (SR_STAGES * SR_STAGE_BYTES)  // dynamic shared memory of aegis_sr_main (the host's cuda_reference.geometry)
#define SR_STAT_THREADS 256
#define SR_STAT_CTAS 4                     // statistics CTAs an SM (64 registers): loads in flight
#define SR_STAT_K_CTAS 2                   // those of aegis_sr_stats_k (8 accumulators a lane: 88 registers)
#define SR_RED_THREADS 256
#ifndef SR_MMA_K
#define SR_MMA_K 8                         // k of one fp64 MMA on sm_90 (4: m16n8k4)
#endif
#ifndef SR_KM_PACK
#define SR_KM_PACK 1                       // k-major stage: 16-byte copies, a thread's 4 rows adjacent (0: 8-byte copies, rows 8 apart)
#endif
#ifndef SR_WHOLE
#define SR_WHOLE 1                         // whole stages by load_whole (0: every stage by load_stage)
#endif

// load modes of the left operand (host-checked alignment)
#define SR_SCALAR 0   // any strides: one element at a time
#define SR_VEC_K 1    // k contiguous, rows 16-byte aligned: 8 k per 16-byte cp.async
#define SR_VEC_R 2    // rows contiguous, 8-byte aligned: 4 rows per 8-byte cp.async
#define SR_VEC_R16 3  // rows contiguous, 16-byte aligned: 8 rows per 16-byte cp.async (8-byte ones unless SR_KM_PACK)

__device__ __forceinline__ float bf16_to_f32(u32 bits) { return __uint_as_float(bits << 16); }

// ---- the tile statistics ---------------------------------------------------------------------
// Accumulated in fp64 in a fixed order per layout and t (the host's mode and G follow the strides,
// alignment and t only): Σ·, Σ|·|, Σ·² (ALL), or Σ|·| alone (the sensors' Σ|c|).
struct SrAcc {
    double sum, sa, sq;
};

template <bool ALL>
__device__ __forceinline__ void acc_add(SrAcc& a, u32 bits) {  // bits: a bf16 in the low 16
    const double v = (double)bf16_to_f32(bits & 0xffffu);
    if (ALL) {
        a.sum += v;
        a.sq = fma(v, v, a.sq);
    }
    a.sa += fabs(v);
}

template <bool ALL>
__device__ __forceinline__ void acc_add8(SrAcc& a, uint4 w) {  // 8 consecutive bf16, in order
    const u32 x[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        acc_add<ALL>(a, x[i]);
        acc_add<ALL>(a, x[i] >> 16);
    }
}

template <bool ALL>
__device__ __forceinline__ void acc_xor(SrAcc& a, int o) {  // a fixed butterfly step: every lane ends with the same bits
    if (ALL) {
        a.sum += __shfl_xor_sync(0xffffffffu, a.sum, o);
        a.sq += __shfl_xor_sync(0xffffffffu, a.sq, o);
    }
    a.sa += __shfl_xor_sync(0xffffffffu, a.sa, o);
}

// rt, rta, rtq of (k, tile j) into slot k·nt + j (rta alone unless ALL)
template <bool ALL>
__device__ __forceinline__ void put_stats(double* rt, double* rta, double* rtq, i64 o, const SrAcc& a) {
    if (ALL) {
        rt[o] = a.sum;
        rtq[o] = a.sq;
    }
    rta[o] = a.sa;
}

#define ST_COLS 0      // any strides, columns the smaller stride: a warp per (k, tile), lanes in order, then a shuffle tree
#define ST_K 1         // any strides, k contiguous: a thread per (k, tile), columns in order
#define ST_VEC_COLS 2  // columns contiguous, rows 16-byte aligned, t a multiple of 8: G lanes per (k, tile)
#define ST_VEC_K 3     // k contiguous, columns 16-byte aligned: a warp per (64 k, tile), 8 k a lane, 4 column slices
#define ST_VEC 4       // 16-byte vectors of a lane batched before their sums (loads in flight)

template <bool ALL>
__device__ __forceinline__ void stats_scalar_cols(const u16* __restrict__ right, i64 K, i64 N, i64 sk, i64 sn, int t,
                                                  int nt, double* rt, double* rta, double* rtq) {
    const i64 total = K * (i64)nt;
    const int lane = threadIdx.x & 31;
    const i64 warps = (i64)gridDim.x * (blockDim.x >> 5);
    for (i64 w = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5; w < total; w += warps) {
        const i64 k = w / nt;
        const int j = (int)(w % nt);
        const i64 c1 = min((i64)j * t + t, N);
        SrAcc a = {0.0, 0.0, 0.0};
        for (i64 c = (i64)j * t + lane; c < c1; c += 32) acc_add<ALL>(a, right[k * sk + c * sn]);
#pragma unroll
        for (int o = 16; o; o >>= 1) acc_xor<ALL>(a, o);
        if (lane == 0) put_stats<ALL>(rt, rta, rtq, k * nt + j, a);
    }
}

template <bool ALL>
__device__ __forceinline__ void stats_scalar_k(const u16* __restrict__ right, i64 K, i64 N, i64 sk, i64 sn, int t,
                                               int nt, double* rt, double* rta, double* rtq) {
    // consecutive threads on consecutive k (coalesced)
    const i64 total = K * (i64)nt;
    for (i64 idx = (i64)blockIdx.x * blockDim.x + threadIdx.x; idx < total; idx += (i64)gridDim.x * blockDim.x) {
        const i64 k = idx % K;
        const int j = (int)(idx / K);
        const i64 c1 = min((i64)j * t + t, N);
        SrAcc a = {0.0, 0.0, 0.0};
        for (i64 c = (i64)j * t; c < c1; ++c) acc_add<ALL>(a, right[k * sk + c * sn]);
        put_stats<ALL>(rt, rta, rtq, k * nt + j, a);
    }
}

// Columns contiguous: G lanes (a power of two ≤ 32) per (k, tile); lane l of a group sums the
// tile's 8-column vectors l, l + G, … in order (16-byte loads, ST_VEC batched), the ragged end of
// the row by scalars, then a xor tree over the group. Groups run along rows (coalesced), and
// every lane of a warp stays in the loop (shuffles) with the groups past the end idle.
template <bool ALL>
__device__ __forceinline__ void stats_vec_cols(const u16* __restrict__ right, i64 K, i64 N, i64 sk, int t, int nt,
                                               int G, double* rt, double* rta, double* rtq) {
    const int lane = threadIdx.x & 31, sub = lane & (G - 1);
    const i64 per_warp = 32 / G;
    const i64 total = K * (i64)nt;
    const i64 warp0 = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const i64 step = (i64)gridDim.x * (blockDim.x >> 5) * per_warp;  // groups per sweep of the grid
    const i64 dk = step / nt;
    const int dj = (int)(step % nt);
    const i64 gid = warp0 * per_warp + lane / G;
    i64 k = gid / nt;
    int j = (int)(gid % nt);
    const int vecs = t >> 3;
    for (i64 base = warp0 * per_warp; base < total; base += step) {
        SrAcc a = {0.0, 0.0, 0.0};
        if (k < K) {
            const u16* row = right + k * sk;
            const i64 c0 = (i64)j * t;
            const i64 c1 = min(c0 + t, N);
            const int full = min(vecs, (int)((c1 - c0) >> 3));  // whole vectors of this tile
            const int mine = full > sub ? (full - sub + G - 1) / G : 0;
            const uint4* p = reinterpret_cast<const uint4*>(row + c0) + sub;
            int v = 0;
            for (; v + ST_VEC <= mine; v += ST_VEC) {
                uint4 w[ST_VEC];
#pragma unroll
                for (int u = 0; u < ST_VEC; ++u) w[u] = __ldg(p + (i64)(v + u) * G);
#pragma unroll
                for (int u = 0; u < ST_VEC; ++u) acc_add8<ALL>(a, w[u]);
            }
            for (; v < mine; ++v) acc_add8<ALL>(a, __ldg(p + (i64)v * G));
            if (sub == full % G)  // the lane next in turn takes the ragged end (< 8 columns)
                for (i64 c = c0 + 8 * (i64)full; c < c1; ++c) acc_add<ALL>(a, row[c]);
        }
        for (int o = G >> 1; o; o >>= 1) acc_xor<ALL>(a, o);
        if (sub == 0 && k < K) put_stats<ALL>(rt, rta, rtq, k * nt + j, a);
        j += dj;
        k += dk;
        if (j >= nt) {
            j -= nt;
            ++k;
        }
    }
}

// k contiguous: a warp per (64 k, tile); lane = 8·slice + chunk holds k = 64·block + 8·chunk … + 7
// (one 16-byte load a column, 128 contiguous bytes a column for 8 lanes) and sums the tile's
// columns slice, slice + 4, … in order (ST_VEC batched); then a xor tree over the 4 slices, and
// slice s writes k 2s, 2s + 1 of its chunk. A ragged K's last chunk loads by scalars.
template <bool ALL>
__device__ __forceinline__ void stats_vec_k(const u16* __restrict__ right, i64 K, i64 N, i64 sn, int t, int nt,
                                            double* rt, double* rta, double* rtq) {
    const int lane = threadIdx.x & 31, chunk = lane & 7, slice = lane >> 3;
    const i64 kblocks = (K + 63) >> 6;
    const i64 units = kblocks * nt;
    const i64 warps = (i64)gridDim.x * (blockDim.x >> 5);
    for (i64 u = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5; u < units; u += warps) {
        const i64 k0 = (u % kblocks) * 64 + 8 * chunk;
        const int j = (int)(u / kblocks);
        const i64 c0 = (i64)j * t;
        const i64 c1 = min(c0 + t, N);
        SrAcc a[8];
#pragma unroll
        for (int e = 0; e < 8; ++e) a[e] = {0.0, 0.0, 0.0};
        const u16* p = right + k0;
        if (k0 + 8 <= K) {
            const i64 n = c1 - c0 > slice ? (c1 - c0 - slice + 3) >> 2 : 0;  // this slice's columns
            const u16* q = p + (c0 + slice) * sn;
            i64 v = 0;
            for (; v + ST_VEC <= n; v += ST_VEC) {
                uint4 w[ST_VEC];
#pragma unroll
                for (int x = 0; x < ST_VEC; ++x) w[x] = __ldg(reinterpret_cast<const uint4*>(q + (v + x) * 4 * sn));
#pragma unroll
                for (int x = 0; x < ST_VEC; ++x) {
                    const u32 h[4] = {w[x].x, w[x].y, w[x].z, w[x].w};
#pragma unroll
                    for (int e = 0; e < 8; ++e) acc_add<ALL>(a[e], h[e >> 1] >> (16 * (e & 1)));
                }
            }
            for (; v < n; ++v) {
                const uint4 w = __ldg(reinterpret_cast<const uint4*>(q + v * 4 * sn));
                const u32 h[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
                for (int e = 0; e < 8; ++e) acc_add<ALL>(a[e], h[e >> 1] >> (16 * (e & 1)));
            }
        } else if (k0 < K) {
            for (i64 c = c0 + slice; c < c1; c += 4)
#pragma unroll
                for (int e = 0; e < 8; ++e)
                    if (k0 + e < K) acc_add<ALL>(a[e], p[c * sn + e]);
        }
#pragma unroll
        for (int e = 0; e < 8; ++e) {
            acc_xor<ALL>(a[e], 8);
            acc_xor<ALL>(a[e], 16);
        }
#pragma unroll
        for (int e = 0; e < 8; ++e)
            if ((e >> 1) == slice && k0 + e < K) put_stats<ALL>(rt, rta, rtq, (k0 + e) * nt + j, a[e]);
    }
}

template <bool ALL>
__device__ __forceinline__ void stats_entry(const u16* right, i64 K, i64 N, i64 sk, i64 sn, int t, int nt, int mode,
                                            int G, double* rt, double* rta, double* rtq) {
    if (mode == ST_VEC_COLS)
        stats_vec_cols<ALL>(right, K, N, sk, t, nt, G, rt, rta, rtq);
    else if (mode == ST_K)
        stats_scalar_k<ALL>(right, K, N, sk, sn, t, nt, rt, rta, rtq);
    else
        stats_scalar_cols<ALL>(right, K, N, sk, sn, t, nt, rt, rta, rtq);
}

// ST_COLS, ST_K, ST_VEC_COLS (64 registers, 4 CTAs an SM); ST_VEC_K has entries of its own (its 8
// accumulators a lane need more registers)
extern "C" __global__ void __launch_bounds__(SR_STAT_THREADS, SR_STAT_CTAS)
aegis_sr_stats(const u16* __restrict__ right, i64 K, i64 N, i64 sk, i64 sn, int t, int nt, int mode, int G,
               double* __restrict__ rt, double* __restrict__ rta, double* __restrict__ rtq) {
    stats_entry<true>(right, K, N, sk, sn, t, nt, mode, G, rt, rta, rtq);
}

extern "C" __global__ void __launch_bounds__(SR_STAT_THREADS, SR_STAT_K_CTAS)
aegis_sr_stats_k(const u16* __restrict__ right, i64 K, i64 N, i64 sk, i64 sn, int t, int nt, int mode, int G,
                 double* __restrict__ rt, double* __restrict__ rta, double* __restrict__ rtq) {
    stats_vec_k<true>(right, K, N, sn, t, nt, rt, rta, rtq);
}

// Σ|·| alone (the sensors' Σ|c|, C the largest tensor of a check): the same sums as the statistics' rta
extern "C" __global__ void __launch_bounds__(SR_STAT_THREADS, SR_STAT_CTAS)
aegis_sr_abs(const u16* __restrict__ x, i64 K, i64 N, i64 sk, i64 sn, int t, int nt, int mode, int G,
             double* __restrict__ rta) {
    stats_entry<false>(x, K, N, sk, sn, t, nt, mode, G, nullptr, rta, nullptr);
}

extern "C" __global__ void __launch_bounds__(SR_STAT_THREADS, SR_STAT_CTAS)
aegis_sr_abs_k(const u16* __restrict__ x, i64 K, i64 N, i64 sk, i64 sn, int t, int nt, int mode, int G,
               double* __restrict__ rta) {
    stats_vec_k<false>(x, K, N, sn, t, nt, nullptr, rta, nullptr);
}

// The stage maxima of rta for aegis_sr_main, in place: rta[SR_BK·b, j] becomes the largest
// rta[k, j] of stage b (k ∈ [SR_BK·b, SR_BK·b + SR_BK) ∩ [0, K)), the one row of a stage that
// the products with ρ read. NaN and Inf propagate, as they would through s.
extern "C" __global__ void __launch_bounds__(SR_STAT_THREADS)
aegis_sr_stage_max(double* __restrict__ rta, i64 K, int nt) {
    const i64 n = (K + SR_BK - 1) / SR_BK * nt;
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        const i64 k0 = i / nt * SR_BK, j = i % nt, k1 = min(k0 + SR_BK, K);
        double m = rta[k0 * nt + j];
        for (i64 k = k0 + 1; k < k1; ++k) {
            const double x = rta[k * nt + j];
            m = (x > m || x != x) ? x : m;  // NaN sticks
        }
        rta[k0 * nt + j] = m;
    }
}

// ---- the products --------------------------------------------------------------------------
// A stage of L in shared memory has one of two layouts (a template parameter):
//   row-major  [SR_BM][SR_BK] (k contiguous; k-contiguous operands): MMA k-step s of the thread
//              with threadID_in_group q reads k = 8q + s (its 8 k in one 16-byte read per row);
//   k-major    [SR_BK][SR_KM_LD] (rows contiguous; transposed operands): k = 4s + q; with SR_KM_PACK
//              the MMA rows of a thread (g, g + 8 of each m16 block) are 4 adjacent rows 4g … 4g + 3
//              of its warp's 32, one 8-byte read per k (rows 8 apart, 2-byte reads, without).
// The statistics of a stage are stored in fragment order, [stat][s][n8 block][lane], holding
// stat[k(s, q)][block·8 + groupID] for lane = 4·groupID + q: one conflict-free 8-byte read each.

__device__ __forceinline__ void cp_async(void* smem, const void* gmem, int bytes, int src_bytes) {
    const u32 s = (u32)__cvta_generic_to_shared(smem);
    if (bytes == 16)
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(src_bytes) : "memory");
    else
        asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n" ::"r"(s), "l"(gmem), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_group 0;\n" ::: "memory"); }
__device__ __forceinline__ void cp_async_wait_older() {  // all but the newest SR_STAGES - 2 groups are in
    asm volatile("cp.async.wait_group %0;\n" ::"n"(SR_STAGES - 2) : "memory");
}

// d (16×8) += a (16×k) · b (k×8), fp64, fragments as the PTX ISA lays them out for m16n8k4
// (a0: row groupID, a1: row groupID+8, k = threadID_in_group; b0: k = threadID_in_group,
// column groupID; d0, d1: row groupID, columns 2·threadID_in_group + 0, 1; d2, d3: 8 rows down).
__device__ __forceinline__ void mma_k4(double (&d)[4], double a0, double a1, double b0) {
#if __CUDA_ARCH__ >= 900
    asm volatile("mma.sync.aligned.m16n8k4.row.col.f64.f64.f64.f64 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};\n"
                 : "+d"(d[0]), "+d"(d[1]), "+d"(d[2]), "+d"(d[3])
                 : "d"(a0), "d"(a1), "d"(b0));
#else
    asm volatile("mma.sync.aligned.m8n8k4.row.col.f64.f64.f64.f64 {%0,%1}, {%2}, {%3}, {%0,%1};\n"
                 : "+d"(d[0]), "+d"(d[1]) : "d"(a0), "d"(b0));
    asm volatile("mma.sync.aligned.m8n8k4.row.col.f64.f64.f64.f64 {%0,%1}, {%2}, {%3}, {%0,%1};\n"
                 : "+d"(d[2]), "+d"(d[3]) : "d"(a1), "d"(b0));
#endif
}

// two k-steps s, s+1 at once (m16n8k8 on sm_90: its columns q and q+4 are the steps' k); else two m16n8k4
__device__ __forceinline__ void mma_k8(double (&d)[4], const double (&a)[2][2], double b0, double b1) {
#if __CUDA_ARCH__ >= 900 && SR_MMA_K == 8
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f64.f64.f64.f64 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+d"(d[0]), "+d"(d[1]), "+d"(d[2]), "+d"(d[3])
                 : "d"(a[0][0]), "d"(a[0][1]), "d"(a[1][0]), "d"(a[1][1]), "d"(b0), "d"(b1));
#else
    mma_k4(d, a[0][0], a[0][1], b0);
    mma_k4(d, a[1][0], a[1][1], b1);
#endif
}

// Enqueue stage [k0, k0 + SR_BK) ∩ [.., ke) of L (rows r0 ..) and of the statistics (tiles j0 ..)
// into shared memory, zeros outside; cp.async where aligned (the caller commits and waits).
template <bool KMAJ, bool RHO>
__device__ __forceinline__ void load_stage(u16* __restrict__ sa, double* __restrict__ sb, const u16* __restrict__ left,
                                           i64 R, i64 sr, i64 sk, int mode, i64 r0, i64 k0, i64 ke,
                                           const double* __restrict__ rt, const double* __restrict__ rta,
                                           const double* __restrict__ rtq, int nt, int j0) {
    const int tid = threadIdx.x;
    if (mode == SR_VEC_K) {  // row-major: 4 chunks of 8 k per row, one 16-byte copy each
        for (int e = tid; e < SR_BM * (SR_BK / 8); e += SR_THREADS) {
            const int r = e >> 2, c = e & 3;
            const i64 row = r0 + r, k = k0 + 8 * c;
            const i64 n = (row < R && k < ke) ? min((i64)8, ke - k) : 0;
            cp_async(sa + r * SR_BK + 8 * c, n ? left + row * sr + k : left, 16, (int)(2 * n));
        }
    } else if (mode == SR_VEC_R16 && SR_KM_PACK) {  // k-major: 8 rows per 16-byte copy
        for (int e = tid; e < SR_BK * (SR_BM / 8); e += SR_THREADS) {
            const int kk = e / (SR_BM / 8), r = 8 * (e % (SR_BM / 8));
            const i64 row = r0 + r, k = k0 + kk;
            const i64 n = (row < R && k < ke) ? min((i64)8, R - row) : 0;
            cp_async(sa + kk * SR_KM_LD + r, n ? left + row + k * sk : left, 16, (int)(2 * n));
        }
    } else if (mode == SR_VEC_R || mode == SR_VEC_R16) {  // k-major: 4 rows per 8-byte copy
        for (int e = tid; e < SR_BK * (SR_BM / 4); e += SR_THREADS) {
            const int kk = e / (SR_BM / 4), r = 4 * (e % (SR_BM / 4));
            const i64 row = r0 + r, k = k0 + kk;
            const i64 n = (row < R && k < ke) ? min((i64)4, R - row) : 0;
            cp_async(sa + kk * SR_KM_LD + r, n ? left + row + k * sk : left, 8, (int)(2 * n));
        }
    } else {  // any strides: plain loads, along the smaller stride
        for (int e = tid; e < SR_BM * SR_BK; e += SR_THREADS) {
            const int r = KMAJ ? e % SR_BM : e / SR_BK, kk = KMAJ ? e / SR_BM : e % SR_BK;
            const i64 row = r0 + r, k = k0 + kk;
            const u16 v = (row < R && k < ke) ? left[row * sr + k * sk] : (u16)0;
            sa[KMAJ ? kk * SR_KM_LD + r : r * SR_BK + kk] = v;
        }
    }
    // statistics: thread per (stat, k, tile), consecutive tiles on consecutive threads (coalesced):
    // rt and rta (slots 0, 1), or with ρ rt and rtq (slots 0, 2) and the stage's row of rmax (slot 1)
    for (int e = tid; e < 2 * SR_BK * SR_BN; e += SR_THREADS) {
        const int st = e / (SR_BK * SR_BN), kk = (e / SR_BN) % SR_BK, n = e % SR_BN;
        const int s = KMAJ ? kk >> 2 : kk & 7, q = KMAJ ? kk & 3 : kk >> 3;
        const int slot = RHO ? 2 * st : st;
        const double* src = st == 0 ? rt : RHO ? rtq : rta;
        const i64 k = k0 + kk;
        const bool ok = k < ke && j0 + n < nt;
        cp_async(sb + slot * SR_B_ELEMS + (s * 2 + (n >> 3)) * 32 + (n & 7) * 4 + q, ok ? src + k * nt + j0 + n : src,
                 8, ok ? 8 : 0);
    }
    if (RHO && tid < SR_BN) {
        const bool ok = j0 + tid < nt;
        const double* src = rta + k0 * nt + j0 + tid;  // k0: a stage's first k
        cp_async(sb + SR_B_ELEMS + tid, ok ? src : rta, 8, ok ? 8 : 0);
    }
}

// A whole stage (rows, tiles and k all inside; 16-byte vectors of L) by fixed offsets from two
// running positions, l (L) and o (the statistics), which move SR_BK k a stage: the same copies to
// the same places as load_stage, without its per-copy 64-bit indices and bounds (which were most
// of this kernel's issued instructions, and its issue slots are what it is short of). With
// W = SR_WARPS (4 vectors of L a thread: SR_BM · SR_BK / 8 = 4 · SR_THREADS):
//   L      row-major, rows tid/4 + 8W·i at k 8·(tid%4) (l_step: 8W rows);
//          k-major, k tid/(4W) + 8i at rows 8·(tid%(4W)) (l_step: 8 k)
//   stats  (k tid/16 + 2W·c, tile tid%16) of each statistic, c < 16/W (o_step: 2W k)
#define SR_L_ROWS (SR_BM / 8)  // 16-byte vectors across a k-major stage's rows
#define SR_O_K (SR_THREADS / 16)  // k between a thread's statistics
template <bool KMAJ, bool RHO>
__device__ __forceinline__ void load_whole(u16* __restrict__ sa, double* __restrict__ sb, const u16* l, i64 l_step,
                                           const double* __restrict__ rt, const double* __restrict__ rta,
                                           const double* __restrict__ rtq, i64 o, i64 o_step) {
    const int tid = threadIdx.x, n = tid & 15, kq = tid >> 4;
    const int a_off = KMAJ ? (int)(threadIdx.x / SR_L_ROWS) * SR_KM_LD + 8 * (int)(threadIdx.x % SR_L_ROWS)
                           : (tid >> 2) * SR_BK + 8 * (tid & 3);
#pragma unroll
    for (int i = 0; i < 4; ++i)
        cp_async(sa + a_off + i * (KMAJ ? 8 * SR_KM_LD : (SR_THREADS / 4) * SR_BK), l + i * l_step, 16, 16);
    // k = kq + SR_O_K·c: k-major s = k/4, q = k%4; row-major s = k%8, q = k/8 (load_stage's mapping)
    const int b_off = KMAJ ? ((kq >> 2) * 2 + (n >> 3)) * 32 + (n & 7) * 4 + (kq & 3)
                     : SR_O_K == 8 ? (kq * 2 + (n >> 3)) * 32 + (n & 7) * 4  // kq < 8
                                   : ((kq & 7) * 2 + (n >> 3)) * 32 + (n & 7) * 4 + (kq >> 3);
    const int b_step = KMAJ ? (SR_O_K / 4) * 2 * 32 : SR_O_K / 8;
#pragma unroll
    for (int st = 0; st < 2; ++st) {  // rt and rta, or with ρ rt and rtq (load_stage's slots)
        const double* src = (st == 0 ? rt : RHO ? rtq : rta) + o;
#pragma unroll
        for (int c = 0; c < SR_BK / SR_O_K; ++c)
            cp_async(sb + (RHO ? 2 * st : st) * SR_B_ELEMS + b_off + c * b_step, src + c * o_step, 8, 8);
    }
    if (RHO && tid < SR_BN) cp_async(sb + SR_B_ELEMS + tid, rta + o, 8, 8);  // the stage's maxima: k = kq = 0 (tid < 16)
}

template <bool KMAJ, bool RHO>
__device__ __forceinline__ void sr_main(u16* __restrict__ s_a, double* __restrict__ s_b, const u16* __restrict__ left,
                                        i64 R, i64 K, i64 sr, i64 sk, int mode, const double* __restrict__ rt,
                                        const double* __restrict__ rta, const double* __restrict__ rtq, int nt,
                                        i64 k_split, double* __restrict__ part) {
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, q = lane & 3;
    const i64 r0 = (i64)blockIdx.x * SR_BM;
    const int j0 = blockIdx.y * SR_BN;
    const int split = blockIdx.z;
    const i64 kb = (i64)split * k_split;
    const i64 ke = min(kb + k_split, K);
    const int stats = RHO ? 3 : 2;
    const int wr = warp * 32 + g;  // this thread's first row in the stage; then +8, +16, +24
    const bool pack = KMAJ && SR_KM_PACK;
    const int wp = warp * 32 + 4 * g;  // packed: this thread's 4 adjacent rows, MMA rows g, g + 8 of block 0, then of block 1

    double acc[3][2][2][4];  // [stat][m16 block][n8 block][fragment]
#pragma unroll
    for (int st = 0; st < 3; ++st)
#pragma unroll
        for (int mb = 0; mb < 2; ++mb)
#pragma unroll
            for (int nb = 0; nb < 2; ++nb)
#pragma unroll
                for (int i = 0; i < 4; ++i) acc[st][mb][nb][i] = 0.0;

    const int stages = (int)((ke - kb + SR_BK - 1) / SR_BK);
    // with ρ, s is the stage bound Σ_stages (Σ_{k∈stage} |L[i,k]|) · max_{k∈stage} rta[k,j], itself a
    // product of K/SR_BK: its m16n8k4 fragments, stage ≡ q (mod 4) in this thread's k slot
    double bnd_a[2][2] = {{0.0, 0.0}, {0.0, 0.0}}, bnd_b[2] = {0.0, 0.0};
    // stage i in buffer i % SR_STAGES; one commit group per stage (empty past the end), so that
    // waiting for all but the newest SR_STAGES - 2 groups waits for the stage about to be multiplied
    // load_whole where the CTA's rows and tiles are inside (block-uniform; a last partial stage by load_stage)
    const bool whole = SR_WHOLE && r0 + SR_BM <= R && j0 + SR_BN <= nt && mode == (KMAJ ? SR_VEC_R16 : SR_VEC_K) &&
                       (!KMAJ || SR_KM_PACK);
    const u16* l = KMAJ ? left + r0 + 8 * (int)(threadIdx.x % SR_L_ROWS) + (kb + (int)(threadIdx.x / SR_L_ROWS)) * sk
                        : left + (r0 + (tid >> 2)) * sr + kb + 8 * (tid & 3);
    const i64 l_step = KMAJ ? 8 * sk : (SR_THREADS / 4) * sr, l_stage = KMAJ ? SR_BK * sk : SR_BK;
    const i64 so = (kb + (tid >> 4)) * nt + j0 + (tid & 15);
    const auto stage_in = [&](int i, int buf) {
        const i64 k0 = kb + (i64)i * SR_BK;
        if (whole && k0 + SR_BK <= ke)
            load_whole<KMAJ, RHO>(s_a + buf * (SR_A_BYTES / 2), s_b + buf * 3 * SR_B_ELEMS, l + i * l_stage, l_step, rt,
                                  rta, rtq, so + (i64)i * SR_BK * nt, SR_O_K * (i64)nt);
        else
            load_stage<KMAJ, RHO>(s_a + buf * (SR_A_BYTES / 2), s_b + buf * 3 * SR_B_ELEMS, left, R, sr, sk, mode, r0, k0,
                                  ke, rt, rta, rtq, nt, j0);
    };
#pragma unroll
    for (int i = 0; i < SR_STAGES - 1; ++i) {
        if (i < stages) stage_in(i, i);
        cp_async_commit();
    }
    for (int stage = 0; stage < stages; ++stage) {
        cp_async_wait_older();
        __syncthreads();  // this stage is in; every warp is done with the buffer refilled next
        const int next = stage + SR_STAGES - 1, nbuf = next % SR_STAGES, buf = stage % SR_STAGES;
        if (next < stages) stage_in(next, nbuf);
        cp_async_commit();
        const u16* sa = s_a + buf * (SR_A_BYTES / 2);
        const double* sb = s_b + buf * 3 * SR_B_ELEMS;
        float l1[4] = {0.f, 0.f, 0.f, 0.f};  // with ρ: 2⁻⁸·Σ|L| of this thread's 8 k of the stage, rows h = 2·mb + half
        uint4 rowv[4];  // row-major: this thread's 8 k of each of its 4 rows
        if (!KMAJ) {
#pragma unroll
            for (int h = 0; h < 4; ++h) rowv[h] = *reinterpret_cast<const uint4*>(sa + (wr + 8 * h) * SR_BK + 8 * q);
        }
#pragma unroll
        for (int s = 0; s < 8; s += 2) {
            // v[mb][step][half]: L of rows wr + 16·mb + 8·half at the steps' k, exact in fp64
            double v[2][2][2];
            uint2 packed[2];
            if (pack) {
#pragma unroll
                for (int u = 0; u < 2; ++u) packed[u] = *reinterpret_cast<const uint2*>(sa + (4 * (s + u) + q) * SR_KM_LD + wp);
            }
#pragma unroll
            for (int h = 0; h < 4; ++h)
#pragma unroll
                for (int u = 0; u < 2; ++u) {
                    u32 bits;
                    if (pack) {
                        bits = ((h < 2 ? packed[u].x : packed[u].y) >> (16 * (h & 1))) & 0xffffu;
                    } else if (KMAJ) {
                        bits = sa[(4 * (s + u) + q) * SR_KM_LD + wr + 8 * h];
                    } else {
                        const u32 w[4] = {rowv[h].x, rowv[h].y, rowv[h].z, rowv[h].w};
                        bits = (w[(s + u) >> 1] >> (16 * ((s + u) & 1))) & 0xffffu;
                    }
                    v[h >> 1][u][h & 1] = (double)bf16_to_f32(bits);
                    if (RHO) l1[h] = fmaf(bf16_to_f32(bits & 0x7fffu), 0x1p-8f, l1[h]);  // exact terms, no overflow
                }
#pragma unroll
            for (int st = 0; st < 3; ++st) {
                if (st == (RHO ? 1 : 2)) continue;  // with ρ, s is the stage's bound below
#pragma unroll
                for (int nb = 0; nb < 2; ++nb) {
                    const double b0 = sb[st * SR_B_ELEMS + (s * 2 + nb) * 32 + lane];
                    const double b1 = sb[st * SR_B_ELEMS + ((s + 1) * 2 + nb) * 32 + lane];
#pragma unroll
                    for (int mb = 0; mb < 2; ++mb) {
                        double x[2][2];  // L, |L| or L² (exact)
#pragma unroll
                        for (int u = 0; u < 2; ++u)
#pragma unroll
                            for (int hf = 0; hf < 2; ++hf) {
                                const double y = v[mb][u][hf];
                                x[u][hf] = st == 0 ? y : st == 1 ? fabs(y) : y * y;
                            }
                        mma_k8(acc[st][mb][nb], x, b0, b1);
                    }
                }
            }
        }
        if (RHO) {  // the stage's Σ|L| of each row (over the 4 lanes of its k) and maxima into the k4 fragments
            const int slot = stage & 3;
#pragma unroll
            for (int h = 0; h < 4; ++h) {
                float x = l1[h];
                x += __shfl_xor_sync(0xffffffffu, x, 1);
                x += __shfl_xor_sync(0xffffffffu, x, 2);
                if (slot == q) bnd_a[h >> 1][h & 1] = 256.0 * (double)x;
            }
            if (slot == q) {
                bnd_b[0] = sb[SR_B_ELEMS + g];
                bnd_b[1] = sb[SR_B_ELEMS + 8 + g];
            }
            if (slot == 3 || stage == stages - 1) {  // s += (Σ|L| of 4 stages) · (their maxima): one m16n8k4 a block
#pragma unroll
                for (int mb = 0; mb < 2; ++mb)
#pragma unroll
                    for (int nb = 0; nb < 2; ++nb) mma_k4(acc[1][mb][nb], bnd_a[mb][0], bnd_a[mb][1], bnd_b[nb]);
                // zeros for the absent stages of a last group
                bnd_a[0][0] = bnd_a[0][1] = bnd_a[1][0] = bnd_a[1][1] = bnd_b[0] = bnd_b[1] = 0.0;
            }
        }
    }
    cp_async_wait_all();  // no copy outlives the CTA (the trailing groups are empty)

    const i64 plane = (i64)gridDim.z * R * nt;  // one of the three outputs, every split
#pragma unroll
    for (int mb = 0; mb < 2; ++mb)
#pragma unroll
        for (int i = 0; i < 4; i += 2) {
            const i64 row = r0 + (pack ? wp + 2 * mb + (i >> 1) : wr + 16 * mb + 4 * i);  // i = 2: the block's row g + 8
            if (row >= R) continue;
#pragma unroll
            for (int nb = 0; nb < 2; ++nb)
#pragma unroll
                for (int c = 0; c < 2; ++c) {
                    const int j = j0 + nb * 8 + 2 * q + c;
                    if (j >= nt) continue;
                    const i64 o = ((i64)split * R + row) * nt + j;
#pragma unroll
                    for (int st = 0; st < stats; ++st) {  // one split: the planes are the results, ρ² as ρ
                        const double x = acc[st][mb][nb][i + c];
                        part[st * plane + o] = st == 2 && gridDim.z == 1 ? sqrt(x) : x;
                    }
                }
        }
}

// the layout follows the load mode: k-major where rows are contiguous, or the smaller stride is the rows'
template <bool RHO>
__device__ __forceinline__ void sr_entry(const u16* left, i64 R, i64 K, i64 sr, i64 sk, int mode, const double* rt,
                                         const double* rta, const double* rtq, int nt, i64 k_split, double* part) {
    extern __shared__ __align__(16) unsigned char sr_smem[];  // SR_SMEM bytes: the stages of L, then of the statistics
    u16* s_a = reinterpret_cast<u16*>(sr_smem);
    double* s_b = reinterpret_cast<double*>(sr_smem + SR_STAGES * SR_A_BYTES);
    if (mode == SR_VEC_R || mode == SR_VEC_R16 || (mode == SR_SCALAR && sr < sk))
        sr_main<true, RHO>(s_a, s_b, left, R, K, sr, sk, mode, rt, rta, rtq, nt, k_split, part);
    else
        sr_main<false, RHO>(s_a, s_b, left, R, K, sr, sk, mode, rt, rta, rtq, nt, k_split, part);
}

extern "C" __global__ void __launch_bounds__(SR_THREADS, SR_CTAS)
aegis_sr_main(const u16* __restrict__ left, i64 R, i64 K, i64 sr, i64 sk, int mode, const double* __restrict__ rt,
              const double* __restrict__ rta, const double* __restrict__ rtq, int nt, i64 k_split, double* __restrict__ part) {
    sr_entry<true>(left, R, K, sr, sk, mode, rt, rta, rtq, nt, k_split, part);
}

extern "C" __global__ void __launch_bounds__(SR_THREADS, SR_CTAS)
aegis_sr_main_norho(const u16* __restrict__ left, i64 R, i64 K, i64 sr, i64 sk, int mode, const double* __restrict__ rt,
                    const double* __restrict__ rta, const double* __restrict__ rtq, int nt, i64 k_split,
                    double* __restrict__ part) {
    sr_entry<false>(left, R, K, sr, sk, mode, rt, rta, rtq, nt, k_split, part);
}

template <bool RHO>
__device__ __forceinline__ void sr_reduce(const double* __restrict__ part, int splits, i64 n, double* __restrict__ sums,
                                          double* __restrict__ s, double* __restrict__ rho) {
    const i64 plane = (i64)splits * n;
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        double a = 0.0, b = 0.0, c = 0.0;
        for (int z = 0; z < splits; ++z) {  // split order, whatever the grid
            a += part[(i64)z * n + i];
            b += part[plane + (i64)z * n + i];
            if (RHO) c += part[2 * plane + (i64)z * n + i];
        }
        sums[i] = a;
        s[i] = b;
        if (RHO) rho[i] = sqrt(c);
    }
}

extern "C" __global__ void __launch_bounds__(SR_RED_THREADS)
aegis_sr_reduce(const double* __restrict__ part, int splits, i64 n, double* __restrict__ sums, double* __restrict__ s,
                double* __restrict__ rho) {  // rho null: no ρ² plane (aegis_sr_main_norho writes two)
    if (rho)
        sr_reduce<true>(part, splits, n, sums, s, rho);
    else
        sr_reduce<false>(part, splits, n, sums, s, rho);
}
