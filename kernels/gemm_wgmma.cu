// gemm_wgmma.cu — Hopper checked GEMM: TMA + mbarrier pipeline + wgmma (v3, sm_90a).
//
// Same contract as gemm_mma.cu (bf16 in, fp32 accumulate, bf16 out, fp32-accumulator
// row/column checksums per 64x128 checksum tile in a fixed order, SM id per tile), built
// for speed on H100/H200:
// - persistent grid (one CTA per SM) walking 128x256 output tiles in grouped order, so the
//   producer prefetches the next tile while consumers run the epilogue;
// - warpgroup 0 is the producer: one thread issues cp.async.bulk.tensor (TMA) copies of
//   A and B k-blocks (64 wide, 128B-swizzled) into a STAGES-deep ring, completing on
//   "full" mbarriers; setmaxnreg gives its registers to the consumers;
// - warpgroups 1 and 2 are consumers: each owns 64 rows x 256 cols of the tile in 128
//   fp32 registers per thread and issues wgmma.m64n256k16 straight from shared memory,
//   releasing a stage ("empty" mbarrier) once the wgmma group that read it retired.
// Layouts: K-major operands use the standard swizzled K-major descriptor; MN-major
// operands (A of wgrad, B of dgrad/wgrad) are loaded as 64(MN)x64(K) boxes and fed with
// the wgmma transpose bit, so no layout needs a transpose pass.
// Epilogue (per consumer; no barrier shared between the two), in two phases around the next
// tile's first EARLY k-blocks, which are issued in between so the tensor cores have work
// while the latency-bound part runs: phase 1 reads the accumulator (C stores first, packed and
// pair-swapped straight from it into whole 32-byte sectors; then row sums in-thread and over
// the 4 lanes of a row, column partials of the thread's two rows and the first step of their
// halving exchange over the 8 row-lanes); phase 2 finishes the column reduction over the
// row-lanes and then over the warpgroup's 4 warps in warp order through shared memory
// (double-buffered by tile parity, bank-rotated: one barrier per tile). Each checksum slot has
// one owner; no atomics. -DAEGIS_INJECT and -DAEGIS_NOSUMS as in gemm_mma.cu.
// History: v1 ran the whole epilogue between main loops and stored C as 4-byte pairs; v2 split
// it around the next k-blocks with whole-sector stores (checked GEMM 0.93-0.98x -> 0.99-1.05x
// cuBLAS on the H200's large shapes); v3 (this) issues the C stores before the checksum work
// (checksum cost at K = 3584 2.5 -> 1.7 %, same bits).
#include "common.cuh"

#define BM 128
#define BN 256
#define BK 64
#define CTM 64   // checksum tile: 64 rows (one consumer warpgroup) x 128 columns (half the CTA
#define CTN 128  // tile), as in gemm_mma.cu
#ifndef STAGES
#define STAGES 4
#endif
#ifndef EARLY
#define EARLY 2  // k-blocks of the next tile issued before the epilogue's second phase (1 or 2)
#endif
#ifndef GROUP_M
#define GROUP_M 16  // tiles of BM rows walked together for L2 reuse of B
#endif
#ifndef MN_LBO
#define MN_LBO 8192  // MN-major: bytes between 64-wide MN blocks (one TMA box)
#endif
#ifndef MN_SBO
#define MN_SBO 1024  // MN-major: bytes between groups of 8 k rows
#endif
// Which checksums the build computes: both, unless -DAEGIS_NOSUMS (plain kernel) or one of the
// experiment knobs -DAEGIS_NO_ROWSUMS / -DAEGIS_NO_COLSUMS (time the other alone).
#if !defined(AEGIS_NOSUMS) && !defined(AEGIS_NO_ROWSUMS)
#define AEGIS_ROWS 1
#endif
#if !defined(AEGIS_NOSUMS) && !defined(AEGIS_NO_COLSUMS)
#define AEGIS_COLS 1
#endif
#define A_STAGE_BYTES (BM * BK * 2)
#define B_STAGE_BYTES (BN * BK * 2)
#define NTHREADS 384
// Shared memory the host grants (cuda.py _wgmma_smem): ring + barriers + column-sum scratch
// + the staged bias (2 KB) + slack to align the ring to 1024 B; the AEGIS_ABFT_ROWS builds add
// ABFT_SMEM.

struct __align__(64) TmaDesc {
    unsigned long long v[16];
};

__device__ __forceinline__ void mbar_init(uint32_t bar, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count));
}
__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.release.cta.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
    asm volatile("mbarrier.arrive.release.cta.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint32_t bar, unsigned parity) {
    uint32_t ok;
    do {
        asm volatile(
            "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}"
            : "=r"(ok) : "r"(bar), "r"(parity) : "memory");
    } while (!ok);
}
__device__ __forceinline__ void tma_load_2d(uint32_t dst, const TmaDesc* map, int c0, int c1, uint32_t bar) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];"
        ::"r"(dst), "l"(reinterpret_cast<unsigned long long>(map)), "r"(c0), "r"(c1), "r"(bar) : "memory");
}

#ifdef AEGIS_ABFT_PRE
__device__ __forceinline__ void bulk_load(uint32_t dst, const void* src, unsigned bytes, uint32_t bar) {  // 1D, no tensor map
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 ::"r"(dst), "l"(reinterpret_cast<unsigned long long>(src)), "r"(bytes), "r"(bar) : "memory");
}
#define ABFT_PRE_PARAM , const unsigned char* __restrict__ rt_pieces
#define ABFT_PRE_ARG , rt_pieces
#else
#define ABFT_PRE_PARAM
#define ABFT_PRE_ARG
#endif

// Shared-memory matrix descriptor, 128B swizzle (layout type 1 in bits 62-63).
__device__ __forceinline__ uint64_t make_desc(uint32_t addr, uint32_t lbo, uint32_t sbo) {
    return (uint64_t)((addr & 0x3FFFF) >> 4) | ((uint64_t)(lbo >> 4) << 16) | ((uint64_t)(sbo >> 4) << 32) |
           (1ull << 62);
}

template <int TA, int TB>
__device__ __forceinline__ void wgmma_256(float* d, uint64_t da, uint64_t db, int scale_d) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63,%64,%65,%66,%67,%68,%69,%70,%71,%72,%73,%74,%75,%76,%77,%78,%79,%80,%81,%82,%83,%84,%85,%86,%87,%88,%89,%90,%91,%92,%93,%94,%95,%96,%97,%98,%99,%100,%101,%102,%103,%104,%105,%106,%107,%108,%109,%110,%111,%112,%113,%114,%115,%116,%117,%118,%119,%120,%121,%122,%123,%124,%125,%126,%127}, %128, %129, p, 1, 1, %131, %132;\n}"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),
          "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),
          "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]),
          "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]),
          "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]),
          "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),
          "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]),
          "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]),
          "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
        : "l"(da), "l"(db), "r"(scale_d), "n"(TA), "n"(TB));
}
// bf16 output of one consumer thread's accumulator fragment, packed and stored straight from the
// accumulator 16 columns at a time, so it needs no packed copy of C in registers and can be
// issued before the checksum work. When N is a multiple of 4 the lanes of a pair (tig, tig^1)
// swap halves (one shuffle per two pairs) so that each lane holds 4 consecutive columns and a
// quad writes 32 contiguous bytes of its row per instruction: whole 32-byte sectors, where one
// 32-bit store per pair wrote 16 bytes into each of 8 rows' sectors (Nsight Compute: 15.5 of 32
// bytes used; the stores cost ~10 % of the kernel at K = 3584). Other N: one 32-bit store per
// pair, or per element at odd N. d[n8*4 + h*2 + j] is row row0 + 8h, column col0 + 8·n8 + j.
// With ``sbias`` (the tile's 256 column biases staged in shared memory, else null) each output is
// the rounded accumulator plus its column's bias, rounded again: bf16(float(bf16(acc)) + float(bias)),
// the bits of torch's bf16 add of the bias to this kernel's C (bias_add). Staged once per tile by
// the consumer warpgroup (one pair per thread, loaded during the main loop): per-element loads
// from global memory here, in the latency-bound phase 1, cost the forward 25 % (H200, in the step).
__device__ __forceinline__ void store_c(const float (&d)[128], bool odd, bf16* __restrict__ C, const __nv_bfloat162* sbias,
                                        int M, int N, int row0, int col0) {
    auto pair = [&](int n8, int h) {
        const __nv_bfloat162 v = __floats2bfloat162_rn(d[n8 * 4 + h * 2], d[n8 * 4 + h * 2 + 1]);
        return sbias ? bias_add(v, sbias[((col0 % BN) >> 1) + n8 * 4]) : v;
    };
    if ((N & 3) == 0) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int r = row0 + 8 * h;
            bf16* crow = C + (long long)r * N;
#pragma unroll
            for (int m = 0; m < 16; ++m) {  // n8 = 2m (a) and 2m+1 (b)
                const __nv_bfloat162 pa = pair(2 * m, h), pb = pair(2 * m + 1, h);
                const uint32_t xa = *reinterpret_cast<const uint32_t*>(&pa), xb = *reinterpret_cast<const uint32_t*>(&pb);
                const uint32_t recv = __shfl_xor_sync(0xffffffffu, odd ? xa : xb, 1);
                // even lane: columns 16m + 2tig .. +3 = (own a, partner's a); odd lane: columns
                // 16m + 8 + 2(tig-1) .. +3 = (partner's b, own b)
                const uint32_t lo = odd ? recv : xa, hi = odd ? xb : recv;
                const int cc = col0 - (col0 & 2) + 16 * m + (odd ? 8 : 0);
                if (r < M && cc < N) *reinterpret_cast<uint2*>(crow + cc) = make_uint2(lo, hi);
            }
        }
        return;
    }
    const bool pair_ok = (N & 1) == 0;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int r = row0 + 8 * h;
        if (r >= M) continue;
        bf16* crow = C + (long long)r * N;
#pragma unroll
        for (int n8 = 0; n8 < 32; ++n8) {
            const int cc = col0 + n8 * 8;
            const __nv_bfloat162 v = pair(n8, h);
            if (pair_ok && cc + 1 < N) {
                *reinterpret_cast<__nv_bfloat162*>(crow + cc) = v;
            } else {
                if (cc < N) crow[cc] = __low2bfloat16(v);
                if (cc + 1 < N) crow[cc + 1] = __high2bfloat16(v);
            }
        }
    }
}
// Column-sum scratch index of column col (0..BN) within a warp's row: each 32-column block is
// rotated by 8·(block mod 4) words, so the float2 partials of a warp's 4 row-lane groups land in
// distinct banks (the plain layout was 8-way conflicted); a 32-column read stays conflict-free.
__device__ __forceinline__ int red_idx(int col) { return (col & ~31) | ((col + ((col >> 2) & 24)) & 31); }

#if defined(AEGIS_BURN) || defined(AEGIS_BURN1)
// Experiment: N independent instructions per thread that the compiler cannot drop (the result is
// stored only if it equals a value it never reaches), of the kind AEGIS_BURN_KIND (0: FFMA,
// 1: SHFL, 2: FSEL on a lane-dependent predicate, 3: FADD): ALU work of about the checksums' size,
// placed where the checksums run, to tell issue/energy cost from latency and price each kind.
#ifndef AEGIS_BURN_KIND
#define AEGIS_BURN_KIND 0
#endif
template <int N>
__device__ __forceinline__ void burn(float seed, float* sink) {
    float x[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) x[i] = seed + i;
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int n = 0; n < N / 8; ++n) {
#if AEGIS_BURN_KIND == 2
        const bool p = (lane >> (n % 5)) & 1;  // a different predicate each round: no select folding
        float y[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) y[i] = p ? x[i] : x[(i + 1 + n) & 7];
#pragma unroll
        for (int i = 0; i < 8; ++i) x[i] = y[i];
#else
#pragma unroll
        for (int i = 0; i < 8; ++i) {
#if AEGIS_BURN_KIND == 1
            x[i] = __shfl_xor_sync(0xffffffffu, x[i], 1 << (n % 5));
#elif AEGIS_BURN_KIND == 3
            x[i] = x[i] + x[(i + 1 + n) & 7];
#else
            x[i] = fmaf(x[i], 1.0001f, 0.5f);
#endif
        }
#endif
    }
    (void)lane;
    float t = 0.f;
#pragma unroll
    for (int i = 0; i < 8; ++i) t += x[i];
    if (t == -1.2345f) *sink = t;
}
#endif
#if defined(AEGIS_PROBE_ROWS) || defined(AEGIS_PROBE_COLS) || defined(AEGIS_ABFT_ROWS) || defined(AEGIS_PROBE_TCSUMS)
// Experiment knobs (benchmarks/abft_floor.py): the tensor-core cost of in-GEMM ABFT checksum
// columns, timed without their data. AEGIS_PROBE_ROWS: one m64n8k16 a consumer per k16 beside the
// m64n256k16 (B's tile sums, three bf16 pieces per 128-column checksum tile, as 8 extra columns:
// the row check's expected sums); AEGIS_PROBE_COLS: two m64n8k16 a consumer with B's stage as the
// A operand (its 256 columns as rows) and 8 columns (A's tile sums, in pieces) as B: the column
// check's; AEGIS_PROBE_TCSUMS (with _ROWS): B's tile sums made on the tensor cores, sixteen
// m64n8k16 a stage with the B stage as the A operand (its 64 k as rows, 256 n as the reduction)
// and a selector of ones as B (A's stage stands in for it here), each consumer for itself (with
// _COLS also A's tile sums over its 64 rows, one more a k16). They
// read the stages' own bf16 data and accumulate into registers only a never-true test reads (ptxas
// drops an MMA whose result nothing reads): C and the sums are the plain build's.
template <int TA, int TB>
__device__ __forceinline__ void wgmma_n8(float* e, uint64_t da, uint64_t db, int scale_d = 1) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %8, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16 {%0,%1,%2,%3}, %4, %5, p, 1, 1, %6, %7;\n}"
        : "+f"(e[0]), "+f"(e[1]), "+f"(e[2]), "+f"(e[3])
        : "l"(da), "l"(db), "n"(TA), "n"(TB), "r"(scale_d));
}
#endif
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory"); }
// Barrier of one consumer warpgroup only (ids 1, 2): the two consumers never wait on each
// other in the epilogue, so one can run its epilogue while the other still issues wgmma.
__device__ __forceinline__ void wg_bar(int c) {
    if (c == 0)
        asm volatile("bar.sync 1, 128;" ::: "memory");
    else
        asm volatile("bar.sync 2, 128;" ::: "memory");
}

// One step of the halving exchange: lanes LANE_XOR apart each give away HALF partials and
// add the partner's copy of the ones they keep (upper: keep v[HALF..2*HALF)).
template <int HALF>
__device__ __forceinline__ void halve_exchange(float* v, bool upper) {
#pragma unroll
    for (int q = 0; q < HALF; ++q) {
        const float send = upper ? v[q] : v[q + HALF];
        const float keep = upper ? v[q + HALF] : v[q];
        v[q] = keep + __shfl_xor_sync(0xffffffffu, send, HALF / 2);
    }
}

// Persistent tile order: GROUP_M row tiles at a time, all their column tiles, then the next group.
__device__ __forceinline__ void tile_coords(int t, int tiles_m, int tiles_n, int& bm, int& bc) {
    int per_group = GROUP_M * tiles_n;
    int first = (t / per_group) * GROUP_M;
    int gsz = min(tiles_m - first, GROUP_M);
    int r = t % per_group;
    bm = first + r % gsz;
    bc = r / gsz;
}

// Which mainloop fault (shift/skipk) a CTA tile runs under: the host gives all checksum
// tiles of a CTA tile the same mainloop mode, so its first one decides.
__device__ __forceinline__ int cta_mode(const InjectParams& inj, int bm, int bc, int tnc, int smid) {
#ifdef AEGIS_INJECT
    const int m = inject_tile_mode(inj, (2 * bm) * tnc + 2 * bc, smid);
    if (m == TILE_SHIFT || m == TILE_SKIPK) return m;
#endif
    return TILE_NONE;
}

#ifdef AEGIS_ABFT_ROWS
// Experiment build (benchmarks/abft_floor.py): the row check inside the GEMM, nothing read twice
// from memory. Each consumer makes B's tile sums of each stage on the tensor cores (sixteen
// m64n8k16: the stage as the A operand, its 64 k as rows and 256 n as the reduction, against a
// selector of ones), one stage ahead of the main MMAs, splits them into three bf16 pieces (hi,
// mid, lo: fp32's 24 bits) and writes them as the 8 K-major columns (6 used) of an n8 operand it
// multiplies beside each k16: the expected row sums of its 64 rows, which this build writes in
// place of the observed ones (the benchmark compares them with the checked build's and fp64).
// AEGIS_ABFT_PRE (with _ROWS): the same check MMAs, their pieces made outside the kernel (B's tile
// sums, split on the host) and loaded with each stage by one 1 KB bulk copy, already in the 128B
// swizzle: [column block][k-block][8 rows × 64 k], no tile sums in the kernel and no wait for them.
#define ABFT_SMEM (1024 + 1024 + 4 * 1024)  // alignment, the selector atom, T[2 consumers][2 parities] (PRE: a 1 KB piece a stage)

__device__ __forceinline__ void split3(float v, bf16* out) {  // v = hi + mid + lo to fp32's 24 bits
    const bf16 hi = __float2bfloat16_rn(v);
    const float r1 = v - __bfloat162float(hi);
    const bf16 mid = __float2bfloat16_rn(r1);
    out[0] = hi;
    out[1] = mid;
    out[2] = __float2bfloat16_rn(r1 - __bfloat162float(mid));
}
#endif

template <bool A_KMAJOR, bool B_KMAJOR>
__device__ __forceinline__ void gemm_wgmma_body(const TmaDesc* tmA, const TmaDesc* tmB, bf16* __restrict__ C,
                                                float* __restrict__ row_sums, float* __restrict__ col_sums,
                                                int* __restrict__ tile_sm, const bf16* __restrict__ bias, int M, int N,
                                                int K, const InjectParams& inj ABFT_PRE_PARAM) {
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    // 1024-byte alignment for the 128B swizzle pattern
    const uint32_t raw = smem_u32(smem_raw);
    unsigned char* smem = smem_raw + (((raw + 1023) & ~1023u) - raw);
    const uint32_t sA = smem_u32(smem);
    const uint32_t sB = sA + STAGES * A_STAGE_BYTES;
    uint64_t* bars = reinterpret_cast<uint64_t*>(smem + STAGES * (A_STAGE_BYTES + B_STAGE_BYTES));
    float* red_col = reinterpret_cast<float*>(bars + 2 * STAGES);  // [2 tile parities][8 consumer warps][BN]
    (void)red_col;  // unused in the -DAEGIS_NOSUMS build
    // the bias of a tile's columns, [2 consumers][2 tile parities][BN / 2 pairs] (with a bias only)
    __nv_bfloat162* sbias = reinterpret_cast<__nv_bfloat162*>(red_col + 2 * 8 * BN);
    const uint32_t full0 = smem_u32(bars), empty0 = smem_u32(bars + STAGES);
#ifdef AEGIS_ABFT_PRE
    const uint32_t sR = (smem_u32(sbias + 2 * BN) + 1023) & ~1023u;  // STAGES pieces of 8 rows x 64 k
#elif defined(AEGIS_ABFT_ROWS)
    const uint32_t sSel = (smem_u32(sbias + 2 * BN) + 1023) & ~1023u;  // 8 rows x 64 n: row 0 ones
    const uint32_t sT = sSel + 1024;
    for (int i = threadIdx.x; i < 5 * 1024 / 16; i += NTHREADS) {  // the selector, then T zeroed (columns 6, 7 stay 0)
        const uint32_t one = i < 8 ? 0x3F803F80u : 0u;
        asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};" ::"r"(sSel + 16 * i), "r"(one) : "memory");
    }
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
#endif

    const int tiles_m = (M + BM - 1) / BM, tiles_n = (N + BN - 1) / BN;
    const int tn128 = (N + CTN - 1) / CTN;
    const int n_tiles = tiles_m * tiles_n;
    const int KT = (K + BK - 1) / BK;
    const int smid = aegis_smid();
    const int wg = threadIdx.x >> 7;

    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(full0 + 8 * s, 1);
            mbar_init(empty0 + 8 * s, 2);
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();

    if (wg == 0) {  // ---------------- producer ----------------
        asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
        if (threadIdx.x == 0) {
            int it = 0;
            for (int t = blockIdx.x; t < n_tiles; t += gridDim.x) {
                int bm, bc;
                tile_coords(t, tiles_m, tiles_n, bm, bc);
                const int mode = cta_mode(inj, bm, bc, tn128, smid);
                int a_m0 = bm * BM;
                if (mode == TILE_SHIFT) a_m0 = ((bm + 1) % tiles_m) * BM;
                const int n0 = bc * BN;
                for (int kt = 0; kt < KT; ++kt, ++it) {
                    const int s = it % STAGES;
                    if (it >= STAGES) mbar_wait(empty0 + 8 * s, ((it / STAGES) - 1) & 1);
                    const uint32_t fb = full0 + 8 * s;
#ifdef AEGIS_ABFT_PRE
                    mbar_expect_tx(fb, A_STAGE_BYTES + B_STAGE_BYTES + 1024);
                    bulk_load(sR + s * 1024, rt_pieces + ((long long)bc * KT + kt) * 1024, 1024, fb);
#else
                    mbar_expect_tx(fb, A_STAGE_BYTES + B_STAGE_BYTES);
#endif
                    const uint32_t a_dst = sA + s * A_STAGE_BYTES, b_dst = sB + s * B_STAGE_BYTES;
                    int k0 = kt * BK;
#ifdef AEGIS_INJECT
                    // skipk: the dropped k-block is loaded from beyond K, which TMA fills with
                    // zeros, so the consumers multiply it like any other and add nothing (no
                    // branch around a wgmma, which would make ptxas serialise them)
                    if (mode == TILE_SKIPK && kt == inj.kstep) k0 = KT * BK;
#endif
                    if (A_KMAJOR) {
                        tma_load_2d(a_dst, tmA, k0, a_m0, fb);
                    } else {
#pragma unroll
                        for (int j = 0; j < BM / 64; ++j) tma_load_2d(a_dst + j * 8192, tmA, a_m0 + 64 * j, k0, fb);
                    }
                    if (B_KMAJOR) {
                        tma_load_2d(b_dst, tmB, k0, n0, fb);
                    } else {
#pragma unroll
                        for (int j = 0; j < BN / 64; ++j) tma_load_2d(b_dst + j * 8192, tmB, n0 + 64 * j, k0, fb);
                    }
                }
            }
        }
        return;
    }

    // ---------------- consumers ----------------
    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
    int t = blockIdx.x;
    if (t >= n_tiles) return;
    const int c = wg - 1;                  // consumer index: rows c*64 .. c*64+63 of the tile
    const int cw = (threadIdx.x - 128) >> 5;  // consumer warp 0..7, in row order
    const int lane = threadIdx.x & 31, g = lane >> 2, tig = lane & 3;
    const bool leader = (threadIdx.x & 127) == 0;
    float d[128];
#pragma unroll
    for (int i = 0; i < 128; ++i) d[i] = 0.f;  // never read: each tile's first wgmma has scale-d 0
#if defined(AEGIS_PROBE_ROWS) || defined(AEGIS_PROBE_COLS) || defined(AEGIS_ABFT_ROWS) || defined(AEGIS_PROBE_TCSUMS)
    float probe[24] = {};
#endif
    int it = 0, ti = 0;  // k-block counter (ring position), tile counter (scratch parity)
#if defined(AEGIS_ABFT_ROWS) && !defined(AEGIS_ABFT_PRE)
    const int total_it = (n_tiles - blockIdx.x + gridDim.x - 1) / gridDim.x * KT;  // this CTA's ring positions
    float tacc[8];
    // B's tile sums of ring position p: tiles 0 and 1 into column 0 of tacc[0..3] and tacc[4..7]
    auto tsum_issue = [&](int p) {
        const int s = p % STAGES;
        mbar_wait(full0 + 8 * s, (p / STAGES) & 1);
        wgmma_fence();
        const uint32_t b0 = sB + s * B_STAGE_BYTES;
#pragma unroll
        for (int nstep = 0; nstep < 16; ++nstep) {  // 16 n a step
            const uint64_t dbs = B_KMAJOR ? make_desc(b0 + nstep * 2048, MN_LBO, MN_SBO)
                                          : make_desc(b0 + (nstep >> 2) * 8192 + (nstep & 3) * 32, 16, 1024);
            wgmma_n8<B_KMAJOR ? 1 : 0, 0>(tacc + 4 * (nstep >> 3), dbs, make_desc(sSel + (nstep & 3) * 32, 16, 1024),
                                          (nstep & 7) ? 1 : 0);
        }
        wgmma_commit();
    };
    // once that group retired: the pieces into this consumer's T of parity p & 1 (row 3·tile + piece)
    auto tsum_store = [&](int p) {
        const uint32_t tb = sT + (c * 2 + (p & 1)) * 1024;
        if (tig == 0) {
            bf16 pc[3];
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int k = (cw & 3) * 16 + g + 8 * h;
#pragma unroll
                for (int tile = 0; tile < 2; ++tile) {
                    split3(tacc[4 * tile + 2 * h], pc);
#pragma unroll
                    for (int q = 0; q < 3; ++q) {
                        const int row = 3 * tile + q;
                        asm volatile("st.shared.u16 [%0], %1;" ::"r"(tb + row * 128 + (((k >> 3) ^ row) << 4) + (k & 7) * 2),
                                     "h"(__bfloat16_as_ushort(pc[q])) : "memory");
                    }
                }
            }
        }
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // the wgmma reads them through the async proxy
        wg_bar(c);
    };
    tsum_issue(0);
    wgmma_wait<0>();
    tsum_store(0);
#endif
    // Wait for ring position `it`, issue k-block kt of the current tile (the first one overwrites
    // the accumulator: scale-d 0) and commit the group (retired later). Returns the stage it read.
    auto issue = [&](int kt) {
        const int s = it % STAGES;
        mbar_wait(full0 + 8 * s, (it / STAGES) & 1);
#if defined(AEGIS_ABFT_ROWS) && !defined(AEGIS_ABFT_PRE)
        // the next stage's tile sums, ahead of this one's MMAs (after the last, this stage's again,
        // unused: no branch around a wgmma, which would make ptxas serialise them)
        tsum_issue(it + 1 < total_it ? it + 1 : it);
#endif
        wgmma_fence();
        const uint32_t a0 = sA + s * A_STAGE_BYTES + c * 8192;  // 64 rows: K-major 64x128B, MN-major one box
        const uint32_t b0 = sB + s * B_STAGE_BYTES;
#pragma unroll
        for (int ks = 0; ks < BK / 16; ++ks) {
            uint64_t da = A_KMAJOR ? make_desc(a0 + ks * 32, 16, 1024) : make_desc(a0 + ks * 2048, MN_LBO, MN_SBO);
            uint64_t db = B_KMAJOR ? make_desc(b0 + ks * 32, 16, 1024) : make_desc(b0 + ks * 2048, MN_LBO, MN_SBO);
            wgmma_256<A_KMAJOR ? 0 : 1, B_KMAJOR ? 0 : 1>(d, da, db, (kt == 0 && ks == 0) ? 0 : 1);
#ifdef AEGIS_ABFT_PRE
            wgmma_n8<A_KMAJOR ? 0 : 1, 0>(probe, da, make_desc(sR + s * 1024 + ks * 32, 16, 1024), (kt == 0 && ks == 0) ? 0 : 1);
#elif defined(AEGIS_ABFT_ROWS)
            wgmma_n8<A_KMAJOR ? 0 : 1, 0>(probe, da, make_desc(sT + (c * 2 + (it & 1)) * 1024 + ks * 32, 16, 1024),
                                          (kt == 0 && ks == 0) ? 0 : 1);
#endif
#ifdef AEGIS_PROBE_ROWS
            wgmma_n8<A_KMAJOR ? 0 : 1, B_KMAJOR ? 0 : 1>(probe, da, db);  // B's first 8 rows stand in for the sums
#endif
#ifdef AEGIS_PROBE_TCSUMS
#pragma unroll
            for (int j = 0; j < 4; ++j) {  // B's tile sums on the tensor cores: the stage as A (64 k x 256 n), a selector as B
                const int nstep = 4 * ks + j;  // 16 n a step, 16 steps over the stage's 256 n; tiles 0 and 1 apart
                const uint64_t dbs = B_KMAJOR ? make_desc(b0 + nstep * 2048, MN_LBO, MN_SBO)
                                              : make_desc(b0 + (nstep >> 2) * 8192 + (nstep & 3) * 32, 16, 1024);
                wgmma_n8<B_KMAJOR ? 1 : 0, 0>(probe + 12 + 4 * (nstep >> 3), dbs, make_desc(a0 + ks * 32, 16, 1024));
            }
#ifdef AEGIS_PROBE_COLS  // and wgrad's A tile sums (this consumer's 64 m as the reduction, 16 a step)
            wgmma_n8<0, 0>(probe + 20, make_desc(a0 + ks * 32, 16, 1024), make_desc(b0 + ks * 32, 16, 1024));
#endif
#endif
#ifdef AEGIS_PROBE_COLS
#pragma unroll
            for (int j = 0; j < 2; ++j) {  // this consumer's 128 of B's columns as two m64 A operands
                const uint32_t bj = b0 + (2 * c + j) * 8192;
                const uint64_t dbt = B_KMAJOR ? make_desc(bj + ks * 32, 16, 1024) : make_desc(bj + ks * 2048, MN_LBO, MN_SBO);
                const uint64_t dat = A_KMAJOR ? make_desc(a0 + ks * 32, 16, 1024) : make_desc(a0 + ks * 2048, MN_LBO, MN_SBO);
                wgmma_n8<B_KMAJOR ? 0 : 1, A_KMAJOR ? 0 : 1>(probe + 4 * (1 + j), dbt, dat);
            }
#endif
        }
        wgmma_commit();
#if defined(AEGIS_ABFT_ROWS) && !defined(AEGIS_ABFT_PRE)
        wgmma_wait<1>();  // the tile sums retired (the main MMAs may still run): their pieces for the next stage
        tsum_store(it + 1);
#endif
        ++it;
        return s;
    };

    int bm, bc;
    tile_coords(t, tiles_m, tiles_n, bm, bc);
    // the bias pair this thread stages for the tile (columns 2·tt, 2·tt + 1), loaded a main loop ahead
    const int tt2 = 2 * (threadIdx.x & 127);
    __nv_bfloat162 bias_next = bias ? bias_load(bias, bc * BN + tt2, N) : __nv_bfloat162();
    // The first EARLY k-blocks of a tile are issued ahead of its main loop: here for the first
    // tile, inside the previous tile's epilogue for the others. head0 is the stage of k-block 0
    // when two were issued (-1 otherwise), prev the stage of the last one issued.
    int head0 = -1, prev;
    auto issue_head = [&]() {
        prev = issue(0);
        head0 = -1;
        if (EARLY > 1 && KT > 1) {
            head0 = prev;
            prev = issue(1);
        }
    };
    issue_head();
#ifdef AEGIS_TIMING  // experiment knob: per-tile cycle counts of consumer warp 0, in place of tile_sm
    long long t_prev = clock64(), t_end = 0, t_p1 = 0;
#endif
    for (;;) {
        if (head0 >= 0) {
            wgmma_wait<1>();  // k-block 0 has retired
            if (leader) mbar_arrive(empty0 + 8 * head0);
        }
        for (int kt = (EARLY > 1 && KT > 1) ? 2 : 1; kt < KT; ++kt) {
            const int s = issue(kt);
            wgmma_wait<1>();  // the group before this one has retired: its stage is free
            if (leader) mbar_arrive(empty0 + 8 * prev);
            prev = s;
        }
        wgmma_wait<0>();
        if (leader) mbar_arrive(empty0 + 8 * prev);
#ifdef AEGIS_TIMING
        t_end = clock64();
#endif

        __nv_bfloat162* tbias = nullptr;
        if (bias) {  // stage this tile's bias (the buffer of its parity: the last reads of it were two tiles ago)
            tbias = sbias + (c * 2 + (ti & 1)) * (BN / 2);
            tbias[tt2 >> 1] = bias_next;
            wg_bar(c);
        }
        // d[n8*4 + h*2 + j] sits at row bm*BM + c*64 + (cw&3)*16 + g + 8h, col bc*BN + n8*8 + 2*tig + j
        const int row0 = bm * BM + c * 64 + (cw & 3) * 16 + g;
        const int col0 = bc * BN + 2 * tig;
        const int tr = 2 * bm + c;  // this consumer's row of checksum tiles
#ifdef AEGIS_INJECT
        {
            const int t0 = tr * tn128 + 2 * bc;  // this consumer's checksum tiles
            const bool live = tr * CTM < M, two = 2 * bc + 1 < tn128;
            const int mode0 = live ? inject_tile_mode(inj, t0, smid) : TILE_NONE;
            const int mode1 = live && two ? inject_tile_mode(inj, t0 + 1, smid) : TILE_NONE;
            const int e0 = live && inj.n_edits ? inj.edit_off[t0] : 0;
            const int e1 = live && inj.n_edits ? inj.edit_off[t0 + (two ? 2 : 1)] : 0;
            auto pos = [&](int i, int& r, int& cc) {
                r = row0 + 8 * ((i >> 1) & 1);
                cc = col0 + (i >> 2) * 8 + (i & 1);
            };
            inject_fragment<128>(inj, d, pos, [&](int i) { return (i >> 2) < 16 ? mode0 : mode1; }, M, N, e0, e1);
        }
#endif
        // The epilogue runs in two phases around the next tile's first EARLY k-blocks. Phase 1
        // reads the fp32 accumulator: the C stores (packed and swapped straight from it), then
        // the row sums, the column partials of the thread's two rows and their first halving
        // exchange. Then the next tile's first wgmma groups are issued into the same registers
        // (scale-d 0), and phase 2 (the rest of the column reduction, the cross-warp exchange,
        // the column-sum stores) runs while the tensor cores work. Registers bound the split:
        // beside the in-flight accumulator (128) there is room for 32 column partials, not 64.
        // Stores first: the checksum arithmetic then issues while they drain, where with the
        // stores last (packed C held in registers) the checked kernel paid a point more at
        // K = 3584 and two at K = 1024 (benchmarks/RESULTS.md, "Cycles per tile").
#ifndef AEGIS_NO_CSTORE  // experiment knob: time the kernel without its C stores (C left unwritten)
        store_c(d, tig & 1, C, tbias, M, N, row0, col0);
#endif
#ifdef AEGIS_ROWS
        // row sums: one per (row h, 128-column half), in-thread, then over the 4 lanes of the row
        float rs[4];
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                float s = 0.f;
#pragma unroll
                for (int n8 = half * 16; n8 < half * 16 + 16; ++n8) s += d[n8 * 4 + h * 2] + d[n8 * 4 + h * 2 + 1];
                rs[h * 2 + half] = s;
            }
#endif
#ifdef AEGIS_COLS
        // column partials over rows g, g+8: v[q] is column n8*8 + 2*tig + j, q = 2*n8 + j
        float v[64];
#pragma unroll
        for (int q = 0; q < 64; ++q) v[q] = d[(q >> 1) * 4 + (q & 1)] + d[(q >> 1) * 4 + 2 + (q & 1)];
#endif
#ifdef AEGIS_BURN1
        burn<AEGIS_BURN1>(d[5], row_sums);
#endif
#ifdef AEGIS_ROWS
#pragma unroll
        for (int i = 0; i < 4; ++i) rs[i] += __shfl_xor_sync(0xffffffffu, rs[i], 1);
#pragma unroll
        for (int i = 0; i < 4; ++i) rs[i] += __shfl_xor_sync(0xffffffffu, rs[i], 2);
#endif
#ifdef AEGIS_COLS
        // the 8 lanes that share a column reduce by a halving exchange: each step a lane sends half
        // of its partials to its partner and keeps the other half (32+16+8 shuffles, not 64x3)
        halve_exchange<32>(v, (g >> 2) & 1);  // partner: lane ^ 16; v[0..32) live from here
#endif
#ifdef AEGIS_ABFT_ROWS
        // the experiment writes the expected row sums in their place: columns 3·tile + piece of the
        // n8 accumulator (lanes tig 0-2 of a row hold columns 0-5), hi + (mid + lo)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const float c0 = probe[2 * h], c1 = probe[2 * h + 1];
            const float n1j0 = __shfl_down_sync(0xffffffffu, c0, 1), n1j1 = __shfl_down_sync(0xffffffffu, c1, 1);
            const float n2j0 = __shfl_down_sync(0xffffffffu, c0, 2), n2j1 = __shfl_down_sync(0xffffffffu, c1, 2);
            const float x[2] = {c0 + (c1 + n1j0), n1j1 + (n2j0 + n2j1)};
            (void)rs;
#pragma unroll
            for (int tile = 0; tile < 2; ++tile) {
                const int r = row0 + 8 * h, tc = 2 * bc + tile;
                if (tig == 0 && r < M && tc < tn128) row_sums[(long long)r * tn128 + tc] = x[tile];
            }
        }
#elif defined(AEGIS_ROWS)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int r = row0 + 8 * (i >> 1), tc = 2 * bc + (i & 1);
            if (tig == 0 && r < M && tc < tn128) row_sums[(long long)r * tn128 + tc] = rs[i];
        }
#endif
        // Phase 2 for the tile at (bm, bc); touches no accumulator register.
        auto phase2 = [&]() {
#ifdef AEGIS_COLS
            // the rest of the column reduction, then over the 4 warps in order. The scratch is
            // double-buffered by tile parity, so one barrier per tile suffices: a warp writes a
            // buffer again only after the next tile's barrier, which every warp passes after it
            // has read this tile's buffer.
            float* red = red_col + (ti & 1) * (8 * BN);
            halve_exchange<16>(v, (g >> 1) & 1);  // lane ^ 8
            halve_exchange<8>(v, g & 1);          // lane ^ 4
            // lane g now holds q = 8g .. 8g+7: columns (4g + r/2)*8 + 2*tig + (r&1), r = 0..7
#pragma unroll
            for (int r = 0; r < 8; r += 2)  // one 64-bit store per pair (the compiler splits a float2 store)
                asm volatile("st.shared.v2.f32 [%0], {%1, %2};" ::"r"(smem_u32(red + cw * BN + red_idx((4 * g + (r >> 1)) * 8 + 2 * tig))),
                             "f"(v[r]), "f"(v[r + 1]) : "memory");
            wg_bar(c);
            const int tt = threadIdx.x & 127;  // each thread: columns tt and tt + 128
            const float* p = red + 4 * c * BN;
#pragma unroll
            for (int hc = 0; hc < 2; ++hc) {
                const int col = tt + 128 * hc, ix = red_idx(col);
                const float s = ((p[ix] + p[BN + ix]) + p[2 * BN + ix]) + p[3 * BN + ix];
                const int cc = bc * BN + col;
                if (cc < N && tr * CTM < M) col_sums[(long long)tr * N + cc] = s;
            }
#endif
#ifdef AEGIS_BURN
            burn<AEGIS_BURN>((float)(threadIdx.x + ti), col_sums);
#endif
            const int tl = threadIdx.x & 127;
            if (tl < 2 && 2 * bc + tl < tn128 && tr * CTM < M) tile_sm[tr * tn128 + 2 * bc + tl] = smid;
        };
        // The last tile ends here; the loop is peeled this way so that on every path into the
        // main loop the accumulator is in flight (a conditional issue makes ptxas serialise wgmma).
        const int nt = t + gridDim.x;
#ifdef AEGIS_TIMING
        t_p1 = clock64();
        // slot 0: phase 1 | head issue << 16; slot 1: phase 2 | (main loop >> 3) << 16 (cycles)
        auto record = [&](long long t_head, long long t_p2) {
            const int ts = tr * tn128 + 2 * bc;
            if (leader && tr * CTM < M && 2 * bc + 1 < tn128) {
                tile_sm[ts] = (int)min(t_p1 - t_end, 65535LL) | ((int)min(t_head - t_p1, 32767LL) << 16);
                tile_sm[ts + 1] = (int)min(t_p2 - t_head, 65535LL) | ((int)min((t_end - t_prev) >> 3, 32767LL) << 16);
            }
        };
#endif
        if (nt >= n_tiles) {
            phase2();
#ifdef AEGIS_TIMING
            record(t_p1, clock64());
#endif
            break;
        }
        int nbm, nbc;
        tile_coords(nt, tiles_m, tiles_n, nbm, nbc);
        if (bias) bias_next = bias_load(bias, nbc * BN + tt2, N);
        issue_head();
#ifdef AEGIS_TIMING
        const long long t_head = clock64();
#endif
        phase2();
#ifdef AEGIS_TIMING
        const long long t_p2 = clock64();
        record(t_head, t_p2);
        t_prev = t_p2;
#endif
        t = nt;
        bm = nbm;
        bc = nbc;
        ++ti;
    }
#if defined(AEGIS_PROBE_ROWS) || defined(AEGIS_PROBE_COLS) || defined(AEGIS_PROBE_TCSUMS)
    // ptxas drops an MMA whose accumulator nothing reads: a test that is never true keeps them
    float keep = 0.f;
#pragma unroll
    for (int i = 0; i < 24; ++i) keep += probe[i];
    if (keep == -1.2345f) row_sums[0] = keep;
#endif
#ifdef AEGIS_NOSUMS
    (void)row_sums;
    (void)col_sums;
#endif
}

#define AEGIS_WGMMA_ENTRY(NAME, AK, BK_)                                                                             \
    extern "C" __global__ void __launch_bounds__(NTHREADS, 1)                                                       \
        NAME(const __grid_constant__ TmaDesc tmA, const __grid_constant__ TmaDesc tmB, bf16* C, float* row_sums,    \
             float* col_sums, int* tile_sm, const bf16* bias, int M, int N, int K, InjectParams inj ABFT_PRE_PARAM) {   \
        gemm_wgmma_body<AK, BK_>(&tmA, &tmB, C, row_sums, col_sums, tile_sm, bias, M, N, K, inj ABFT_PRE_ARG);      \
    }

AEGIS_WGMMA_ENTRY(gemm_wgmma_fwd, true, true)      // A (M,K), B stored (N,K)
AEGIS_WGMMA_ENTRY(gemm_wgmma_dgrad, true, false)   // A (M,K), B (K,N)
AEGIS_WGMMA_ENTRY(gemm_wgmma_wgrad, false, false)  // A stored (K,M), B (K,N)
