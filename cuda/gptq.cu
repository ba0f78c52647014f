// gptq.cu — blocked GPTQ solver (docs/numerics.md "GPTQ solver"), batched over E matrices of
// the same shape (all experts of a layer). Per matrix e:
//   W: weight_t [C, R] f32, updated in place (row perm[j] holds processing position j),
//   U: upper Cholesky factor of H⁻¹ [C, C] (processing order), qmeta: [R, ceil(C/G)] of W.T,
//   perm: [C] i32 or null, codes: [C, R] u8 in ORIGINAL order, err: workspace [B, R] f32.
// gptq_block_f32: the in-block column loop for block [i1, i1 + bsz). One thread per column r
//   (columns are independent inside a block); its block rows live in shared memory, the U
//   scalars of row j are read by lane 0.. of each warp and broadcast with __shfl_sync.
// gptq_trail_f32: W[i2:, :] -= U[i1:i2, i2:]ᵀ · Err, a batched 64×64-tiled fp32 GEMM.

#define GQ_THREADS 64
#define GQ_BMAX 128

extern "C" __global__ void __launch_bounds__(GQ_THREADS) gptq_block_f32(
    float* W, const float* U, const u32* qmeta, const int* perm, u8* codes, float* err, int C, int R, int G,
    int bits, int i1, int bsz) {
    __shared__ float Ws[GQ_BMAX][GQ_THREADS];
    const int e = blockIdx.y;
    const int tid = threadIdx.x, lane = tid & 31;
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
    for (int jj = 0; jj < bsz; jj++) {
        const int j = i1 + jj;
        const int src = perm ? perm[j] : j;
        const int g = src / G;
        if (g != cached_g) {
            cached_g = g;
            if (ok) p = qmeta_params(qmeta[(i64)r * ng + g], bits);
        }
        const float* Urow = U + (i64)j * C;
        const float d = Urow[j];
        const float x = Ws[jj][tid];
        const float q = quant_code(x, p);
        const float xq = dequant(q, p);
        const float ev = (x - xq) / d;
        Ws[jj][tid] = xq;
        if (ok) {
            codes[(i64)src * R + r] = (u8)q;
            err[(i64)jj * R + r] = ev;
        }
        for (int k0 = jj + 1; k0 < bsz; k0 += 32) {
            const float mine = (k0 + lane < bsz) ? Urow[i1 + k0 + lane] : 0.0f;
            const int cnt = min(32, bsz - k0);
            for (int l = 0; l < cnt; l++) {
                const float coef = __shfl_sync(0xffffffffu, mine, l);
                if (coef != 0.0f) Ws[k0 + l][tid] = Ws[k0 + l][tid] - coef * ev;
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

#define GT_T 64
#define GT_K 16

extern "C" __global__ void __launch_bounds__(256) gptq_trail_f32(float* W, const float* U, const float* err,
                                                                 const int* perm, int C, int R, int i1, int bsz) {
    __shared__ float As[GT_K][GT_T + 4];  // As[b][i] = U[i1 + b][i2 + i]
    __shared__ float Bs[GT_K][GT_T + 4];  // Bs[b][r] = err[b][r]
    const int e = blockIdx.z;
    const int i2 = i1 + bsz;
    W += (i64)e * C * R;
    U += (i64)e * C * C;
    err += (i64)e * GQ_BMAX * R;
    if (perm) perm += (i64)e * C;
    const int tid = threadIdx.x, tx = tid & 15, ty = tid >> 4;
    const int ib = i2 + blockIdx.y * GT_T;  // output rows (processing positions)
    const int rb = blockIdx.x * GT_T;
    float acc[4][4];
#pragma unroll
    for (int a = 0; a < 4; a++)
#pragma unroll
        for (int c = 0; c < 4; c++) acc[a][c] = 0.0f;
    for (int b0 = 0; b0 < bsz; b0 += GT_K) {
#pragma unroll
        for (int it = 0; it < 4; it++) {
            int l = tid + 256 * it;
            int bb = l >> 6, cc = l & 63;
            int b = b0 + bb;
            float ua = 0.0f, eb = 0.0f;
            if (b < bsz) {
                if (ib + cc < C) ua = U[(i64)(i1 + b) * C + ib + cc];
                if (rb + cc < R) eb = err[(i64)b * R + rb + cc];
            }
            As[bb][cc] = ua;
            Bs[bb][cc] = eb;
        }
        __syncthreads();
#pragma unroll
        for (int kk = 0; kk < GT_K; kk++) {
            float a[4], c[4];
#pragma unroll
            for (int q = 0; q < 4; q++) { a[q] = As[kk][ty * 4 + q]; c[q] = Bs[kk][tx * 4 + q]; }
#pragma unroll
            for (int p = 0; p < 4; p++)
#pragma unroll
                for (int q = 0; q < 4; q++) acc[p][q] = acc[p][q] + a[p] * c[q];
        }
        __syncthreads();
    }
#pragma unroll
    for (int p = 0; p < 4; p++) {
        const int i = ib + ty * 4 + p;
        if (i >= C) continue;
        const i64 row = perm ? (i64)perm[i] : (i64)i;
#pragma unroll
        for (int q = 0; q < 4; q++) {
            const int r = rb + tx * 4 + q;
            if (r < R) W[row * R + r] = W[row * R + r] - acc[p][q];
        }
    }
}
