// gptq.cu — blocked GPTQ solver (docs/numerics.md "GPTQ solver"), batched over E matrices of
// the same shape (all experts of a layer). Per matrix e:
//   W: weight_t [C, R] f32, updated in place (row perm[j] holds processing position j),
//   U: upper Cholesky factor of H⁻¹ [C, C] (processing order), qmeta: [R, ceil(C/G)] of W.T,
//   perm: [C] i32 or null, codes: [C, R] u8 in ORIGINAL order, err: workspace [err_rows, R] f32
//   holding the scaled errors of the current super-block's columns (see ops::gptq_solve).
// gptq_block_f32: the in-block column loop for block [i1, i1 + bsz). One thread per column r
//   (columns are independent inside a block); its block rows live in shared memory. The rows
//   are taken GQ_SUB at a time: the sub-block's rows are quantized in registers, then its
//   errors update the block's later rows as one rank-GQ_SUB update per row, with the U
//   coefficients staged transposed in shared memory (two broadcast 16-byte loads per row).
// gptq_trail_tf32x3: W[rows, :] -= U[k0:k0+kn, rows]ᵀ · Err, a batched tensor-core GEMM (3xTF32).

#define GQ_THREADS 64
#define GQ_BMAX 128
#define GQ_SUB 8

// w − c·e as the CPU computes it (separate multiply and subtract), skipped where c == 0.
__device__ __forceinline__ float gq_axpy(float w, float c, float e) { return c != 0.0f ? w - c * e : w; }

// Rows [k0, k1) of this thread's column of the block: w −= c·ev[jj] for jj in increasing
// order, c = U[i1 + s0 + jj][i1 + k] from Us. DENSE: every coefficient is nonzero, so the zero
// test (forge-core skips zero coefficients) can go.
template <bool DENSE>
__device__ __forceinline__ void gq_rank_update(float (&Ws)[GQ_BMAX][GQ_THREADS], const float (&Us)[GQ_BMAX][GQ_SUB],
                                               int tid, int k0, int k1, const float (&ev)[GQ_SUB]) {
#pragma unroll 4
    for (int k = k0; k < k1; k++) {
        const float4 c0 = *(const float4*)&Us[k][0];
        const float4 c1 = *(const float4*)&Us[k][4];
        const float cs[GQ_SUB] = {c0.x, c0.y, c0.z, c0.w, c1.x, c1.y, c1.z, c1.w};
        float w = Ws[k][tid];
#pragma unroll
        for (int jj = 0; jj < GQ_SUB; jj++) w = DENSE ? w - cs[jj] * ev[jj] : gq_axpy(w, cs[jj], ev[jj]);
        Ws[k][tid] = w;
    }
}

// Each row of the block receives its updates in processing order (row k from every j < k, in
// increasing j) whether they come from inside its sub-block or from an earlier sub-block's
// rank update, so the values equal forge-core's row-by-row loop bit for bit. Per update the
// old loop spent a shuffle, a shared load and a shared store; the rank update spends 4 shared
// accesses per GQ_SUB updates of one row. That gained only 16 % (H100: 36.1 -> 30.2 ms for the
// 16 launches of 64 x 7168x2048), so the kernel is mostly latency-bound (the column's
// quantize-divide-update chain, 12 warps per SM for the shared memory), not shared-memory bound.
extern "C" __global__ void __launch_bounds__(GQ_THREADS) gptq_block_f32(
    float* W, const float* U, const u32* qmeta, const int* perm, u8* codes, float* err, int C, int R, int G,
    int bits, int i1, int bsz, int err_rows) {
    __shared__ float Ws[GQ_BMAX][GQ_THREADS];
    // Us[k][jj] = U[i1 + s0 + jj][i1 + k]: the current sub-block's rows of U, transposed.
    __shared__ __align__(16) float Us[GQ_BMAX][GQ_SUB];
    const int e = blockIdx.y;
    const int tid = threadIdx.x;
    const int r = blockIdx.x * GQ_THREADS + tid;
    const bool ok = r < R;
    const i64 CR = (i64)C * R;
    W += e * CR;
    U += (i64)e * C * C;
    codes += e * CR;
    err += (i64)e * err_rows * R;
    const int ng = (C + G - 1) / G;
    qmeta += (i64)e * R * ng;
    if (perm) perm += (i64)e * C;

    for (int jj = 0; jj < bsz; jj++) {
        int src = perm ? perm[i1 + jj] : i1 + jj;
        Ws[jj][tid] = ok ? W[(i64)src * R + r] : 0.0f;
    }
    int cached_g = -1;
    GroupParams p;
    p.scale = 1.0f; p.inv = 1.0f; p.zero = 0.0f; p.maxq = 15.0f;
    for (int s0 = 0; s0 < bsz; s0 += GQ_SUB) {
        const int sn = min(GQ_SUB, bsz - s0);
        // Stage U[i1 + s0 + jj][i1 + k] for k in [s0, bsz) (coalesced along k); `dense` says
        // whether every coefficient of the rank update is nonzero, so it may skip the tests.
        __syncthreads();  // the previous sub-block's readers of Us are done
        int dense = 1;
#pragma unroll
        for (int jj = 0; jj < GQ_SUB; jj++) {
            const float* urow = U + (i64)(i1 + s0 + jj) * C + i1;
            for (int k = s0 + tid; k < bsz; k += GQ_THREADS) {
                const float v = jj < sn ? urow[k] : 0.0f;
                Us[k][jj] = v;
                if (k >= s0 + GQ_SUB && v == 0.0f) dense = 0;
            }
        }
        dense = __syncthreads_and(dense);
        float x[GQ_SUB], ev[GQ_SUB];
#pragma unroll
        for (int jj = 0; jj < GQ_SUB; jj++) {
            x[jj] = jj < sn ? Ws[s0 + jj][tid] : 0.0f;
            ev[jj] = 0.0f;
        }
#pragma unroll
        for (int jj = 0; jj < GQ_SUB; jj++) {
            if (jj >= sn) break;
            const int j = i1 + s0 + jj;
            const int src = perm ? perm[j] : j;
            const int g = src / G;
            if (g != cached_g) {
                cached_g = g;
                if (ok) p = qmeta_params(qmeta[(i64)r * ng + g], bits);
            }
            const float q = quant_code(x[jj], p);
            const float xq = dequant(q, p);
            ev[jj] = (x[jj] - xq) / Us[s0 + jj][jj];
            x[jj] = xq;
            if (ok) {
                codes[(i64)src * R + r] = (u8)q;
                err[(i64)(s0 + jj) * R + r] = ev[jj];
            }
#pragma unroll
            for (int kk = jj + 1; kk < GQ_SUB; kk++)
                if (kk < sn) x[kk] = gq_axpy(x[kk], Us[s0 + kk][jj], ev[jj]);
        }
#pragma unroll
        for (int jj = 0; jj < GQ_SUB; jj++)
            if (jj < sn) Ws[s0 + jj][tid] = x[jj];
        // Rank-GQ_SUB update of the later rows (none after a partial, i.e. last, sub-block).
        if (dense)
            gq_rank_update<true>(Ws, Us, tid, s0 + GQ_SUB, bsz, ev);
        else
            gq_rank_update<false>(Ws, Us, tid, s0 + GQ_SUB, bsz, ev);
    }
    if (ok) {
        for (int jj = 0; jj < bsz; jj++) {
            int src = perm ? perm[i1 + jj] : i1 + jj;
            W[(i64)src * R + r] = Ws[jj][tid];
        }
    }
}

// gptq_trail_tf32x3: a trailing update W[row0:row1, :] -= U[k0:k0+kn, row0:row1]ᵀ · Err[0:kn]
// (Err's rows are the scaled errors of columns k0.., per expert err_rows apart) on tensor cores,
// fp32 accuracy from three TF32 products (docs/numerics.md "GPTQ solver"): each operand x is
// split into hi = x rounded to TF32 (nearest, ties away) and lo = x − hi (exact; the MMA reads
// its top 19 bits), and a·b ≈ a_lo·b_hi + a_hi·b_lo + a_hi·b_hi with fp32 accumulation (error
// ≈ 2^-22 relative per product; lo·lo is below that). 128×128 output tile per 256-thread
// block, 8 warps of 64×32 (4×4 mma.m16n8k8 tiles), K staged 16 rows at a time in two
// buffers (cp.async where rows are 16-byte aligned). Shared rows are padded to 136 floats: the fragment loads
// (row t, column g of a warp) then hit 32 distinct banks.
#define TT_T 128
#define TT_BK 16
#define TT_LD (TT_T + 8)

// Up to 4 floats from p (avail of them exist), zeros past the end: the unaligned path's loads.
__device__ __forceinline__ float4 tt_load(const float* p, int avail) {
    float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    if (avail > 0) v.x = __ldg(p);
    if (avail > 1) v.y = __ldg(p + 1);
    if (avail > 2) v.z = __ldg(p + 2);
    if (avail > 3) v.w = __ldg(p + 3);
    return v;
}

// x = hi + lo with hi x rounded to TF32 (10-bit mantissa, to nearest, ties away from zero).
__device__ __forceinline__ void tf32_split(float x, u32& hi, u32& lo) {
    hi = (__float_as_uint(x) + 0x1000u) & 0xFFFFE000u;
    lo = __float_as_uint(x - __uint_as_float(hi));
}

typedef float TtStage[2][TT_BK][TT_LD];

template <bool VEC>
__device__ __forceinline__ void gptq_trail_impl(TtStage& As, TtStage& Bs, float* W, const float* U, const float* err,
                                                const int* perm, int C, int R, int k0, int kn, int row0, int row1,
                                                int err_rows) {
    // As[buf][b][i] = U[k0 + b][ib + i], Bs[buf][b][r] = err[b][rb + r]
    const int e = blockIdx.z;
    W += (i64)e * C * R;
    U += (i64)e * C * C;
    err += (i64)e * err_rows * R;
    if (perm) perm += (i64)e * C;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int wm = (warp & 1) * 64, wn = (warp >> 1) * 32;  // the warp's 64×32 of the tile
    const int ib = row0 + blockIdx.y * TT_T;  // first output row (processing position)
    const int rb = blockIdx.x * TT_T;
    // Loader: rows lk and lk + 8 of a stage, 4 consecutive elements at lc.
    const int lk = tid >> 5, lc = (tid & 31) * 4;
    const int a_avail = row1 - (ib + lc), b_avail = R - (rb + lc);
    const float* ua = U + (i64)(k0 + lk) * C + ib + lc;
    const float* eb = err + (i64)lk * R + rb + lc;

    float acc[4][4][4];
#pragma unroll
    for (int m = 0; m < 4; m++)
#pragma unroll
        for (int n = 0; n < 4; n++)
#pragma unroll
            for (int q = 0; q < 4; q++) acc[m][n][q] = 0.0f;

    // Stage `st` into buffer `buf`: cp.async (zero-filled past the edges) on the VEC path,
    // plain loads and stores otherwise.
    auto load_stage = [&](int st, int buf) {
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int off = st * TT_BK + 8 * h;
            const bool ok = lk + off < kn;
            const float* pa = ua + (i64)off * C;
            const float* pb = eb + (i64)off * R;
            float* sa = &As[buf][lk + 8 * h][lc];
            float* sb = &Bs[buf][lk + 8 * h][lc];
            if (VEC) {
                const bool oka = ok && a_avail >= 4, okb = ok && b_avail >= 4;
                cp_async16(sa, oka ? pa : U, oka ? 16 : 0);
                cp_async16(sb, okb ? pb : err, okb ? 16 : 0);
            } else {
                *(float4*)sa = tt_load(pa, ok ? a_avail : 0);
                *(float4*)sb = tt_load(pb, ok ? b_avail : 0);
            }
        }
        if (VEC) cp_async_commit();
    };
    const int nk = (kn + TT_BK - 1) / TT_BK;
    load_stage(0, 0);
    for (int st = 0; st < nk; st++) {
        const int cur = st & 1;
        // The other buffer was last read in iteration st - 1, before its closing barrier.
        if (st + 1 < nk) load_stage(st + 1, cur ^ 1);
        if (VEC) {
            if (st + 1 < nk)
                cp_async_wait<1>();
            else
                cp_async_wait<0>();
        }
        __syncthreads();
#pragma unroll
        for (int kk = 0; kk < TT_BK; kk += 8) {
            u32 bh[4][2], bl[4][2];
#pragma unroll
            for (int n = 0; n < 4; n++) {
                tf32_split(Bs[cur][kk + t][wn + n * 8 + g], bh[n][0], bl[n][0]);
                tf32_split(Bs[cur][kk + t + 4][wn + n * 8 + g], bh[n][1], bl[n][1]);
            }
#pragma unroll
            for (int m = 0; m < 4; m++) {
                u32 ah[4], al[4];
                const int i0 = wm + m * 16 + g;
                tf32_split(As[cur][kk + t][i0], ah[0], al[0]);
                tf32_split(As[cur][kk + t][i0 + 8], ah[1], al[1]);
                tf32_split(As[cur][kk + t + 4][i0], ah[2], al[2]);
                tf32_split(As[cur][kk + t + 4][i0 + 8], ah[3], al[3]);
#pragma unroll
                for (int n = 0; n < 4; n++) {
                    mma_tf32(acc[m][n], al, bh[n][0], bh[n][1]);
                    mma_tf32(acc[m][n], ah, bl[n][0], bl[n][1]);
                    mma_tf32(acc[m][n], ah, bh[n][0], bh[n][1]);
                }
            }
        }
        __syncthreads();
    }
    // acc[m][n] = {(g, 2t), (g, 2t+1), (g+8, 2t), (g+8, 2t+1)} of the m-th 16-row, n-th 8-column tile.
#pragma unroll
    for (int m = 0; m < 4; m++) {
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int i = ib + wm + m * 16 + g + 8 * h;
            if (i >= row1) continue;
            const i64 row = perm ? (i64)perm[i] : (i64)i;
            float* wr = W + row * R;
#pragma unroll
            for (int n = 0; n < 4; n++) {
                const int r = rb + wn + n * 8 + 2 * t;
                const float d0 = acc[m][n][2 * h], d1 = acc[m][n][2 * h + 1];
                if (VEC) {
                    if (r + 2 > R) continue;
                    float2 v = *(float2*)&wr[r];
                    v.x = v.x - d0;
                    v.y = v.y - d1;
                    *(float2*)&wr[r] = v;
                } else {
                    if (r < R) wr[r] = wr[r] - d0;
                    if (r + 1 < R) wr[r + 1] = wr[r + 1] - d1;
                }
            }
        }
    }
}

// vec = 1 (VEC): C, R, row0, row1 multiples of 4, U / err / W 16-byte aligned; else scalar loads.
extern "C" __global__ void __launch_bounds__(256, 2) gptq_trail_tf32x3(float* W, const float* U, const float* err,
                                                                       const int* perm, int C, int R, int k0, int kn,
                                                                       int row0, int row1, int err_rows, int vec) {
    __shared__ __align__(16) TtStage As, Bs;  // 2 × 2 × 16 × 136 floats = 34 KB, one copy for both paths
    if (vec)
        gptq_trail_impl<true>(As, Bs, W, U, err, perm, C, R, k0, kn, row0, row1, err_rows);
    else
        gptq_trail_impl<false>(As, Bs, W, U, err, perm, C, R, k0, kn, row0, row1, err_rows);
}
