/* quant_scalar.h - the scalar number conversions and quantization steps of pagedkv,
 * shared by the CPU loops (pagedkv/ops/quant_rows.h, compiled as C by the Cython
 * build, which adds this folder to its include path) and the CUDA kernels
 * (common.cuh: NVRTC finds this file in the pagedkv._cuda_src package data; the host
 * emulation builds it with g++ through emulate.h).
 *
 * One definition, so the CPU ops and the kernels cannot drift apart: each function is
 * the arithmetic of pagedkv/format/quant.py bit for bit (float32 throughout, each step
 * rounding once: the CPU build has -ffp-contract=off, NVRTC --fmad=false, and the
 * products and sums below go through PKV_MUL/PKV_ADD, the _rn intrinsics on a GPU).
 * They are written without branches on the value's class (every case computed, one
 * selected with bit masks), so that the CPU row loops vectorize; a GPU runs the selects
 * without divergence. tests/test_cpu_quant.py and tests/test_kernels_emulated.py sweep
 * them against torch's casts over every rounding case.
 */
#ifndef PAGEDKV_QUANT_SCALAR_H
#define PAGEDKV_QUANT_SCALAR_H

#if defined(__CUDACC__) || defined(__CUDACC_RTC__) || defined(PAGEDKV_EMULATE)
/* a kernel source (NVRTC or the g++ emulation, whose emulate.h maps these names) */
#define PKV_HD __host__ __device__ __forceinline__
#define PKV_BITS(f) __float_as_uint(f)
#define PKV_FLOAT(u) __uint_as_float(u)
#define PKV_MUL(a, b) __fmul_rn((a), (b))
#define PKV_ADD(a, b) __fadd_rn((a), (b))
#define PKV_SUB(a, b) __fsub_rn((a), (b))
#define PKV_DIV(a, b) __fdiv_rn((a), (b))
typedef long long pkv_i64;
typedef int pkv_i32;
typedef unsigned int pkv_u32;
typedef unsigned short pkv_u16;
typedef unsigned char pkv_u8;
#else
/* the CPU ops (C) */
#include <stdint.h>
#include <string.h>
#define PKV_HD static inline
#define PKV_BITS(f) pkv_bits_of(f)
#define PKV_FLOAT(u) pkv_float_of(u)
#define PKV_MUL(a, b) ((a) * (b))
#define PKV_ADD(a, b) ((a) + (b))
#define PKV_SUB(a, b) ((a) - (b))
#define PKV_DIV(a, b) ((a) / (b))
typedef int64_t pkv_i64;
typedef int32_t pkv_i32;
typedef uint32_t pkv_u32;
typedef uint16_t pkv_u16;
typedef uint8_t pkv_u8;
static inline pkv_u32 pkv_bits_of(float f) { pkv_u32 u; memcpy(&u, &f, 4); return u; }
static inline float pkv_float_of(pkv_u32 u) { float f; memcpy(&f, &u, 4); return f; }
#endif

/* storage formats (the kernels' template argument, the CPU ops' qtype) */
#define PKV_Q_E4M3 0
#define PKV_Q_E5M2 1
#define PKV_Q_INT8 2
#define PKV_Q_INT4 3
#define PKV_Q_INT3 4

/* ---- float bits ---------------------------------------------------------------- */

PKV_HD pkv_u32 pkv_bits(float f) { return PKV_BITS(f); }
PKV_HD float pkv_float(pkv_u32 u) { return PKV_FLOAT(u); }
PKV_HD int pkv_isfinite(float x) { return (pkv_bits(x) & 0x7f800000u) != 0x7f800000u; }
PKV_HD int pkv_isnan(float x) { return (pkv_bits(x) & 0x7fffffffu) > 0x7f800000u; }
PKV_HD float pkv_fabs(float x) { return pkv_float(pkv_bits(x) & 0x7fffffffu); }

/* round half to even for 0 <= x < 2^23 (adding 2^23 leaves no fraction bits) */
PKV_HD float pkv_rint_small(float x) { return PKV_SUB(PKV_ADD(x, 8388608.0f), 8388608.0f); }

/* c ? a : b for c in {0, 1}, as bit masks */
PKV_HD pkv_u32 pkv_sel(pkv_u32 c, pkv_u32 a, pkv_u32 b) {
    const pkv_u32 m = 0u - c;
    return (a & m) | (b & ~m);
}

/* ---- model dtypes: float16 and bfloat16 as raw bits ------------------------------ */

PKV_HD float pkv_f16_to_f32(pkv_u16 h) {
    const pkv_u32 sign = (pkv_u32)(h & 0x8000u) << 16, m = h & 0x7fffu, mant = h & 0x3ffu;
    const pkv_u32 normal = (m << 13) + (112u << 23);
    const pkv_u32 sub = pkv_bits(PKV_MUL((float)(pkv_i32)mant, 5.9604644775390625e-8f));  /* exact */
    const pkv_u32 special = 0x7f800000u | (mant << 13) | pkv_sel(mant != 0u, 0x400000u, 0u);  /* inf, quiet NaN */
    pkv_u32 u = pkv_sel(m >= 0x400u, normal, sub);
    u = pkv_sel(m >= 0x7c00u, special, u);
    return pkv_float(sign | u);
}

/* Round to nearest even. A NaN stays a quiet NaN with its sign and top payload bits
 * (x86 F16C's rule, which torch's CPU cast follows); NaN payloads are not part of
 * pagedkv's contract (torch's own CPU and CUDA casts differ there). */
PKV_HD pkv_u16 pkv_f32_to_f16(float f) {
    const pkv_u32 u = pkv_bits(f), sign = (u >> 16) & 0x8000u, a = u & 0x7fffffffu;
    const pkv_i32 ai = (pkv_i32)a;
    const pkv_u32 nan = 0x7e00u | ((a >> 13) & 0x3ffu);
    const pkv_u32 normal = ((a + 0xfffu + ((a >> 13) & 1u)) >> 13) - (112u << 10);
    /* subnormal result: rint(|f| * 2^24) in [0, 1024] (a capped so the product stays small) */
    const float small = pkv_float((pkv_u32)(ai < 0x38800000 ? ai : 0x38800000));
    const pkv_u32 sub = (pkv_u32)(pkv_i32)pkv_rint_small(PKV_MUL(small, 16777216.0f));
    pkv_u32 r = pkv_sel(ai >= 0x38800000, normal, sub);
    r = pkv_sel(ai >= 0x47800000, 0x7c00u, r);
    r = pkv_sel(ai > 0x7f800000, nan, r);
    return (pkv_u16)(sign | r);
}

PKV_HD float pkv_bf16_to_f32(pkv_u16 b) { return pkv_float((pkv_u32)b << 16); }

/* Round to nearest even; a NaN is truncated and made quiet (sign, top payload bits). */
PKV_HD pkv_u16 pkv_f32_to_bf16(float f) {
    const pkv_u32 u = pkv_bits(f);
    const pkv_u32 rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    return (pkv_u16)pkv_sel((pkv_i32)(u & 0x7fffffffu) > 0x7f800000, (u >> 16) | 0x0040u, rounded);
}

/* float32 -> bfloat16 rounded toward +inf (up = 1) or -inf (up = 0): the magnitude is
 * truncated when that moves toward the wanted infinity, else rounded away from zero
 * (overflowing to infinity past bfloat16's range); the sign stays; NaN -> 0x7fc0.
 * int3's parameters are rounded outward so (pagedkv/format/quant.py). */
PKV_HD pkv_u16 pkv_f32_to_bf16_directed(float f, pkv_u32 up) {
    const pkv_u32 u = pkv_bits(f), a = u & 0x7fffffffu, neg = u >> 31;
    const pkv_u32 mag = pkv_sel(neg != up, (a + 0xffffu) & 0xffff0000u, a & 0xffff0000u);
    return (pkv_u16)pkv_sel(a > 0x7f800000u, 0x7fc0u, ((u & 0x80000000u) | mag) >> 16);
}

/* ---- fp8 (OCP e4m3fn, e5m2) ---------------------------------------------------------
 * float -> fp8 saturates: torch's cast of clamp(x, -FMAX, FMAX), and cuda_fp8.h's
 * __NV_SATFINITE: round to nearest even, |x| beyond FMAX (inf included) -> +-FMAX,
 * NaN -> 0x7f with x's sign. */

PKV_HD pkv_u8 pkv_f32_to_e4m3(float f) {
    const pkv_u32 u = pkv_bits(f), sign = (u >> 24) & 0x80u, a = u & 0x7fffffffu;
    const pkv_i32 ai = (pkv_i32)a;
    const pkv_u32 normal = ((a + 0x7ffffu + ((a >> 20) & 1u)) >> 20) - (120u << 3);  /* >= 2^-6 */
    const float small = pkv_float((pkv_u32)(ai < 0x3c800000 ? ai : 0x3c800000));
    const pkv_u32 sub = (pkv_u32)(pkv_i32)pkv_rint_small(PKV_MUL(small, 512.0f));  /* rint(|f| * 2^9) in [0, 8] */
    pkv_u32 r = pkv_sel(ai >= 0x3c800000, normal, sub);
    r = pkv_sel(ai >= 0x43e00000, 0x7eu, r);  /* >= 448 */
    r = pkv_sel(ai > 0x7f800000, 0x7fu, r);
    return (pkv_u8)(sign | r);
}

PKV_HD pkv_u8 pkv_f32_to_e5m2(float f) {
    const pkv_u32 u = pkv_bits(f), sign = (u >> 24) & 0x80u, a = u & 0x7fffffffu;
    const pkv_i32 ai = (pkv_i32)a;
    const pkv_u32 normal = ((a + 0xfffffu + ((a >> 21) & 1u)) >> 21) - (112u << 2);  /* >= 2^-14 */
    const float small = pkv_float((pkv_u32)(ai < 0x38800000 ? ai : 0x38800000));
    const pkv_u32 sub = (pkv_u32)(pkv_i32)pkv_rint_small(PKV_MUL(small, 65536.0f));  /* rint(|f| * 2^16) in [0, 4] */
    pkv_u32 r = pkv_sel(ai >= 0x38800000, normal, sub);
    r = pkv_sel(ai >= 0x47600000, 0x7bu, r);  /* >= 57344 */
    r = pkv_sel(ai > 0x7f800000, 0x7fu, r);
    return (pkv_u8)(sign | r);
}

/* fp8 code -> float32 (exact). Subnormal codes go through an exact int -> float
 * conversion, never through a float32 subnormal (which a thread with
 * denormals-are-zero set would read as 0). */
PKV_HD float pkv_e4m3_to_f32(pkv_u8 q) {
    const pkv_u32 sign = (pkv_u32)(q & 0x80u) << 24, m = q & 0x7fu;
    pkv_u32 u = pkv_sel(m > 7u, (m << 20) + (120u << 23),
                        pkv_bits(PKV_MUL((float)(pkv_i32)(m & 7u), 0.001953125f)));
    u = pkv_sel(m == 0x7fu, 0x7ff00000u, u);  /* the only NaN (quiet; the bits torch gives) */
    return pkv_float(u | sign);
}

/* e5m2 is the upper byte of an IEEE half */
PKV_HD float pkv_e5m2_to_f32(pkv_u8 q) {
    const pkv_u32 sign = (pkv_u32)(q & 0x80u) << 24, m = q & 0x7fu;
    pkv_u32 u = pkv_sel(m > 3u, (m << 21) + (112u << 23),
                        pkv_bits(PKV_MUL((float)(pkv_i32)(m & 3u), 1.52587890625e-05f)));
    /* inf, or NaN made quiet (as torch and the hardware do) */
    u = pkv_sel(m >= 0x7cu, 0x7f800000u | ((m & 3u) << 21) | pkv_sel(m > 0x7cu, 0x400000u, 0u), u);
    return pkv_float(u | sign);
}

/* ---- quantization steps ----------------------------------------------------------- */

/* top code of the asymmetric formats: int8 255 (stored as code - 128), int4 15, int3 7 */
#define PKV_TOP_INT8 255.0f
#define PKV_TOP_INT4 15.0f
#define PKV_TOP_INT3 7.0f

/* a group's scale when its range gives none (zero or not finite) */
PKV_HD float pkv_fix_scale(float s) { return (s == 0.0f || !pkv_isfinite(s)) ? 1.0f : s; }

/* an asymmetric code from v = (x - zero) / scale: NaN -> 0, clamped to [0, top], then
 * rounded half to even (clamp then round == round then clamp: top is an integer) */
PKV_HD pkv_u32 pkv_int_code(float v, float top) {
    v = v != v ? 0.0f : v;
    v = v < 0.0f ? 0.0f : (v > top ? top : v);
    return (pkv_u32)(pkv_i32)pkv_rint_small(v);
}

/* code -> value of the asymmetric formats: float(c) * scale + zero (two roundings);
 * int8's c is its stored byte + 128 */
PKV_HD float pkv_affine(float c, float scale, float zero) { return PKV_ADD(PKV_MUL(c, scale), zero); }
PKV_HD float pkv_int8_value(pkv_u8 q) { return (float)((pkv_i32)(signed char)q + 128); }

/* int4: two codes per byte, element 2i in the low nibble */
PKV_HD pkv_u8 pkv_int4_pack(pkv_u32 even, pkv_u32 odd) { return (pkv_u8)(even | (odd << 4)); }
PKV_HD pkv_u32 pkv_int4_code(pkv_u8 byte, pkv_i64 d) { return (byte >> ((pkv_u32)(d & 1) * 4)) & 15u; }

/* int3: eight 3-bit codes per three bytes, c0 | c1 << 3 | ... | c7 << 21 little-endian */
PKV_HD pkv_u32 pkv_int3_load(const pkv_u8* p) {
    return (pkv_u32)p[0] | ((pkv_u32)p[1] << 8) | ((pkv_u32)p[2] << 16);
}
PKV_HD void pkv_int3_store(pkv_u8* p, pkv_u32 bits) {
    p[0] = (pkv_u8)bits;
    p[1] = (pkv_u8)(bits >> 8);
    p[2] = (pkv_u8)(bits >> 16);
}
PKV_HD pkv_u32 pkv_int3_code(pkv_u32 bits, pkv_i64 d) { return (bits >> (3 * (pkv_u32)(d & 7))) & 7u; }

/* bytes of one quantized head_dim row: int4 two codes per byte, int3 eight per three
 * bytes (head_dim a multiple of 8), else one per byte */
PKV_HD pkv_i64 pkv_row_bytes_of(int q, pkv_i64 head_dim) {
    return q == PKV_Q_INT4 ? head_dim / 2 : (q == PKV_Q_INT3 ? head_dim / 8 * 3 : head_dim);
}

#endif /* PAGEDKV_QUANT_SCALAR_H */
