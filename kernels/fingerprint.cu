// fingerprint.cu — bitwise tensor fingerprints (v1), GPU twin of aegis_cli/fingerprint.py.
//
// A tensor's bytes are read as little-endian 64-bit words (the last one zero-padded):
//     h = Σ_w fmix64(word_w ⊕ KEY ⊕ w·GOLDEN)   mod 2^64
// fmix64 is the murmur3 finaliser (a bijection), w the word's position in the tensor.
// Integer addition mod 2^64 is exact and associative, so every reduction order gives the
// same bits: the value equals the CPU implementation for the same bytes, whatever the
// grid. docs/fingerprints.md states what the fingerprint guarantees.
//
// aegis_fp_blocks  out[b] = Σ over words [b·bw, (b+1)·bw) — per-block fingerprints that
//                  localise a difference; a CTA owns whole blocks (grid-stride over them),
//                  so each slot is written once after a fixed-shape block reduction.
//                  Threads stream 16-byte vectors (two words), FP_UNROLL loads in flight.
// aegis_fp_sum     out[0] = Σ in[i] mod 2^64 (one CTA): whole-tensor value from the blocks.
//
// The data pointer must be 16-byte aligned (aegis_cli/fingerprint_cuda.py copies a tensor
// that is not). One mix per 8 bytes, whatever the dtype, keeps the kernel memory-bound.

typedef unsigned long long u64;

#define FP_THREADS 256
#ifndef FP_UNROLL
#define FP_UNROLL 4
#endif
#define FP_KEY 0xA5E615D0C0FFEE11ULL
#define FP_GOLDEN 0x9E3779B97F4A7C15ULL
#define FP_M1 0xFF51AFD7ED558CCDULL
#define FP_M2 0xC4CEB9FE1A85EC53ULL

__device__ __forceinline__ u64 fmix64(u64 k) {
    k ^= k >> 33;
    k *= FP_M1;
    k ^= k >> 33;
    k *= FP_M2;
    k ^= k >> 33;
    return k;
}

__device__ __forceinline__ u64 fp_term(u64 word, u64 pos) { return fmix64(word ^ FP_KEY ^ (pos * FP_GOLDEN)); }

__device__ __forceinline__ u64 fp_pair(uint4 v, u64 pos) {
    const u64 lo = ((u64)v.y << 32) | v.x;
    const u64 hi = ((u64)v.w << 32) | v.z;
    return fp_term(lo, pos) + fp_term(hi, pos + 1);
}

// Sum of v over the CTA, valid in thread 0. Ends with a barrier so smem can be reused.
__device__ __forceinline__ u64 block_sum(u64 v, u64* smem) {
#pragma unroll
    for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (lane == 0) smem[warp] = v;
    __syncthreads();
    if (warp == 0) {
        v = lane < (int)(blockDim.x >> 5) ? smem[lane] : 0ULL;
#pragma unroll
        for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    }
    __syncthreads();
    return v;
}

extern "C" __global__ void __launch_bounds__(FP_THREADS)
aegis_fp_blocks(const unsigned char* __restrict__ data, long long nbytes, long long bw,
                u64* __restrict__ out, long long nblocks) {
    __shared__ u64 smem[32];
    const long long nfull = nbytes >> 3;  // whole words
    const int tail = (int)(nbytes & 7);   // bytes of the zero-padded last word
    const u64* __restrict__ wd = reinterpret_cast<const u64*>(data);
    const uint4* __restrict__ vec = reinterpret_cast<const uint4*>(data);
    for (long long b = blockIdx.x; b < nblocks; b += gridDim.x) {
        const long long w0 = b * bw;
        const long long w1 = min(w0 + bw, nfull);  // may be < w0 for a block holding only the tail
        u64 acc = 0;
        long long ws = w0;
        if (ws < w1 && (ws & 1)) {  // odd start: one word alone, then aligned pairs
            if (threadIdx.x == 0) acc += fp_term(wd[ws], (u64)ws);
            ++ws;
        }
        const long long np = w1 > ws ? (w1 - ws) >> 1 : 0;
        const uint4* __restrict__ v0 = vec + (ws >> 1);
        long long i = threadIdx.x;
        for (; i + (long long)(FP_UNROLL - 1) * FP_THREADS < np; i += (long long)FP_UNROLL * FP_THREADS) {
            uint4 v[FP_UNROLL];
#pragma unroll
            for (int u = 0; u < FP_UNROLL; ++u) v[u] = __ldcs(v0 + i + u * FP_THREADS);
#pragma unroll
            for (int u = 0; u < FP_UNROLL; ++u) acc += fp_pair(v[u], (u64)(ws + 2 * (i + u * FP_THREADS)));
        }
        for (; i < np; i += FP_THREADS) acc += fp_pair(__ldcs(v0 + i), (u64)(ws + 2 * i));
        if (w1 > ws && ((w1 - ws) & 1) && threadIdx.x == 0) acc += fp_term(wd[w1 - 1], (u64)(w1 - 1));
        if (tail && nfull >= w0 && nfull < w0 + bw && threadIdx.x == 0) {
            u64 last = 0;
            for (int j = 0; j < tail; ++j) last |= (u64)data[8 * nfull + j] << (8 * j);
            acc += fp_term(last, (u64)nfull);
        }
        acc = block_sum(acc, smem);
        if (threadIdx.x == 0) out[b] = acc;
    }
}

extern "C" __global__ void __launch_bounds__(1024)
aegis_fp_sum(const u64* __restrict__ in, long long n, u64* __restrict__ out) {
    __shared__ u64 smem[32];
    u64 acc = 0;
    for (long long i = threadIdx.x; i < n; i += blockDim.x) acc += in[i];
    acc = block_sum(acc, smem);
    if (threadIdx.x == 0) out[0] = acc;
}
