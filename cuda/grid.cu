// grid.cu — qmeta4 group metadata: range grid and MSE / L^p shrink search
// (spec gptq-core-qmeta4 §6.2, §6.3; docs/numerics.md). One warp per group.
// x: [rows, cols] row-major, groups of G consecutive elements of a row, the last group of a
// row padded with zeros. qmeta: [rows, ceil(cols/G)] u32.

// Shrink factor `ci` of the MSE search, computed as forge_core::grid::MseSpec::candidates does
// (f64, then rounded to f32; --fmad=false keeps the f64 steps unfused, so the values are
// bit-identical). Computed per launch from its arguments: no __constant__ table shared by
// concurrent launches on different streams.
__device__ __forceinline__ float mse_candidate(int ci, int n_grid, float max_shrink) {
    if (n_grid == 1) return 1.0f;
    const double s = (double)max_shrink;
    const double step = 2.0 * s / ((double)n_grid - 1.0);
    return (float)(1.0 - s + (double)ci * step);
}

template <int DT>
__device__ __forceinline__ void qmeta_range_impl(const void* x, u32* qmeta, int rows, int cols, int G,
                                                 int bits, int symmetric, const float* bs, int bcols) {
    const int lane = threadIdx.x & 31;
    const i64 gid = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const int ng = (cols + G - 1) / G;
    if (gid >= (i64)rows * ng) return;
    const i64 r = gid / ng;
    const int g = (int)(gid % ng);
    float mn = f_inf(), mx = -f_inf();
    for (int i = lane; i < G; i += 32) {
        int c = g * G + i;
        float v = c < cols ? Elem<DT>::load(x, r * cols + c) : 0.0f;
        if (bs != nullptr && c < cols) v = v * block_scale(bs, bcols, r, c);
        mn = fminf(mn, v);
        mx = fmaxf(mx, v);
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
        mn = fminf(mn, __shfl_xor_sync(0xffffffffu, mn, off));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
    }
    if (lane == 0) {
        // The grid always contains 0 (xmin = min(min x, 0), xmax = max(max x, 0)), as
        // forge_core::grid::range_meta; min/max are exact, so the order does not matter.
        mn = fminf(mn, 0.0f);
        mx = fmaxf(mx, 0.0f);
        float maxq = (float)((1u << bits) - 1u);
        u32 m;
        if (symmetric) {
            float amax = fmaxf(fabsf(mn), fabsf(mx));
            float s = (2.0f * amax) / maxq;
            s = s + FORGE_EPS;
            s = fmaxf(s, forge_scale_min());
            m = make_qmeta(encode_log2_q88(s), 1u << (bits - 1), 1u);
        } else {
            float s = (mx - mn) / maxq;
            s = s + FORGE_EPS;
            s = fmaxf(s, forge_scale_min());
            float z = rintf(-mn / s);
            z = fminf(fmaxf(z, 0.0f), maxq);
            m = make_qmeta(encode_log2_q88(s), (u32)z, 0u);
        }
        qmeta[gid] = m;
    }
}

// MSE / L^p refinement. One warp per group; the group's elements are staged in shared
// memory (G <= 1024, a multiple of 32; blockDim 128 => 4 groups per block).
template <int DT>
__device__ __forceinline__ void qmeta_mse_impl(const void* x, u32* qmeta, int rows, int cols, int G,
                                               int bits, int n_grid, float norm, float max_shrink,
                                               const float* bs, int bcols) {
    extern __shared__ float sm_grp[];
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const i64 gid = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const int ng = (cols + G - 1) / G;
    if (gid >= (i64)rows * ng) return;
    const i64 r = gid / ng;
    const int g = (int)(gid % ng);
    float* buf = sm_grp + warp * G;
    for (int i = lane; i < G; i += 32) {
        int c = g * G + i;
        float v = c < cols ? Elem<DT>::load(x, r * cols + c) : 0.0f;
        if (bs != nullptr && c < cols) v = v * block_scale(bs, bcols, r, c);
        buf[i] = v;
    }
    __syncwarp();
    const u32 meta = qmeta[gid];
    const GroupParams p0 = qmeta_params(meta, bits);
    const bool l2 = (norm == 2.0f);
    // One candidate per lane (ci = lane, lane + 32, ...), each summed over the whole group in
    // forge_core::grid::candidate_loss's order: 32 strided partial sums (partial l takes
    // elements l, l + 32, ... in turn; G % 32 == 0), then the halving tree. The loss is the
    // same float as the CPU's, and no shuffles are spent per candidate.
    float best = f_inf();
    int best_ci = 0x7FFFFFFF, best_q = 0;
    for (int ci = lane; ci < n_grid; ci += 32) {
        // Evaluated at the scale that would be stored: decode(encode(max(s0 * p, SCALE_MIN))),
        // as forge_core::grid::mse_refine_group.
        float sc = p0.scale * mse_candidate(ci, n_grid, max_shrink);
        sc = fmaxf(sc, forge_scale_min());
        const int q = encode_log2_q88(sc);
        const float s = decode_scale(q);
        const float inv = 1.0f / s;
        float part[32];
#pragma unroll
        for (int l = 0; l < 32; l++) part[l] = 0.0f;
        for (int c = 0; c < G; c += 32) {
#pragma unroll
            for (int l = 0; l < 32; l++) {
                const float xv = buf[c + l];  // the same address in every lane: a broadcast
                float t = xv * inv;
                t = t + p0.zero;
                t = rintf(t);
                t = fminf(fmaxf(t, 0.0f), p0.maxq);
                float e = (t - p0.zero) * s;
                e = e - xv;
                const float loss = l2 ? e * e : pow_p(fabsf(e), norm);
                part[l] = part[l] + loss;
            }
        }
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) {
#pragma unroll
            for (int l = 0; l < off; l++) part[l] = part[l] + part[l + off];
        }
        if (part[0] < best) {  // a lane's candidates ascend: the lowest index wins ties
            best = part[0];
            best_ci = ci;
            best_q = q;
        }
    }
    // The lowest loss over the lanes, the lowest candidate index among equal losses (the CPU's
    // first strictly better candidate); a NaN loss never wins, as there.
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
        const float ob = __shfl_xor_sync(0xffffffffu, best, off);
        const int oc = __shfl_xor_sync(0xffffffffu, best_ci, off);
        const int oq = __shfl_xor_sync(0xffffffffu, best_q, off);
        if (ob < best || (ob == best && oc < best_ci)) {
            best = ob;
            best_ci = oc;
            best_q = oq;
        }
    }
    if (best_ci == 0x7FFFFFFF) best_q = (int)(short)(meta & 0xFFFFu);
    if (lane == 0) qmeta[gid] = make_qmeta(best_q, (meta >> 16) & 0xFFu, (meta >> 24) & 1u);
}

#define FORGE_GRID_ENTRIES(SUF, DT)                                                                    \
    extern "C" __global__ void qmeta_range_##SUF(const void* x, u32* qmeta, int rows, int cols, int G,  \
                                                  int bits, int symmetric, const float* bs, int bcols) { \
        qmeta_range_impl<DT>(x, qmeta, rows, cols, G, bits, symmetric, bs, bcols);                      \
    }                                                                                                  \
    extern "C" __global__ void qmeta_mse_##SUF(const void* x, u32* qmeta, int rows, int cols, int G,    \
                                                int bits, int n_grid, float norm, float max_shrink,     \
                                                const float* bs, int bcols) {                           \
        qmeta_mse_impl<DT>(x, qmeta, rows, cols, G, bits, n_grid, norm, max_shrink, bs, bcols);         \
    }

FORGE_GRID_ENTRIES(f32, FORGE_DT_F32)
FORGE_GRID_ENTRIES(f16, FORGE_DT_F16)
FORGE_GRID_ENTRIES(bf16, FORGE_DT_BF16)
FORGE_GRID_ENTRIES(f8e4m3, FORGE_DT_F8E4M3)
