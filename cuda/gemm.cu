// gemm.cu — W4A16 GEMM reading the vLLM AWQ layout directly (no repack):
//   y[M, N] = x[M, K] · dequant(W)ᵀ,  W[n, k] = (q − z) · scale16,  fp32 accumulate.
// x, y: fp16 or bf16 row-major. qweight i32 [K, N/8], qzeros i32 [K/G, N/8], scales f16 [K/G, N].
//
// Tensor cores (mma.sync m16n8k16, fp32 accumulate) for every M. The B operand (weights) is
// built straight from the packed words: a thread (groupID g, thread-in-group t) of a warp
// owns word column c = c0 + g and reads the words at k = 2t, 2t+1, 2t+8, 2t+9 of each
// 16-deep k step; nibble i of those words is its B fragment of "n-tile" i, whose column j
// is output n = 8(c0 + j) + ORDER[i]. So each packed word is read by one thread exactly once
// per M tile, and 8 mma's consume the 4 words. Nibbles become halves with the magic-number
// trick (0x6400|q = 1024+q in fp16, 0x4300|q = 128+q in bf16), then (q−z)·s in half2 / bf16x2.
// A (activations) comes from shared memory with ldmatrix. Tiles move global → shared with a
// 4-stage cp.async pipeline. Split-K over blockIdx.z writes fp32 partials that a second
// kernel sums in a fixed order (deterministic).
//
// Block: 4 warps, 32 word columns (256 outputs n) x 16·MT rows of M; BK = 32.

#define GM_BK 32
#define GM_BW 32
#define GM_BSTRIDE 36
#define GM_ASTRIDE 40

__device__ __forceinline__ u32 prmt(u32 a, u32 b, u32 sel) {
    u32 d;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
    return d;
}

// (a & b) | c in one LOP3 (the compiler splits it when both b and c are immediates).
__device__ __forceinline__ u32 and_or(u32 a, u32 b, u32 c) {
    u32 d;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}

// (magic|q) pair -> (q - z) * s, two lanes at once.
template <bool BF>
__device__ __forceinline__ u32 dq2(u32 v, u32 zm, u32 s2) {
    u32 d;
    if (BF) {
        // zm holds -(128 + z) in bf16; v = 128 + q: v*1 + zm is exact, then *s rounded once.
        asm("{ .reg .b32 one, nz; mov.b32 one, 0x3F803F80; mov.b32 nz, 0x80008000;\n"
            "  fma.rn.bf16x2 %0, %1, one, %2;\n"
            "  fma.rn.bf16x2 %0, %0, %3, nz; }"
            : "=r"(d)
            : "r"(v), "r"(zm), "r"(s2));
    } else {
        asm("{ sub.rn.f16x2 %0, %1, %2;\n  mul.rn.f16x2 %0, %0, %3; }" : "=r"(d) : "r"(v), "r"(zm), "r"(s2));
    }
    return d;
}

// dq2's constants for nibble i of a group's zero-point word zw, whose column has the f16
// scale bits `hs`: zm = the magic-biased −zero (bf16: −(128 + z); f16: 1024 + z) and s2 = the
// scale in the activation dtype, each in both halves.
template <bool BF>
__device__ __forceinline__ void dq_consts(u32 zw, int i, u32 hs, u32& zm, u32& s2) {
    const u32 z = (zw >> (4 * i)) & 15u;
    if (BF) {
        const u32 nz = 0xC300u | z;
        zm = nz | (nz << 16);
        const u32 b = f32_to_bf16_rn(f16_to_f32((u16)hs));
        s2 = b | (b << 16);
    } else {
        const u32 mz = 0x6400u | z;
        zm = mz | (mz << 16);
        s2 = hs | (hs << 16);
    }
}

// The grouped forms' routing (MoE experts: w4a16_awqg_*, w4a16_wgg_*): blockIdx.y is row y of
// the segment table (first sorted position, row count <= the kernel's token tile, expert id);
// sorted position p reads row x_rows[p] of x and writes row out_rows[p] of y, with expert e's
// tensors e · (ew, ez, es) elements on. A count of 0 does nothing; an expert id outside
// [0, experts) writes zeros.
struct GroupedRoute {
    const int* x_rows;
    const int* out_rows;
    const int* segments;
    i64 ew, ez, es;
    int experts;

    // This block's segment: sets `first` (its first sorted position) and moves qw, qz, sc to its
    // expert's tensors; returns its rows (at most `tile`), or 0 when there is nothing to compute:
    // a count of 0, or a masked expert, whose rows get zeros in the block's `cols` outputs from
    // `col0` (those below N). Call after pdl_wait: the table is the previous kernel's output.
    __device__ __forceinline__ int take_segment(int tile, int col0, int cols, int N, u16* y, int& first,
                                                const u32* __restrict__& qw, const u32* __restrict__& qz,
                                                const u16* __restrict__& sc) const {
        const int* seg = segments + 3 * blockIdx.y;
        first = seg[0];
        const int rows = min(seg[1], tile), e = seg[2];
        if (rows <= 0) return 0;
        if (e < 0 || e >= experts) {
            for (int i = threadIdx.x; i < rows * cols; i += blockDim.x) {
                const int n = col0 + i % cols;
                if (n < N) y[(i64)out_rows[first + i / cols] * N + n] = 0;
            }
            return 0;
        }
        qw += e * ew;
        qz += e * ez;
        sc += e * es;
        return rows;
    }
};

template <int MT> struct GemmStages { static constexpr int value = MT == 1 ? 6 : (MT == 2 ? 5 : 4); };

// GROUPED (w4a16_awqg_*, MoE experts on any GPU with mma.sync): blockIdx.y is a row of the
// segment table (see GroupedRoute), its up to BM rows this block's M from row 0 of the tile,
// gathered through x_rows and written through out_rows; K is not split.
template <int MT, bool BF, bool GROUPED>
__device__ __forceinline__ void w4a16_awq_impl(const u16* __restrict__ x, const u32* __restrict__ qw,
                                               const u32* __restrict__ qz, const u16* __restrict__ sc, void* out,
                                               int M, int N, int K, int G, int k_chunk, int split_out,
                                               GroupedRoute route) {
    pdl_launch_dependents();  // the split-K reduction's launch may overlap this grid's tail
    constexpr int BM = 16 * MT;
    constexpr int ST = GemmStages<MT>::value;
    __shared__ __align__(16) u32 Bs[ST][GM_BK * GM_BSTRIDE];
    __shared__ __align__(16) u16 As[ST][BM * GM_ASTRIDE];
    // Group metadata of each stage's tile: 32 zero words, then 256 f16 scales (128 words).
    __shared__ __align__(16) u32 Ms[ST][GM_BW + 128];

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, tig = lane & 3;
    const int NW = N >> 3;
    const int wc_block = blockIdx.x * GM_BW;
    // Grouped: this block's segment, its rows as M and its expert's tensors (the table is the
    // previous kernel's output).
    int first = 0;
    constexpr int XC = BM >= 32 ? BM / 32 : 1;  // x chunks a thread loads a stage
    const u16* xrow[GROUPED ? XC : 1];
    if constexpr (GROUPED) {
        pdl_wait();
        M = route.take_segment(BM, 8 * wc_block, 8 * GM_BW, N, (u16*)out, first, qw, qz, sc);
        if (M == 0) return;
#pragma unroll
        for (int i = 0; i < XC; i++) {
            const int row = (tid + 128 * i) >> 2;
            xrow[i] = row < M ? x + (i64)route.x_rows[first + row] * K : x;
        }
    }
    const int m0 = GROUPED ? 0 : blockIdx.y * BM;
    const int kbeg = blockIdx.z * k_chunk;
    const int kend = min(K, kbeg + k_chunk);
    const int ntiles = (kend - kbeg) / GM_BK;

    auto load_stage = [&](int stage, int t) {
        const int k0 = kbeg + t * GM_BK;
#pragma unroll
        for (int i = 0; i < 2; i++) {
            int c = tid + 128 * i;
            int row = c >> 3, ch = c & 7;
            int gk = k0 + row, gwc = wc_block + 4 * ch;
            bool ok = (gk < kend) && (gwc < NW);
            const u32* src = ok ? qw + (i64)gk * NW + gwc : qw;
            cp_async16(&Bs[stage][row * GM_BSTRIDE + 4 * ch], src, ok ? 16 : 0);
        }
        if constexpr (GROUPED) {
#pragma unroll
            for (int i = 0; i < XC; i++) {
                const int c = tid + 128 * i, row = c >> 2, ch = c & 3;
                if (c < BM * 4) {
                    const bool ok = row < M;
                    cp_async16(&As[stage][row * GM_ASTRIDE + 8 * ch], ok ? xrow[i] + k0 + 8 * ch : x, ok ? 16 : 0);
                }
            }
        } else {
            for (int c = tid; c < BM * 4; c += 128) {
                int row = c >> 2, ch = c & 3;
                int gm = m0 + row;
                bool ok = gm < M;
                const u16* src = ok ? x + (i64)gm * K + k0 + 8 * ch : x;
                cp_async16(&As[stage][row * GM_ASTRIDE + 8 * ch], src, ok ? 16 : 0);
            }
        }
        if (tid < 40) {
            const int grp = k0 / G;
            if (tid < 8) {
                int gwc = wc_block + 4 * tid;
                bool ok = gwc < NW;
                cp_async16(&Ms[stage][4 * tid], ok ? qz + (i64)grp * NW + gwc : qz, ok ? 16 : 0);
            } else {
                int c = tid - 8;  // 8 scales = 1 word column per chunk
                int gwc = wc_block + c;
                bool ok = gwc < NW;
                cp_async16(&Ms[stage][GM_BW + 4 * c], ok ? sc + (i64)grp * N + 8 * (i64)gwc : sc, ok ? 16 : 0);
            }
        }
    };

#pragma unroll
    for (int s = 0; s < ST - 1; s++) {
        if (s < ntiles) load_stage(s, s);
        cp_async_commit();
    }

    float acc[MT][8][4];
#pragma unroll
    for (int a = 0; a < MT; a++)
#pragma unroll
        for (int b = 0; b < 8; b++)
#pragma unroll
            for (int c = 0; c < 4; c++) acc[a][b][c] = 0.0f;

    const int cl = 8 * warp + g;  // this thread's word column within the block (B operand)
    int cur_grp = -1;
    u32 zm[8], s2[8];

    for (int t = 0; t < ntiles; t++) {
        cp_async_wait<ST - 2>();
        __syncthreads();
        {
            int nt = t + ST - 1;
            if (nt < ntiles) load_stage(nt % ST, nt);
            cp_async_commit();
        }
        const int st = t % ST;
        const int grp = (kbeg + t * GM_BK) / G;
        if (grp != cur_grp) {
            cur_grp = grp;
            const u32 zw = Ms[st][cl];
            const uint4 sv = *(const uint4*)&Ms[st][GM_BW + 4 * cl];
            const u32 h[8] = {sv.x & 0xFFFF, sv.x >> 16, sv.y & 0xFFFF, sv.y >> 16,
                              sv.z & 0xFFFF, sv.z >> 16, sv.w & 0xFFFF, sv.w >> 16};
#pragma unroll
            for (int i = 0; i < 8; i++) dq_consts<BF>(zw, i, h[awq_col(i)], zm[i], s2[i]);
        }
#pragma unroll
        for (int s = 0; s < 2; s++) {
            u32 a[MT][4];
#pragma unroll
            for (int mt = 0; mt < MT; mt++)
                ldmatrix_x4(a[mt], &As[st][(16 * mt + (lane & 15)) * GM_ASTRIDE + 16 * s + (lane >> 4) * 8]);
            const u32* bsrow = &Bs[st][(16 * s) * GM_BSTRIDE + cl];
            const u32 w0 = bsrow[(2 * tig) * GM_BSTRIDE];
            const u32 w1 = bsrow[(2 * tig + 1) * GM_BSTRIDE];
            const u32 w2 = bsrow[(2 * tig + 8) * GM_BSTRIDE];
            const u32 w3 = bsrow[(2 * tig + 9) * GM_BSTRIDE];
            const u32 tl0 = prmt(w0, w1, 0x5410), th0 = prmt(w0, w1, 0x7632);
            const u32 tl1 = prmt(w2, w3, 0x5410), th1 = prmt(w2, w3, 0x7632);
            const u32 MAGIC = BF ? 0x43004300u : 0x64006400u;
#pragma unroll
            for (int i = 0; i < 8; i++) {
                const u32 src0 = i < 4 ? tl0 : th0;
                const u32 src1 = i < 4 ? tl1 : th1;
                const int sh = 4 * (i & 3);
                u32 b0 = ((src0 >> sh) & 0x000F000Fu) | MAGIC;
                u32 b1 = ((src1 >> sh) & 0x000F000Fu) | MAGIC;
                b0 = dq2<BF>(b0, zm[i], s2[i]);
                b1 = dq2<BF>(b1, zm[i], s2[i]);
#pragma unroll
                for (int mt = 0; mt < MT; mt++) mma16816<BF>(acc[mt][i], a[mt], b0, b1);
            }
        }
    }
    cp_async_wait<0>();

    // Epilogue.
    const int wca = wc_block + 8 * warp + 2 * tig;
#pragma unroll
    for (int mt = 0; mt < MT; mt++) {
#pragma unroll
        for (int i = 0; i < 8; i++) {
#pragma unroll
            for (int c = 0; c < 4; c++) {
                const int r = m0 + 16 * mt + g + ((c & 2) ? 8 : 0);
                const int wc = wca + (c & 1);
                if (r < M && wc < NW) {
                    const i64 n = 8 * (i64)wc + awq_col(i);
                    const float v = acc[mt][i][c];
                    if (!GROUPED && split_out) {
                        ((float*)out)[((i64)blockIdx.z * M + r) * N + n] = v;
                    } else {
                        const i64 row = GROUPED ? (i64)route.out_rows[first + r] : (i64)r;
                        ((u16*)out)[row * N + n] = f32_to_act_rn(v, BF);
                    }
                }
            }
        }
    }
}

// The grouped form (MoE experts, any GPU): grid (N / 256, segments), K not split, y written
// directly; see GroupedRoute.
#define FORGE_GEMM_ENTRY(SUF, MT, BF)                                                                      \
    extern "C" __global__ void __launch_bounds__(128) w4a16_awq_##SUF##_m##MT(                            \
        const u16* x, const u32* qw, const u32* qz, const u16* sc, void* out, int M, int N, int K, int G,  \
        int k_chunk, int split_out) {                                                                      \
        w4a16_awq_impl<MT, BF, false>(x, qw, qz, sc, out, M, N, K, G, k_chunk, split_out, GroupedRoute{}); \
    }                                                                                                      \
    extern "C" __global__ void __launch_bounds__(128) w4a16_awqg_##SUF##_m##MT(                           \
        const u16* x, const int* x_rows, const int* out_rows, const int* segments, const u32* qw,          \
        const u32* qz, const u16* sc, i64 ew, i64 ez, i64 es, int experts, void* out, int N, int K,        \
        int G) {                                                                                           \
        w4a16_awq_impl<MT, BF, true>(x, qw, qz, sc, out, 0, N, K, G, K, 0,                                  \
                                     GroupedRoute{x_rows, out_rows, segments, ew, ez, es, experts});       \
    }
FORGE_GEMM_ENTRY(f16, 1, false)
FORGE_GEMM_ENTRY(f16, 2, false)
FORGE_GEMM_ENTRY(f16, 4, false)
FORGE_GEMM_ENTRY(bf16, 1, true)
FORGE_GEMM_ENTRY(bf16, 2, true)
FORGE_GEMM_ENTRY(bf16, 4, true)

// ---- Hopper: wgmma (sm_90a), M > 4 ---------------------------------------------------------
// yᵀ = W · xᵀ per block: 128 outputs n (16 word columns) × TN rows of x (tokens: 256, 128, 64, 32
// or 16, the entry point's _t<TN>; ops.rs takes the smallest that holds M up to 128, past it 128
// or 256 by its cost model), two warpgroups, one m64 tile of the outputs each, its MMAs
// m64n<TN>k16. The weights are the MMA's A operand, dequantized
// into registers; x is B, read by the MMA from shared memory (K-major, 128-byte swizzle: 16-byte
// chunk c of row r at chunk c ^ (r % 8)). A thread of warpgroup j (warp w, groupID g,
// thread-in-group t) owns word column 4w + g%4 and reads its words at k = 2t, 2t+1, 2t+8, 2t+9 of
// each 16-deep step; with h = g/4, its rows g and g+8 of tile j are the outputs of nibbles
// 4j + 2h and 4j + 2h + 1 of that column (both warpgroups read each word), and the
// dequantization (dq2) is the tiled kernel's. K moves 64 at a time
// through a WG_ST-stage cp.async pipeline; each 16-deep step is one MMA group, and three stay in
// flight while the next steps' fragments are dequantized (four register buffers; the 32-token
// tile takes its steps in pairs, a group each, one in flight). Needs N % 128 == 0,
// K % 64 == 0 and G % 64 == 0 (ops.rs routes other shapes to the tiled kernel). Split-K as there.
#define WG_BK 64
#define WG_ST 4
#define WG_WSTR 20                      // words per k row of a weight stage (16 + 4: no bank conflicts)
#define WG_WWORDS (WG_BK * WG_WSTR)     // one weight stage
#define WG_MWORDS 80                    // one stage's group metadata: 16 zero words, 128 f16 scales
#define WG_EPI_STR 132                  // floats per row of the epilogue's [TN tokens][128 n] tile
#define WG_THREADS 256                  // two warpgroups: tile j of the two m64 tiles is warpgroup j's
// `split_out` (WG_OUT_* from the generated header, ops.rs): the outputs in y (K not split), this
// split's fp32 partials in the workspace (summed by w4a16_reduce_*), or the splits of a cluster
// summed through distributed shared memory into y.
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// d += A·B with A (the dequantized weights) from registers a[0..4), B (x, TN tokens) from
// shared memory (descriptor db), K-major: m64n128k16, m64n64k16, m64n32k16 or m64n16k16. A0: the
// operand number of a[0] (after the TN / 2 accumulators).
#define FORGE_WG_RS(N, DT, REGS, OPS, A0, A1, A2, A3, DB, SC)                                              \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" SC ", 0;\n"                                         \
                 "wgmma.mma_async.sync.aligned.m64n" N "k16.f32." DT "." DT " " REGS ", {%" A0 ", %" A1      \
                 ", %" A2 ", %" A3 "}, %" DB ", p, 1, 1, 0;\n}\n"                                             \
                 : OPS(d)                                                                                  \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1))
#define FORGE_WG_RS256(DT) \
    FORGE_WG_RS("256", DT, FORGE_WG_ACC256_REGS, FORGE_WG_ACC256_OPS, "128", "129", "130", "131", "132", "133")
#define FORGE_WG_RS128(DT) \
    FORGE_WG_RS("128", DT, FORGE_WG_ACC_REGS, FORGE_WG_ACC_OPS, "64", "65", "66", "67", "68", "69")
#define FORGE_WG_RS64(DT) \
    FORGE_WG_RS("64", DT, FORGE_WG_ACC32_REGS, FORGE_WG_ACC32_OPS, "32", "33", "34", "35", "36", "37")
#define FORGE_WG_RS32(DT) \
    FORGE_WG_RS("32", DT, FORGE_WG_ACC16_REGS, FORGE_WG_ACC16_OPS, "16", "17", "18", "19", "20", "21")
#define FORGE_WG_RS16(DT) \
    FORGE_WG_RS("16", DT, FORGE_WG_ACC8_REGS, FORGE_WG_ACC8_OPS, "8", "9", "10", "11", "12", "13")
template <bool BF, int TN>
__device__ __forceinline__ void wgmma_rs_m64k16(float (&d)[TN / 2], const u32 a[4], u64 db) {
    if constexpr (TN == 256) {
        if (BF) FORGE_WG_RS256("bf16");
        else FORGE_WG_RS256("f16");
    } else if constexpr (TN == 128) {
        if (BF) FORGE_WG_RS128("bf16");
        else FORGE_WG_RS128("f16");
    } else if constexpr (TN == 64) {
        if (BF) FORGE_WG_RS64("bf16");
        else FORGE_WG_RS64("f16");
    } else if constexpr (TN == 32) {
        if (BF) FORGE_WG_RS32("bf16");
        else FORGE_WG_RS32("f16");
    } else {
        static_assert(TN == 16, "wgmma token tiles: 16, 32, 64, 128 or 256");
        if (BF) FORGE_WG_RS16("bf16");
        else FORGE_WG_RS16("f16");
    }
}
#undef FORGE_WG_RS256
#undef FORGE_WG_RS128
#undef FORGE_WG_RS64
#undef FORGE_WG_RS32
#undef FORGE_WG_RS16
#undef FORGE_WG_RS
// Marks registers as used (and changed) here, so that their values, read by MMAs still in
// flight, are not moved and their registers not given to other values before this point.
__device__ __forceinline__ void wg_keep(u32 (&r)[4]) {
    asm volatile("" : "+r"(r[0]), "+r"(r[1]), "+r"(r[2]), "+r"(r[3]));
}
#endif

template <bool BF, int TN, bool GROUPED>
__device__ __forceinline__ void w4a16_wg_impl(const u16* __restrict__ x, const u32* __restrict__ qw,
                                              const u32* __restrict__ qz, const u16* __restrict__ sc, void* out,
                                              int M, int N, int K, int G, int k_chunk, int split_out,
                                              GroupedRoute route) {
    pdl_launch_dependents();  // the split-K reduction's launch may overlap this grid's tail
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    // Grouped: this block's segment, its rows as M (from row 0 of the tile) and its expert's
    // tensors. Read after pdl_wait: the table is the previous kernel's output.
    int first = 0;
    if constexpr (GROUPED) {
        pdl_wait();
        M = route.take_segment(TN, 128 * blockIdx.x, 128, N, (u16*)out, first, qw, qz, sc);
        if (M == 0) return;
    }
    constexpr int XB = TN * WG_BK * 2;  // one x stage: TN rows of 128 bytes
    // x chunks a thread loads a stage (16 tokens: threads 0..127 load one each, the rest none).
    constexpr int XI = TN >= 32 ? TN / 32 : 1;
    extern __shared__ __align__(16) u8 wg_smem[];
    // x stages first, each on a 1024-byte boundary (where the swizzle pattern repeats).
    u8* Xs = wg_smem + ((1024 - (smem_u32(wg_smem) & 1023)) & 1023);
    u32* Ws = (u32*)(Xs + WG_ST * XB);
    u32* Ms = Ws + WG_ST * WG_WWORDS;
    const int tid = threadIdx.x, lane = tid & 31, warp = (tid >> 5) & 3, wg = tid >> 7;
    const int g = lane >> 2, t = lane & 3, h = g >> 2;
    const int NW = N >> 3;
    const int wc0 = blockIdx.x * 16;
    const int m0 = GROUPED ? 0 : blockIdx.y * TN;
    const int kbeg = blockIdx.z * k_chunk;
    const int kend = min(K, kbeg + k_chunk);
    const int ntiles = (kend - kbeg) / WG_BK;
    // Stages per group (G is a multiple of WG_BK) and where the split starts in its group: the
    // loads and the dequantization step through groups by counting, without a division a stage.
    const int spg = G / WG_BK;

    // Loads, addressed once and advanced by pointer increments: x chunk (row tid/8 + 32i, 16-byte
    // chunk tid%8), weight chunk (row tid/4, chunk tid%4) and, for tid < 20, a 16-byte chunk of
    // the group metadata. Shared addresses are kept as 32-bit shared-window offsets.
    const int xr = tid >> 3, xch = tid & 7;
    const u32 x_dst = smem_u32(Xs) + xr * 128 + ((xch ^ (xr & 7)) << 4);
    const u16* xg = x + (i64)(m0 + xr) * K + kbeg + 8 * xch;
    const i64 x32 = (i64)32 * K;  // 32 rows of x
    const bool x_loader = TN >= 32 || xr < TN;  // this thread loads x rows
    const bool x_full = m0 + TN <= M;
    const int x_rows = min(XI, max(0, (M - m0 - xr + 31) / 32));  // chunks i < x_rows hold real rows
    // Grouped: each chunk's row of x by its own pointer (rows gathered through route.x_rows).
    const u16* xq[GROUPED ? XI : 1];
    if constexpr (GROUPED) {
#pragma unroll
        for (int i = 0; i < XI; i++)
            xq[i] = i < x_rows ? x + (i64)route.x_rows[first + xr + 32 * i] * K + kbeg + 8 * xch : x;
    }
    const u32 w_dst = smem_u32(Ws) + 4 * ((tid >> 2) * WG_WSTR + 4 * (tid & 3));
    const u32* wgp = qw + (i64)(kbeg + (tid >> 2)) * NW + wc0 + 4 * (tid & 3);
    const u32* m_src = tid < 4 ? qz + wc0 + 4 * tid : (const u32*)(sc + 8 * (wc0 + tid - 4));
    const i64 m_step = tid < 4 ? NW : N / 2;  // words from one group's metadata to the next
    const u32 m_dst = smem_u32(Ms) + 4 * (tid < 4 ? 4 * tid : 16 + 4 * (tid - 4));
    int load_pos = (kbeg % G) / WG_BK;
    const u32* m_cur = m_src + (i64)(kbeg / G) * m_step;
    auto load_stage = [&](int stage) {
        const u32 xs = x_dst + stage * XB;
        if (GROUPED && x_loader) {
#pragma unroll
            for (int i = 0; i < XI; i++) {
                cp_async16_s(xs + 4096 * i, i < x_rows ? xq[i] : x, i < x_rows ? 16 : 0);
                xq[i] += WG_BK;
            }
        } else if (x_loader) {
            if (x_full) {
                const u16* p = xg;
#pragma unroll
                for (int i = 0; i < XI; i++) {
                    cp_async16_s(xs + 4096 * i, p, 16);
                    p += x32;
                }
            } else {
#pragma unroll
                for (int i = 0; i < XI; i++)
                    cp_async16_s(xs + 4096 * i, i < x_rows ? xg + x32 * i : x, i < x_rows ? 16 : 0);
            }
        }
        xg += WG_BK;
        cp_async16_s(w_dst + stage * (4 * WG_WWORDS), wgp, 16);
        wgp += (i64)WG_BK * NW;
        if (tid < 20) cp_async16_s(m_dst + stage * (4 * WG_MWORDS), m_cur, 16);
        if (++load_pos == spg) {
            load_pos = 0;
            m_cur += m_step;
        }
    };

    // Launched with programmatic serialization (ops.rs): the set-up above overlaps the previous
    // kernel's tail; every load and store waits for it. (L2 prefetches of the block's weights
    // before this wait were slower: the whole slice by up to 18 % on 7168x18432, where the
    // prefetched lines outrun the L2; the first two stages no faster than none. LOG.md.)
    if constexpr (!GROUPED) pdl_wait();

    float acc[TN / 2];
#pragma unroll
    for (int i = 0; i < TN / 2; i++) acc[i] = 0.0f;
    wg_fence_acc(acc);

    const int col = 4 * warp + (g & 3);  // this thread's word column within the block
    const int nib = 4 * wg + 2 * h;       // its rows g and g + 8: nibbles nib and nib + 1
    const u32 MAGIC = BF ? 0x43004300u : 0x64006400u;
    // prmt selector: byte 2·wg + h of the k = 2t (2t+8) word to byte 0, of the 2t+1 (2t+9) word to
    // byte 2 (this warpgroup's tile is nibbles 4·wg + 2h and 4·wg + 2h + 1 of the column).
    const u32 sel = (2 * wg + h) | ((4 + 2 * wg + h) << 8);
    // Shared-window addresses in stage 0, computed once: this thread's weight word at k = 2t of
    // step 0, its column's zero-point word, and nibble nib's scale (nib + 1's is 4 bytes on:
    // AWQ's scale order puts nibbles 2m and 2m + 1 at 2m and 2m + 2 of the 8).
    const u32 w_rd = smem_u32(Ws) + 4 * (2 * t * WG_WSTR + col);
    const u32 z_rd = smem_u32(Ms) + 4 * col;
    const u32 s_rd = smem_u32(Ms) + 64 + 2 * (8 * col + 2 * (nib & 3) + (nib >> 2));
    u32 zm[2], s2[2];
    int dq_pos = (kbeg % G) / WG_BK;  // this stage's place in its group (0: new constants)
    // A fragments of each 16-deep step of a stage: the MMAs read them asynchronously, so a
    // buffer is rewritten only after the group that read it has completed.
    u32 a[4][4];
#pragma unroll
    for (int b = 0; b < 4; b++)
#pragma unroll
        for (int i = 0; i < 4; i++) a[b][i] = 0u;
    // x descriptors: the stage's start address advances the low bits (address / 16).
    const u64 x_desc = hw_desc(Xs, 16);

#pragma unroll
    for (int s = 0; s < WG_ST - 2; s++) {
        if (s < ntiles) load_stage(s);
        cp_async_commit();
    }
    for (int tt = 0; tt < ntiles; tt++) {
        cp_async_wait<WG_ST - 3>();
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  // cp.async writes -> the MMA's reads
        __syncthreads();
        // The stage this overwrites was read by the MMAs of step tt - 2, finished by now.
        if (tt + WG_ST - 2 < ntiles) load_stage((tt + WG_ST - 2) % WG_ST);
        cp_async_commit();
        const int st = tt % WG_ST;
        if (tt == 0 || dq_pos == 0) {
            const u32 mo = st * (4 * WG_MWORDS);
            const u32 zw = lds_u32(z_rd + mo);
#pragma unroll
            for (int q = 0; q < 2; q++) dq_consts<BF>(zw, nib + q, lds_u16(s_rd + mo + 4 * q), zm[q], s2[q]);
        }
        if (++dq_pos == spg) dq_pos = 0;
        const u32 ws = w_rd + st * (4 * WG_WWORDS);
        const u64 xd = x_desc + (u64)((st * XB) >> 4);
        // Each step's four weight words are read one step ahead, before the previous step's
        // fence (whose memory clobber holds later reads behind it): a step's dequantization
        // then finds them loaded instead of waiting on shared memory (ncu: those waits were a
        // quarter of the loop's stalls). Only the stage's first read follows the barrier.
        u32 w4[4];
        auto read_step = [&](int kk) {
            const u32 r0 = ws + 4 * 16 * kk * WG_WSTR;
            w4[0] = lds_u32(r0);
            w4[1] = lds_u32(r0 + 4 * WG_WSTR);
            w4[2] = lds_u32(r0 + 4 * 8 * WG_WSTR);
            w4[3] = lds_u32(r0 + 4 * 9 * WG_WSTR);
        };
        read_step(0);
#pragma unroll
        for (int kk = 0; kk < 4; kk++) {
            u32(&ab)[4] = a[kk];
            const u32 v01 = prmt(w4[0], w4[1], sel), v89 = prmt(w4[2], w4[3], sel);
            if (kk < 3) read_step(kk + 1);
#pragma unroll
            for (int r = 0; r < 4; r++) {
                // r: 0 = (row g, k 2t..), 1 = (row g+8, k 2t..), 2 = (row g, k 2t+8..), 3 = (row g+8, k 2t+8..)
                const u32 v = (r < 2 ? v01 : v89) >> (4 * (r & 1));
                ab[r] = dq2<BF>(and_or(v, 0x000F000Fu, MAGIC), zm[r & 1], s2[r & 1]);
            }
            // SPG steps an MMA group: one fence for their fragments, their MMAs, one commit, and
            // a wait for the group that read the next SPG buffers (4 / SPG - 1 groups stay in
            // flight); only then may those registers be reused (the fence keeps them live until
            // here). The 32-token tile takes its steps in pairs: its short m64n32 MMAs leave the
            // per-group fence, commit and wait exposed, and on an H200 M = 24 / 32 ran 2-5 %
            // faster on four DeepSeek-V3 shapes, outputs identical; pairs lost 0-2 % at 16 tokens
            // and 2-6 % at 64 and 128, and a whole stage a group (waited at once) lost everywhere
            // (LOG.md, session 39, "one fence a pair of steps").
            constexpr int SPG = TN == 32 ? 2 : 1;
            if (kk % SPG == SPG - 1) {
                asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
                for (int i = kk + 1 - SPG; i <= kk; i++) wgmma_rs_m64k16<BF, TN>(acc, a[i], xd + 2 * i);
                asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
                asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(4 / SPG - 1) : "memory");
#pragma unroll
                for (int i = 1; i <= SPG; i++) wg_keep(a[(kk + i) & 3]);
            }
        }
    }
    asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
    wg_fence_acc(acc);
    cp_async_wait<0>();
    __syncthreads();

    // Epilogue through shared memory: acc[4q + c] is output row 16·warp + g + 8(c/2) of this
    // warpgroup's tile (nibble 4·wg + 2h + c/2 of word column col) and token 8q + 2t + c%2.
    float* S = (float*)Xs;
#pragma unroll
    for (int q = 0; q < TN / 8; q++)
#pragma unroll
        for (int c = 0; c < 4; c++) {
            const int nib = 4 * wg + 2 * h + (c >> 1);
            const int nl = 8 * col + 2 * (nib & 3) + (nib >> 2);
            S[(8 * q + 2 * t + (c & 1)) * WG_EPI_STR + nl] = acc[4 * q + c];
        }
    __syncthreads();
    auto store_y = [&](int r, int c4, float4 v) {
        const i64 row = GROUPED ? (i64)route.out_rows[first + r] : (i64)(m0 + r);
        u16* y = (u16*)out + row * N + 8 * wc0 + c4;  // y is only 2-byte aligned
        const float f[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int e = 0; e < 4; e++) y[e] = f32_to_act_rn(f[e], BF);
    };
    if (split_out == WG_OUT_CLUSTER) {
        // K split over the blocks of one cluster (ops.rs launches cluster dims (1, 1, gridDim.z)):
        // each block's fp32 tile stays in its shared memory, and block r sums token rows r,
        // r + splits, ... of all the tiles in split order (as w4a16_reduce does from the
        // workspace) through distributed shared memory: no partials in global memory, no second
        // kernel.
        cluster_sync();
        const int splits = gridDim.z, rows = min(TN, M - m0);
        const u32 rank = cluster_ctarank(), s_base = smem_u32(S);
        for (int i = tid;; i += WG_THREADS) {
            const int r = (int)rank + splits * (i >> 5), c4 = 4 * (i & 31);
            if (r >= rows) break;
            const u32 a = s_base + 4 * (r * WG_EPI_STR + c4);
            float4 v[WG_MAX_SPLITS];
#pragma unroll
            for (int z = 0; z < WG_MAX_SPLITS; z++)
                if (z < splits) v[z] = ld_cluster_f4(a, z);
            float4 sum = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
            for (int z = 0; z < WG_MAX_SPLITS; z++)
                if (z < splits) {
                    sum.x = sum.x + v[z].x;
                    sum.y = sum.y + v[z].y;
                    sum.z = sum.z + v[z].z;
                    sum.w = sum.w + v[z].w;
                }
            store_y(r, c4, sum);
        }
        cluster_sync_relaxed();  // the other blocks read this block's tile until here
        return;
    }
    for (int i = tid; i < TN * 32; i += WG_THREADS) {
        const int r = i >> 5, c4 = 4 * (i & 31);
        if (m0 + r >= M) break;
        const float4 v = *(const float4*)&S[r * WG_EPI_STR + c4];
        if (split_out == WG_OUT_PARTIALS) {
            *(float4*)((float*)out + (i64)blockIdx.z * M * N + (i64)(m0 + r) * N + 8 * wc0 + c4) = v;
        } else {
            store_y(r, c4, v);
        }
    }
#endif
}

#define FORGE_GEMM_WG_ENTRY(SUF, BF, TN)                                                                   \
    extern "C" __global__ void __launch_bounds__(WG_THREADS) w4a16_wg_##SUF##_t##TN(                       \
        const u16* x, const u32* qw, const u32* qz, const u16* sc, void* out, int M, int N, int K, int G,  \
        int k_chunk, int split_out) {                                                                      \
        w4a16_wg_impl<BF, TN, false>(x, qw, qz, sc, out, M, N, K, G, k_chunk, split_out, GroupedRoute{});        \
    }
// The grouped form (MoE experts at prefill): grid (N / 128, segments), K not split, y written
// directly; see GroupedRoute.
#define FORGE_GEMM_WGG_ENTRY(SUF, BF, TN)                                                                  \
    extern "C" __global__ void __launch_bounds__(WG_THREADS) w4a16_wgg_##SUF##_t##TN(                      \
        const u16* x, const int* x_rows, const int* out_rows, const int* segments, const u32* qw,          \
        const u32* qz, const u16* sc, i64 ew, i64 ez, i64 es, int experts, void* out, int N, int K,        \
        int G) {                                                                                           \
        w4a16_wg_impl<BF, TN, true>(x, qw, qz, sc, out, 0, N, K, G, K, WG_OUT_Y,                            \
                                    GroupedRoute{x_rows, out_rows, segments, ew, ez, es, experts});             \
    }
#define FORGE_GEMM_WG_TILES(ENTRY) \
    ENTRY(f16, false, 256)         \
    ENTRY(bf16, true, 256)         \
    ENTRY(f16, false, 128)         \
    ENTRY(bf16, true, 128)         \
    ENTRY(f16, false, 64)          \
    ENTRY(bf16, true, 64)          \
    ENTRY(f16, false, 32)          \
    ENTRY(bf16, true, 32)          \
    ENTRY(f16, false, 16)          \
    ENTRY(bf16, true, 16)
// The 256-token tile (m64n256 MMAs, 128 accumulators a thread: one block an SM): ops.rs takes
// it past M = 128 where its cost model prices it below the 128-token tile, as it dequantizes
// each weight stage once for twice the MMAs (LOG.md, "A 256-token tile"); the grouped form takes
// 256-row segments only for long K and many rows an expert (forge.runtime), since its K is not
// split and a lone block an SM has no second block to hide its prologue and epilogue behind.
FORGE_GEMM_WG_TILES(FORGE_GEMM_WG_ENTRY)
FORGE_GEMM_WG_TILES(FORGE_GEMM_WGG_ENTRY)
#undef FORGE_GEMM_WG_TILES

// Sum of split-K partials ws[splits, MN] in split order, converted to the output dtype; four
// outputs a thread (16-byte loads) when `vec` (MN % 4 == 0; ops.rs sets it for large MN, where
// the loads dominate: a small MN split many ways wants more threads), else one.
template <bool BF>
__device__ __forceinline__ void w4a16_reduce_impl(const float* ws, u16* y, int splits, i64 mn, int vec) {
    pdl_wait();  // the partials' grid has finished (launched with programmatic serialization)
    const i64 tid = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (vec) {
        const i64 i = 4 * tid;
        if (i >= mn) return;
        float4 s = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        for (int z = 0; z < splits; z++) {
            const float4 v = *(const float4*)(ws + (i64)z * mn + i);
            s.x = s.x + v.x;
            s.y = s.y + v.y;
            s.z = s.z + v.z;
            s.w = s.w + v.w;
        }
        const float f[4] = {s.x, s.y, s.z, s.w};
#pragma unroll
        for (int e = 0; e < 4; e++) y[i + e] = f32_to_act_rn(f[e], BF);
        return;
    }
    if (tid >= mn) return;
    float s = 0.0f;
    for (int z = 0; z < splits; z++) s = s + ws[(i64)z * mn + tid];
    y[tid] = f32_to_act_rn(s, BF);
}
extern "C" __global__ void w4a16_reduce_f16(const float* ws, u16* y, int splits, i64 mn, int vec) {
    w4a16_reduce_impl<false>(ws, y, splits, mn, vec);
}
extern "C" __global__ void w4a16_reduce_bf16(const float* ws, u16* y, int splits, i64 mn, int vec) {
    w4a16_reduce_impl<true>(ws, y, splits, mn, vec);
}

// ---------------------------------------------------------------------------------------
// GEMV-style path for M <= 16: no shared-memory staging of the weights. Each warp streams
// its B fragments straight from global memory (one batch of 32 k ahead in registers), the
// block's slice of x sits in shared memory (rows >= M alias a zero row for ldmatrix), the
// 4 warps of a block split the block's K range (interleaved batches of 32 k) and their
// accumulators are summed in a fixed order at the end. Block = 8 word columns (64 outputs).

template <bool BF>
__device__ __forceinline__ void gemv_meta(u32 zw, uint4 sv, u32 zm[8], u32 s2[8]) {
    const u32 h[8] = {sv.x & 0xFFFF, sv.x >> 16, sv.y & 0xFFFF, sv.y >> 16,
                      sv.z & 0xFFFF, sv.z >> 16, sv.w & 0xFFFF, sv.w >> 16};
#pragma unroll
    for (int i = 0; i < 8; i++) {
        u32 z = (zw >> (4 * i)) & 15u;
        u32 hs = h[awq_col(i)];
        if (BF) {
            u32 nz = 0xC300u | z;
            zm[i] = nz | (nz << 16);
            u32 b = f32_to_bf16_rn(f16_to_f32((u16)hs));
            s2[i] = b | (b << 16);
        } else {
            u32 mz = 0x6400u | z;
            zm[i] = mz | (mz << 16);
            s2[i] = hs | (hs << 16);
        }
    }
}

template <bool BF>
__device__ __forceinline__ void gemv_step(float acc[8][4], const u16* arow, u32 w0, u32 w1, u32 w2, u32 w3,
                                          const u32 zm[8], const u32 s2[8]) {
    u32 a[4];
    ldmatrix_x4(a, arow);
    const u32 tl0 = prmt(w0, w1, 0x5410), th0 = prmt(w0, w1, 0x7632);
    const u32 tl1 = prmt(w2, w3, 0x5410), th1 = prmt(w2, w3, 0x7632);
    const u32 MAGIC = BF ? 0x43004300u : 0x64006400u;
#pragma unroll
    for (int i = 0; i < 8; i++) {
        const u32 src0 = i < 4 ? tl0 : th0;
        const u32 src1 = i < 4 ? tl1 : th1;
        const int sh = 4 * (i & 3);
        u32 b0 = and_or(src0 >> sh, 0x000F000Fu, MAGIC);
        u32 b1 = and_or(src1 >> sh, 0x000F000Fu, MAGIC);
        b0 = dq2<BF>(b0, zm[i], s2[i]);
        b1 = dq2<BF>(b1, zm[i], s2[i]);
        mma16816<BF>(acc[i], a, b0, b1);
    }
}

struct GemvBatch {
    u32 w[8];
    u32 zw;
    uint4 sv;
};

template <bool BF>
__device__ __forceinline__ void w4a16_gemv_impl(const u16* __restrict__ x, const u32* __restrict__ qw,
                                                const u32* __restrict__ qz, const u16* __restrict__ sc, void* out,
                                                int M, int N, int K, int gshift, int k_chunk, int split_out) {
    pdl_launch_dependents();  // the split-K reduction's launch may overlap this grid's tail
    extern __shared__ __align__(16) u16 xs[];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, tig = lane & 3;
    const int NW = N >> 3;
    const int c = blockIdx.x * 8 + g;
    const bool col_ok = c < NW;
    const int kbeg = blockIdx.z * k_chunk;
    const int kend = min(K, kbeg + k_chunk);
    const int klen = kend - kbeg;
    const int XS = k_chunk + 8;

    float acc[8][4];
#pragma unroll
    for (int b = 0; b < 8; b++)
#pragma unroll
        for (int q = 0; q < 4; q++) acc[b][q] = 0.0f;

    const int arow_r = (lane & 15) < M ? (lane & 15) : M;
    const u16* arow = xs + arow_r * XS + (lane >> 4) * 8;
    const u32* qcol = qw + c;

    const i64 NW64 = NW;
    auto load = [&](int b, GemvBatch& B) {
        const int k0 = kbeg + 32 * b;
        if (col_ok) {
            const u32* p = qcol + (i64)(k0 + 2 * tig) * NW64;
            B.w[0] = __ldg(p);
            B.w[1] = __ldg(p + NW64);
            B.w[2] = __ldg(p + 8 * NW64);
            B.w[3] = __ldg(p + 9 * NW64);
            B.w[4] = __ldg(p + 16 * NW64);
            B.w[5] = __ldg(p + 17 * NW64);
            B.w[6] = __ldg(p + 24 * NW64);
            B.w[7] = __ldg(p + 25 * NW64);
            const int grp = k0 >> gshift;
            B.zw = __ldg(qz + (i64)grp * NW64 + c);
            B.sv = __ldg((const uint4*)(sc + (i64)grp * N + 8 * (i64)c));
        } else {
#pragma unroll
            for (int j = 0; j < 8; j++) B.w[j] = 0;
            B.zw = 0;
            B.sv.x = 0; B.sv.y = 0; B.sv.z = 0; B.sv.w = 0;
        }
    };
    auto compute = [&](int b, const GemvBatch& B) {
        u32 zm[8], s2[8];
        gemv_meta<BF>(B.zw, B.sv, zm, s2);
        gemv_step<BF>(acc, arow + 32 * b, B.w[0], B.w[1], B.w[2], B.w[3], zm, s2);
        gemv_step<BF>(acc, arow + 32 * b + 16, B.w[4], B.w[5], B.w[6], B.w[7], zm, s2);
    };

    const int nb = klen >> 5;
    GemvBatch B0, B1, B2;
    int b = warp;
    if (b < nb) load(b, B0);
    if (b + 4 < nb) load(b + 4, B1);

    // x slice -> shared memory (row M is zeros), while the first weight batches are in flight:
    // a short block (small shapes split K finely) otherwise waits for two round trips.
    const int cpr = klen >> 3;  // 16-byte chunks per row
    for (int i = tid; i < (M + 1) * cpr; i += 128) {
        int r = i / cpr, cc = i - r * cpr;
        uint4 v;
        v.x = 0; v.y = 0; v.z = 0; v.w = 0;
        if (r < M) v = *(const uint4*)(x + (i64)r * K + kbeg + 8 * cc);
        *(uint4*)&xs[r * XS + 8 * cc] = v;
    }
    __syncthreads();

    for (; b < nb; b += 12) {
        if (b + 8 < nb) load(b + 8, B2);
        compute(b, B0);
        if (b + 4 >= nb) break;
        if (b + 12 < nb) load(b + 12, B0);
        compute(b + 4, B1);
        if (b + 8 >= nb) break;
        if (b + 16 < nb) load(b + 16, B1);
        compute(b + 8, B2);
    }

    // Sum the 4 warps' accumulators (fixed order) through shared memory.
    __syncthreads();
    float* red = (float*)xs;  // 4 warps x 32 lanes x 32 values (16 KB) — reuses the x slice
    if (warp > 0) {
#pragma unroll
        for (int i = 0; i < 8; i++)
#pragma unroll
            for (int q = 0; q < 4; q++) red[((warp - 1) * 32 + (i * 4 + q)) * 32 + lane] = acc[i][q];
    }
    __syncthreads();
    if (warp == 0) {
#pragma unroll
        for (int i = 0; i < 8; i++) {
#pragma unroll
            for (int q = 0; q < 4; q++) {
                float v = acc[i][q];
#pragma unroll
                for (int w = 0; w < 3; w++) v = v + red[(w * 32 + (i * 4 + q)) * 32 + lane];
                const int r = g + ((q & 2) ? 8 : 0);
                const int wc = blockIdx.x * 8 + 2 * tig + (q & 1);
                if (r < M && wc < NW) {
                    const i64 n = 8 * (i64)wc + awq_col(i);
                    if (split_out) {
                        ((float*)out)[((i64)blockIdx.z * M + r) * N + n] = v;
                    } else {
                        ((u16*)out)[(i64)r * N + n] = f32_to_act_rn(v, BF);
                    }
                }
            }
        }
    }
}

// G is passed as its log2 (the GEMV path needs a power-of-two group size).
#ifndef GEMV_MIN_BLOCKS
#define GEMV_MIN_BLOCKS 4
#endif
extern "C" __global__ void __launch_bounds__(128, GEMV_MIN_BLOCKS) w4a16_gemv_f16(const u16* x, const u32* qw, const u32* qz,
                                                                 const u16* sc, void* out, int M, int N, int K,
                                                                 int gshift, int k_chunk, int split_out) {
    w4a16_gemv_impl<false>(x, qw, qz, sc, out, M, N, K, gshift, k_chunk, split_out);
}
extern "C" __global__ void __launch_bounds__(128, GEMV_MIN_BLOCKS) w4a16_gemv_bf16(const u16* x, const u32* qw, const u32* qz,
                                                                  const u16* sc, void* out, int M, int N, int K,
                                                                  int gshift, int k_chunk, int split_out) {
    w4a16_gemv_impl<true>(x, qw, qz, sc, out, M, N, K, gshift, k_chunk, split_out);
}

// ---------------------------------------------------------------------------------------
// GEMV path, version 3 (M <= 4, power-of-two G): SIMT, fp32 FMA, zero point folded out of
// the inner loop. Lane l of a warp owns WPL consecutive word columns (8·WPL outputs) and
// streams down its warp's contiguous K range with one 4·WPL-byte load per row (a warp reads
// 128·WPL contiguous bytes of a row), 8 rows (8 loads) in flight. A nibble q becomes the
// float 128 + q by OR-ing it into bits 16..19 of 0x43000000 (exact); per group the thread
// sums A = Σ (128+q)·x and X = Σ x over its rows and folds
//   Σ (q − z)·s·x = s·(A − (128 + z)·X)
// into the running total once per group. The 8 warps of a block split the block's K range
// (contiguous slices) and are summed in a fixed order through shared memory; split-K over
// blockIdx.z as for the other kernels (fp32 partials + w4a16_reduce_*).
// bf16 activations use bf16(scale) (the same contract as the tensor-core paths).
//
// Grouped variant (w4a16_gemv3g_*, MoE experts at decode): blockIdx.y is a *segment* of up
// to MR rows that share one expert, from a table of int32 triples (first sorted position,
// row count 0..MR, expert id). Row r of segment s reads x row x_rows[first + r] and writes
// output row out_rows[first + r] (of M rows; split-K partials [splits, M, N] alike); the
// expert's qweight / qzeros / scales start ew / ez / es elements after the previous one's.
// A segment of count 0 (the table is sized for the worst case) does nothing; an expert id
// outside [0, E) (expert-parallel masking) writes zeros. Each block runs the row loop for
// exactly its segment's count (one instantiation per count), so a 1-row segment of the MR=4
// kernel costs what a 1-row GEMV does. Every output element is written by exactly one block
// per split, in a fixed order: deterministic.

#define GV3_WARPS 8

// The rows of one block: where each x row starts and which output row it writes.
template <int MR> struct Gv3Rows {
    const u16* x[MR];
    int out[MR];
};

// R rows (of which the first m are real: rows >= m read zeros and write nothing), output
// columns of this block, K slice of blockIdx.z. `active` false skips the weights (zeros
// out). red: the block's (GV3_WARPS - 1)·R·8·WPL·32 floats of shared memory.
template <int R, int MR, int WPL, bool BF>
__device__ __forceinline__ void gemv3_core(const Gv3Rows<MR>& rows, int m, bool active, const u32* __restrict__ qw,
                                           const u32* __restrict__ qz, const u16* __restrict__ sc, float* red,
                                           void* out, int M, int N, int K, int gshift, int k_chunk, int split_out) {
    constexpr int NC = 8 * WPL;  // outputs per lane
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int NW = N >> 3;
    const int c = (blockIdx.x * 32 + lane) * WPL;  // first word column of this lane
    const bool col_ok = c < NW;                     // NW % 4 == 0: all WPL words in or out
    const int kbeg = blockIdx.z * k_chunk;
    const int kend = min(K, kbeg + k_chunk);
    const int wlen = k_chunk / GV3_WARPS;  // multiple of 8
    const int kb = min(kend, kbeg + warp * wlen);
    const int ke = min(kend, kb + wlen);
    const u32 MAGIC = 0x43000000u, MASK = 0x000F0000u;
    const i64 NW64 = NW;

    float T[R][NC], A[R][NC], X[R];
#pragma unroll
    for (int r = 0; r < R; r++) {
        X[r] = 0.0f;
#pragma unroll
        for (int i = 0; i < NC; i++) { T[r][i] = 0.0f; A[r][i] = 0.0f; }
    }
    // Group metadata (raw) of the group being summed.
    u32 zw[WPL];
    uint4 sv[WPL];
    int cur = -1;

    auto flush = [&]() {
#pragma unroll
        for (int j = 0; j < WPL; j++) {
            const u32 h[4] = {sv[j].x, sv[j].y, sv[j].z, sv[j].w};
#pragma unroll
            for (int i = 0; i < 8; i++) {
                const int o = awq_col(i);
                const u16 hs = (u16)((h[o >> 1] >> (16 * (o & 1))) & 0xFFFF);
                float s = f16_to_f32(hs);
                if (BF) s = bf16_to_f32(f32_to_bf16_rn(s));
                const float zz = __uint_as_float(MAGIC | (((zw[j] >> (4 * i)) & 15u) << 16));  // 128 + z
#pragma unroll
                for (int r = 0; r < R; r++) {
                    const float d = fmaf(-zz, X[r], A[r][8 * j + i]);
                    T[r][8 * j + i] = fmaf(s, d, T[r][8 * j + i]);
                    A[r][8 * j + i] = 0.0f;
                }
            }
        }
#pragma unroll
        for (int r = 0; r < R; r++) X[r] = 0.0f;
    };

    if (col_ok && active) {
        for (int k0 = kb; k0 < ke; k0 += 8) {
            const int grp = k0 >> gshift;
            if (grp != cur) {
                if (cur >= 0) flush();
                cur = grp;
#pragma unroll
                for (int j = 0; j < WPL; j++) {
                    zw[j] = __ldg(qz + (i64)grp * NW64 + c + j);
                    sv[j] = __ldg((const uint4*)(sc + (i64)grp * N + 8 * (i64)(c + j)));
                }
            }
            // 8 rows of weights in flight, loaded past L1 (read once; L1 keeps the x rows):
            // reduced DeepSeek-V3 MoE decode on an H100, batch 16 4646-4650 -> 4721-4723 tok/s,
            // batch 1 512-514 -> 516-517 (LOG.md, "Weights past L1").
            u32 w[8][WPL];
            const u32* p = qw + (i64)k0 * NW64 + c;
#pragma unroll
            for (int rr = 0; rr < 8; rr++) {
                if (WPL == 2) {
                    const uint2 v = ld_stream((const uint2*)(p + rr * NW64));
                    w[rr][0] = v.x;
                    w[rr][WPL - 1] = v.y;
                } else {
                    w[rr][0] = ld_stream(p + rr * NW64);
                }
            }
            float xv[R][8];
#pragma unroll
            for (int r = 0; r < R; r++) {
                uint4 xr;
                xr.x = 0; xr.y = 0; xr.z = 0; xr.w = 0;
                if (r < m) xr = __ldg((const uint4*)(rows.x[r] + k0));
                const u32 xw[4] = {xr.x, xr.y, xr.z, xr.w};
#pragma unroll
                for (int t = 0; t < 4; t++) {
                    if (BF) {
                        xv[r][2 * t] = __uint_as_float(xw[t] << 16);
                        xv[r][2 * t + 1] = __uint_as_float(xw[t] & 0xFFFF0000u);
                    } else {
                        xv[r][2 * t] = f16_to_f32((u16)(xw[t] & 0xFFFF));
                        xv[r][2 * t + 1] = f16_to_f32((u16)(xw[t] >> 16));
                    }
                }
#pragma unroll
                for (int rr = 0; rr < 8; rr++) X[r] = X[r] + xv[r][rr];
            }
#pragma unroll
            for (int rr = 0; rr < 8; rr++) {
#pragma unroll
                for (int j = 0; j < WPL; j++) {
                    const u32 v = w[rr][j];
                    float f[8];
                    f[0] = __uint_as_float(and_or(v << 16, MASK, MAGIC));
                    f[1] = __uint_as_float(and_or(v << 12, MASK, MAGIC));
                    f[2] = __uint_as_float(and_or(v << 8, MASK, MAGIC));
                    f[3] = __uint_as_float(and_or(v << 4, MASK, MAGIC));
                    f[4] = __uint_as_float(and_or(v, MASK, MAGIC));
                    f[5] = __uint_as_float(and_or(v >> 4, MASK, MAGIC));
                    f[6] = __uint_as_float(and_or(v >> 8, MASK, MAGIC));
                    f[7] = __uint_as_float(and_or(v >> 12, MASK, MAGIC));
#pragma unroll
                    for (int r = 0; r < R; r++)
#pragma unroll
                        for (int i = 0; i < 8; i++) A[r][8 * j + i] = fmaf(f[i], xv[r][rr], A[r][8 * j + i]);
                }
            }
        }
        if (cur >= 0) flush();
    }

    // Sum the warps (fixed order) through shared memory.
    if (warp > 0) {
#pragma unroll
        for (int r = 0; r < R; r++)
#pragma unroll
            for (int i = 0; i < NC; i++) red[(((warp - 1) * R + r) * NC + i) * 32 + lane] = T[r][i];
    }
    __syncthreads();
    if (warp == 0 && col_ok) {
#pragma unroll
        for (int r = 0; r < R; r++) {
            if (r >= m) break;
            const i64 orow = rows.out[r];
#pragma unroll
            for (int i = 0; i < NC; i++) {
                float v = T[r][i];
#pragma unroll
                for (int w = 0; w < GV3_WARPS - 1; w++) v = v + red[((w * R + r) * NC + i) * 32 + lane];
                const i64 n = 8 * (i64)(c + i / 8) + awq_col(i % 8);
                if (split_out) {
                    ((float*)out)[((i64)blockIdx.z * M + orow) * N + n] = v;
                } else {
                    ((u16*)out)[orow * N + n] = f32_to_act_rn(v, BF);
                }
            }
        }
    }
}

// The plain kernel (GROUPED false: rows 0..M-1 of x and y, M <= MR, one expert) and the
// grouped one (GROUPED true: the segment of blockIdx.y, see above) share gemv3_core.
template <int MR, int WPL, bool BF, bool GROUPED>
__device__ __forceinline__ void w4a16_gemv3_impl(const u16* __restrict__ x, const int* __restrict__ x_rows,
                                                 const int* __restrict__ out_rows, const int* __restrict__ seg,
                                                 const u32* __restrict__ qw, const u32* __restrict__ qz,
                                                 const u16* __restrict__ sc, i64 ew, i64 ez, i64 es, int E,
                                                 void* out, int M, int N, int K, int gshift, int k_chunk,
                                                 int split_out) {
    pdl_launch_dependents();  // the split-K reduction's launch may overlap this grid's tail
    __shared__ float red[(GV3_WARPS - 1) * MR * 8 * WPL * 32];
    Gv3Rows<MR> rows;
    int m = M;
    bool active = true;
    if (GROUPED) {
        const int first = __ldg(seg + 3 * blockIdx.y);
        m = min(__ldg(seg + 3 * blockIdx.y + 1), MR);
        const int e = __ldg(seg + 3 * blockIdx.y + 2);
        if (m <= 0) return;  // a table row past the real segments: the whole block leaves
        active = e >= 0 && e < E;
        if (active) {
            qw += (i64)e * ew;
            qz += (i64)e * ez;
            sc += (i64)e * es;
        }
#pragma unroll
        for (int r = 0; r < MR; r++) {
            const bool ok = r < m;
            rows.x[r] = x + (ok ? (i64)__ldg(x_rows + first + r) * K : 0);
            rows.out[r] = ok ? __ldg(out_rows + first + r) : 0;
        }
    } else {
#pragma unroll
        for (int r = 0; r < MR; r++) {
            rows.x[r] = x + (i64)r * K;
            rows.out[r] = r;
        }
    }
    if constexpr (!GROUPED) {
        gemv3_core<MR, MR, WPL, BF>(rows, m, active, qw, qz, sc, red, out, M, N, K, gshift, k_chunk, split_out);
    } else {
        // one instantiation per row count (m is uniform over the block)
        if (m == MR) {
            gemv3_core<MR, MR, WPL, BF>(rows, m, active, qw, qz, sc, red, out, M, N, K, gshift, k_chunk, split_out);
        } else if (m == 1) {
            gemv3_core<1, MR, WPL, BF>(rows, m, active, qw, qz, sc, red, out, M, N, K, gshift, k_chunk, split_out);
        } else if constexpr (MR >= 3) {
            if (m == 2) {
                gemv3_core<2, MR, WPL, BF>(rows, m, active, qw, qz, sc, red, out, M, N, K, gshift, k_chunk, split_out);
            } else {
                gemv3_core<3, MR, WPL, BF>(rows, m, active, qw, qz, sc, red, out, M, N, K, gshift, k_chunk, split_out);
            }
        }
    }
}

#define FORGE_GEMV3_ENTRY(SUF, MR, WPL, BF)                                                                  \
    extern "C" __global__ void __launch_bounds__(32 * GV3_WARPS) w4a16_gemv3_##SUF##_r##MR(                  \
        const u16* x, const u32* qw, const u32* qz, const u16* sc, void* out, int M, int N, int K, int gshift, \
        int k_chunk, int split_out) {                                                                         \
        w4a16_gemv3_impl<MR, WPL, BF, false>(x, nullptr, nullptr, nullptr, qw, qz, sc, 0, 0, 0, 1, out, M, N, K, \
                                             gshift, k_chunk, split_out);                                     \
    }
FORGE_GEMV3_ENTRY(f16, 1, 2, false)
FORGE_GEMV3_ENTRY(f16, 2, 2, false)
FORGE_GEMV3_ENTRY(f16, 4, 1, false)
FORGE_GEMV3_ENTRY(bf16, 1, 2, true)
FORGE_GEMV3_ENTRY(bf16, 2, 2, true)
FORGE_GEMV3_ENTRY(bf16, 4, 1, true)

// Grouped entries: M = rows of the output (pairs), blockIdx.y = segment.
#define FORGE_GEMV3G_ENTRY(SUF, MR, WPL, BF, MINB)                                                             \
    extern "C" __global__ void __launch_bounds__(32 * GV3_WARPS, MINB) w4a16_gemv3g_##SUF##_r##MR(                \
        const u16* x, const int* x_rows, const int* out_rows, const int* seg, const u32* qw, const u32* qz,     \
        const u16* sc, i64 ew, i64 ez, i64 es, int E, void* out, int M, int N, int K, int gshift, int k_chunk,  \
        int split_out) {                                                                                        \
        w4a16_gemv3_impl<MR, WPL, BF, true>(x, x_rows, out_rows, seg, qw, qz, sc, ew, ez, es, E, out, M, N, K,  \
                                            gshift, k_chunk, split_out);                                        \
    }
FORGE_GEMV3G_ENTRY(f16, 1, 2, false, 4)
FORGE_GEMV3G_ENTRY(f16, 2, 2, false, 2)
FORGE_GEMV3G_ENTRY(f16, 4, 1, false, 2)
FORGE_GEMV3G_ENTRY(bf16, 1, 2, true, 4)
FORGE_GEMV3G_ENTRY(bf16, 2, 2, true, 2)
FORGE_GEMV3G_ENTRY(bf16, 4, 1, true, 2)

// MoE routing for the grouped GEMV, one block (runtime.moe_segments is the reference, bit for
// bit): the (token, expert) pairs of top_k_index [P = T·k] (int64 or int32) sorted stably by
// expert, ids outside [0, E) gathered under E; order[pos] = pair index at sorted position pos,
// tokens[pos] = order[pos] / k; each expert's run cut into segments of at most `rows` pairs,
// segs[s] = (first sorted position, count, expert id) in sorted order, rows from the last real
// segment to nseg zeros. Shared memory: P + 3·(E + 1) ints. A pair's rank among its expert's
// pairs is counted over the earlier pairs (every thread reads the same id at once): O(P) a
// thread, for decode-sized P.
extern "C" __global__ void __launch_bounds__(1024) moe_route(const void* ids, int ids64, int P, int k, int E,
                                                             int rows, int nseg, int* order, int* tokens, int* segs) {
    extern __shared__ int mr_smem[];
    int* bid = mr_smem;         // [P] bucket of each pair
    int* cnt = bid + P;         // [E + 1] pairs a bucket
    int* start = cnt + E + 1;   // [E + 1] first sorted position of a bucket
    int* sfirst = start + E + 1;  // [E + 1] first segment of a bucket
    const int tid = threadIdx.x, nt = blockDim.x, lane = tid & 31;
    for (int b = tid; b <= E; b += nt) cnt[b] = 0;
    __syncthreads();
    for (int p = tid; p < P; p += nt) {
        const long long v = ids64 ? ((const long long*)ids)[p] : (long long)((const int*)ids)[p];
        const int b = (v >= 0 && v < E) ? (int)v : E;
        bid[p] = b;
        atomicAdd(&cnt[b], 1);
    }
    __syncthreads();
    if (tid < 32) {  // exclusive scans of the counts and of the segments a bucket, 32 at a time
        int run = 0, srun = 0;
        for (int b0 = 0; b0 <= E; b0 += 32) {
            const int b = b0 + lane;
            const int c = b <= E ? cnt[b] : 0, sc = (c + rows - 1) / rows;
            int ic = c, is = sc;
#pragma unroll
            for (int d = 1; d < 32; d <<= 1) {
                const int uc = __shfl_up_sync(0xffffffffu, ic, d), us = __shfl_up_sync(0xffffffffu, is, d);
                if (lane >= d) { ic += uc; is += us; }
            }
            if (b <= E) { start[b] = run + ic - c; sfirst[b] = srun + is - sc; }
            run += __shfl_sync(0xffffffffu, ic, 31);
            srun += __shfl_sync(0xffffffffu, is, 31);
        }
    }
    __syncthreads();
    for (int p = tid; p < P; p += nt) {
        const int b = bid[p];
        int rank = 0;
        for (int q = 0; q < p; q++) rank += bid[q] == b;
        const int pos = start[b] + rank;
        order[pos] = p;
        tokens[pos] = p / k;
        if (rank % rows == 0) {
            int* sg = segs + 3 * (i64)(sfirst[b] + rank / rows);
            sg[0] = pos;
            sg[1] = min(rows, cnt[b] - rank);
            sg[2] = b;
        }
    }
    const int real = sfirst[E] + (cnt[E] + rows - 1) / rows;
    for (int i = real * 3 + tid; i < nseg * 3; i += nt) segs[i] = 0;
}

// The MoE top-k weighted sum of the grouped GEMV's per-pair outputs: out[t, h] = Σ_j w'[t, j] ·
// y[t·k + j, h] over j = 0..k-1 in that order, each product and sum rounded to fp32, w' = w where the id is in [0, E) and 0 elsewhere (a masked
// pair adds nothing whatever its weight); out rounded to y's type. y and out [*, H] f16/bf16
// (BF), H % 8 == 0, 16-byte aligned; w f32 (wkind 0), bf16 (1) or f16 (2); ids int64 or int32.
// Block (x: 8 outputs a thread, y: token).
extern "C" __global__ void __launch_bounds__(256) moe_combine(const u16* y, const void* w, int wkind, const void* ids,
                                                              int ids64, int k, int H, int E, int bf, u16* out) {
    const int t = blockIdx.y;
    const int h = 8 * (blockIdx.x * blockDim.x + threadIdx.x);
    if (h >= H) return;
    float acc[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
    for (int j = 0; j < k; j++) {
        const i64 p = (i64)t * k + j;
        const long long id = ids64 ? ((const long long*)ids)[p] : (long long)((const int*)ids)[p];
        float wj = wkind == 0 ? ((const float*)w)[p]
                              : (wkind == 1 ? bf16_to_f32(((const u16*)w)[p]) : f16_to_f32(((const u16*)w)[p]));
        if (id < 0 || id >= E) wj = 0.0f;
        const uint4 v = *(const uint4*)(y + p * H + h);
        const u32 u[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int c = 0; c < 8; c++) {
            const u16 b = (u16)(u[c >> 1] >> (16 * (c & 1)));
            acc[c] = __fadd_rn(acc[c], __fmul_rn(wj, act_to_f32(b, bf)));
        }
    }
    u32 o[4];
#pragma unroll
    for (int c = 0; c < 4; c++) {
        const u16 lo = f32_to_act_rn(acc[2 * c], bf);
        const u16 hi = f32_to_act_rn(acc[2 * c + 1], bf);
        o[c] = (u32)lo | ((u32)hi << 16);
    }
    *(uint4*)(out + (i64)t * H + h) = make_uint4(o[0], o[1], o[2], o[3]);
}

// The experts' activation: y[r, c] = silu(g) · u for g = x[r, c], u = x[r, I + c] (x [rows, 2I]:
// a row's I gate columns, then its I up columns, as the gate_up projection writes them), each
// step rounded as torch's two ops round it: silu(g) = g / (1 + exp(-g)) in fp32 rounded to the
// type, then its product with u in fp32 rounded to the type. f16/bf16 (BF), I % 8 == 0, x and y
// 16-byte aligned. 8 outputs a thread.
extern "C" __global__ void __launch_bounds__(256) silu_mul(const u16* x, i64 rows, int I, int bf, u16* y) {
    const int per = I >> 3;
    const i64 v = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (v >= rows * per) return;
    const i64 r = v / per;
    const int c = 8 * (int)(v - r * per);
    const uint4 gv = *(const uint4*)(x + r * 2 * I + c);
    const uint4 uv = *(const uint4*)(x + r * 2 * I + I + c);
    const u32 g2[4] = {gv.x, gv.y, gv.z, gv.w};
    const u32 u2[4] = {uv.x, uv.y, uv.z, uv.w};
    u32 o[4];
#pragma unroll
    for (int w = 0; w < 4; w++) {
        u32 word = 0;
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const u16 gb = (u16)(g2[w] >> (16 * h)), ub = (u16)(u2[w] >> (16 * h));
            const float g = act_to_f32(gb, bf);
            const float u = act_to_f32(ub, bf);
            const float a = __fdiv_rn(g, __fadd_rn(1.0f, expf(-g)));
            const u16 ab = f32_to_act_rn(a, bf);
            const float p = __fmul_rn(act_to_f32(ab, bf), u);
            word |= (u32)f32_to_act_rn(p, bf) << (16 * h);
        }
        o[w] = word;
    }
    *(uint4*)(y + r * I + c) = make_uint4(o[0], o[1], o[2], o[3]);
}

// ---------------------------------------------------------------------------------------
// Tile layout: the AWQ codes repacked once (at load time) so that a GEMV streams each output
// tile's weights as one contiguous run of 16-byte loads, already in mma.m16n8k16 A-fragment
// order (the weights are A: 16 outputs x 16 k a step; x is B, one token per B column).
//
//   qweight_tiled u32 [N/16][K/64][32 lanes][4 steps]
//
// Word (t, c, lane = 4g + tt, j) holds, in nibble p (bits 4p..4p+3; r = p & 3, e = p >> 2),
// the code q[k][n] with n = 16t + g + 8·(r & 1) and k = 64c + 16tt + 4j + 2·(r >> 1) + e.
// That is A register r of step j of chunk c for lane (g, tt), low half e = 0, high half e = 1,
// with the MMA's k index permuted inside the step (kk = 2tt + e -> 16tt + 4j + e,
// kk = 2tt + 8 + e -> 16tt + 4j + 2 + e): lane tt's B registers of step j are then x at
// k = 64c + 16tt + 4j .. +3, so a lane reads its whole chunk of x as 32 contiguous bytes.
// Needs N % 16 == 0 and K % 64 == 0. Zero points and scales stay in the AWQ tensors.

__device__ __forceinline__ u32 tiled_word(const u32* __restrict__ qw, i64 NW, int t, int c, int lane, int j) {
    const int g = lane >> 2, tt = lane & 3;
    u32 w = 0;
#pragma unroll
    for (int p = 0; p < 8; p++) {
        const int r = p & 3, e = p >> 2;
        const int n = 16 * t + g + 8 * (r & 1);
        const i64 k = 64 * (i64)c + 16 * tt + 4 * j + 2 * (r >> 1) + e;
        const u32 word = __ldg(qw + k * NW + (n >> 3));
        w |= ((word >> (4 * awq_nibble(n & 7))) & 15u) << (4 * p);
    }
    return w;
}

// One thread a tiled word of one matrix.
extern "C" __global__ void w4a16_tile_repack(const u32* qw, u32* out, int K, int N) {
    const i64 words = (i64)K * (N >> 3);
    const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= words) return;
    const int kc = K >> 6;
    const int j = (int)(i & 3), lane = (int)((i >> 2) & 31);
    const i64 rest = i >> 7;
    const int c = (int)(rest % kc), t = (int)(rest / kc);
    out[i] = tiled_word(qw, N >> 3, t, c, lane, j);
}

// AWQ weights dequantized to row-major [K, N] (qweight's own order): out[k][n] = (q − z)·s,
// q = q[k][n], z and s of group k / G, computed in fp32 and rounded once to the output dtype:
// f32 exact, f16 as the f16 kernels' (q − z)·scale, bf16 with the scale first rounded to
// bf16 as the bf16 kernels take it (dq_consts, dq2). So a GEMM on this output multiplies the
// very weights the fused W4A16 kernels do (the runtime's route for many rows: dequantize, then
// cuBLAS). A thread a qweight word: 8 outputs of one k, its scales one 16-byte load (scales
// 16-byte aligned, N % 8 == 0), its outputs one or two 16-byte stores. Grid (word columns /
// 256, min(K, 65535)), k strided by gridDim.y. (Eight rows a thread, their loads issued
// before any use, was slower on an H200: 7168x18432 to bf16 118 -> 146 µs; LOG.md, "Session
// 44".)
template <typename OUT, int KIND>  // KIND: 0 f32, 1 f16, 2 bf16
__device__ __forceinline__ void awq_dequant_impl(const u32* __restrict__ qw, const u32* __restrict__ qz,
                                                 const u16* __restrict__ sc, OUT* __restrict__ out, int K, int N,
                                                 int G) {
    const int NW = N >> 3;
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= NW) return;
    for (int k = blockIdx.y; k < K; k += gridDim.y) {
        const i64 grp = k / G;
        const u32 w = __ldg(qw + (i64)k * NW + c);
        const u32 z = __ldg(qz + grp * NW + c);
        const uint4 s4 = __ldg((const uint4*)(sc + grp * N + 8 * (i64)c));
        const u32 sw[4] = {s4.x, s4.y, s4.z, s4.w};
        float v[8];
#pragma unroll
        for (int j = 0; j < 8; j++) {
            const int nib = awq_nibble(j);
            const int d = (int)((w >> (4 * nib)) & 15u) - (int)((z >> (4 * nib)) & 15u);
            float s = f16_to_f32((u16)(sw[j >> 1] >> (16 * (j & 1))));
            if (KIND == 2) s = bf16_to_f32(f32_to_bf16_rn(s));
            v[j] = (float)d * s;
        }
        OUT* o = out + (i64)k * N + 8 * (i64)c;
        if constexpr (KIND == 0) {
            ((float4*)o)[0] = make_float4(v[0], v[1], v[2], v[3]);
            ((float4*)o)[1] = make_float4(v[4], v[5], v[6], v[7]);
        } else {
            u32 h[4];
#pragma unroll
            for (int j = 0; j < 4; j++) {
                const u32 lo = f32_to_act_rn(v[2 * j], KIND == 2);
                const u32 hi = f32_to_act_rn(v[2 * j + 1], KIND == 2);
                h[j] = lo | (hi << 16);
            }
            *(uint4*)o = make_uint4(h[0], h[1], h[2], h[3]);
        }
    }
}
extern "C" __global__ void awq_dequant_f32(const u32* qw, const u32* qz, const u16* sc, float* out, int K, int N,
                                           int G) {
    awq_dequant_impl<float, 0>(qw, qz, sc, out, K, N, G);
}
extern "C" __global__ void awq_dequant_f16(const u32* qw, const u32* qz, const u16* sc, u16* out, int K, int N,
                                           int G) {
    awq_dequant_impl<u16, 1>(qw, qz, sc, out, K, N, G);
}
extern "C" __global__ void awq_dequant_bf16(const u32* qw, const u32* qz, const u16* sc, u16* out, int K, int N,
                                            int G) {
    awq_dequant_impl<u16, 2>(qw, qz, sc, out, K, N, G);
}

// GEMV on the tile layout, M <= 8·NT tokens (B columns of NT 8-token tiles; lanes past M read
// row M-1 and their outputs are dropped). Block = one 16-output tile, its 4 to 32 warps on
// contiguous runs of whole groups (G % 64 == 0), each keeping RW chunks of weights in flight
// and reading each chunk's x (L1 hits) as it uses it; per group the fresh fp32 accumulators
// are scaled once (y += s·Σ (q − z)·x, with (q − z) exact in bf16/f16 and the f16 scale exact
// in fp32) and the warps are summed in a fixed order through shared memory: one launch, no
// split-K workspace, deterministic. Each dequantized A fragment serves all NT token tiles.
// TILED_MAX_WARPS and TILED16_MAX_WARPS (the most warps a block of each entry) come from the
// generated header: ops.rs sizes the launches by the same constants.

// Per-warp state of the tiled GEMV: lane (g, tt) owns outputs 16t + g and 16t + g + 8 of
// tile t (A rows) and token columns 8nt + 2tt, 8nt + 2tt + 1 of the accumulators; the group's
// zero points (biased like the codes) and scales, with the next group's metadata loaded one
// group ahead.
template <bool BF, int NT> struct TiledWarp {
    const u32* qz;  // this lane's zero words of the next group (rows g, g + 8: word columns 2t, 2t + 1)
    const u16* sc;  // this lane's scales of the next group (columns 16t + g, 16t + g + 8)
    i64 NW, N;
    int nib, left;  // nibble of column g in a zero word; groups still to fetch
    u32 mz0 = 0, mz1 = 0, zb0 = 0, zb1 = 0;
    u16 ms0 = 0, ms1 = 0;
    float s0 = 0.0f, s1 = 0.0f;
    // One accumulator set a token tile. (Two for one tile, even and odd steps, halved the
    // MMAs' dependency chain but took 85 registers against 64 with x read at use, and with
    // them the fourth block of 8 warps an SM; LOG.md, "The tiled GEMV's registers".)
    float acc[NT][4] = {};
    float out[NT][4] = {};

    __device__ __forceinline__ void load_meta() {
        if (left > 0) {
            mz0 = __ldg(qz);
            mz1 = __ldg(qz + 1);
            ms0 = __ldg(sc);
            ms1 = __ldg(sc + 8);
            qz += NW;
            sc += N;
            left--;
        }
    }
    // Makes the fetched group's metadata current and fetches the next group's.
    __device__ __forceinline__ void take_meta() {
        const u32 z0 = (mz0 >> (4 * nib)) & 15u, z1 = (mz1 >> (4 * nib)) & 15u;
        // f16: 1024 + z (subtracted); bf16: −(128 + z) (added: sm_80 has no bf16x2 subtract)
        const u32 zbias = BF ? 0xC300C300u : 0x64006400u;
        zb0 = zbias | (z0 * 0x10001u);
        zb1 = zbias | (z1 * 0x10001u);
        s0 = f16_to_f32(ms0);
        s1 = f16_to_f32(ms1);
        load_meta();
    }
    // The 4 steps of one chunk: wq = this lane's word of each step, xa/xb[nt] = its 16 x
    // values of token tile nt.
    __device__ __forceinline__ void chunk(const uint4& wq, const uint4 (&xa)[NT], const uint4 (&xb)[NT]) {
        const u32 MAGIC = BF ? 0x43004300u : 0x64006400u;
        const u32 w[4] = {wq.x, wq.y, wq.z, wq.w};
#pragma unroll
        for (int j = 0; j < 4; j++) {
            u32 a[4];
#pragma unroll
            for (int r = 0; r < 4; r++) {
                const u32 v = and_or(w[j] >> (4 * r), 0x000F000Fu, MAGIC);  // 128 + q / 1024 + q
                const u32 zb = (r & 1) ? zb1 : zb0;
                if (BF) {
                    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(a[r]) : "r"(v), "r"(0x3F803F80u), "r"(zb));
                } else {
                    asm("sub.rn.f16x2 %0, %1, %2;" : "=r"(a[r]) : "r"(v), "r"(zb));
                }
            }
#pragma unroll
            for (int nt = 0; nt < NT; nt++) {
                const u32 xv[8] = {xa[nt].x, xa[nt].y, xa[nt].z, xa[nt].w, xb[nt].x, xb[nt].y, xb[nt].z, xb[nt].w};
                mma16816<BF>(acc[nt], a, xv[2 * j], xv[2 * j + 1]);
            }
        }
    }
    // Scales the finished group's sums into the output and starts the next group.
    __device__ __forceinline__ void fold() {
#pragma unroll
        for (int nt = 0; nt < NT; nt++) {
            out[nt][0] = fmaf(s0, acc[nt][0], out[nt][0]);
            out[nt][1] = fmaf(s0, acc[nt][1], out[nt][1]);
            out[nt][2] = fmaf(s1, acc[nt][2], out[nt][2]);
            out[nt][3] = fmaf(s1, acc[nt][3], out[nt][3]);
#pragma unroll
            for (int q = 0; q < 4; q++) acc[nt][q] = 0.0f;
        }
        take_meta();
    }
};

// GEMV on the tile layout. Each warp keeps RW chunks of weights in flight in registers (a
// slot refilled right after its use) and loads a chunk's x just before using it: x is small
// and shared by every block, so those loads hit L1, and holding them in flight as well took
// the registers of a fourth block an SM (LOG.md, "The tiled GEMV's registers"). The weights
// are loaded without L1 allocation (read once; L1 holds x, which the co-resident blocks
// share): 7168x18432 at M = 1 31.1 -> 29.1 µs, M = 16 39.2 -> 37.4 on an H100 (LOG.md,
// "Weights past L1"). The main loop walks running pointers and, when a group is whole rounds
// (G = 128, 256, ...), folds each group after its last round without counting chunks: a round
// of 2 chunks 210 -> 138 instructions (M <= 8), on an H200 7168x18432 at M = 1 / 16 24.8 -> 21.8
// / 34.0 -> 31.4 µs, six DeepSeek-V3 shapes 12-23 % (M <= 8) and 8-14 % (M = 16) less time
// (LOG.md, "The tiled GEMV's main loop, strength-reduced"); counting the rounds of a group, not
// only G = 128's one, left G = 128 as it was and made G = 256 4 % faster (LOG.md, session 37).
template <bool BF, int RW, int NT>
__device__ __forceinline__ void w4a16_gemv_tiled_impl(const u16* __restrict__ x, const uint4* __restrict__ qt,
                                                      const u32* __restrict__ qz, const u16* __restrict__ sc,
                                                      u16* __restrict__ y, int M, int N, int K, int G) {
    static_assert(NT == 1 || NT == 2, "one or two token tiles");
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    const int g = lane >> 2, tt = lane & 3, t = blockIdx.x;
    const int groups = K / G, gch = G >> 6;
    const int gpw = (groups + nwarps - 1) / nwarps;
    const int gbeg = min(groups, warp * gpw), gend = min(groups, gbeg + gpw);
    const int n = (gend - gbeg) * gch;  // this warp's chunks
    const uint4* wp = qt + ((i64)t * (K >> 6) + (i64)gbeg * gch) * 32 + lane;
    const uint4* xp[NT];
#pragma unroll
    for (int nt = 0; nt < NT; nt++)
        xp[nt] = (const uint4*)(x + (i64)min(8 * nt + g, M - 1) * K + 16 * tt) + (i64)gbeg * gch * 8;

    TiledWarp<BF, NT> st;
    st.NW = N >> 3;
    st.N = N;
    st.qz = qz + (i64)gbeg * st.NW + 2 * t;
    st.sc = sc + (i64)gbeg * N + 16 * t + g;
    st.nib = awq_nibble(g);
    st.left = gend - gbeg;
    // Every group's zero points and scales on their way to L2 at once: the ring below fetches
    // them one group ahead, a DRAM trip a group when the weights are cold (LOG.md, "Metadata
    // prefetch").
    for (int i = lane; i < st.left; i += 32) {
        prefetch_l2(st.qz + (i64)i * st.NW);
        prefetch_l2(st.sc + (i64)i * N);
    }
    st.load_meta();

    uint4 wr[RW];
    // The next chunk with the weights w: its x loaded, then multiplied. The x (xp, advanced a
    // chunk at each use) and the next refill's weights (wn, advanced a chunk at each refill) are
    // running pointers, not offsets recomputed from the chunk index.
    auto multiply_chunk = [&](const uint4& w) {
        uint4 xa[NT], xb[NT];
#pragma unroll
        for (int nt = 0; nt < NT; nt++) {
            xa[nt] = __ldg(xp[nt]);
            xb[nt] = __ldg(xp[nt] + 1);
            xp[nt] += 8;
        }
        st.chunk(w, xa, xb);
    };
#pragma unroll
    for (int s = 0; s < RW; s++)
        if (s < n) wr[s] = ld_stream(wp + 32 * s);
    const uint4* wn = wp + 32 * RW;
    // Slot s refilled with the next chunk's weights.
    auto refill = [&](int s) {
        wr[s] = ld_stream(wn);
        wn += 32;
    };
    st.take_meta();
    int in_grp = 0, c = 0;
    if (gch % RW == 0) {
        // A group is gch / RW whole rounds of RW chunks (one at G = 128, DeepSeek-V3's group
        // size; n is then a multiple of RW): folded after its last round, counting rounds, not
        // chunks, and the last round, which ends a group, without refills.
        const int rpg = gch / RW;
        int r = 0;
        for (; c + 2 * RW <= n; c += RW) {
#pragma unroll
            for (int s = 0; s < RW; s++) {
                multiply_chunk(wr[s]);
                refill(s);
            }
            if (++r == rpg) {  // warp-uniform
                r = 0;
                st.fold();
            }
        }
        if (c < n) {
#pragma unroll
            for (int s = 0; s < RW; s++) multiply_chunk(wr[s]);
            st.fold();
        }
    } else {
        // Full rounds whose refills are all in range: no per-chunk bounds checks.
        for (; c + 2 * RW <= n; c += RW) {
#pragma unroll
            for (int s = 0; s < RW; s++) {
                multiply_chunk(wr[s]);
                refill(s);
                if (++in_grp == gch) {  // warp-uniform
                    in_grp = 0;
                    st.fold();
                }
            }
        }
        // The last (< 2·RW) chunks.
        for (; c < n; c += RW) {
#pragma unroll
            for (int s = 0; s < RW; s++) {
                if (c + s < n) {  // warp-uniform: the MMAs run convergently
                    multiply_chunk(wr[s]);
                    if (c + RW + s < n) refill(s);
                    if (++in_grp == gch) {
                        in_grp = 0;
                        st.fold();
                    }
                }
            }
        }
    }

    // The warps' outputs summed in warp order through shared memory; rows < M written. The
    // outputs, [warps][16 rows][8·NT tokens] fp32: the M > 8 kernel's (NT = 2) a static array
    // for its 16 warps, the M <= 8 kernel's dynamic shared memory sized by ops.rs to the
    // launch's up to 32 (on an H200 1-12 % faster on ten DeepSeek-V3 shapes than a static array
    // for 32). Each kernel's sum is written in the one form found to keep its registers: NVRTC
    // 13.0 gave the M > 8 kernel 83 registers, not 82, whenever its array was reached through a
    // pointer or an accessor, and then ran 7168x18432 at M = 16 in 37.2 against 34.0 µs; the
    // M <= 8 kernel's flat indexing runs it 1-3 % faster than 3-D (LOG.md, "Up to 32 warps a
    // tile").
    if constexpr (NT == 2) {
        __shared__ float red16[TILED16_MAX_WARPS][16][8 * NT];
#pragma unroll
        for (int nt = 0; nt < NT; nt++) {
            red16[warp][g][8 * nt + 2 * tt] = st.out[nt][0];
            red16[warp][g][8 * nt + 2 * tt + 1] = st.out[nt][1];
            red16[warp][g + 8][8 * nt + 2 * tt] = st.out[nt][2];
            red16[warp][g + 8][8 * nt + 2 * tt + 1] = st.out[nt][3];
        }
        __syncthreads();
        for (int i = threadIdx.x; i < 16 * 8 * NT; i += blockDim.x) {
            const int row = i / (8 * NT), col = i % (8 * NT);
            if (col < M) {
                float v = 0.0f;
                for (int w = 0; w < nwarps; w++) v += red16[w][row][col];
                y[(i64)col * N + 16 * t + row] = f32_to_act_rn(v, BF);
            }
        }
    } else {
        extern __shared__ float red_dyn[];
        red_dyn[(warp * 16 + g) * 8 + 2 * tt] = st.out[0][0];
        red_dyn[(warp * 16 + g) * 8 + 2 * tt + 1] = st.out[0][1];
        red_dyn[(warp * 16 + g + 8) * 8 + 2 * tt] = st.out[0][2];
        red_dyn[(warp * 16 + g + 8) * 8 + 2 * tt + 1] = st.out[0][3];
        __syncthreads();
        for (int i = threadIdx.x; i < 16 * 8; i += blockDim.x) {
            const int row = i / 8, col = i % 8;
            if (col < M) {
                float v = 0.0f;
                for (int w = 0; w < nwarps; w++) v += red_dyn[(w * 16 + row) * 8 + col];
                y[(i64)col * N + 16 * t + row] = f32_to_act_rn(v, BF);
            }
        }
    }
}

// M <= 8 (w4a16_gemv_tiled_*): 2 chunks of weights in flight a warp, each chunk's x read at
// use (64 registers: 4 blocks of 8 warps an SM; with 2 chunks of x in flight too, 78 and 3),
// with the warps a block fitted to the tiles and SMs (ops.rs tiled_warps), up to 32: fewer
// tiles than SMs (7168x2048) then spread a tile's groups over a whole SM's warps. 8 < M <= 16
// (w4a16_gemv_tiled16_*): two token tiles share each A fragment, 2 chunks of weights in flight
// (82 registers from NVRTC 13.0, 76 since the main loop's running pointers, 78 with rounds
// counted a group; with 3 chunks of weights and x in flight, 118). H200, M = 1 / 16: 7168x18432
// 27.3 -> 26.9 / 37.2 -> 34.1 µs, the expert shapes -1 to +3 / 8-9 % faster (LOG.md, "The
// tiled GEMV's registers"). Not measured on an H100, where 2 chunks of x and weights at M = 16
// (100 registers) were slower than 3 (53 against 45.5 µs on 7168x18432).
// Launched plainly: programmatic launch with L2 prefetches of the weights before the wait was
// faster back to back (cold 6.9 -> 5.3 µs) but slower after a foreign kernel, and whole-model
// decode 1 % slower (LOG.md, "Programmatic launch").
#define FORGE_GEMV_TILED_ENTRY(SUF, BF)                                                                        \
    extern "C" __global__ void __launch_bounds__(32 * TILED_MAX_WARPS) w4a16_gemv_tiled_##SUF(                  \
        const u16* x, const uint4* qt, const u32* qz, const u16* sc, u16* y, int M, int N, int K, int G) {       \
        w4a16_gemv_tiled_impl<BF, 2, 1>(x, qt, qz, sc, y, M, N, K, G);                                       \
    }                                                                                                           \
    extern "C" __global__ void __launch_bounds__(32 * TILED16_MAX_WARPS) w4a16_gemv_tiled16_##SUF(              \
        const u16* x, const uint4* qt, const u32* qz, const u16* sc, u16* y, int M, int N, int K, int G) {       \
        w4a16_gemv_tiled_impl<BF, 2, 2>(x, qt, qz, sc, y, M, N, K, G);                                       \
    }
FORGE_GEMV_TILED_ENTRY(f16, false)
FORGE_GEMV_TILED_ENTRY(bf16, true)
