// common.cuh — shared helpers of the 4bit-forge kernels.
//
// Compiled at run time by NVRTC (crates/forge-cuda), with `--fmad=false`, no fast math,
// and WITHOUT any CUDA header: halves and bf16 are handled as raw 16-bit patterns and
// converted with PTX `cvt`. The runtime prepends a generated header that defines the
// tables FORGE_THRESH_BITS / FORGE_POW2_BITS / FORGE_E4M3_BITS (copied bit for bit from
// forge-core; POW2 in constant memory, the others in global memory), so CPU and GPU use
// identical constants. The arithmetic mirrors docs/numerics.md and forge-core exactly; keep
// the two in sync.

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef int i32;
typedef unsigned long long u64;
typedef long long i64;

#define FORGE_DT_F32 0
#define FORGE_DT_F16 1
#define FORGE_DT_BF16 2
#define FORGE_DT_F8E4M3 3

#define FORGE_EPS 1e-9f

// Smallest stored scale, 2^-24 (smallest positive fp16); mirrors forge_core::grid::SCALE_MIN.
__device__ __forceinline__ float forge_scale_min() { return __uint_as_float(0x33800000u); }

__device__ __forceinline__ float f_inf() { return __int_as_float(0x7f800000); }

// ---- element conversions (exact) -------------------------------------------------------
__device__ __forceinline__ float f16_to_f32(u16 h) {
    float f;
    asm("{ .reg .b16 t; mov.b16 t, %1; cvt.f32.f16 %0, t; }" : "=f"(f) : "h"(h));
    return f;
}
__device__ __forceinline__ u16 f32_to_f16_rn(float f) {
    u16 h;
    asm("{ .reg .b16 t; cvt.rn.f16.f32 t, %1; mov.b16 %0, t; }" : "=h"(h) : "f"(f));
    return h;
}
__device__ __forceinline__ float bf16_to_f32(u16 h) { return __uint_as_float(((u32)h) << 16); }
__device__ __forceinline__ u16 f32_to_bf16_rn(float f) {
    u16 h;
    asm("{ .reg .b16 t; cvt.rn.bf16.f32 t, %1; mov.b16 %0, t; }" : "=h"(h) : "f"(f));
    return h;
}
// A 16-bit activation, bf16 when `bf` else f16, to fp32 and back (round to nearest even).
__device__ __forceinline__ float act_to_f32(u16 h, bool bf) { return bf ? bf16_to_f32(h) : f16_to_f32(h); }
__device__ __forceinline__ u16 f32_to_act_rn(float f, bool bf) { return bf ? f32_to_bf16_rn(f) : f32_to_f16_rn(f); }
// A table read (1 KB, stays in L1): measured faster than decoding the bits arithmetically
// (fused FP8 pack of 7168x18432 on an H200: 137 vs 148 us). sm_89+ use the hardware
// conversion instead (e4m3x8_to_f32; the same pack on an H100: 129.8 vs 136.2 us).
__device__ __forceinline__ float e4m3_to_f32(u8 b) { return __uint_as_float(FORGE_E4M3_BITS[b]); }

// FP8 block scales (DeepSeek's `weight_scale_inv`): element [r, c] of an F8_E4M3 weight is
// e4m3(x[r, c]) * bs[(r / 128) * bcols + c / 128], one f32 multiply as
// forge_io::Checkpoint::dequantized_f32 computes it (bit-identical). bs null: no scale.
#define FORGE_FP8_BLOCK 128
__device__ __forceinline__ float block_scale(const float* bs, int bcols, i64 r, i64 c) {
    return bs[(r / FORGE_FP8_BLOCK) * bcols + c / FORGE_FP8_BLOCK];
}

template <int DT> struct Elem;
template <> struct Elem<FORGE_DT_F32> {
    typedef float T;
    static __device__ __forceinline__ float load(const void* p, i64 i) { return ((const float*)p)[i]; }
};
template <> struct Elem<FORGE_DT_F16> {
    typedef u16 T;
    static __device__ __forceinline__ float load(const void* p, i64 i) { return f16_to_f32(((const u16*)p)[i]); }
};
template <> struct Elem<FORGE_DT_BF16> {
    typedef u16 T;
    static __device__ __forceinline__ float load(const void* p, i64 i) { return bf16_to_f32(((const u16*)p)[i]); }
};
template <> struct Elem<FORGE_DT_F8E4M3> {
    typedef u8 T;
    static __device__ __forceinline__ float load(const void* p, i64 i) { return e4m3_to_f32(((const u8*)p)[i]); }
};

// Bytes per element of DT.
template <int DT> struct ElemBytes {
    enum { v = DT == FORGE_DT_F32 ? 4 : (DT == FORGE_DT_F8E4M3 ? 1 : 2) };
};

#if __CUDA_ARCH__ >= 890
// 4 E4M3 bytes (little-endian in w) as two f16x2 (bytes 0, 1 in lo; 2, 3 in hi), by the
// hardware conversion, two bytes at a time: E4M3 -> f16 is exact (f16 holds every E4M3 value,
// subnormals included).
__device__ __forceinline__ void e4m3x4_to_f16x2(u32 w, u32& lo, u32& hi) {
    asm("{ .reg .b16 l, h; mov.b32 {l, h}, %2; cvt.rn.f16x2.e4m3x2 %0, l; cvt.rn.f16x2.e4m3x2 %1, h; }"
        : "=r"(lo), "=r"(hi)
        : "r"(w));
}
#endif

// 8 E4M3 bytes (little-endian in a, b) as f32.
__device__ __forceinline__ void e4m3x8_to_f32(u32 a, u32 b, float v[8]) {
#if __CUDA_ARCH__ >= 890
    // The hardware conversion to f16x2 (exact), then f16 -> f32 (exact too).
    const u32 w[2] = {a, b};
#pragma unroll
    for (int j = 0; j < 2; j++) {
        u32 lo, hi;
        e4m3x4_to_f16x2(w[j], lo, hi);
        v[4 * j] = f16_to_f32((u16)(lo & 0xFFFFu));
        v[4 * j + 1] = f16_to_f32((u16)(lo >> 16));
        v[4 * j + 2] = f16_to_f32((u16)(hi & 0xFFFFu));
        v[4 * j + 3] = f16_to_f32((u16)(hi >> 16));
    }
#else
#pragma unroll
    for (int j = 0; j < 4; j++) { v[j] = e4m3_to_f32((a >> (8 * j)) & 0xFF); v[4 + j] = e4m3_to_f32((b >> (8 * j)) & 0xFF); }
#endif
}

// Elements 8q..8q+7 of a run of raw 16-byte words `raw` (a row's bytes as loaded) as f32.
template <int DT> __device__ __forceinline__ void decode_run(const uint4* raw, int q, float v[8]);
template <> __device__ __forceinline__ void decode_run<FORGE_DT_F32>(const uint4* raw, int q, float v[8]) {
    const uint4 a = raw[2 * q], b = raw[2 * q + 1];
    const u32 w[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
    for (int j = 0; j < 8; j++) v[j] = __uint_as_float(w[j]);
}
template <> __device__ __forceinline__ void decode_run<FORGE_DT_F16>(const uint4* raw, int q, float v[8]) {
    const uint4 a = raw[q];
    const u32 w[4] = {a.x, a.y, a.z, a.w};
#pragma unroll
    for (int j = 0; j < 4; j++) { v[2 * j] = f16_to_f32((u16)(w[j] & 0xFFFF)); v[2 * j + 1] = f16_to_f32((u16)(w[j] >> 16)); }
}
template <> __device__ __forceinline__ void decode_run<FORGE_DT_BF16>(const uint4* raw, int q, float v[8]) {
    const uint4 a = raw[q];
    const u32 w[4] = {a.x, a.y, a.z, a.w};
#pragma unroll
    for (int j = 0; j < 4; j++) { v[2 * j] = __uint_as_float(w[j] << 16); v[2 * j + 1] = __uint_as_float(w[j] & 0xFFFF0000u); }
}
template <> __device__ __forceinline__ void decode_run<FORGE_DT_F8E4M3>(const uint4* raw, int q, float v[8]) {
    const uint4 a = raw[q >> 1];
    if (q & 1) e4m3x8_to_f32(a.z, a.w, v);
    else e4m3x8_to_f32(a.x, a.y, v);
}

// 8 consecutive elements starting at element index i (i multiple of 8, 16-byte aligned
// for 16-bit types, 32-byte for f32, 8-byte for fp8).
template <int DT> __device__ __forceinline__ void load8(const void* p, i64 i, float v[8]) {
    const uint4* q = (const uint4*)((const u8*)p + i * ElemBytes<DT>::v);
    uint4 raw[2];
    raw[0] = q[0];
    if (DT == FORGE_DT_F32) raw[1] = q[1];
    decode_run<DT>(raw, 0, v);
}
template <> __device__ __forceinline__ void load8<FORGE_DT_F8E4M3>(const void* p, i64 i, float v[8]) {
    uint2 a = *(const uint2*)((const u8*)p + i);
    e4m3x8_to_f32(a.x, a.y, v);
}

// ---- AWQ nibble order ----------------------------------------------------------------------
// Nibble i of an AWQ word holds column awq_col(i) of its 8 (ORDER = {0,2,4,6,1,3,5,7}); column
// j sits at nibble awq_nibble(j), the inverse.
__device__ __forceinline__ int awq_col(int i) { return ((i & 3) << 1) | (i >> 2); }
__device__ __forceinline__ int awq_nibble(int j) { return (j >> 1) | ((j & 1) << 2); }

// ---- qmeta4 ----------------------------------------------------------------------------
__device__ __forceinline__ float pow2i(int e) { return __uint_as_float(((u32)(e + 127)) << 23); }

// Mirrors forge_core::qmeta::encode_log2_q88.
__device__ __forceinline__ int encode_log2_q88(float s) {
    if (s != s || s == f_inf()) return 32767;
    if (s <= 0.0f) return -32768;
    u32 bits = __float_as_uint(s);
    int eadj = 0;
    if (((bits >> 23) & 0xFF) == 0) {
        bits = __float_as_uint(s * 8388608.0f);
        eadj = -23;
    }
    int e = (int)((bits >> 23) & 0xFF) - 127 + eadj;
    float m = __uint_as_float((bits & 0x007FFFFFu) | 0x3F800000u);
    // The partition point of THRESH <= m (THRESH[k] = f32(2^((k + 0.5)/256)), m in [1, 2)) is
    // round(256·log2 m): the hardware log2 puts a first guess within one of it, and the table
    // then settles it exactly (two independent reads where a binary search made eight
    // dependent ones; the loops make the result exact whatever the guess).
    int lo = min(256, max(0, (int)(256.0f * __log2f(m) + 0.5f)));
    while (lo > 0 && __uint_as_float(FORGE_THRESH_BITS[lo - 1]) > m) lo--;
    while (lo < 256 && __uint_as_float(FORGE_THRESH_BITS[lo]) <= m) lo++;
    int q = 256 * e + lo;
    return q < -32768 ? -32768 : (q > 32767 ? 32767 : q);
}

// Mirrors forge_core::qmeta::decode_scale.
__device__ __forceinline__ float decode_scale(int q) {
    float m = __uint_as_float(FORGE_POW2_BITS[q & 255]);
    int e = q >> 8;
    if (e < -126) return (m * pow2i(e + 64)) * pow2i(-64);
    return m * pow2i(e);
}

__device__ __forceinline__ u32 make_qmeta(int q88, u32 zero, u32 flags) {
    return ((u32)q88 & 0xFFFFu) | ((zero & 0xFFu) << 16) | ((flags & 0xFFu) << 24);
}

struct GroupParams { float scale, inv, zero, maxq; };

__device__ __forceinline__ GroupParams qmeta_params(u32 m, int bits) {
    GroupParams p;
    p.scale = decode_scale((int)(short)(m & 0xFFFFu));
    p.inv = 1.0f / p.scale;
    u32 flags = m >> 24;
    p.zero = (flags & 1u) ? (float)(1u << (bits - 1)) : (float)((m >> 16) & 0xFFu);
    p.maxq = (float)((1u << bits) - 1u);
    return p;
}

// 1.5·2^23: for |y| < 2^22, y + FORGE_ROUND holds rint(y) in its low mantissa bits (its bits are
// FORGE_ROUND_BITS + n) and (y + FORGE_ROUND) − FORGE_ROUND is that integer as a float: integers
// cross between floats and ints without a conversion instruction (1/8 of the FMA issue rate).
#define FORGE_ROUND 12582912.0f
#define FORGE_ROUND_BITS 0x4B400000u
__device__ __forceinline__ float int_f32(int k) { return __uint_as_float(FORGE_ROUND_BITS + (u32)k) - FORGE_ROUND; }
// clamp(rint(t), 0, maxq) for maxq < 2^22 without a conversion instruction: t + 1.5·2^23 − 1.5·2^23
// is rint(t) for |t| < 2^22, and any larger |t| is clamped to the same end.
__device__ __forceinline__ float rint_clamp(float t, float maxq) {
    return fminf(fmaxf((t + FORGE_ROUND) - FORGE_ROUND, 0.0f), maxq);
}

// x * inv + z  (separate multiply and add; --fmad=false), the value the quantizer rounds.
__device__ __forceinline__ float quant_arg(float x, const GroupParams& p) {
    const float t = x * p.inv;
    return t + p.zero;
}
// q = clamp(rne(x * inv + z), 0, maxq)
__device__ __forceinline__ float quant_code(float x, const GroupParams& p) {
    return rint_clamp(quant_arg(x, p), p.maxq);
}
// The same code as an integer: the unsigned conversion rounds to nearest even and saturates
// (negative values and -Inf to 0, +Inf to UINT_MAX, NaN to 0, as quant_code's clamp does),
// leaving one min.
__device__ __forceinline__ u32 quant_code_u(float x, const GroupParams& p, u32 maxq) {
    return min(__float2uint_rn(quant_arg(x, p)), maxq);
}
// quant_code_u of x0 on grid p0 and x1 on grid p1 as one u16x2 pair (x0 low). On sm_90 each is
// converted to u16 (nearest even, saturating: NaN and negatives 0, large values 65535) and both
// are clamped to maxq by one vector min — one ALU min per two codes (VIMNMX.U16x2); elsewhere
// (no vector min) two quant_code_u.
__device__ __forceinline__ u32 quant_code_u16x2(float x0, const GroupParams& p0, float x1, const GroupParams& p1,
                                                u32 maxq) {
#if __CUDA_ARCH__ >= 900
    u16 c0, c1;
    asm("cvt.rni.u16.f32 %0, %1;" : "=h"(c0) : "f"(quant_arg(x0, p0)));
    asm("cvt.rni.u16.f32 %0, %1;" : "=h"(c1) : "f"(quant_arg(x1, p1)));
    return __vminu2((u32)c0 | ((u32)c1 << 16), maxq * 0x10001u);
#else
    return quant_code_u(x0, p0, maxq) + (quant_code_u(x1, p1, maxq) << 16);  // codes <= maxq < 2^16: + is |
#endif
}
__device__ __forceinline__ float dequant(float q, const GroupParams& p) { return (q - p.zero) * p.scale; }

// ---- portable pow (mirrors forge_core::pmath) -------------------------------------------
// Only + − *, explicit fmaf and bit moves: no division and no float <-> int conversion (both
// issue at 1/8 of the FMA rate). Integers cross through the bits of y + 1.5·2^23.

__device__ __forceinline__ float log2_poly(float a) {
    const bool sub = a < 1.17549435e-38f;
    const float a2 = sub ? a * 8388608.0f : a;
    const u32 ix = __float_as_uint(a2) + (0x3F800000u - 0x3F3504F3u);
    const float m = __uint_as_float((ix & 0x007FFFFFu) + 0x3F3504F3u);
    const int k = (int)(ix >> 23) - (sub ? 127 + 23 : 127);
    const float f = m - 1.0f;
    const float d = m + 1.0f;
    float r = fmaf(-0.23901331f, d, 0.98505586f);
    r = fmaf(r, fmaf(-d, r, 1.0f), r);
    float t = f * r;
    t = fmaf(r, fmaf(-t, d, f), t);
    const float t2 = t * t;
    const float s = fmaf(fmaf(0.59577274f, t2, 0.9615886f), t2, 2.8853905f);
    return fmaf(t, s, int_f32(k));
}

__device__ __forceinline__ float exp2_poly(float y) {
    const float yc = fminf(fmaxf(y, -127.0f), 127.0f);
    const float v = yc + FORGE_ROUND;
    const float f = yc - (v - FORGE_ROUND);
    float q = fmaf(1.3333524e-3f, f, 9.666245e-3f);
    q = fmaf(q, f, 5.5505004e-2f);
    q = fmaf(q, f, 0.24022351f);
    q = fmaf(q, f, 0.6931471f);
    const float p = fmaf(f, q, 1.0f);
    return p * __uint_as_float((__float_as_uint(v) - FORGE_ROUND_BITS + 127u) << 23);
}

__device__ __forceinline__ float pow_p(float a, float p) { return a == 0.0f ? 0.0f : exp2_poly(p * log2_poly(a)); }

// ---- register-blocked GEMM micro-tile ------------------------------------------------------
// acc[p][q] += a[p]·b[q] as one fused multiply-add each: the modules are compiled with
// --fmad=false (the bit-exact grid kernels need it), which would split `acc + a*b` in two.
// The product is commutative inside the fma, so a symmetric accumulation stays symmetric.
__device__ __forceinline__ void fma_outer4x4(float (&acc)[4][4], const float (&a)[4], const float (&b)[4]) {
#pragma unroll
    for (int p = 0; p < 4; p++)
#pragma unroll
        for (int q = 0; q < 4; q++) acc[p][q] = fmaf(a[p], b[q], acc[p][q]);
}

// ---- misc ------------------------------------------------------------------------------
// Programmatic dependent launch (sm_90+; no-ops before). A kernel launched after this one with
// programmatic stream serialization (ops.rs: the wgmma GEMM, the split-K reduction) may be
// scheduled once every block of this grid has called pdl_launch_dependents (or exited), so its
// launch overlaps this grid's tail; its pdl_wait returns when this grid has finished and its
// writes are visible.
__device__ __forceinline__ void pdl_launch_dependents() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_wait() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

// Streamed weights (read once, by one warp: a GEMV's): 4, 8 or 16 read-only bytes loaded
// without allocating in L1, which keeps L1 for the data the co-resident blocks share (x,
// metadata).
__device__ __forceinline__ u32 ld_stream(const u32* p) {
    u32 v;
    asm("ld.global.nc.L1::no_allocate.u32 %0, [%1];" : "=r"(v) : "l"(p));
    return v;
}
__device__ __forceinline__ uint2 ld_stream(const uint2* p) {
    uint2 v;
    asm("ld.global.nc.L1::no_allocate.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p));
    return v;
}
__device__ __forceinline__ uint4 ld_stream(const uint4* p) {
    uint4 v;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
        : "l"(p));
    return v;
}
// One line's L2 prefetch hint by this thread.
__device__ __forceinline__ void prefetch_l2(const void* p) { asm volatile("prefetch.global.L2 [%0];\n" ::"l"(p)); }

__device__ __forceinline__ u32 smem_u32(const void* p) {
    u32 r;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(r) : "l"(p));
    return r;
}

// 32 / 16 bits from a shared-window address (volatile: kept in order with the barriers and
// fences around them, which are volatile asm or barrier intrinsics too).
__device__ __forceinline__ u32 lds_u32(u32 a) {
    u32 v;
    asm volatile("ld.shared.u32 %0, [%1];" : "=r"(v) : "r"(a));
    return v;
}
__device__ __forceinline__ u16 lds_u16(u32 a) {
    u16 v;
    asm volatile("ld.shared.u16 %0, [%1];" : "=h"(v) : "r"(a));
    return v;
}

// ---- tensor cores (sm_80+): cp.async, ldmatrix, mma.sync (m16n8k8 TF32, m16n8k16 f16/bf16), fp32 accumulate ----
// 16 bytes global -> shared at a shared-window address (src_bytes < 16 zero-fills the rest).
__device__ __forceinline__ void cp_async16_s(u32 saddr, const void* gmem, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(saddr), "l"(gmem), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, int src_bytes) {
    cp_async16_s(smem_u32(smem), gmem, src_bytes);
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

__device__ __forceinline__ void ldmatrix_x4(u32 r[4], const void* smem) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_u32(smem)));
}
// The same four 8x8 matrices, each transposed on the way (lane l gets elements (2(l%4), l/4)
// and (2(l%4)+1, l/4) of its matrix: pairs run down a stored column).
__device__ __forceinline__ void ldmatrix_x4_trans(u32 r[4], const void* smem) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_u32(smem)));
}

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// Hopper wgmma shared-memory matrix descriptor: 128-byte swizzle, 8-row groups 1024 bytes
// apart (SBO), `lbo` bytes between the two halves of an MN-major operand (unused by K-major).
__device__ __forceinline__ u64 hw_desc(const void* p, u32 lbo) {
    const u64 a = smem_u32(p);
    return ((a & 0x3FFFF) >> 4) | ((u64)(lbo >> 4) << 16) | ((u64)(1024 >> 4) << 32) | (1ull << 62);
}
// The 64 fp32 accumulators d[0..64) of an m64n128 wgmma in inline asm: their register list in
// the instruction text (operands %0..%63) and the operands that bind them, read and written.
#define FORGE_WG_ACC_REGS "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"
#define FORGE_WG_ACC_OPS(d) \
    "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
// The 128 accumulators of an m64n256 wgmma, bound as two halves of 64 (columns 0-127 and
// 128-255, each laid out as an m64n128's): FORGE_WG_ACC_OPS(lo), FORGE_WG_ACC_OPS(hi).
#define FORGE_WG_ACC256_REGS "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}"
// The same 128 bound as one array (an m64n256 with A from registers).
#define FORGE_WG_ACC256_OPS(d) FORGE_WG_ACC_OPS(d), FORGE_WG_ACC_OPS((d + 64))
// The same for the 32 of an m64n64 wgmma, the 16 of an m64n32 and the 8 of an m64n16.
#define FORGE_WG_ACC32_REGS "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define FORGE_WG_ACC32_OPS(d) \
    "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
#define FORGE_WG_ACC16_REGS "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}"
#define FORGE_WG_ACC16_OPS(d) \
    "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
#define FORGE_WG_ACC8_REGS "{%0, %1, %2, %3, %4, %5, %6, %7}"
#define FORGE_WG_ACC8_OPS(d) "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
// Pins the accumulators: their definitions (the zeroing) stay before the MMA pipeline and
// their uses after it (else ptxas serializes every wgmma, C7515).
__device__ __forceinline__ void wg_fence_acc(float (&d)[128]) { asm volatile("" : FORGE_WG_ACC256_OPS(d)::"memory"); }
__device__ __forceinline__ void wg_fence_acc(float (&d)[64]) { asm volatile("" : FORGE_WG_ACC_OPS(d)::"memory"); }
__device__ __forceinline__ void wg_fence_acc(float (&d)[32]) { asm volatile("" : FORGE_WG_ACC32_OPS(d)::"memory"); }
__device__ __forceinline__ void wg_fence_acc(float (&d)[16]) { asm volatile("" : FORGE_WG_ACC16_OPS(d)::"memory"); }
__device__ __forceinline__ void wg_fence_acc(float (&d)[8]) { asm volatile("" : FORGE_WG_ACC8_OPS(d)::"memory"); }
// mbarriers (shared-window addresses): init with the number of arrivals a phase takes; wait
// for the phase of the given parity to complete; arrive; arrive when this thread's earlier
// cp.async copies have landed (counted in the init count: .noinc).
__device__ __forceinline__ void mbar_init(u32 bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
    asm volatile(
        "{\n.reg .pred p;\nWAIT:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
        "@!p bra WAIT;\n}\n" ::"r"(bar),
        "r"(parity)
        : "memory");
}
__device__ __forceinline__ void mbar_arrive(u32 bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void cp_async_mbar_arrive(u32 bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}
// Thread block clusters (a launch with a cluster dimension, ops.rs): every thread of every
// block of the cluster arrives, and waits for all the others; the release / acquire pair makes
// each block's earlier shared-memory writes visible to the other blocks' reads after it.
__device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}
// cluster_sync without ordering this thread's memory accesses (no release: its global stores
// are not waited for), for a block that must not exit before the rest of its cluster has read
// its shared memory: a thread's loads have returned once it has used their values.
__device__ __forceinline__ void cluster_sync_relaxed() {
    asm volatile("barrier.cluster.arrive.relaxed.aligned;\nbarrier.cluster.wait.aligned;\n" ::: "memory");
}
// This block's rank in its cluster.
__device__ __forceinline__ u32 cluster_ctarank() {
    u32 r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
    return r;
}
// 16 bytes at shared offset `addr` (this block's layout) of cluster block `rank`'s shared
// memory (distributed shared memory; the block may be this one).
__device__ __forceinline__ float4 ld_cluster_f4(u32 addr, u32 rank) {
    u32 a;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(a) : "r"(addr), "r"(rank));
    float4 v;
    asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];\n"
                 : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
                 : "r"(a)
                 : "memory");
    return v;
}
#endif

// d += a·b, mma.m16n8k8 with TF32 operands (the MMA reads each register's top 19 bits) and
// fp32 accumulate.
__device__ __forceinline__ void mma_tf32(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

template <bool BF>
__device__ __forceinline__ void mma16816(float c[4], const u32 a[4], u32 b0, u32 b1) {
    if (BF) {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
            "{%0,%1,%2,%3};\n"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    } else {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
            "{%0,%1,%2,%3};\n"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
}
