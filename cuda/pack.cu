// pack.cu — int4 packing for vLLM: fused round-to-nearest quantize + AWQ pack of a weight
// [N, K], and packing of GPTQ codes [K, N] (u8) into the AWQ and GPTQ v1 layouts.
// AWQ: qweight i32 [K, N/8], nibble i of word [k, c] = column 8c + ORDER[i],
// ORDER = {0,2,4,6,1,3,5,7}; qzeros i32 [K/G, N/8] same order; scales f16 [K/G, N].
// GPTQ v1: qweight i32 [K/8, N] (row 8r+i at bits 4i), qzeros [K/G, N/8] plain order of
// z - 1, scales f16 [K/G, N].

__device__ __forceinline__ u32 awq_word8(const u8* v) {  // v[0..8): codes of columns 8c..8c+7
    return (u32)(v[0] & 15) | ((u32)(v[2] & 15) << 4) | ((u32)(v[4] & 15) << 8) | ((u32)(v[6] & 15) << 12) |
           ((u32)(v[1] & 15) << 16) | ((u32)(v[3] & 15) << 20) | ((u32)(v[5] & 15) << 24) |
           ((u32)(v[7] & 15) << 28);
}
// Same from a little-endian u64 holding 8 bytes.
__device__ __forceinline__ u32 awq_word_u64(u64 b) {
    u32 w = 0;
    const int order[8] = {0, 2, 4, 6, 1, 3, 5, 7};
#pragma unroll
    for (int i = 0; i < 8; i++) w |= (u32)((b >> (8 * order[i])) & 15) << (4 * i);
    return w;
}

__device__ __forceinline__ u32 zero_point_of(u32 m, int bits) {
    return ((m >> 24) & 1u) ? (1u << (bits - 1)) : ((m >> 16) & 0xFFu);
}

// Tile: 256 output rows (n) x 32 inputs (k), 256 threads. Grid (K/32, ceil(N/256)): the
// k-tiles of the same rows run side by side, so the weight rows stream contiguously.
#define QP_BN 256
#define QP_BK 32
#define QP_STRIDE (QP_BN + 8)

template <int DT>
__device__ __forceinline__ void awq_quant_pack_impl(const void* w, const u32* qmeta, u32* qweight, u32* qzeros,
                                                    u16* scales, int N, int K, int G, int bits, const float* bs,
                                                    int bcols) {
    __shared__ __align__(16) u8 codes[QP_BK * QP_STRIDE];  // codes[k][n]
    const int tid = threadIdx.x;
    const int n0 = blockIdx.y * QP_BN;
    const int k0 = blockIdx.x * QP_BK;
    const int ng = K / G;
    const int grp = k0 / G;
    // Phase 1: quantize, 4 chunks of 8 consecutive k per thread.
#pragma unroll
    for (int it = 0; it < 4; it++) {
        int c = tid + 256 * it;
        int nl = c >> 2, kc = c & 3;
        int n = n0 + nl;
        if (n < N) {
            float v[8];
            load8<DT>(w, (i64)n * K + k0 + 8 * kc, v);
            if (bs != nullptr) {  // 8 consecutive k (k % 8 == 0) share one 128-wide block
                const float sc = block_scale(bs, bcols, n, k0 + 8 * kc);
#pragma unroll
                for (int j = 0; j < 8; j++) v[j] = v[j] * sc;
            }
            GroupParams p = qmeta_params(qmeta[(i64)n * ng + grp], bits);
#pragma unroll
            for (int j = 0; j < 8; j++) codes[(8 * kc + j) * QP_STRIDE + nl] = (u8)quant_code(v[j], p);
        }
    }
    __syncthreads();
    // Phase 2: pack, 4 words per thread: row k (32 rows) x word column (32 columns).
    const int NW = N / 8;
#pragma unroll
    for (int it = 0; it < 4; it++) {
        int idx = tid + 256 * it;
        int wc = idx & 31, kl = idx >> 5;
        int gwc = n0 / 8 + wc;
        if (gwc < NW) {
            u64 b = *(const u64*)(codes + kl * QP_STRIDE + 8 * wc);
            qweight[(i64)(k0 + kl) * NW + gwc] = awq_word_u64(b);
        }
    }
    // Group metadata once per group (the tile whose k0 starts the group).
    if (k0 % G == 0) {
        int n = n0 + tid;
        if (n < N) scales[(i64)grp * N + n] = f32_to_f16_rn(decode_scale((int)(short)(qmeta[(i64)n * ng + grp] & 0xFFFFu)));
        if (tid < 32) {
            int gwc = n0 / 8 + tid;
            if (gwc < NW) {
                u8 z[8];
#pragma unroll
                for (int j = 0; j < 8; j++) z[j] = (u8)zero_point_of(qmeta[(i64)(8 * gwc + j) * ng + grp], bits);
                qzeros[(i64)grp * NW + gwc] = awq_word8(z);
            }
        }
    }
}

#define FORGE_QPACK_ENTRY(SUF, DT)                                                                       \
    extern "C" __global__ void __launch_bounds__(256) awq_quant_pack_##SUF(                              \
        const void* w, const u32* qmeta, u32* qweight, u32* qzeros, u16* scales, int N, int K, int G,     \
        int bits, const float* bs, int bcols) {                                                          \
        awq_quant_pack_impl<DT>(w, qmeta, qweight, qzeros, scales, N, K, G, bits, bs, bcols);           \
    }
FORGE_QPACK_ENTRY(f32, FORGE_DT_F32)
FORGE_QPACK_ENTRY(f16, FORGE_DT_F16)
FORGE_QPACK_ENTRY(bf16, FORGE_DT_BF16)
FORGE_QPACK_ENTRY(f8e4m3, FORGE_DT_F8E4M3)

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
