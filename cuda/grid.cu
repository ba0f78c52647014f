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

// Lanes per group of the range grid: one per 8 elements, rounded up to a power of two (at
// most 32; larger groups loop). ops.rs launches `groups x range_lanes(G)` threads.
__device__ __forceinline__ int range_lanes(int G) {
    int w = 1;
    while (w < (G + 7) / 8 && w < 32) w <<= 1;
    return w;
}

template <int DT>
__device__ __forceinline__ void qmeta_range_impl(const void* x, u32* qmeta, int rows, int cols, int G,
                                                 int bits, int symmetric, const float* bs, int bcols) {
    const int W = range_lanes(G);
    const i64 t = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    const i64 gid = t / W;
    const int sub = (int)(t % W);
    const int ng = (cols + G - 1) / G;
    // A warp holds 32 / W whole groups; lanes past the last group take part in the shuffles.
    const bool active = gid < (i64)rows * ng;
    const i64 r = active ? gid / ng : 0;
    const int g = active ? (int)(gid % ng) : 0;
    float mn = f_inf(), mx = -f_inf();
    // The padding past `cols` is zeros, and the grid contains 0 anyway (below): skipped.
    if (active && cols % 8 == 0 && ((u64)x & 15) == 0) {
        // 8 consecutive elements per lane (one 16-byte load; they share one block scale).
        for (int i = 8 * sub; i < G; i += 8 * W) {
            const int c = g * G + i;
            if (c < cols) {
                float v[8];
                load8<DT>(x, r * cols + c, v);
                const float sc = bs != nullptr ? block_scale(bs, bcols, r, c) : 1.0f;
#pragma unroll
                for (int j = 0; j < 8; j++) {
                    const float e = bs != nullptr ? v[j] * sc : v[j];
                    mn = fminf(mn, e);
                    mx = fmaxf(mx, e);
                }
            }
        }
    } else if (active) {
        for (int i = sub; i < G; i += W) {
            const int c = g * G + i;
            if (c < cols) {
                float v = Elem<DT>::load(x, r * cols + c);
                if (bs != nullptr) v = v * block_scale(bs, bcols, r, c);
                mn = fminf(mn, v);
                mx = fmaxf(mx, v);
            }
        }
    }
    for (int off = W / 2; off > 0; off >>= 1) {
        mn = fminf(mn, __shfl_xor_sync(0xffffffffu, mn, off));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
    }
    if (active && sub == 0) {
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

// The MSE / L^p search of one group staged in `buf` (G elements, G % 32 == 0), candidates in
// index order, each loss summed as forge_core::grid::candidate_loss sums it (lane-strided
// partial sums, then the shfl_down tree): the result is bit-identical to the CPU's. A
// candidate's stored scale (an encode, a decode and a division) is computed once, by lane
// `ci % 32`, for 32 candidates at a time, and broadcast by shuffles. L2 is the norm == 2 case.
// Measured and dropped (H100, 7168x2048, 100 candidates, norm 2.4; this form 5.24-5.44 ms):
// 4 or 8 candidates summed side by side with interleaved trees, 5.14 / 5.39 ms (noise); all
// 32 candidates' partial sums per lane then one recursive-halving reduction (same floats,
// 31 shuffles per 32 sums), 10.4 ms. What did help was the element's arithmetic: pow_p had an
// IEEE division (MUFU.RCP and a slow-path check) and, with rintf, four float <-> int
// conversions, each issuing at 1/8 of the FMA rate; without them (forge_core::pmath, FMA
// polynomials, integers through the bits of y + 1.5·2^23, rint_clamp) the loop has ~56
// instructions per element and candidate instead of ~100, and the search takes 3.37 ms.
template <bool L2>
__device__ __forceinline__ int mse_search(const float* buf, int G, int lane, const GroupParams& p0, u32 meta,
                                          int n_grid, float norm, float max_shrink) {
    float best = f_inf();
    int best_q = (int)(short)(meta & 0xFFFFu);
    for (int c0 = 0; c0 < n_grid; c0 += 32) {
        // Evaluated at the scale that would be stored: decode(encode(max(s0 * p, SCALE_MIN))),
        // as forge_core::grid::mse_refine_group.
        float sc = p0.scale * mse_candidate(min(c0 + lane, n_grid - 1), n_grid, max_shrink);
        sc = fmaxf(sc, forge_scale_min());
        const int lane_q = encode_log2_q88(sc);
        const float lane_s = decode_scale(lane_q);
        const float lane_inv = 1.0f / lane_s;
        const int m = min(32, n_grid - c0);
        for (int j = 0; j < m; j++) {
            const int q = __shfl_sync(0xffffffffu, lane_q, j);
            // The candidate's grid: its stored scale, the base grid's zero point and maxq.
            GroupParams pc = p0;
            pc.scale = __shfl_sync(0xffffffffu, lane_s, j);
            pc.inv = __shfl_sync(0xffffffffu, lane_inv, j);
            float acc = 0.0f;
            for (int i = lane; i < G; i += 32) {
                const float xv = buf[i];
                const float e = dequant(quant_code(xv, pc), pc) - xv;
                acc = acc + (L2 ? e * e : pow_p(fabsf(e), norm));
            }
#pragma unroll
            for (int off = 16; off > 0; off >>= 1) {
                const float o = __shfl_down_sync(0xffffffffu, acc, off);
                if (lane < off) acc = acc + o;
            }
            if (acc < best) {  // lane 0's value is the loss; lowest index wins ties
                best = acc;
                best_q = q;
            }
        }
    }
    return best_q;
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
    const int best_q = norm == 2.0f ? mse_search<true>(buf, G, lane, p0, meta, n_grid, norm, max_shrink)
                                    : mse_search<false>(buf, G, lane, p0, meta, n_grid, norm, max_shrink);
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
