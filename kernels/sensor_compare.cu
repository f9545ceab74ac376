// sensor_compare.cu — the in-training sensors' comparison of a checked launch's fused checksums
// with their fp64 references (docs/sensors.md §2.1), twin of the torch path in
// aegis_cli/sensors/sense.py (`sigma_of` and numerics.normalised_diff, the CPU path and reference),
// launched by aegis_cli/backends/cuda_compare.py: one launch per check instead of some thirty
// small torch kernels over the (R, T) fp64 arrays.
//
// Up to two sides per launch (rows; wgrad also columns), blockIdx.y the side. For each element of
// a side, with sums fp32 and ref, s, ρ, Σ|c| fp64 (any strides):
//     σ = s·w                                          no ρ (wgrad on a truncating device)
//     σ = min(min(ρ·u, s·p) + Σ|c|·b, s·p)              without Σ|c|: min(ρ·u, s·p)
//     d = nan_to_num(max(|sums − ref| − floor, 0) / max(σ, 2⁻¹⁰²²))   NaN and +inf → +inf
// Every operation is one IEEE fp64 operation rounded to nearest, in the torch path's order (the
// _rn intrinsics are never contracted into FMAs; min propagates NaN as torch.minimum does), so d
// is the torch path's bits. d is written row-major (R, T).
//
// summary[side] ← max d of the side: atomicMax on the bits of a non-negative double (d ≥ +0,
// never NaN), exact, so the same value whatever the order. summary[nsides] ← 0.0 (atomicAnd) when
// some s of either side is not finite (NaN/Inf inputs: no reference to compare with). The caller
// sets summary to 0.0 … 0.0, 1.0 before the launch.

typedef long long i64;
typedef unsigned long long u64;

#define SC_THREADS 256
#define SC_NAN __longlong_as_double(0x7ff8000000000000LL)
#define SC_INF __longlong_as_double(0x7ff0000000000000LL)
#define SC_MIN_NORMAL 2.2250738585072014e-308  // 2⁻¹⁰²²: normalised_diff's smallest scale

struct SC_Side {
    const float* sums;
    const double* ref;
    const double* s;
    const double* rho;   // null: σ = s·w
    const double* cabs;  // null: no bias term
    double* d;
    i64 rows, cols;
    i64 sums_r, sums_c, ref_r, ref_c, s_r, s_c, rho_r, rho_c, cabs_r, cabs_c;  // strides in elements
    double floor;
};

struct SC_Params {
    SC_Side side[2];
    double u, p, b, w;
    u64* summary;
    int nsides;
};

__device__ __forceinline__ double min_nan(double a, double b) {  // torch.minimum
    return (isnan(a) || isnan(b)) ? SC_NAN : (a < b ? a : b);
}

extern "C" __global__ void __launch_bounds__(SC_THREADS) aegis_sc_compare(const SC_Params P) {
    const SC_Side& S = P.side[blockIdx.y];
    const i64 n = S.rows * S.cols;
    double worst = 0.0;
    int bad = 0;
    for (i64 i = (i64)blockIdx.x * SC_THREADS + threadIdx.x; i < n; i += (i64)gridDim.x * SC_THREADS) {
        const i64 r = i / S.cols, c = i - r * S.cols;
        const double s = S.s[r * S.s_r + c * S.s_c];
        double sigma;
        if (S.rho == nullptr) {
            sigma = __dmul_rn(s, P.w);
        } else {
            const double sp = __dmul_rn(s, P.p);
            sigma = min_nan(__dmul_rn(S.rho[r * S.rho_r + c * S.rho_c], P.u), sp);
            if (S.cabs != nullptr) sigma = min_nan(__dadd_rn(sigma, __dmul_rn(S.cabs[r * S.cabs_r + c * S.cabs_c], P.b)), sp);
        }
        const double obs = (double)S.sums[r * S.sums_r + c * S.sums_c];
        double diff = __dsub_rn(fabs(__dsub_rn(obs, S.ref[r * S.ref_r + c * S.ref_c])), S.floor);
        diff = diff < 0.0 ? 0.0 : diff;  // clamp(min=0); NaN stays NaN
        double q = __ddiv_rn(diff, sigma < SC_MIN_NORMAL ? SC_MIN_NORMAL : sigma);  // clamp(min=2⁻¹⁰²²); NaN stays
        if (isnan(q) || isinf(q)) q = SC_INF;
        q = q == 0.0 ? 0.0 : q;  // +0: the bits order as the values for atomicMax
        S.d[i] = q;
        worst = fmax(worst, q);
        bad |= !isfinite(s);
    }
    // the block's largest d (max is exact: any order gives the same value), then one atomic
    for (int o = 16; o > 0; o >>= 1) worst = fmax(worst, __shfl_down_sync(0xffffffffu, worst, o));
    __shared__ double warps[SC_THREADS / 32];
    if ((threadIdx.x & 31) == 0) warps[threadIdx.x >> 5] = worst;
    const int any_bad = __syncthreads_or(bad);
    if (threadIdx.x == 0) {
        for (int w = 1; w < SC_THREADS / 32; ++w) worst = fmax(worst, warps[w]);
        if (worst > 0.0) atomicMax(P.summary + blockIdx.y, (u64)__double_as_longlong(worst));
        if (any_bad) atomicAnd(P.summary + P.nsides, 0ull);
    }
}
