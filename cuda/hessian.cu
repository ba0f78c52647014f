// hessian.cu — H += alpha · XᵀX in fp32 (X: [T, D], f32 / f16 / bf16), and the segmented form
// for routed experts: for expert e, the rows idx[off[e] .. off[e+1]) of X go into
// H_e = H + e·D·D. Only the upper-triangular 64×64 tiles are computed; each is added to
// both (i, j) and (j, i) (the products are commutative, so H stays exactly symmetric).
// Tile: 64×64, 256 threads, 4×4 outputs per thread, 16 rows of X per step.

#define HS_T 64
#define HS_K 16

template <int DT>
__device__ __forceinline__ void hessian_impl(const void* x, float* H, const int* idx, const int* off, int T, int D,
                                             float alpha) {
    __shared__ float Xi[HS_K][HS_T + 4];
    __shared__ float Xj[HS_K][HS_T + 4];
    const int nb = (D + HS_T - 1) / HS_T;
    int b = blockIdx.x, bi = 0;
    while (b >= nb - bi) { b -= nb - bi; bi++; }
    const int bj = bi + b;
    const int e = blockIdx.y;
    int r0 = 0, r1 = T;
    if (off) { r0 = off[e]; r1 = off[e + 1]; }
    float* He = H + (i64)e * D * D;
    const int tid = threadIdx.x, tx = tid & 15, ty = tid >> 4;
    const int i0 = bi * HS_T, j0 = bj * HS_T;
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
                float v = alpha * acc[p][q];
                He[(i64)i * D + j] += v;
                if (bi != bj) He[(i64)j * D + i] += v;
            }
        }
    }
}

#define FORGE_HESS_ENTRY(SUF, DT)                                                                          \
    extern "C" __global__ void __launch_bounds__(256) hessian_accum_##SUF(const void* x, float* H, const int* idx, \
                                                                        const int* off, int T, int D, float alpha) { \
        hessian_impl<DT>(x, H, idx, off, T, D, alpha);                                                     \
    }
FORGE_HESS_ENTRY(f32, FORGE_DT_F32)
FORGE_HESS_ENTRY(f16, FORGE_DT_F16)
FORGE_HESS_ENTRY(bf16, FORGE_DT_BF16)
