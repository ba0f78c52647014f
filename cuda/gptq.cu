// gptq.cu — blocked GPTQ solver (docs/numerics.md "GPTQ solver"), batched over E matrices of
// the same shape (all experts of a layer). Per matrix e:
//   W: weight_t [C, R] f32, updated in place (row perm[j] holds processing position j),
//   U: upper Cholesky factor of H⁻¹ [C, C] (processing order), qmeta: [R, ceil(C/G)] of W.T,
//   perm: [C] i32 or null, codes: [C, R] u8 in ORIGINAL order, err: workspace [B, R] f32.
// gptq_block_f32: the in-block column loop for block [i1, i1 + bsz). One thread per column r
//   (columns are independent inside a block); its block rows live in shared memory. The rows
//   are taken GQ_SUB at a time: the sub-block's rows are quantized in registers, then its
//   errors update the block's later rows as one rank-GQ_SUB update per row, with the U
//   coefficients staged transposed in shared memory (two broadcast 16-byte loads per row).
// gptq_trail128_f32: W[i2:, :] -= U[i1:i2, i2:]ᵀ · Err, a batched register-blocked fp32 GEMM.

#define GQ_THREADS 64
#define GQ_BMAX 128
#define GQ_SUB 8

// w − c·e as the CPU computes it (separate multiply and subtract), skipped where c == 0.
__device__ __forceinline__ float gq_axpy(float w, float c, float e) { return c != 0.0f ? w - c * e : w; }

// Each row of the block receives its updates in processing order (row k from every j < k, in
// increasing j) whether they come from inside its sub-block or from an earlier sub-block's
// rank update, so the values equal forge-core's row-by-row loop bit for bit. Per update the
// old loop spent a shuffle, a shared load and a shared store (shared-memory bound: 2.26 ms per
// launch of 64 experts of 7168x2048 on an H100); the rank update spends 4 shared accesses per
// GQ_SUB updates of one row.
extern "C" __global__ void __launch_bounds__(GQ_THREADS) gptq_block_f32(
    float* W, const float* U, const u32* qmeta, const int* perm, u8* codes, float* err, int C, int R, int G,
    int bits, int i1, int bsz) {
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
    err += (i64)e * GQ_BMAX * R;
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
        if (dense) {
#pragma unroll 4
            for (int k = s0 + GQ_SUB; k < bsz; k++) {
                const float4 c0 = *(const float4*)&Us[k][0];
                const float4 c1 = *(const float4*)&Us[k][4];
                const float cs[GQ_SUB] = {c0.x, c0.y, c0.z, c0.w, c1.x, c1.y, c1.z, c1.w};
                float w = Ws[k][tid];
#pragma unroll
                for (int jj = 0; jj < GQ_SUB; jj++) w = w - cs[jj] * ev[jj];
                Ws[k][tid] = w;
            }
        } else {
            for (int k = s0 + GQ_SUB; k < bsz; k++) {
                const float4 c0 = *(const float4*)&Us[k][0];
                const float4 c1 = *(const float4*)&Us[k][4];
                const float cs[GQ_SUB] = {c0.x, c0.y, c0.z, c0.w, c1.x, c1.y, c1.z, c1.w};
                float w = Ws[k][tid];
#pragma unroll
                for (int jj = 0; jj < GQ_SUB; jj++) w = gq_axpy(w, cs[jj], ev[jj]);
                Ws[k][tid] = w;
            }
        }
    }
    if (ok) {
        for (int jj = 0; jj < bsz; jj++) {
            int src = perm ? perm[i1 + jj] : i1 + jj;
            W[(i64)src * R + r] = Ws[jj][tid];
        }
    }
}

// gptq_trail128_f32: the trailing update, register-blocked: 128×128 output tile
// per 256-thread block, 8×8 outputs per thread (rows ty·4+{0..3}, 64+ty·4+{0..3}; columns
// tx·4+{0..3}, 64+tx·4+{0..3}), BK = 8, shared memory double-buffered with one barrier per
// k step, explicit fmaf (fp32, no TF32; the module is compiled with --fmad=false).
#define GT2_T 128
#define GT2_K 8

template <bool VEC>
__device__ __forceinline__ float4 gt2_load(const float* p, int avail) {
    float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    if (VEC) {
        if (avail >= 4) v = __ldg((const float4*)p);
    } else {
        if (avail > 0) v.x = __ldg(p);
        if (avail > 1) v.y = __ldg(p + 1);
        if (avail > 2) v.z = __ldg(p + 2);
        if (avail > 3) v.w = __ldg(p + 3);
    }
    return v;
}

template <bool VEC>
__device__ __forceinline__ void gptq_trail128_impl(float* W, const float* U, const float* err, const int* perm, int C,
                                                   int R, int i1, int bsz) {
    __shared__ __align__(16) float As[2][GT2_K][GT2_T];  // As[b][i] = U[i1 + b][i2 + ib + i]
    __shared__ __align__(16) float Bs[2][GT2_K][GT2_T];  // Bs[b][r] = err[b][rb + r]
    const int e = blockIdx.z;
    const int i2 = i1 + bsz;
    W += (i64)e * C * R;
    U += (i64)e * C * C;
    err += (i64)e * GQ_BMAX * R;
    if (perm) perm += (i64)e * C;
    const int tid = threadIdx.x, tx = tid & 15, ty = tid >> 4;
    const int ib = i2 + blockIdx.y * GT2_T;  // first output row (processing position)
    const int rb = blockIdx.x * GT2_T;
    // Loader: k row lk, 4 consecutive elements at lc.
    const int lk = tid >> 5, lc = (tid & 31) * 4;
    const int a_avail = C - (ib + lc), b_avail = R - (rb + lc);
    const float* ua = U + (i64)(i1 + lk) * C + ib + lc;
    const float* eb = err + (i64)lk * R + rb + lc;

    float acc[8][8];
#pragma unroll
    for (int a = 0; a < 8; a++)
#pragma unroll
        for (int c = 0; c < 8; c++) acc[a][c] = 0.0f;

    const int nk = (bsz + GT2_K - 1) / GT2_K;
    float4 ra, rbv;
    {
        const bool ok = lk < bsz;
        ra = gt2_load<VEC>(ua, ok ? a_avail : 0);
        rbv = gt2_load<VEC>(eb, ok ? b_avail : 0);
        *(float4*)&As[0][lk][lc] = ra;
        *(float4*)&Bs[0][lk][lc] = rbv;
    }
    __syncthreads();
    for (int t = 0; t < nk; t++) {
        const int cur = t & 1;
        if (t + 1 < nk) {
            const int b = (t + 1) * GT2_K + lk;
            const bool ok = b < bsz;
            ra = gt2_load<VEC>(ua + (i64)(t + 1) * GT2_K * C, ok ? a_avail : 0);
            rbv = gt2_load<VEC>(eb + (i64)(t + 1) * GT2_K * R, ok ? b_avail : 0);
        }
#pragma unroll
        for (int kk = 0; kk < GT2_K; kk++) {
            const float4 a0 = *(const float4*)&As[cur][kk][ty * 4];
            const float4 a1 = *(const float4*)&As[cur][kk][64 + ty * 4];
            const float4 b0 = *(const float4*)&Bs[cur][kk][tx * 4];
            const float4 b1 = *(const float4*)&Bs[cur][kk][64 + tx * 4];
            const float a[8] = {a0.x, a0.y, a0.z, a0.w, a1.x, a1.y, a1.z, a1.w};
            const float c[8] = {b0.x, b0.y, b0.z, b0.w, b1.x, b1.y, b1.z, b1.w};
#pragma unroll
            for (int p = 0; p < 8; p++)
#pragma unroll
                for (int q = 0; q < 8; q++) acc[p][q] = fmaf(a[p], c[q], acc[p][q]);
        }
        if (t + 1 < nk) {
            *(float4*)&As[cur ^ 1][lk][lc] = ra;
            *(float4*)&Bs[cur ^ 1][lk][lc] = rbv;
        }
        __syncthreads();
    }
#pragma unroll
    for (int p = 0; p < 8; p++) {
        const int i = ib + (p < 4 ? ty * 4 + p : 64 + ty * 4 + (p - 4));
        if (i >= C) continue;
        const i64 row = perm ? (i64)perm[i] : (i64)i;
        float* wr = W + row * R;
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int r = rb + h * 64 + tx * 4;
            if (VEC) {
                if (r + 4 > R) continue;
                float4 v = *(float4*)&wr[r];
                v.x = v.x - acc[p][4 * h + 0];
                v.y = v.y - acc[p][4 * h + 1];
                v.z = v.z - acc[p][4 * h + 2];
                v.w = v.w - acc[p][4 * h + 3];
                *(float4*)&wr[r] = v;
            } else {
#pragma unroll
                for (int q = 0; q < 4; q++)
                    if (r + q < R) wr[r + q] = wr[r + q] - acc[p][4 * h + q];
            }
        }
    }
}

// vec = 1 (VEC): C, R, i2 multiples of 4, U / err / W 16-byte aligned; else the scalar loads.
extern "C" __global__ void __launch_bounds__(256, 2) gptq_trail128_f32(float* W, const float* U, const float* err,
                                                                       const int* perm, int C, int R, int i1, int bsz,
                                                                       int vec) {
    if (vec)
        gptq_trail128_impl<true>(W, U, err, perm, C, R, i1, bsz);
    else
        gptq_trail128_impl<false>(W, U, err, perm, C, R, i1, bsz);
}
