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

// Tile: QP_BN = 256 output rows (n) x QP_BK = 64 inputs (k), PACK_THREADS = 256 threads, for the
// 16- and 32-bit types (FP8: QP8_BN x QP8_BK = 64 x 256, below); the generated header defines
// them from ops.rs (pack_tile), which launches ceil(K/inputs) x ceil(N/rows) blocks, the k-tiles
// of the same rows side by side, so the weight rows stream contiguously, with the tile's
// rows·inputs·EB bytes of dynamic shared memory.
static_assert(QP_BN == 256 && QP_BK == 64 && PACK_THREADS == 256, "the squares: a thread a row, 8 warps of runs");

// The block's 256-row x 64-input tile (the pack kernel's grid): its first row and input, the
// groups a row, the whole 32-input quarters it holds (K and G are multiples of 32, so a group
// can only start at a quarter), and each quarter's group and whether a group starts there, from
// one division (G >= 32: the next quarter is at most one group further; a division or remainder
// by the runtime G per quarter cost ~20 instructions each).
// k / G for the runtime group size G: a shift when G is a power of two (32, 64, 128), else a
// division.
struct GroupDiv {
    int G, shift;
    bool pow2;
    __device__ __forceinline__ explicit GroupDiv(int g) : G(g), shift(__ffs(g) - 1), pow2((g & (g - 1)) == 0) {}
    __device__ __forceinline__ int operator()(int k) const { return pow2 ? k >> shift : k / G; }
};

struct PackTile {
    int n0, k0, ng, quarters;
    int grp[QP_BK / 32];
    bool start[QP_BK / 32];
};
__device__ __forceinline__ PackTile pack_tile(int K, int G) {
    PackTile t;
    t.n0 = blockIdx.y * QP_BN;
    t.k0 = blockIdx.x * QP_BK;
    const GroupDiv group_of(G);
    t.ng = group_of(K);
    t.quarters = min(QP_BK / 32, (K - t.k0) / 32);
    int grp = group_of(t.k0), rem = t.k0 - grp * G;
#pragma unroll
    for (int h = 0; h < QP_BK / 32; h++) {
        if (h > 0 && (rem += 32) >= G) {
            rem -= G;
            grp++;
        }
        t.grp[h] = grp;
        t.start[h] = rem == 0;
    }
    return t;
}

// Row n's grids for the tile's groups (G >= 32): each group's (1/scale, zero) stored at
// slot[(group - the tile's first) * stride] for the quantizing lanes, and the group metadata,
// once per group, by the tile that holds the group's first input: the row's scale, and an
// octet of lanes (rows 8c..8c+7; N % 8 == 0, so an octet is all in or all out) ORs its zero
// points into the AWQ word by shuffles — nothing is read again at the block's end. Every lane
// of a warp that calls it takes part (the shuffles).
__device__ __forceinline__ void row_grids_and_meta(const PackTile& t, const u32* qmeta, int n, int N, int bits,
                                                   float2* slot, int stride, u16* scales, u32* qzeros) {
    constexpr int Q = QP_BK / 32;
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
// barrier. Against the row kernel it replaced (H100, kernel alone, bit-identical; LOG.md "Fused quantize +
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
    extern "C" __global__ void __launch_bounds__(PACK_THREADS, 7) awq_quant_pack_##SUF(                  \
        const void* w, const u32* qmeta, u32* qweight, u32* qzeros, u16* scales, int N, int K, int G,     \
        int bits, const float* bs, int bcols) {                                                          \
        awq_quant_pack_sq<DT>(w, qmeta, qweight, qzeros, scales, N, K, G, bits, bs, bcols);              \
    }
FORGE_QPACK_SQ_ENTRY(f16, FORGE_DT_F16)
FORGE_QPACK_SQ_ENTRY(bf16, FORGE_DT_BF16)
FORGE_QPACK_SQ_ENTRY(f32, FORGE_DT_F32)

// Grid item i's row, items row-major with ngt a row (1, 2 and 4 by shifts).
__device__ __forceinline__ int grid_item_row(int i, int ngt) {
    return ngt == 1 ? i : ngt == 2 ? i >> 1 : ngt == 4 ? i >> 2 : i / ngt;
}

// ---- FP8: 64 rows x 256 inputs ----------------------------------------------------------------
// The squares above for E4M3 bytes on a tile of 64 rows x 256 inputs (16 KB, as the others' 256 x
// 64): a row's tile bytes are two whole 128-byte lines, copied by 16-byte cp.async, and with
// G = 128 a row's two grid words share one 32-byte sector, which one warp load reads for both
// (lanes 2r, 2r + 1). The grid words were the costliest part of the 128 x 128 tile this replaced:
// a scattered 32-byte sector a row for 4 bytes, 13 % of its L2 sectors (H200: that kernel with
// constant grid words took 57 instead of 69 µs at 18432x7168). Lane l of warp w quantizes rows
// 8c..8c+7 (c = l % 8) at run q = 4w + l / 8 (inputs 8q..8q+7); a row's 16-byte chunk k (runs
// 2k, 2k + 1) sits at chunk k ^ (row / 8), so a half-warp's 8-byte reads (8 rows 8 apart, both
// halves of a chunk) take one wavefront. The group metadata goes through shared memory: no
// shuffles, any number of groups a tile (G = 32: 8), and its stores after the barrier (with the
// early grid word below, 18432x7168 63.6-63.9 µs against 65.2-65.5 with them before it).
extern "C" __global__ void __launch_bounds__(PACK_THREADS, 8)
    awq_quant_pack_f8e4m3(const void* w, const u32* qmeta, u32* qweight, u32* qzeros, u16* scales, int N, int K,
                          int G, int bits, const float* bs, int bcols) {
    constexpr int NGT = QP8_BK / 32;                    // groups a tile at most (G >= 32)
    static_assert(QP8_BN == 64 && QP8_BK == 256 && PACK_THREADS == 256, "copies, lanes and loops below");
    extern __shared__ __align__(128) u8 tile[];          // QP8_BN * QP8_BK bytes (ops.rs pack_smem)
    __shared__ float2 prm[NGT][QP8_BN];                  // (1/scale, zero) of group slot g, row r at (r % 8)·8 + r / 8
    __shared__ __align__(16) u8 zsm[NGT][QP8_BN];        // zero points of the groups that start in the tile
    __shared__ u16 ssm[NGT][QP8_BN];                     // their f16 scales
    const int tid = threadIdx.x;
    const int n0 = blockIdx.y * QP8_BN, k0 = blockIdx.x * QP8_BK;
    const GroupDiv group_of(G);
    const int ng = group_of(K);
    // Whole 32-input quarters in the tile (K % 32 == 0), and the groups g0 <= g < g1 they touch.
    const int quarters = min(QP8_BK / 32, (K - k0) / 32), kend = k0 + 32 * quarters;
    const int g0 = group_of(k0), g1 = group_of(kend + G - 1);
    const int ngt = g1 - g0;
    auto starts_here = [&](int g) { return g * G >= k0; };  // the tile holds group g's first input
    const u32 maxq = (1u << bits) - 1u;
    const int rows = min(QP8_BN, N - n0), chunks = 2 * quarters;
    // The grids, item i = row · ngt + slot (a row's grid words side by side in one warp load):
    // thread t's first item's word is requested before the tile's copies, so that it comes back
    // ahead of them and the grid is decoded while they land (requested after them, the decode
    // waited for the tile: 3-4 % slower on every shape).
    const int r_first = grid_item_row(tid, ngt);
    const u32 word_first = tid < QP8_BN * ngt && r_first < rows
                               ? __ldg(qmeta + (i64)(n0 + r_first) * ng + g0 + (tid - r_first * ngt))
                               : 0u;
    const int warp = tid >> 5, lane = tid & 31, c = lane & 7, q = 4 * warp + (lane >> 3);
    const bool live = q < 4 * quarters && 8 * c < rows;
    // This lane's block scale (rows n0.., 64 of one 128-row block; inputs 8q.., one block),
    // also requested ahead of the copies: after them it waited behind the tile in L1TEX
    // (H200, 18432x7168 60.4 -> 58.6 µs kernel alone).
    const float sc = live && bs != nullptr ? block_scale(bs, bcols, n0, k0 + 8 * q) : 1.0f;
    {
        // Copy i of thread t: row t / 16 + 16 i, chunk t % 16 (a warp: two rows' 256 bytes).
        const int r0 = tid >> 4, k = tid & 15;
        const u32 tb = smem_u32(tile);
        const u8* src = (const u8*)w + (i64)(n0 + r0) * K + k0 + 16 * k;
        if (k < chunks) {
#pragma unroll
            for (int i = 0; i < QP8_BN / 16; i++) {
                const int r = r0 + 16 * i;
                if (r < rows) cp_async16_s(tb + QP8_BK * r + 16 * (k ^ (r >> 3)), src, 16);
                src += (i64)16 * K;
            }
        }
    }
    cp_async_commit();
    // Each group's metadata is written by the tile that holds its first input, from shared
    // memory after the barrier: scales a group's rows side by side (one store a warp), zero
    // points as AWQ words.
    for (int i = tid; i < QP8_BN * ngt; i += PACK_THREADS) {
        const int r = grid_item_row(i, ngt);
        const int gi = i - r * ngt, g = g0 + gi, n = n0 + r;
        if (r < rows) {
            const GroupParams p = qmeta_params(i == tid ? word_first : __ldg(qmeta + (i64)n * ng + g), bits);
            prm[gi][(r & 7) * 8 + (r >> 3)] = make_float2(p.inv, p.zero);
            if (starts_here(g)) {
                ssm[gi][r] = f32_to_f16_rn(p.scale);
                zsm[gi][r] = (u8)((u32)p.zero & 15u);
            }
        }
    }
    cp_async_wait<0>();
    __syncthreads();
    for (int i = tid; i < QP8_BN * ngt; i += PACK_THREADS) {
        const int gi = i >> 6, r = i & 63, g = g0 + gi;  // i / QP8_BN, i % QP8_BN
        if (starts_here(g) && r < rows) scales[(i64)g * N + n0 + r] = ssm[gi][r];
    }
    // Zero points: thread t < 8 · ngt, octet t % 8 (N % 8 == 0: an octet is all in or all out).
    if (tid < 8 * ngt) {
        const int o = tid & 7, gi = tid >> 3, g = g0 + gi;
        if (starts_here(g) && 8 * o < rows) {
            const uint2 z = *(const uint2*)&zsm[gi][8 * o];
            qzeros[(i64)g * (N / 8) + n0 / 8 + o] = awq_word_u64(((u64)z.y << 32) | z.x);
        }
    }
    if (!live) return;
    const int x = k0 + 8 * q - g0 * G;  // run q's inputs from the first group's start
    const float2* pr = prm[group_of(x)] + c;
    // Run q of row 8c + j: chunk q / 2 at (q / 2) ^ c, its half q % 2.
    const u8* tr = tile + 8 * QP8_BK * c + 16 * ((q >> 1) ^ c) + 8 * (q & 1);
    u32 words[8] = {0u, 0u, 0u, 0u, 0u, 0u, 0u, 0u};
#pragma unroll
    for (int m = 0; m < 4; m++) {
        float v0[8], v1[8];
        const uint2 a = *(const uint2*)(tr + 2 * QP8_BK * m), b = *(const uint2*)(tr + 2 * QP8_BK * m + QP8_BK);
        e4m3x8_to_f32(a.x, a.y, v0);
        e4m3x8_to_f32(b.x, b.y, v1);
        const float2 g0p = pr[(2 * m) * 8], g1p = pr[(2 * m + 1) * 8];
        const GroupParams p0{0.0f, g0p.x, g0p.y, 0.0f}, p1{0.0f, g1p.x, g1p.y, 0.0f};
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
