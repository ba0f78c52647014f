// hessian.cu — H += alpha · XᵀX in fp32 (X: [T, D], f32 / f16 / bf16), and the segmented form
// for routed experts: for expert e, the rows idx[off[e] .. off[e+1]) of X go into
// H_e = H + e·D·D (one launch for every expert: blockIdx.y is the expert). With `overwrite`
// every kernel writes H = alpha · XᵀX instead (each element of H once, an expert without rows
// zeroed): no read of H, as a fresh product.
//
// Three kernels, all computing only the tiles that hold elements on or above the diagonal and
// mirroring those elements (H stays exactly symmetric):
//  - hessian_wg_<f16|bf16> (Hopper, sm_90a; at the end): 128 × 256 tiles, warp-specialized
//    (a producer warpgroup gathering rows, two consumers on warpgroup MMAs), the tile added
//    to H by bulk reductions in L2; its own walk (hw_tile).
// The other two share 128 × 128 (64 × 64) tiles walked in 8×8 groups by ht_tile / ht_block:
//  - hessian_tc_<f16|bf16>: tensor cores, for 16-bit inputs with D % 8 == 0 and a 16-byte
//    aligned X. mma.sync m16n8k16, fp32 accumulate: a product of two 16-bit values is exact
//    in fp32, so this sums the same exact products as the SIMT kernel, in another order.
//    Tile 128×128, 8 warps (2×4, 64×32 each), 32 rows of X per step through a 4-stage
//    cp.async pipeline; the rows are gathered by index straight from X (no gathered copy).
//    Shared memory holds the rows as loaded ([k][feature], 16-byte chunks XOR-swizzled by
//    row so ldmatrix reads are conflict-free) and ldmatrix.trans turns them into both the A
//    (Xᵀ) and the B (X) fragments. A diagonal tile reads one operand for both.
//  - hessian_accum_<f32|f16|bf16>: fp32 SIMT, 64×64 tiles, 256 threads, 4×4 outputs per
//    thread, 16 rows of X per step (f32 inputs, and 16-bit inputs the tensor-core kernel
//    does not take).

// ---- shared by the three kernels ---------------------------------------------------------
// Tile (bi ≤ bj) of block b: the upper triangle of nb × nb tiles is walked in groups of
// HT_GROUP × HT_GROUP tiles (upper groups only; a diagonal group's upper tiles), so that the
// blocks resident at one time read the rows of few column blocks and share them in L2.
#define HT_GROUP 8
__device__ __forceinline__ void ht_tile(int b, int nb, int& bi, int& bj) {
    const int ng = (nb + HT_GROUP - 1) / HT_GROUP;
    for (int gi = 0; gi < ng; gi++) {
        const int ri = min(HT_GROUP, nb - gi * HT_GROUP);
        for (int gj = gi; gj < ng; gj++) {
            const int rj = min(HT_GROUP, nb - gj * HT_GROUP);
            const int cnt = gi == gj ? ri * (ri + 1) / 2 : ri * rj;
            if (b < cnt) {
                if (gi == gj) {
                    int a = 0;
                    while (b >= ri - a) { b -= ri - a; a++; }
                    bi = gi * HT_GROUP + a;
                    bj = bi + b;
                } else {
                    bi = gi * HT_GROUP + b / rj;
                    bj = gj * HT_GROUP + b % rj;
                }
                return;
            }
            b -= cnt;
        }
    }
    bi = bj = 0;  // not reached: the grid has nb (nb + 1) / 2 blocks
}

// The TILE × TILE tile and the rows of this block (blockIdx.x: the tile, blockIdx.y: the
// expert); false when the expert has no rows.
struct HtBlock {
    int i0, j0, r0, r1;
    bool diag;
    float* He;
};
// The rows [r0, r1) of this block's expert (blockIdx.y; all T rows when off is null) and its
// Hessian He; false when the expert has no rows. Shared with hessian_wg.
__device__ __forceinline__ bool ht_segment(float* H, const int* off, int T, int D, int& r0, int& r1, float*& He) {
    r0 = 0;
    r1 = T;
    if (off) { r0 = off[blockIdx.y]; r1 = off[blockIdx.y + 1]; }
    He = H + (i64)blockIdx.y * D * D;
    return r1 > r0;
}
template <int TILE>
__device__ __forceinline__ bool ht_block(float* H, const int* off, int T, int D, HtBlock& b) {
    int bi, bj;
    ht_tile(blockIdx.x, (D + TILE - 1) / TILE, bi, bj);
    b.diag = bi == bj;
    b.i0 = bi * TILE;
    b.j0 = bj * TILE;
    return ht_segment(H, off, T, D, b.r0, b.r1, b.He);
}

// One element of H: the fresh value with `overwrite`, else added to what H holds.
__device__ __forceinline__ void h_put(float* h, float v, bool overwrite) { *h = overwrite ? v : *h + v; }

#define HS_T 64
#define HS_K 16

template <int DT>
__device__ __forceinline__ void hessian_impl(const void* x, float* H, const int* idx, const int* off, int T, int D,
                                             float alpha, int overwrite) {
    __shared__ float Xi[HS_K][HS_T + 4];
    __shared__ float Xj[HS_K][HS_T + 4];
    HtBlock b;
    // Overwriting, an expert without rows still writes its (zero) tile.
    if (!ht_block<HS_T>(H, off, T, D, b) && !overwrite) return;
    const int r0 = b.r0, r1 = b.r1, i0 = b.i0, j0 = b.j0;
    const int tid = threadIdx.x, tx = tid & 15, ty = tid >> 4;
    float acc[4][4];
#pragma unroll
    for (int a = 0; a < 4; a++)
#pragma unroll
        for (int c = 0; c < 4; c++) acc[a][c] = 0.0f;
    for (int t0 = r0; t0 < r1; t0 += HS_K) {
#pragma unroll
        for (int it = 0; it < 4; it++) {
            int l = tid + 256 * it;
            int rr = l >> 6, cc = l & 63;
            int t = t0 + rr;
            float vi = 0.0f, vj = 0.0f;
            if (t < r1) {
                i64 row = idx ? (i64)idx[t] : (i64)t;
                if (i0 + cc < D) vi = Elem<DT>::load(x, row * D + i0 + cc);
                if (j0 + cc < D) vj = Elem<DT>::load(x, row * D + j0 + cc);
            }
            Xi[rr][cc] = vi;
            Xj[rr][cc] = vj;
        }
        __syncthreads();
#pragma unroll
        for (int kk = 0; kk < HS_K; kk++) {
            float a[4], c[4];
#pragma unroll
            for (int q = 0; q < 4; q++) { a[q] = Xi[kk][ty * 4 + q]; c[q] = Xj[kk][tx * 4 + q]; }
            fma_outer4x4(acc, a, c);
        }
        __syncthreads();
    }
#pragma unroll
    for (int p = 0; p < 4; p++) {
#pragma unroll
        for (int q = 0; q < 4; q++) {
            int i = i0 + ty * 4 + p, j = j0 + tx * 4 + q;
            if (i < D && j < D) {
                const float v = alpha * acc[p][q];
                h_put(b.He + (i64)i * D + j, v, overwrite);
                if (!b.diag) h_put(b.He + (i64)j * D + i, v, overwrite);
            }
        }
    }
}

#define FORGE_HESS_ENTRY(SUF, DT)                                                                          \
    extern "C" __global__ void __launch_bounds__(256) hessian_accum_##SUF(const void* x, float* H, const int* idx, \
                                                                        const int* off, int T, int D, float alpha, \
                                                                        int overwrite) {                        \
        hessian_impl<DT>(x, H, idx, off, T, D, alpha, overwrite);                                          \
    }
FORGE_HESS_ENTRY(f32, FORGE_DT_F32)
FORGE_HESS_ENTRY(f16, FORGE_DT_F16)
FORGE_HESS_ENTRY(bf16, FORGE_DT_BF16)

// ---- tensor cores -------------------------------------------------------------------------
#define HT_T 128
#define HT_K 32
#define HT_ST 4
#define HT_THREADS 256
#define HT_SROW (HT_T + 1)  // row stride of the fp32 tile staged for the epilogue (odd: no bank conflicts)
#define HT_TILE_ELEMS (HT_K * HT_T)  // one operand of one stage, in 16-bit elements

// Element (row k, column c) of a [HT_K][HT_T] stage: 16-byte chunk c/8 is stored at chunk
// (c/8) ^ (k % 8) of its row.
__device__ __forceinline__ int ht_at(int k, int c) { return k * HT_T + ((((c >> 3) ^ k) & 7) | ((c >> 3) & 8)) * 8 + (c & 7); }


// Adds alpha · S (the block's 128 × 128 fp32 tile, row stride HT_SROW) to H at (i0, j0) and
// its mirror at (j0, i0), a row at a time: warp w takes tile rows w, w + 8, ..., lane l
// columns l, l + 32, l + 64, l + 96. A diagonal tile takes each value from its upper
// triangle, so H stays exactly symmetric.
__device__ __forceinline__ void ht_epilogue(const float* S, float* He, int D, int i0, int j0, bool diag, float alpha,
                                            bool overwrite) {
    const int lane = threadIdx.x & 31;
    for (int a = threadIdx.x >> 5; a < HT_T; a += blockDim.x >> 5) {
#pragma unroll
        for (int cq = 0; cq < HT_T; cq += 32) {
            const int c = cq + lane;
            const int i = i0 + a, j = j0 + c;
            if (i < D && j < D) {
                const float v = alpha * (diag && a > c ? S[c * HT_SROW + a] : S[a * HT_SROW + c]);
                h_put(He + (i64)i * D + j, v, overwrite);
            }
            // The mirror: row j0 + a of H, columns i0 + c, from column a of S.
            const int mi_ = j0 + a, mj = i0 + c;
            if (!diag && mi_ < D && mj < D) h_put(He + (i64)mi_ * D + mj, alpha * S[c * HT_SROW + a], overwrite);
        }
    }
}


// One stage: rows r0 + 32·step .. of the block's 128 i-features into As and 128 j-features
// into Bs (not for a diagonal tile: As serves both), as 32 rows × 16 chunks of 16 bytes,
// two chunks per operand for each of the 256 threads; chunk ch of row k lands at element
// at(k, ch) of the stage. Rows past the segment and features past D are zero-filled.
template <class At>
__device__ __forceinline__ void ht_load(const u16* x, const int* idx, int D, const HtBlock& b, int step, u16* As,
                                        u16* Bs, At at) {
    const int t0 = b.r0 + step * HT_K;
#pragma unroll
    for (int it = 0; it < 2; it++) {
        const int l = threadIdx.x + HT_THREADS * it, k = l >> 4, ch = l & 15;
        const int t = t0 + k;
        const bool row_ok = t < b.r1;
        const i64 row = row_ok ? (idx ? (i64)idx[t] : (i64)t) : 0;
        const int s = at(k, ch);
        const bool a_ok = row_ok && b.i0 + ch * 8 < D;
        cp_async16(As + s, x + (a_ok ? row * D + b.i0 + ch * 8 : 0), a_ok ? 16 : 0);
        if (!b.diag) {
            const bool b_ok = row_ok && b.j0 + ch * 8 < D;
            cp_async16(Bs + s, x + (b_ok ? row * D + b.j0 + ch * 8 : 0), b_ok ? 16 : 0);
        }
    }
}

template <bool BF>
__device__ __forceinline__ void hessian_tc_impl(const u16* x, float* H, const int* idx, const int* off, int T, int D,
                                                float alpha, int overwrite) {
    extern __shared__ __align__(16) u16 hs_smem[];
    HtBlock b;
    if (!ht_block<HT_T>(H, off, T, D, b) && !overwrite) return;
    const bool diag = b.diag;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wm = (warp >> 2) * 64, wn = (warp & 3) * 32;
    u16* As = hs_smem;
    u16* Bs = hs_smem + HT_ST * HT_TILE_ELEMS;
    auto load = [&](int step, int stage) {
        const int base = stage * HT_TILE_ELEMS;
        ht_load(x, idx, D, b, step, As, Bs, [&](int k, int ch) { return base + ht_at(k, ch * 8); });
    };

    float acc[4][4][4];
#pragma unroll
    for (int a = 0; a < 4; a++)
#pragma unroll
        for (int c = 0; c < 4; c++)
#pragma unroll
            for (int q = 0; q < 4; q++) acc[a][c][q] = 0.0f;

    const int steps = (b.r1 - b.r0 + HT_K - 1) / HT_K;
#pragma unroll
    for (int s = 0; s < HT_ST - 1; s++) {
        if (s < steps) load(s, s);
        cp_async_commit();
    }
    // ldmatrix lane roles: matrix q = lane / 8, its row r = lane % 8.
    const int q = lane >> 3, r = lane & 7;
    for (int step = 0; step < steps; step++) {
        cp_async_wait<HT_ST - 2>();
        __syncthreads();
        if (step + HT_ST - 1 < steps) load(step + HT_ST - 1, (step + HT_ST - 1) % HT_ST);
        cp_async_commit();
        const u16* as = As + (step % HT_ST) * HT_TILE_ELEMS;
        const u16* bs = (diag ? As : Bs) + (step % HT_ST) * HT_TILE_ELEMS;
#pragma unroll
        for (int kk = 0; kk < HT_K; kk += 16) {
            u32 af[4][4], bfr[2][4];
            // A = Xᵀ (m = feature, k = row): matrices (k 0-7, m 0-7), (k 0-7, m 8-15),
            // (k 8-15, m 0-7), (k 8-15, m 8-15) give a0..a3.
#pragma unroll
            for (int mi = 0; mi < 4; mi++)
                ldmatrix_x4_trans(af[mi], as + ht_at(kk + r + ((q >> 1) << 3), wm + mi * 16 + ((q & 1) << 3)));
            // B = X (k = row, n = feature): matrices (k 0-7, n 0-7), (k 8-15, n 0-7),
            // (k 0-7, n 8-15), (k 8-15, n 8-15) give b0, b1 of two n-tiles.
#pragma unroll
            for (int nj = 0; nj < 2; nj++)
                ldmatrix_x4_trans(bfr[nj], bs + ht_at(kk + r + ((q & 1) << 3), wn + nj * 16 + ((q >> 1) << 3)));
#pragma unroll
            for (int mi = 0; mi < 4; mi++)
#pragma unroll
                for (int ni = 0; ni < 4; ni++)
                    mma16816<BF>(acc[mi][ni], af[mi], bfr[ni >> 1][(ni & 1) * 2], bfr[ni >> 1][(ni & 1) * 2 + 1]);
        }
    }
    cp_async_wait<0>();
    __syncthreads();

    // Epilogue through shared memory, so that both H[i0.., j0..] and its mirror
    // H[j0.., i0..] are read and written a row at a time (coalesced). Accumulator (mi, ni):
    // c0, c1 at (g, 2t), (g, 2t+1); c2, c3 at (g+8, 2t), (g+8, 2t+1).
    float* S = reinterpret_cast<float*>(hs_smem);
    const int g = lane >> 2, t4 = lane & 3;
#pragma unroll
    for (int mi = 0; mi < 4; mi++)
#pragma unroll
        for (int ni = 0; ni < 4; ni++)
#pragma unroll
            for (int c = 0; c < 4; c++)
                S[(wm + mi * 16 + g + ((c >> 1) << 3)) * HT_SROW + wn + ni * 8 + 2 * t4 + (c & 1)] = acc[mi][ni][c];
    __syncthreads();
    ht_epilogue(S, b.He, D, b.i0, b.j0, diag, alpha, overwrite != 0);
}

#define FORGE_HESS_TC_ENTRY(SUF, BF)                                                                       \
    extern "C" __global__ void __launch_bounds__(HT_THREADS, 2) hessian_tc_##SUF(const u16* x, float* H, const int* idx, \
                                                                          const int* off, int T, int D, float alpha, \
                                                                          int overwrite) {                        \
        hessian_tc_impl<BF>(x, H, idx, off, T, D, alpha, overwrite);                                       \
    }
FORGE_HESS_TC_ENTRY(f16, false)
FORGE_HESS_TC_ENTRY(bf16, true)

// ---- Hopper: wgmma (sm_90a) -----------------------------------------------------------------
// Tiles of 128 × 256 (HW_TI features of the i-block × HW_TJ of the j-block): every tile that
// holds an element on or above the diagonal, each writing those elements and mirroring them.
// Warp-specialized, 3 warpgroups: the producer (the third) gathers HW_K = 64 rows of X a stage
// into a HW_ST-stage ring with cp.async, rows read by index (as ht_load); the two consumers
// each multiply 64 rows of the tile against its 256 columns, one m64n256k16 MMA per 16 rows
// of X with both operands in shared memory. mbarriers hand the stages over: full[s] when the
// producer's copies into stage s have landed, empty[s] when both consumers' MMAs that read it
// are done. A 128 × 256 tile needs 24 bytes of X per 16 K-products where a 128 × 128 one
// needs 32.
//
// Shared memory holds each stage's operands as 64-feature "halves" of [HW_K rows][64]
// (128 bytes a row, 8 KB), A's 2 then B's 4, in the 128-byte swizzle the MMA expects: 16-byte
// chunk c of row k at chunk c ^ (k % 8). Both operands are "MN-major" (features contiguous):
// descriptor LBO = the step between halves, SBO = the step between groups of 8 rows (1024 B).
// A tile whose i-block lies inside its j-block (the diagonal ones) reads A from B's halves.
#define HW_THREADS_WG 384  // 2 consumer warpgroups and the producer
#define HW_TI 128
#define HW_TJ 256
#define HW_K 64
#define HW_ST 4
#define HW_HALF (HW_K * 64)                       // 16-bit elements of one 64-feature half
#define HW_STAGE ((HW_TI + HW_TJ) / 64 * HW_HALF)  // both operands of one stage
// The adding epilogue's fp32 staging: a tile quarter (128 rows × 64) in rows of HW_QROW floats
// (8-byte pairs, no bank conflicts a half-warp), a mirror quarter (64 rows × 128) in rows of
// HW_TROW (no bank conflicts), each in one of HW_EB buffers of HW_EBUF floats in the ring.
#define HW_QROW (64 + 8)
#define HW_TROW (HW_TI + 4)
#define HW_EBUF (HW_TI * HW_QROW)
#define HW_EB 5
static_assert(HW_EB * HW_EBUF * 4 <= HW_ST * HW_STAGE * 2 && 64 * HW_TROW <= HW_EBUF, "epilogue buffers");
#define HW_GI 8                                    // the walk's groups: 8 i-blocks × 4 j-blocks
#define HW_GJ 4

// Tile (bi, bj) of block b among the tiles of 128 × 256 with bj >= bi / 2 (those holding an
// element on or above the diagonal), walked in groups of HW_GI × HW_GJ tiles, row-major in a
// group, so that the blocks resident at one time share the feature columns they read (as
// ht_tile). Row group gi (i-blocks 8gi ..) starts with its diagonal group (j-blocks 4gi ..
// 4gi + 3, from i / 2 in row i), then whole groups of 4 j-blocks (the last one narrower).
__device__ __forceinline__ void hw_tile(int b, int nbi, int nbj, int& bi, int& bj) {
    for (int ia = 0; ia < nbi; ia += HW_GI) {
        const int ib = min(nbi, ia + HW_GI), jd = min(nbj, ia / 2 + HW_GJ), rows = ib - ia;
        for (int i = ia; i < ib; i++) {
            const int cnt = max(0, jd - i / 2);
            if (b < cnt) { bi = i; bj = i / 2 + b; return; }
            b -= cnt;
        }
        const int rest = rows * (nbj - jd);
        if (b < rest) {
            const int g = b / (rows * HW_GJ), jg = jd + g * HW_GJ, w = min(HW_GJ, nbj - jg);
            const int r = b - g * rows * HW_GJ;
            bi = ia + r / w;
            bj = jg + r % w;
            return;
        }
        b -= rest;
    }
    bi = bj = 0;  // not reached: the grid has hw_tiles(D) blocks
}

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// d += A·B (d: lo = columns 0-127, hi = 128-255), both operands from shared memory
// (descriptors da, db), MN-major (transposed).
#define FORGE_HW_WGMMA(DT)                                                                                  \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"                                            \
                 "wgmma.mma_async.sync.aligned.m64n256k16.f32." DT "." DT " " FORGE_WG_ACC256_REGS           \
                 ", %128, %129, p, 1, 1, 1, 1;\n}\n"                                                         \
                 : FORGE_WG_ACC_OPS(lo), FORGE_WG_ACC_OPS(hi)                                                \
                 : "l"(da), "l"(db), "r"(1))
template <bool BF>
__device__ __forceinline__ void wgmma_m64n256k16(float (&lo)[64], float (&hi)[64], u64 da, u64 db) {
    if (BF) FORGE_HW_WGMMA("bf16");
    else FORGE_HW_WGMMA("f16");
}
#undef FORGE_HW_WGMMA
#endif

template <bool BF>
__device__ __forceinline__ void hessian_wg_impl(const u16* x, float* H, const int* idx, const int* off, int T, int D,
                                                float alpha, int overwrite) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    extern __shared__ __align__(16) u16 hs_smem[];
    // The swizzle pattern repeats every 1024 bytes from a 1024-byte boundary.
    u16* base = hs_smem + ((1024 - (smem_u32(hs_smem) & 1023)) & 1023) / 2;
    int bi, bj;
    hw_tile(blockIdx.x, (D + HW_TI - 1) / HW_TI, (D + HW_TJ - 1) / HW_TJ, bi, bj);
    const int i0 = bi * HW_TI, j0 = bj * HW_TJ;
    int r0, r1;
    float* He;
    // Overwriting, an expert without rows still writes its (zero) tile.
    if (!ht_segment(H, off, T, D, r0, r1, He) && !overwrite) return;
    // The i-block inside the j-block: A is B's halves (i0 - j0) / 64 and the next.
    const bool a_in_b = i0 >= j0 && i0 < j0 + HW_TJ;
    const int tid = threadIdx.x, lane = tid & 31, wg = tid >> 7;
    const int steps = (r1 - r0 + HW_K - 1) / HW_K;
    const u32 sbase = smem_u32(base);
    // The mbarriers, after the stages: full[s] at bar + 8s, empty[s] at bar + 8(HW_ST + s).
    const u32 bar = sbase + HW_ST * HW_STAGE * 2;
    if (tid == 0) {
        for (int s = 0; s < HW_ST; s++) {
            mbar_init(bar + 8 * s, 128);                // every producer thread's copies
            mbar_init(bar + 8 * (HW_ST + s), 8);        // lane 0 of every consumer warp
        }
    }
    __syncthreads();

    float d0[64], d1[64];  // consumers: the tile's rows 64·wg.., columns 0-127 and 128-255
    if (wg == 2) {
        // Producer: thread p moves rows p / 8 + 16r (r < HW_K / 16) of each stage, chunk p % 8 of each
        // half of A (unless a_in_b) and B: a warp's copy covers 4 rows × 128 contiguous bytes
        // (whole L2 lines). Chunk p % 8 of row k sits at chunk (p ^ k) % 8 of the half's row,
        // the same for the thread's 4 rows (16 ≡ 0 mod 8), so its shared offsets are the
        // same every stage. Its rows' indices are read two stages ahead and kept raw until
        // their stage is issued: scaling an index by D right after its load would stall the
        // producer on that load every stage (long scoreboard), which made routed rows ~1.5×
        // slower than contiguous ones (ncu, one expert of 27404 rows: 4.31 vs 2.84 ms). A stage
        // whose copies are all in range (every stage but a segment's last, in a tile inside H)
        // takes a path of ~84 instructions instead of ~270: this producer's issue rate, not L2,
        // held the tensor pipe at 67 % (ncu: consumers waiting on full stages for 55 % of
        // their stall samples); with the short path it is at 80 %.
        const int p = tid - 256, lk = p >> 3, lq = p & 7;
        const u32 o = (lk * 64 + ((lq ^ lk) & 7) * 8) * 2;
        // Segment position of this thread's row q of stage `step`, and the rows' indices in x.
        auto pos = [&](int step, int q) { return r0 + step * HW_K + lk + 16 * q; };
        // Both operands' features inside H (the general path zero-fills past D).
        const bool whole = i0 + HW_TI <= D && j0 + HW_TJ <= D;
        auto rows_at = [&](int step, int (&r)[HW_K / 16]) {
            if (idx) {
#pragma unroll
                for (int q = 0; q < HW_K / 16; q++) r[q] = __ldg(idx + min(pos(step, q), r1 - 1));
            } else {
#pragma unroll
                for (int q = 0; q < HW_K / 16; q++) r[q] = pos(step, q);
            }
        };
        // Stage `step` from the raw indices r (read two stages before).
        auto issue = [&](int step, const int (&r)[HW_K / 16]) {
            const int s = step % HW_ST;
            if (step >= HW_ST) mbar_wait(bar + 8 * (HW_ST + s), (step / HW_ST - 1) & 1);
            const u32 st = sbase + s * HW_STAGE * 2 + o;
            if (whole && pos(step, HW_K / 16 - 1) < r1) {
                // Every copy of the stage is in range: one pointer a row and operand, the
                // halves at constant offsets that ptxas folds into the copies' addresses (one
                // loop shared with the general path, an address expression a copy, lost that:
                // 4818 instructions against 4628, no folded offsets).
#pragma unroll
                for (int q = 0; q < HW_K / 16; q++) {
                    const u16* xr = x + (i64)r[q] * D + 8 * lq;
                    const u16* xa = xr + i0;
                    const u16* xb = xr + j0;
                    const u32 sq = st + q * 16 * 128;
                    if (!a_in_b) {
#pragma unroll
                        for (int h = 0; h < HW_TI / 64; h++) cp_async16_s(sq + h * HW_HALF * 2, xa + 64 * h, 16);
                    }
#pragma unroll
                    for (int h = 0; h < HW_TJ / 64; h++)
                        cp_async16_s(sq + (HW_TI / 64 + h) * HW_HALF * 2, xb + 64 * h, 16);
                }
                cp_async_mbar_arrive(bar + 8 * s);
                return;
            }
            i64 xo[HW_K / 16];
#pragma unroll
            for (int q = 0; q < HW_K / 16; q++) xo[q] = pos(step, q) < r1 ? (i64)r[q] * D : -1;
#pragma unroll
            for (int q = 0; q < HW_K / 16; q++) {
                const u16* xr = x + (xo[q] < 0 ? 0 : xo[q]);
                const u32 sq = st + q * 16 * 128;  // 16 rows of 128 bytes further
                if (!a_in_b) {
#pragma unroll
                    for (int h = 0; h < HW_TI / 64; h++) {
                        const int f = i0 + 64 * h + 8 * lq;
                        const bool ok = xo[q] >= 0 && f < D;
                        cp_async16_s(sq + h * HW_HALF * 2, xr + (ok ? f : 0), ok ? 16 : 0);
                    }
                }
#pragma unroll
                for (int h = 0; h < HW_TJ / 64; h++) {
                    const int f = j0 + 64 * h + 8 * lq;
                    const bool ok = xo[q] >= 0 && f < D;
                    cp_async16_s(sq + (HW_TI / 64 + h) * HW_HALF * 2, xr + (ok ? f : 0), ok ? 16 : 0);
                }
            }
            cp_async_mbar_arrive(bar + 8 * s);
        };
        // Two index sets in turn (no register moves, which would wait on their loads).
        int ra[HW_K / 16], rb[HW_K / 16];
        if (steps > 0) {  // (an empty segment has no index to read)
            rows_at(0, ra);
            rows_at(1, rb);
        }
        for (int step = 0; step < steps; step += 2) {
            issue(step, ra);
            rows_at(step + 2, ra);
            if (step + 1 < steps) {
                issue(step + 1, rb);
                rows_at(step + 3, rb);
            }
        }
        cp_async_wait<0>();
    } else {
#pragma unroll
        for (int i = 0; i < 64; i++) { d0[i] = 0.0f; d1[i] = 0.0f; }
        wg_fence_acc(d0);
        wg_fence_acc(d1);
        const int a_half = a_in_b ? HW_TI / 64 + (i0 - j0) / 64 + wg : wg;
        for (int step = 0; step < steps; step++) {
            const int s = step % HW_ST;
            mbar_wait(bar + 8 * s, (step / HW_ST) & 1);
            asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  // cp.async writes → the MMA's reads
            const u16* st = base + s * HW_STAGE;
            const u16* as = st + a_half * HW_HALF;
            const u16* bs = st + HW_TI / 64 * HW_HALF;
            asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
            for (int kk = 0; kk < HW_K; kk += 16)
                wgmma_m64n256k16<BF>(d0, d1, hw_desc(as + kk * 64, HW_HALF * 2), hw_desc(bs + kk * 64, HW_HALF * 2));
            asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
            // One step's MMAs stay in flight; the previous step's are done: its stage is free.
            asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");
            if (step > 0 && lane == 0) mbar_arrive(bar + 8 * (HW_ST + (step - 1) % HW_ST));
        }
        asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
        wg_fence_acc(d0);
        wg_fence_acc(d1);
    }
    __syncthreads();

    // Accumulator elements 4j + 2h and 4j + 2h + 1 of a consumer thread (warp w of its
    // warpgroup, lane l): tile row 64·wg + 16w + l/4 + 8h, columns q and q + 1 with
    // q = 128·hi + 8j + 2(l % 4) (hi: d1 rather than d0); pair calls f(row, q, alpha times
    // both) for one of them, each_pair for all.
    auto pair = [&](int hi, int j, int h, auto f) {
        const int w4 = (tid >> 5) & 3, gq = lane >> 2, t4 = lane & 3;
        f(wg * 64 + w4 * 16 + gq + 8 * h, hi * 128 + j * 8 + 2 * t4, alpha * (hi ? d1 : d0)[4 * j + 2 * h],
          alpha * (hi ? d1 : d0)[4 * j + 2 * h + 1]);
    };
    auto each_pair = [&](auto f) {
#pragma unroll
        for (int hi = 0; hi < 2; hi++)
#pragma unroll
            for (int j = 0; j < 16; j++)
#pragma unroll
                for (int h = 0; h < 2; h++) pair(hi, j, h, f);
    };

    if (overwrite) {
        // H = alpha · tile straight from the accumulators: element (i, j) of the tile where
        // i <= j, and its mirror (j, i) where i < j; every element of H is on or above the
        // diagonal in exactly one tile, so each is written once (no read, no atomics). A warp's
        // store covers whole 32-byte sectors: 8 rows × 4 pairs of columns for the tile, 4 rows
        // × 8 consecutive columns for the mirror.
        if (wg < 2) {
            each_pair([&](int r, int q, float v0, float v1) {
                const int gi = i0 + r, gj = j0 + q;
                if (gi >= D) return;
                float* row = He + (i64)gi * D;
                if (gi <= gj && gj + 1 < D) {
                    *reinterpret_cast<float2*>(row + gj) = make_float2(v0, v1);  // D even, gj even
                } else {
                    if (gj < D && gi <= gj) row[gj] = v0;
                    if (gj + 1 < D && gi <= gj + 1) row[gj + 1] = v1;
                }
                if (gj < D && gi < gj) He[(i64)gj * D + gi] = v0;
                if (gj + 1 < D && gi < gj + 1) He[(i64)(gj + 1) * D + gi] = v1;
            });
        }
        return;
    }

    // The epilogue adds the tile to H in L2 by bulk reductions from shared memory (the SM does
    // not wait on H's 512 KB of read-modify-write, which bounded tiles of a few thousand rows),
    // in up to 8 pieces: alpha · the tile's four 64-column quarters (128 rows of H each, a row
    // from column max(j0 + 64Q, i) down to a multiple of 4), then alpha · its mirror's four
    // quarters (64 rows j of H each, from column i0 to j up to a multiple of 4). The pieces are
    // staged in turn into a ring of HW_EB buffers, so that staging one overlaps the bulk reads of
    // the ones before it; a buffer is restaged once its previous piece's reads are done. The
    // elements of the ops' edge vectors on the other side of the diagonal are staged as zeros
    // (adding 0 changes nothing, and the adds are atomic where a neighbour tile owns them), so H
    // stays exactly symmetric. Quarters with nothing to add (past D, or wholly on the other side
    // of the diagonal) are skipped. Staged whole and reduced in two passes, the tile then its
    // mirror, each pass waiting for its reads, 64 experts of D = 7168 at 32768×8 routed rows took
    // 27.9-28.6 ms on an H200, pipelined 26.9-27.9 (131072×8: 97.9-99.0 → 94.9-97.7; LOG.md,
    // session 38; with the pairs' formula shared with each_pair, 168 registers instead of 166:
    // adding the same within the spread, fresh products 1 % slower). The producer is done: the
    // named barrier 1 counts the two consumers' threads.
    if (wg >= 2) return;
    float* S = reinterpret_cast<float*>(base);
    int put = 0;  // pieces staged so far (the same in every thread)
#pragma unroll
    for (int piece = 0; piece < 8; piece++) {
        const bool mirror = piece >= 4;
        const int Q = piece & 3, q0 = 64 * Q;  // the tile's columns q0 .. q0 + 63
        if (j0 + q0 >= D) continue;
        // The tile needs i <= j, its mirror i < j, for some row i0 + r and column j0 + q.
        if (mirror ? j0 + q0 + 63 <= i0 : j0 + q0 + 63 < i0) continue;
        float* Sb = S + (put % HW_EB) * HW_EBUF;
        if (put >= HW_EB) {
            asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(HW_EB - 1) : "memory");
            asm volatile("bar.sync 1, 256;\n" ::: "memory");
        }
        // The pairs of quarter Q: hi = Q / 2, j = 8(Q % 2) .. + 7.
#pragma unroll
        for (int jj = 0; jj < 8; jj++)
#pragma unroll
            for (int h = 0; h < 2; h++)
                pair(Q >> 1, 8 * (Q & 1) + jj, h, [&](int r, int q, float v0, float v1) {
                    if (mirror) {
                        Sb[(q - q0) * HW_TROW + r] = i0 + r < j0 + q ? v0 : 0.0f;
                        Sb[(q + 1 - q0) * HW_TROW + r] = i0 + r < j0 + q + 1 ? v1 : 0.0f;
                    } else {
                        *reinterpret_cast<float2*>(Sb + r * HW_QROW + q - q0) =
                            make_float2(i0 + r <= j0 + q ? v0 : 0.0f, i0 + r <= j0 + q + 1 ? v1 : 0.0f);
                    }
                });
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  // the staging → the bulk reads
        asm volatile("bar.sync 1, 256;\n" ::: "memory");
        // The issuing threads alternate between the warpgroups from piece to piece.
        const int u = (tid + 128 * (put & 1)) & 255;
        int row = D, c0 = 0, c1 = 0;  // H row, columns [c0, c1)
        u32 src = 0;
        if (mirror && u < 64) {
            row = j0 + q0 + u;
            c0 = i0;
            c1 = min(i0 + HW_TI, (row + 3) & ~3);
            src = smem_u32(Sb + u * HW_TROW);
        } else if (!mirror && u < HW_TI) {
            row = i0 + u;
            c0 = max(j0 + q0, row & ~3);
            c1 = min(j0 + q0 + 64, D);
            src = smem_u32(Sb + u * HW_QROW + c0 - j0 - q0);
        }
        if (row < D && c1 > c0) {
            asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n" ::"l"(
                             He + (i64)row * D + c0),
                         "r"(src), "r"((c1 - c0) * 4)
                         : "memory");
        }
        asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
        put++;
    }
    asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
#endif
}

#define FORGE_HESS_WG_ENTRY(SUF, BF)                                                                          \
    extern "C" __global__ void __launch_bounds__(HW_THREADS_WG, 1) hessian_wg_##SUF(const u16* x, float* H, const int* idx, \
                                                                          const int* off, int T, int D, float alpha, \
                                                                          int overwrite) {                        \
        hessian_wg_impl<BF>(x, H, idx, off, T, D, alpha, overwrite);                                          \
    }
FORGE_HESS_WG_ENTRY(f16, false)
FORGE_HESS_WG_ENTRY(bf16, true)
