// grid.cu — qmeta4 group metadata: range grid and MSE / L^p shrink search
// (spec gptq-core-qmeta4 §6.2, §6.3; docs/numerics.md). Range grid, three kernels (ops.rs
// range_kernel chooses): groups of 128 or 256 whole bytes read by octets of lanes
// (qmeta_range_oct_*), else one thread per group when groups are whole 16-byte units
// (qmeta_range_tpg_*), else a lane per 8 elements (qmeta_range_*); MSE search: one warp per group.
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

// The qmeta4 word of a group whose elements span [mn, mx]. The grid always contains 0
// (xmin = min(min x, 0), xmax = max(max x, 0)), as forge_core::grid::range_meta; min/max are
// exact, so the order they were taken in does not matter.
__device__ __forceinline__ u32 range_qmeta(float mn, float mx, int bits, int symmetric) {
    mn = fminf(mn, 0.0f);
    mx = fmaxf(mx, 0.0f);
    float maxq = (float)((1u << bits) - 1u);
    if (symmetric) {
        float amax = fmaxf(fabsf(mn), fabsf(mx));
        float s = (2.0f * amax) / maxq;
        s = s + FORGE_EPS;
        s = fmaxf(s, forge_scale_min());
        return make_qmeta(encode_log2_q88(s), 1u << (bits - 1), 1u);
    }
    float s = (mx - mn) / maxq;
    s = s + FORGE_EPS;
    s = fmaxf(s, forge_scale_min());
    float z = rintf(-mn / s);
    z = fminf(fmaxf(z, 0.0f), maxq);
    return make_qmeta(encode_log2_q88(s), (u32)z, 0u);
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
    if (active && sub == 0) qmeta[gid] = range_qmeta(mn, mx, bits, symmetric);
}

// ---- Range grid, one thread per group (ops.rs launches it when every group is whole 16-byte
// units: x 16-byte aligned, G and cols multiples of 16 bytes' worth of elements) -------------
// Thread t takes group t: it loads up to 8 units (128 bytes) at once, as many loads in flight
// as a 16-lane group had elements, and the encode runs on every lane instead of one in 16.
// The running min / max stay in the element's own type, two at a time (min/max.f16x2 and
// .bf16x2; E4M3 converts to f16x2 exactly, two bytes an instruction), per 128-column block
// when there are block scales: min over a block of x·s is min(vmin·s, vmax·s) of the block's
// raw vmin, vmax (multiplying by s is monotonic, rounding too), so each block costs two
// multiplies instead of one per element. NaN elements are skipped as fminf / fmaxf skip them.
template <int DT> struct RangeUnit;  // min/max of 16-byte units, packed
template <> struct RangeUnit<FORGE_DT_F32> {
    enum { EPU = 4 };
    float lo, hi;
    __device__ __forceinline__ void reset() { lo = f_inf(); hi = -f_inf(); }
    __device__ __forceinline__ void add(uint4 u) {
        const u32 w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
        for (int j = 0; j < 4; j++) { lo = fminf(lo, __uint_as_float(w[j])); hi = fmaxf(hi, __uint_as_float(w[j])); }
    }
    __device__ __forceinline__ void get(float& vmin, float& vmax) const { vmin = lo; vmax = hi; }
    __device__ __forceinline__ void merge(float olo, float ohi) { lo = fminf(lo, olo); hi = fmaxf(hi, ohi); }
};
template <bool BF> struct RangeUnit16 {  // f16x2 or bf16x2 accumulators; a unit is 8 elements
    enum { EPU = 8 };
    u32 lo, hi;
    __device__ __forceinline__ void reset() {
        lo = BF ? 0x7F807F80u : 0x7C007C00u;
        hi = BF ? 0xFF80FF80u : 0xFC00FC00u;
    }
    __device__ __forceinline__ void merge(u32 olo, u32 ohi) {  // another unit's lo / hi
        if (BF) {
            asm("min.bf16x2 %0, %0, %1;" : "+r"(lo) : "r"(olo));
            asm("max.bf16x2 %0, %0, %1;" : "+r"(hi) : "r"(ohi));
        } else {
            asm("min.f16x2 %0, %0, %1;" : "+r"(lo) : "r"(olo));
            asm("max.f16x2 %0, %0, %1;" : "+r"(hi) : "r"(ohi));
        }
    }
    __device__ __forceinline__ void add2(u32 v) { merge(v, v); }
    __device__ __forceinline__ void add(uint4 u) { add2(u.x); add2(u.y); add2(u.z); add2(u.w); }
    __device__ __forceinline__ void get(float& vmin, float& vmax) const {
        if (BF) {
            vmin = fminf(bf16_to_f32((u16)(lo & 0xFFFF)), bf16_to_f32((u16)(lo >> 16)));
            vmax = fmaxf(bf16_to_f32((u16)(hi & 0xFFFF)), bf16_to_f32((u16)(hi >> 16)));
        } else {
            vmin = fminf(f16_to_f32((u16)(lo & 0xFFFF)), f16_to_f32((u16)(lo >> 16)));
            vmax = fmaxf(f16_to_f32((u16)(hi & 0xFFFF)), f16_to_f32((u16)(hi >> 16)));
        }
    }
};
template <> struct RangeUnit<FORGE_DT_F16> : RangeUnit16<false> {};
template <> struct RangeUnit<FORGE_DT_BF16> : RangeUnit16<true> {};
template <> struct RangeUnit<FORGE_DT_F8E4M3> : RangeUnit16<false> {  // 16 bytes, 16 elements
    enum { EPU = 16 };
    __device__ __forceinline__ void add(uint4 u) {
#if __CUDA_ARCH__ >= 890
        const u32 w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
        for (int j = 0; j < 4; j++) {
            u32 a, b;
            e4m3x4_to_f16x2(w[j], a, b);
            add2(a);
            add2(b);
        }
#else
        (void)u;
        __trap();  // ops.rs (range_per_group) launches this kernel for E4M3 from sm_89 only
#endif
    }
};

// [lo, hi] of a group's raw values times its block scale sc (negative scales swap the ends).
__device__ __forceinline__ void scale_range(float& lo, float& hi, float sc) {
    const float a = lo * sc, b = hi * sc;
    lo = fminf(a, b);
    hi = fmaxf(a, b);
}

// The same grid with 8 lanes a group, for whole groups of 8 or 16 16-byte units (cols % G == 0,
// G·size 128 or 256 bytes, CPL = 1 or 2 units a lane; with block scales, groups of one 128-column
// block only): a warp's 32 groups are read in 8 steps, step j giving groups 4j .. 4j + 3 to
// octets of lanes, CPL units a lane, so that a warp's load covers 4 groups' whole lines (one
// thread a group reads a line a thread, 32 lines a load). Each lane keeps its units' raw
// min / max (packed, as RangeUnit), and a recursive halving over the octet (3 rounds, 7
// shuffles of each) leaves lane (s = lane / 8, t = lane % 8) with group 4t + s's, which it
// scales (the group is one block: min(vmin·s, vmax·s)) and encodes: every lane encodes one
// group, as before. Min / max are exact, so the order of the halving does not matter.
template <int DT, int CPL>
__device__ __forceinline__ void range_octets(const void* x, u32* qmeta, i64 total, int ng, int G,
                                             int bits, int symmetric, const float* bs, int bcols, i64 gbase,
                                             int lane) {
    typedef RangeUnit<DT> U;
    const int s = lane >> 3, t = lane & 7;
    // cols % G == 0: group g of the matrix starts at element g·G (128·CPL bytes a group), so
    // step j's unit sits 4j groups after the lane's first one.
    const uint4* p = (const uint4*)((const u8*)x + (gbase + s) * (128 * CPL) + t * (16 * CPL));
    U part[8];
#pragma unroll
    for (int j = 0; j < 8; j++) {
        part[j].reset();
        if (gbase + 4 * j + s < total)
#pragma unroll
            for (int v = 0; v < CPL; v++) part[j].add(__ldg(p + j * 32 * CPL + v));
    }
#pragma unroll
    for (int h = 4; h >= 1; h >>= 1) {
        const bool up = (lane & h) != 0;  // keeps the upper half of its 2h partials
#pragma unroll
        for (int i = 0; i < h; i++) {
            const U send = up ? part[i] : part[i + h];
            U keep = up ? part[i + h] : part[i];
            keep.merge(__shfl_xor_sync(0xFFFFFFFFu, send.lo, h), __shfl_xor_sync(0xFFFFFFFFu, send.hi, h));
            part[i] = keep;
        }
    }
    const int k = 4 * t + s;
    if (gbase + k >= total) return;
    float mn, mx;
    part[0].get(mn, mx);
    if (bs != nullptr && mn <= mx) {  // not only NaNs
        const i64 r = (gbase + k) / ng;
        scale_range(mn, mx, block_scale(bs, bcols, r, (gbase + k - r * ng) * G));
    }
    qmeta[gbase + k] = range_qmeta(mn, mx, bits, symmetric);
}

template <int DT>
__device__ __forceinline__ void qmeta_range_tpg_impl(const void* x, u32* qmeta, int rows, int cols, int G,
                                                     int bits, int symmetric, const float* bs, int bcols) {
    typedef RangeUnit<DT> U;
    constexpr int EPU = U::EPU;
    const i64 gid = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    const int ng = (cols + G - 1) / G;
    if (gid >= (i64)rows * ng) return;
    const i64 r = gid / ng;
    const int c0 = (int)(gid % ng) * G;
    const int units = min(G, cols - c0) / EPU;
    const uint4* p = (const uint4*)((const u8*)x + ((i64)r * cols + c0) * ElemBytes<DT>::v);
    float mn = f_inf(), mx = -f_inf();
    U acc;
    acc.reset();
    int blk = -1;  // the 128-column block acc covers (block scales only)
    auto fold = [&]() {
        float vmin, vmax;
        acc.get(vmin, vmax);
        if (bs != nullptr) {
            if (blk < 0 || !(vmin <= vmax)) return;  // no element, or only NaNs
            scale_range(vmin, vmax, block_scale(bs, bcols, r, (i64)blk * FORGE_FP8_BLOCK));
            mn = fminf(mn, vmin);
            mx = fmaxf(mx, vmax);
        } else {
            mn = fminf(mn, vmin);
            mx = fmaxf(mx, vmax);
        }
    };
    for (int u0 = 0; u0 < units; u0 += 8) {
        uint4 raw[8];
#pragma unroll
        for (int j = 0; j < 8; j++)
            if (u0 + j < units) raw[j] = __ldg(p + u0 + j);
#pragma unroll
        for (int j = 0; j < 8; j++) {
            if (u0 + j < units) {
                if (bs != nullptr) {
                    const int b = (c0 + (u0 + j) * EPU) / FORGE_FP8_BLOCK;  // a unit never straddles two
                    if (b != blk) {
                        fold();
                        blk = b;
                        acc.reset();
                    }
                }
                acc.add(raw[j]);
            }
        }
    }
    fold();
    qmeta[gid] = range_qmeta(mn, mx, bits, symmetric);
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

// Whole groups of 128 or 256 bytes (cols % G == 0; with block scales 128 only; ops.rs
// range_kernel): a warp's 32 groups read by octets of lanes (range_octets).
template <int DT>
__device__ __forceinline__ void qmeta_range_oct_impl(const void* x, u32* qmeta, int rows, int cols, int G,
                                                     int bits, int symmetric, const float* bs, int bcols) {
    const int lane = threadIdx.x & 31;
    const i64 gbase = (i64)blockIdx.x * blockDim.x + threadIdx.x - lane, total = (i64)rows * (cols / G);
    if (gbase >= total) return;  // the whole warp
    if (G * ElemBytes<DT>::v == 128) range_octets<DT, 1>(x, qmeta, total, cols / G, G, bits, symmetric, bs, bcols, gbase, lane);
    else range_octets<DT, 2>(x, qmeta, total, cols / G, G, bits, symmetric, bs, bcols, gbase, lane);
}

#define FORGE_GRID_ENTRIES(SUF, DT)                                                                    \
    extern "C" __global__ void qmeta_range_##SUF(const void* x, u32* qmeta, int rows, int cols, int G,  \
                                                  int bits, int symmetric, const float* bs, int bcols) { \
        qmeta_range_impl<DT>(x, qmeta, rows, cols, G, bits, symmetric, bs, bcols);                      \
    }                                                                                                  \
    extern "C" __global__ void __launch_bounds__(256, 4)                                               \
        qmeta_range_tpg_##SUF(const void* x, u32* qmeta, int rows, int cols, int G, int bits, int symmetric, \
                              const float* bs, int bcols) {                                            \
        qmeta_range_tpg_impl<DT>(x, qmeta, rows, cols, G, bits, symmetric, bs, bcols);                  \
    }                                                                                                  \
    extern "C" __global__ void __launch_bounds__(256, 4)                                               \
        qmeta_range_oct_##SUF(const void* x, u32* qmeta, int rows, int cols, int G, int bits, int symmetric, \
                              const float* bs, int bcols) {                                            \
        qmeta_range_oct_impl<DT>(x, qmeta, rows, cols, G, bits, symmetric, bs, bcols);                  \
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
