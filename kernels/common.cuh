// common.cuh — shared device helpers for the aegis checked GEMMs (v1).
//
// PTX wrappers (smid, cp.async, ldmatrix, mma.sync), the fault-injection parameter
// block and the code that applies it to an accumulator fragment. Both GEMM kernels
// include this; the injection code is compiled only with -DAEGIS_INJECT, so the
// production variants carry none of it.
#pragma once
#include <cuda_bf16.h>
#if defined(__CUDACC_RTC__)  // NVRTC has no <stdint.h>; these match its definitions
typedef unsigned int uint32_t;
typedef unsigned long long uint64_t;
#else
#include <stdint.h>
#endif

typedef __nv_bfloat16 bf16;

__device__ __forceinline__ int aegis_smid() {
    int id;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(id));
    return id;
}

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// The GEMMs' bias epilogue (docs/kernels.md): bias_load reads the bias of columns col, col + 1
// (0 past N; col is even, so the pair load is aligned when N is even); bias_add adds a pair of them
// to a pair of outputs already rounded to bf16, in fp32, rounding to bf16 again: the bits of
// torch's bf16 add of the bias to C.
__device__ __forceinline__ __nv_bfloat162 bias_load(const bf16* __restrict__ bias, int col, int N) {
    if ((N & 1) == 0 && col + 1 < N) return *reinterpret_cast<const __nv_bfloat162*>(bias + col);
    const bf16 zero = __float2bfloat16_rn(0.f);
    return __halves2bfloat162(col < N ? bias[col] : zero, col + 1 < N ? bias[col + 1] : zero);
}
__device__ __forceinline__ __nv_bfloat162 bias_add(__nv_bfloat162 v, __nv_bfloat162 b) {
    const float2 f = __bfloat1622float2(v), g = __bfloat1622float2(b);
    return __floats2bfloat162_rn(__fadd_rn(f.x, g.x), __fadd_rn(f.y, g.y));
}

// ---- fault injection ------------------------------------------------------------
// Host (aegis_cli/backends/cuda.py) turns a FaultPlan into this block. Element edits
// are grouped per output tile (CSR: edit_off[tile] .. edit_off[tile+1]) so a CTA scans
// only its own. Tile modes act on the whole tile; shift and skipk act in the main loop.
enum { EDIT_XOR = 0, EDIT_SET = 1, EDIT_ADD = 2 };
enum { TILE_NONE = 0, TILE_ZERO = 1, TILE_STUCK = 2, TILE_SHIFT = 3, TILE_SKIPK = 4 };

#define AEGIS_MAX_LANES 4  // stuck-lane faults per launch (cuda.py MAX_LANES)

struct InjectParams {
    const long long* edit_idx;   // flat row*N + col
    const int* edit_off;         // [tiles_m*tiles_n + 1]
    const unsigned* edit_val;    // xor mask / new bits / float bits to add
    const unsigned char* edit_op;
    const signed char* tile_mode;  // [tiles_m*tiles_n] or null
    int sm_target;               // tiles run on this SM get sm_mode (-1: none)
    int sm_mode;
    float tile_value;            // TILE_STUCK value
    int kstep;                   // 64-wide k block dropped by TILE_SKIPK
    // stuck lanes: flat % lane_stride[l] == lane_offset[l] gets lane_mask[l], l < n_lanes
    int lane_stride[AEGIS_MAX_LANES];
    int lane_offset[AEGIS_MAX_LANES];
    unsigned lane_mask[AEGIS_MAX_LANES];
    int n_lanes;
    int n_edits;
};

// The mode a tile runs under: per-tile table, overridden when the tile lands on the pinned SM.
__device__ __forceinline__ int inject_tile_mode(const InjectParams& p, int tile, int smid) {
    int mode = p.tile_mode ? (int)p.tile_mode[tile] : TILE_NONE;
    if (p.sm_target >= 0 && smid == p.sm_target) mode = p.sm_mode;
    return mode;
}

// Apply an edit to one fp32 accumulator value.
__device__ __forceinline__ float inject_edit(float v, unsigned char op, unsigned bits) {
    if (op == EDIT_XOR) return __uint_as_float(__float_as_uint(v) ^ bits);
    if (op == EDIT_SET) return __uint_as_float(bits);
    return v + __uint_as_float(bits);
}

// Apply the injection block to one thread's NREG accumulator values, before the checksums.
// pos(i, r, c) gives value i's global row and column, mode_of(i) the mode of its checksum
// tile. Edits are matched by a compile-time unrolled compare so the fragment stays in
// registers. Out-of-range values are forced to zero so a corrupted padding row or column
// cannot leak into the tile sums.
template <int NREG, class PosFn, class ModeFn>
__device__ __forceinline__ void inject_fragment(const InjectParams& p, float* v, PosFn pos, ModeFn mode_of, int M, int N,
                                                int e0, int e1) {
#pragma unroll
    for (int i = 0; i < NREG; ++i) {
        int r, c;
        pos(i, r, c);
        const int mode = mode_of(i);
        float x = v[i];
        if (mode == TILE_ZERO) x = 0.f;
        if (mode == TILE_STUCK) x = p.tile_value;
        v[i] = x;
    }
#pragma unroll 1
    for (int l = 0; l < p.n_lanes; ++l) {  // a runtime loop: one copy of the per-element test
        const int stride = p.lane_stride[l], offset = p.lane_offset[l];
        const unsigned mask = p.lane_mask[l];
#pragma unroll
        for (int i = 0; i < NREG; ++i) {
            int r, c;
            pos(i, r, c);
            if (((long long)r * N + c) % stride == offset) v[i] = __uint_as_float(__float_as_uint(v[i]) ^ mask);
        }
    }
    for (int e = e0; e < e1; ++e) {
        const long long flat = p.edit_idx[e];
        const int er = (int)(flat / N), ec = (int)(flat % N);
        const unsigned char op = p.edit_op[e];
        const unsigned bits = p.edit_val[e];
#pragma unroll
        for (int i = 0; i < NREG; ++i) {
            int r, c;
            pos(i, r, c);
            if (r == er && c == ec) v[i] = inject_edit(v[i], op, bits);
        }
    }
#pragma unroll
    for (int i = 0; i < NREG; ++i) {
        int r, c;
        pos(i, r, c);
        if (r >= M || c >= N) v[i] = 0.f;
    }
}
