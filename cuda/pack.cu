// pack.cu — int4 packing for vLLM: fused round-to-nearest quantize + AWQ pack of a weight
// [N, K], and packing of GPTQ codes [K, N] (u8) into the AWQ and GPTQ v1 layouts.
// AWQ: qweight i32 [K, N/8], nibble i of word [k, c] = column 8c + awq_col(i) (common.cuh:
// the order 0,2,4,6,1,3,5,7); qzeros i32 [K/G, N/8] same order; scales f16 [K/G, N].
// GPTQ v1: qweight i32 [K/8, N] (row 8r+i at bits 4i), qzeros [K/G, N/8] plain order of
// z - 1, scales f16 [K/G, N].

__device__ __forceinline__ u32 awq_word8(const u8* v) {  // v[0..8): codes of columns 8c..8c+7
    u32 w = 0;
#pragma unroll
    for (int i = 0; i < 8; i++) w |= (u32)(v[awq_col(i)] & 15) << (4 * i);
    return w;
}
// Same from a little-endian u64 holding 8 bytes.
__device__ __forceinline__ u32 awq_word_u64(u64 b) {
    u32 w = 0;
#pragma unroll
    for (int i = 0; i < 8; i++) w |= (u32)((b >> (8 * awq_col(i))) & 15) << (4 * i);
    return w;
}

__device__ __forceinline__ u32 zero_point_of(u32 m, int bits) {
    return ((m >> 24) & 1u) ? (1u << (bits - 1)) : ((m >> 16) & 0xFFu);
}

// Tile: 256 output rows (n) x QP_BK = 64 inputs (k), 256 threads, for the 16- and 32-bit types
// (FP8: 128 x 128, QP8_BN x QP8_BK below); ops.rs (pack_tile) launches ceil(K/inputs) x
// ceil(N/rows) blocks, the k-tiles of the same rows side by side, so the weight rows stream
// contiguously, with the tile's rows·inputs·EB bytes of dynamic shared memory.
#define QP_BN 256
#define QP_BK 64

// The block's 256-row x 64-input tile (the pack kernel's grid): its first row and input, the
// groups a row, the whole 32-input quarters it holds (K and G are multiples of 32, so a group
// can only start at a quarter), and each quarter's group and whether a group starts there, from
// one division (G >= 32: the next quarter is at most one group further; a division or remainder
// by the runtime G per quarter cost ~20 instructions each). A power-of-two G (32, 64, 128)
// divides by a shift. Q = the tile's quarters (64 inputs: 2; FP8's 128: 4), BN its rows.
template <int Q> struct PackTileQ {
    int n0, k0, ng, quarters;
    int grp[Q];
    bool start[Q];
    // The group slot (group - grp[0]) of quarter h known only at run time (grp[h] indexed at
    // run time would sit in local memory), from k0 % G as pack_tile_q divides.
    __device__ __forceinline__ int slot(int h, int G) const {
        const int x = k0 - grp[0] * G + 32 * h;
        return (G & (G - 1)) == 0 ? x >> (__ffs(G) - 1) : x / G;
    }
};
typedef PackTileQ<QP_BK / 32> PackTile;
template <int BN, int Q> __device__ __forceinline__ PackTileQ<Q> pack_tile_q(int K, int G) {
    PackTileQ<Q> t;
    t.n0 = blockIdx.y * BN;
    t.k0 = blockIdx.x * 32 * Q;
    const bool g_pow2 = (G & (G - 1)) == 0;
    const int g_shift = __ffs(G) - 1;
    t.ng = g_pow2 ? K >> g_shift : K / G;
    t.quarters = min(Q, (K - t.k0) / 32);
    int grp = g_pow2 ? t.k0 >> g_shift : t.k0 / G, rem = t.k0 - grp * G;
#pragma unroll
    for (int h = 0; h < Q; h++) {
        if (h > 0 && (rem += 32) >= G) {
            rem -= G;
            grp++;
        }
        t.grp[h] = grp;
        t.start[h] = rem == 0;
    }
    return t;
}
__device__ __forceinline__ PackTile pack_tile(int K, int G) { return pack_tile_q<QP_BN, QP_BK / 32>(K, G); }

// Row n's grids for the tile's groups (G >= 32): each group's (1/scale, zero) stored at
// slot[(group - the tile's first) * stride] for the quantizing lanes, and the group metadata,
// once per group, by the tile that holds the group's first input: the row's scale, and an
// octet of lanes (rows 8c..8c+7; N % 8 == 0, so an octet is all in or all out) ORs its zero
// points into the AWQ word by shuffles — nothing is read again at the block's end. Every lane
// of a warp that calls it takes part (the shuffles).
template <int Q>
__device__ __forceinline__ void row_grids_and_meta(const PackTileQ<Q>& t, const u32* qmeta, int n, int N, int bits,
                                                   float2* slot, int stride, u16* scales, u32* qzeros) {
    GroupParams p[Q];
    if (n < N) {
        const u32* qm = qmeta + (i64)n * t.ng;
#pragma unroll
        for (int h = 0; h < Q; h++) {
            if (h == 0 || (h < t.quarters && t.start[h])) {
                p[h] = qmeta_params(qm[t.grp[h]], bits);
                slot[(t.grp[h] - t.grp[0]) * stride] = make_float2(p[h].inv, p[h].zero);
            } else {
                p[h] = p[h - 1];
            }
        }
    }
#pragma unroll
    for (int h = 0; h < Q; h++) {
        if (h < t.quarters && t.start[h]) {
            const int grp = t.grp[h], j = threadIdx.x & 7;
            u32 zw = 0;
            if (n < N) {
                scales[(i64)grp * N + n] = f32_to_f16_rn(p[h].scale);
                zw = ((u32)p[h].zero & 15u) << (4 * awq_nibble(j));
            }
            zw |= __shfl_xor_sync(0xFFFFFFFFu, zw, 1);
            zw |= __shfl_xor_sync(0xFFFFFFFFu, zw, 2);
            zw |= __shfl_xor_sync(0xFFFFFFFFu, zw, 4);
            if (j == 0 && n < N) qzeros[(i64)grp * (N / 8) + n / 8] = zw;
        }
    }
}

// ---- Squares: a lane per 8 rows x 8 inputs, no transpose ----------------------------------
// Block: 256 rows (n0..) x 64 inputs (k0..), 256 threads. The row tiles are staged in shared
// memory by cp.async (8 threads a row, each one 8-input run: coalesced), each run at a
// swizzled place so that a warp's reads of one run from 32 rows 8 apart take the fewest
// wavefronts. Thread t decodes row t's grid for the tile's groups into shared memory (1/scale,
// zero) and writes the group metadata. Then warp w, lane c quantizes rows 8c..8c+7 at inputs
// 8w..8w+7: rows 2m and 2m+1 make one clamped u16x2 pair an input, which shifted by 4m lands on
// nibbles m and m + 4 of that input's AWQ word (columns 2m, 2m+1): 8 AWQ words a lane, stored
// by the warp as 128 contiguous bytes an input row. No run words, no nibble transpose, one
// barrier. Against the row kernel it replaced (H100, kernel alone, bit-identical; README "Fused quantize +
// pack: squares"): FP8 with block scales 7168x2048 11.2 -> 10.1 µs, 2048x7168 10.5 -> 9.8,
// 18432x7168 89.9 -> 87.6; bf16 16.0 -> 14.2, 14.9 -> 12.3, 123.8 -> 123.9; f32 (session
// 24, 32 registers) 32.0 -> 28.8, 32.0 -> 27.2, 239.7 -> 207.8. (Session 15's
// square kernel loaded each lane's rows straight from global memory, 32 lines a warp load,
// and was slower on two of three shapes.)
template <int EB> __device__ __forceinline__ u32 sq_tile_addr(int r, int p) {
    // Row r (0..255) of 64·EB bytes, run p (0..7) of 8·EB bytes. A warp reads run w of rows
    // 8c + j (c = lane): the XOR by (r / 8) % 8 spreads them over 8 runs.
    return (u32)(r * 64 * EB + 8 * EB * (p ^ ((r >> 3) & 7)));
}
template <int DT>
__device__ __forceinline__ void awq_quant_pack_sq(const void* w, const u32* qmeta, u32* qweight, u32* qzeros,
                                                  u16* scales, int N, int K, int G, int bits, const float* bs,
                                                  int bcols) {
    constexpr int EB = ElemBytes<DT>::v, BK = QP_BK, QUARTERS = BK / 32;
    static_assert(QUARTERS == 2, "64-input tiles");
    static_assert(EB >= 2, "16- and 32-bit types (FP8: awq_quant_pack_f8e4m3)");
    extern __shared__ __align__(128) u8 tile[];  // QP_BN * BK * EB bytes (ops.rs pack_smem)
    __shared__ float2 prm[2][QP_BN];  // (1/scale, zero) of the tile's groups, row r at (r % 8)·32 + r / 8
    const int tid = threadIdx.x;
    const PackTile t = pack_tile(K, G);
    const int n0 = t.n0, k0 = t.k0, quarters = t.quarters;
    const u32 maxq = (1u << bits) - 1u;
    const int rows = min(QP_BN, N - n0), runs = 4 * quarters;
    {
        // Run s = tid + 256 i: row r0 + 32 i, run p.
        const u32 tbase = smem_u32(tile);
        const int r0 = tid >> 3, p = tid & 7;
        const u8* src = (const u8*)w + ((i64)(n0 + r0) * K + k0 + 8 * p) * EB;
        const i64 step = (i64)32 * K * EB;
        if (p < runs) {
#pragma unroll
            for (int i = 0; i < 8; i++) {
                const u32 dst = tbase + sq_tile_addr<EB>(r0 + 32 * i, p);
                if (r0 + 32 * i < rows) {
#pragma unroll
                    for (int b = 0; b < EB / 2; b++) cp_async16_s(dst + 16 * b, src + 16 * b, 16);  // a run: 8·EB bytes
                }
                src += step;
            }
        }
    }
    cp_async_commit();
    const int warp = tid >> 5, c = tid & 31;
    const bool live = warp < runs && 8 * c < rows;
    // This lane's block scale (its 8 rows and 8 inputs lie in one 128 x 128 block), loaded
    // before the grid so that both trips overlap the tile's.
    const float sc = live && bs != nullptr ? block_scale(bs, bcols, n0 + 8 * c, k0) : 1.0f;
    // Row tid's grid for the tile's groups (one or two), and the group metadata.
    row_grids_and_meta(t, qmeta, n0 + tid, N, bits, &prm[0][(tid & 7) * 32 + (tid >> 3)], QP_BN, scales, qzeros);
    cp_async_wait<0>();
    __syncthreads();
    if (!live) return;
    const float2* pr = prm[warp >= 4 ? t.grp[1] - t.grp[0] : 0] + c;
    const bool mul = bs != nullptr;  // no block scale: no multiply
    u32 words[8] = {0u, 0u, 0u, 0u, 0u, 0u, 0u, 0u};
#pragma unroll
    for (int m = 0; m < 4; m++) {
        float v0[8], v1[8];
        // The two rows' runs as decode_run reads a row's loaded words (f32: two 16-byte words).
        uint4 a[2], b[2];
        const u8* ta = tile + sq_tile_addr<EB>(8 * c + 2 * m, warp);
        const u8* tb = tile + sq_tile_addr<EB>(8 * c + 2 * m + 1, warp);
#pragma unroll
        for (int v = 0; v < EB / 2; v++) {
            a[v] = ((const uint4*)ta)[v];
            b[v] = ((const uint4*)tb)[v];
        }
        decode_run<DT>(a, 0, v0);
        decode_run<DT>(b, 0, v1);
        // The two rows' grids as the quantizer reads them (1/scale and zero only).
        const float2 g0 = pr[(2 * m) * 32], g1 = pr[(2 * m + 1) * 32];
        const GroupParams p0{0.0f, g0.x, g0.y, 0.0f}, p1{0.0f, g1.x, g1.y, 0.0f};
#pragma unroll
        for (int j = 0; j < 8; j++) {
            const float x0 = mul ? v0[j] * sc : v0[j], x1 = mul ? v1[j] * sc : v1[j];
            words[j] += quant_code_u16x2(x0, p0, x1, p1, maxq) << (4 * m);  // codes <= 15: + is |
        }
    }
    const int NW = N / 8;
    u32* dst = qweight + (i64)(k0 + 8 * warp) * NW + n0 / 8 + c;
#pragma unroll
    for (int j = 0; j < 8; j++, dst += NW) *dst = words[j];
}

// At most 32 registers (no spills): the expert shapes' 896 blocks run in one wave (at 40
// registers, 6 an SM, 1.13 waves): bf16 2-4 % faster (H100, kernel alone; FP8, then on these
// tiles, 3-4 %).
#define FORGE_QPACK_SQ_ENTRY(SUF, DT)                                                                    \
    extern "C" __global__ void __launch_bounds__(256, 7) awq_quant_pack_##SUF(                           \
        const void* w, const u32* qmeta, u32* qweight, u32* qzeros, u16* scales, int N, int K, int G,     \
        int bits, const float* bs, int bcols) {                                                          \
        awq_quant_pack_sq<DT>(w, qmeta, qweight, qzeros, scales, N, K, G, bits, bs, bcols);              \
    }
FORGE_QPACK_SQ_ENTRY(f16, FORGE_DT_F16)
FORGE_QPACK_SQ_ENTRY(bf16, FORGE_DT_BF16)
FORGE_QPACK_SQ_ENTRY(f32, FORGE_DT_F32)

// ---- FP8: 128 rows x 128 inputs ----------------------------------------------------------------
// The squares above for E4M3 bytes on a tile of 128 rows x 128 inputs (16 KB, as the others' 256
// x 64), so that a row's tile bytes are one whole 128-byte line: 16-byte copies, a warp's 32
// covering 4 rows (the 64-input tile's 8-byte copies took about twice the L1 wavefronts a byte,
// the MIO throttle its warps stalled on most), and one grid read a row for G = 128 (the 64-input
// tiles read each grid twice, a 32-byte sector for 4 bytes each time). Lane l of warp w
// quantizes rows 8c..8c+7 (c = l % 16) at run q = 2w + l / 16 (inputs 8q..8q+7); a row's 16-byte
// chunk k (runs 2k, 2k + 1) sits at chunk k ^ ((row / 8) % 8), so a warp's 8-byte reads of runs
// 2w, 2w + 1 from 16 rows 8 apart take the 2 wavefronts 256 bytes need. Threads 0..127 decode
// their row's grids for the tile's 1-4 groups and write the group metadata.
#define QP8_BN 128
#define QP8_BK 128
extern "C" __global__ void __launch_bounds__(256, 8)
    awq_quant_pack_f8e4m3(const void* w, const u32* qmeta, u32* qweight, u32* qzeros, u16* scales, int N, int K,
                          int G, int bits, const float* bs, int bcols) {
    constexpr int Q = QP8_BK / 32;
    extern __shared__ __align__(128) u8 tile[];     // QP8_BN * QP8_BK bytes (ops.rs pack_smem)
    __shared__ float2 prm[Q][QP8_BN];             // (1/scale, zero) of the tile's groups, row r at (r % 8)·16 + r / 8
    const int tid = threadIdx.x;
    const PackTileQ<Q> t = pack_tile_q<QP8_BN, Q>(K, G);
    const int n0 = t.n0, k0 = t.k0, quarters = t.quarters;
    const u32 maxq = (1u << bits) - 1u;
    const int rows = min(QP8_BN, N - n0), chunks = 2 * quarters;
    {
        // Copy i of thread t: row t / 8 + 32 i, chunk t % 8 (16 bytes, runs 2k and 2k + 1).
        const int r0 = tid >> 3, k = tid & 7;
        const u32 tb = smem_u32(tile);
        const u8* src = (const u8*)w + (i64)(n0 + r0) * K + k0 + 16 * k;
        if (k < chunks) {
#pragma unroll
            for (int i = 0; i < QP8_BN / 32; i++) {
                const int r = r0 + 32 * i;
                if (r < rows) cp_async16_s(tb + 128 * r + 16 * (k ^ ((r >> 3) & 7)), src, 16);
                src += (i64)32 * K;
            }
        }
    }
    cp_async_commit();
    const int warp = tid >> 5, lane = tid & 31, c = lane & 15, q = 2 * warp + (lane >> 4);
    const bool live = q < 4 * quarters && 8 * c < rows;
    // This lane's block scale: the tile is one 128 x 128 block.
    const float sc = live && bs != nullptr ? block_scale(bs, bcols, n0, k0) : 1.0f;
    if (warp < QP8_BN / 32)
        row_grids_and_meta(t, qmeta, n0 + tid, N, bits, &prm[0][(tid & 7) * 16 + (tid >> 3)], QP8_BN, scales, qzeros);
    cp_async_wait<0>();
    __syncthreads();
    if (!live) return;
    const float2* pr = prm[t.slot(q >> 2, G)] + c;  // run q lies in quarter q / 4
    // Run q of row 8c + j: chunk q / 2 at (q / 2) ^ (c % 8), its half q % 2.
    const u8* tr = tile + 1024 * c + 16 * ((q >> 1) ^ (c & 7)) + 8 * (q & 1);
    u32 words[8] = {0u, 0u, 0u, 0u, 0u, 0u, 0u, 0u};
#pragma unroll
    for (int m = 0; m < 4; m++) {
        float v0[8], v1[8];
        const uint2 a = *(const uint2*)(tr + 256 * m), b = *(const uint2*)(tr + 256 * m + 128);
        e4m3x8_to_f32(a.x, a.y, v0);
        e4m3x8_to_f32(b.x, b.y, v1);
        const float2 g0 = pr[(2 * m) * 16], g1 = pr[(2 * m + 1) * 16];
        const GroupParams p0{0.0f, g0.x, g0.y, 0.0f}, p1{0.0f, g1.x, g1.y, 0.0f};
#pragma unroll
        for (int j = 0; j < 8; j++)
            words[j] += quant_code_u16x2(v0[j] * sc, p0, v1[j] * sc, p1, maxq) << (4 * m);  // codes <= 15: + is |
    }
    const int NW = N / 8;
    u32* dst = qweight + (i64)(k0 + 8 * q) * NW + n0 / 8 + c;
#pragma unroll
    for (int j = 0; j < 8; j++, dst += NW) *dst = words[j];
}

// codes [K, N] u8 -> AWQ qweight [K, N/8]; one word per thread.
extern "C" __global__ void awq_pack_codes(const u8* codes, u32* qweight, int K, int N) {
    const i64 NW = N / 8;
    const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (i64)K * NW) return;
    const i64 k = i / NW, c = i % NW;
    u64 b = *(const u64*)(codes + k * N + 8 * c);
    qweight[i] = awq_word_u64(b);
}

// qmeta [N, K/G] -> AWQ qzeros [K/G, N/8] and scales f16 [K/G, N]; one word column per thread.
extern "C" __global__ void awq_pack_meta(const u32* qmeta, u32* qzeros, u16* scales, int N, int ng, int bits) {
    const i64 NW = N / 8;
    const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (i64)ng * NW) return;
    const i64 g = i / NW, c = i % NW;
    u8 z[8];
#pragma unroll
    for (int j = 0; j < 8; j++) {
        u32 m = qmeta[(8 * c + j) * ng + g];
        z[j] = (u8)zero_point_of(m, bits);
        scales[g * N + 8 * c + j] = f32_to_f16_rn(decode_scale((int)(short)(m & 0xFFFFu)));
    }
    qzeros[i] = awq_word8(z);
}

// codes [K, N] u8 -> GPTQ v1 qweight [K/8, N]; one word per thread.
extern "C" __global__ void gptq_pack_codes(const u8* codes, u32* qweight, int K, int N) {
    const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (i64)(K / 8) * N) return;
    const i64 r = i / N, n = i % N;
    u32 w = 0;
#pragma unroll
    for (int j = 0; j < 8; j++) w |= (u32)(codes[(8 * r + j) * N + n] & 15) << (4 * j);
    qweight[i] = w;
}

// qmeta [N, K/G] -> GPTQ v1 qzeros [K/G, N/8] (z - 1, plain order) and scales [K/G, N].
// A zero point of 0 cannot be stored: *bad is set to 1 (when bad != 0).
extern "C" __global__ void gptq_pack_meta(const u32* qmeta, u32* qzeros, u16* scales, u32* bad, int N, int ng,
                                          int bits) {
    const i64 NW = N / 8;
    const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (i64)ng * NW) return;
    const i64 g = i / NW, c = i % NW;
    u32 w = 0;
#pragma unroll
    for (int j = 0; j < 8; j++) {
        u32 m = qmeta[(8 * c + j) * ng + g];
        u32 z = zero_point_of(m, bits);
        if (z == 0 && bad) atomicOr(bad, 1u);
        w |= ((z - 1u) & 15u) << (4 * j);
        scales[g * N + 8 * c + j] = f32_to_f16_rn(decode_scale((int)(short)(m & 0xFFFFu)));
    }
    qzeros[i] = w;
}
