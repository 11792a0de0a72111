/* quant_rows.h - quantize and dequantize one (token, head) row on the CPU.
 *
 * The arithmetic of pagedkv/quant.py, bit for bit: float32 throughout, each step
 * rounds once (the module is built with -ffp-contract=off, no -ffast-math), NaN
 * and infinities as torch treats them. The number conversions are cuda/common.cuh's
 * (proven against torch's casts by tests/test_kernels_emulated.py), written in C.
 */
#ifndef PAGEDKV_QUANT_ROWS_H
#define PAGEDKV_QUANT_ROWS_H

#include <stdint.h>
#include <string.h>

/* model dtypes (input of a write, output of a gather) */
#define PKV_F32 0
#define PKV_F16 1
#define PKV_BF16 2
/* storage formats */
#define PKV_E4M3 0
#define PKV_E5M2 1
#define PKV_INT8 2
#define PKV_INT4 3

static inline uint32_t pkv_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float pkv_float(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline int pkv_isnan(float x) { return (pkv_bits(x) & 0x7fffffffu) > 0x7f800000u; }
static inline int pkv_isfinite(float x) { return (pkv_bits(x) & 0x7f800000u) != 0x7f800000u; }

/* round half to even for 0 <= x < 2^23 (adding 2^23 leaves no fraction bits) */
static inline float pkv_rint_small(float x) { return (x + 8388608.0f) - 8388608.0f; }

/* ---- model dtypes ---------------------------------------------------------- */

static inline float pkv_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
    if (exp == 0) return pkv_float(pkv_bits((float)mant * 5.9604644775390625e-8f) | sign);
    if (exp == 31) return pkv_float(sign | 0x7f800000u | (mant << 13) | (mant ? 0x400000u : 0u));
    return pkv_float(sign | ((exp + 112u) << 23) | (mant << 13));
}

/* c ? a : b for c in {0, 1}, as bit masks: gather loops stay branch-free and vectorize */
static inline uint32_t pkv_sel(uint32_t c, uint32_t a, uint32_t b) {
    const uint32_t m = 0u - c;
    return (a & m) | (b & ~m);
}

/* round to nearest even; every case computed, one selected (NaN: quiet, top payload bits) */
static inline uint16_t pkv_f32_to_f16(float f) {
    const uint32_t u = pkv_bits(f), sign = (u >> 16) & 0x8000u, a = u & 0x7fffffffu;
    const int32_t ai = (int32_t)a;
    const uint32_t nan = 0x7e00u | ((a >> 13) & 0x3ffu);
    const uint32_t normal = ((a + 0xfffu + ((a >> 13) & 1u)) >> 13) - (112u << 10);
    /* subnormal result: rint(|f| * 2^24) in [0, 1024] (a capped so the product stays small) */
    const float small = pkv_float((uint32_t)(ai < 0x38800000 ? ai : 0x38800000));
    const uint32_t sub = (uint32_t)(int32_t)pkv_rint_small(small * 16777216.0f);
    uint32_t r = pkv_sel(ai >= 0x38800000, normal, sub);
    r = pkv_sel(ai >= 0x47800000, 0x7c00u, r);
    r = pkv_sel(ai > 0x7f800000, nan, r);
    return (uint16_t)(sign | r);
}

static inline float pkv_bf16_to_f32(uint16_t b) { return pkv_float((uint32_t)b << 16); }

static inline uint16_t pkv_f32_to_bf16(float f) {
    const uint32_t u = pkv_bits(f);
    const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    return (uint16_t)pkv_sel((int32_t)(u & 0x7fffffffu) > 0x7f800000, (u >> 16) | 0x0040u, rounded);
}

static inline float pkv_load(const char* row, int dtype, int64_t i) {
    uint16_t h;
    if (dtype == PKV_F32) { float f; memcpy(&f, row + 4 * i, 4); return f; }
    memcpy(&h, row + 2 * i, 2);
    return dtype == PKV_F16 ? pkv_f16_to_f32(h) : pkv_bf16_to_f32(h);
}

/* ---- fp8 (saturating: torch's cast of clamp(x, -FMAX, FMAX); NaN keeps its sign) ---- */

static inline uint8_t pkv_f32_to_e4m3(float f) {
    uint32_t u = pkv_bits(f), sign = (u >> 24) & 0x80u, a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return (uint8_t)(sign | 0x7fu);
    if (a >= 0x43e00000u) return (uint8_t)(sign | 0x7eu);
    if (a >= 0x3c800000u) return (uint8_t)(sign | (((a + 0x7ffffu + ((a >> 20) & 1u)) >> 20) - (120u << 3)));
    return (uint8_t)(sign | (uint32_t)pkv_rint_small(pkv_float(a) * 512.0f));
}

static inline uint8_t pkv_f32_to_e5m2(float f) {
    uint32_t u = pkv_bits(f), sign = (u >> 24) & 0x80u, a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return (uint8_t)(sign | 0x7fu);
    if (a >= 0x47600000u) return (uint8_t)(sign | 0x7bu);
    if (a >= 0x38800000u) return (uint8_t)(sign | (((a + 0xfffffu + ((a >> 21) & 1u)) >> 21) - (112u << 2)));
    return (uint8_t)(sign | (uint32_t)pkv_rint_small(pkv_float(a) * 65536.0f));
}

/* fp8 code -> float32 (exact), without branches on the code's class so loops of it vectorize.
 * Subnormal codes go through an exact int -> float conversion, never through a
 * float32 subnormal (which a thread with denormals-are-zero set would read as 0). */
static inline float pkv_fp8_decode(uint8_t q, int qtype) {
    const uint32_t sign = (uint32_t)(q & 0x80u) << 24, m = q & 0x7fu;
    uint32_t u;
    if (qtype == PKV_E4M3) {
        u = pkv_sel(m > 7u, (m << 20) + (120u << 23), pkv_bits((float)(int32_t)(m & 7u) * 0.001953125f));
        u = pkv_sel(m == 0x7fu, 0x7fc00000u, u);
    } else {
        u = pkv_sel(m > 3u, (m << 21) + (112u << 23), pkv_bits((float)(int32_t)(m & 3u) * 1.52587890625e-05f));
        u = pkv_sel(m >= 0x7cu, 0x7f800000u | ((m & 3u) << 21), u);
    }
    return pkv_float(u | sign);
}

/* ---- quantize -------------------------------------------------------------- */

static inline float pkv_fix_scale(float s) { return (s == 0.0f || !pkv_isfinite(s)) ? 1.0f : s; }
/* min/max that propagate NaN like torch.amin/amax */
static inline float pkv_max_nan(float acc, float x) { return (x > acc || pkv_isnan(x)) ? x : acc; }
static inline float pkv_min_nan(float acc, float x) { return (x < acc || pkv_isnan(x)) ? x : acc; }

/* fp8: q = fp8(clamp(x / s, -FMAX, FMAX)), s = fix(amax / FMAX) */
static inline void pkv_quantize_fp8(const char* x, int in_type, int64_t n, int qtype, uint8_t* q, float* scale) {
    float amax = pkv_float(pkv_bits(pkv_load(x, in_type, 0)) & 0x7fffffffu);
    for (int64_t d = 1; d < n; ++d) amax = pkv_max_nan(amax, pkv_float(pkv_bits(pkv_load(x, in_type, d)) & 0x7fffffffu));
    float s = pkv_fix_scale(amax / (qtype == PKV_E4M3 ? 448.0f : 57344.0f));
    for (int64_t d = 0; d < n; ++d) {
        float v = pkv_load(x, in_type, d);
        v = pkv_isnan(v) ? v : v / s;
        q[d] = qtype == PKV_E4M3 ? pkv_f32_to_e4m3(v) : pkv_f32_to_e5m2(v);
    }
    *scale = s;
}

/* Asymmetric codes of elements [first, first + n): c = clamp(rint((x - mn) / s), 0, top)
 * with s = fix((mx - mn) / top), NaN -> 0. int8 stores c - 128 per byte; int4 packs c
 * into the nibble of element i (low nibble for even i). */
static inline void pkv_quantize_asym(const char* x, int in_type, int64_t first, int64_t n, int qtype,
                                     uint8_t* q, float* scale, float* zero) {
    const float top = qtype == PKV_INT8 ? 255.0f : 15.0f;
    float mn = pkv_load(x, in_type, first), mx = mn;
    for (int64_t d = first + 1; d < first + n; ++d) {
        float v = pkv_load(x, in_type, d);
        mn = pkv_min_nan(mn, v);
        mx = pkv_max_nan(mx, v);
    }
    float s = pkv_fix_scale((mx - mn) / top);
    for (int64_t d = first; d < first + n; ++d) {
        float v = (pkv_load(x, in_type, d) - mn) / s;
        if (pkv_isnan(v)) v = 0.0f;
        v = v < 0.0f ? 0.0f : (v > top ? top : v);  /* clamp then round == round then clamp here */
        uint32_t c = (uint32_t)pkv_rint_small(v);
        if (qtype == PKV_INT8) q[d] = (uint8_t)(c - 128u);
        else if (d & 1) q[d >> 1] = (uint8_t)(q[d >> 1] | (c << 4));
        else q[d >> 1] = (uint8_t)c;
    }
    *scale = s;
    *zero = mn;
}

/* one row of head_dim elements: groups == 1 except for int4 */
static inline void pkv_quantize_row(const char* x, int in_type, int64_t head_dim, int qtype, int64_t groups,
                                    uint8_t* q, float* scale, float* zero) {
    if (qtype == PKV_E4M3 || qtype == PKV_E5M2) {
        pkv_quantize_fp8(x, in_type, head_dim, qtype, q, scale);
        return;
    }
    int64_t g_len = head_dim / groups;
    for (int64_t g = 0; g < groups; ++g)
        pkv_quantize_asym(x, in_type, g * g_len, g_len, qtype, q, scale + g, zero + g);
}

/* ---- dequantize ------------------------------------------------------------ */

/* y = float(q) * s (fp8) or (float(c) * s) + mn (int8: c = q + 128; int4: the nibble).
 * One loop per (format, output) pair, each simple enough for the compiler to vectorize. */
#define PKV_DEQUANT_LOOPS(STORE)                                                            \
    if (qtype == PKV_INT4) {                                                                \
        const int64_t g_len = head_dim / groups;                                            \
        for (int64_t g = 0; g < groups; ++g) {                                              \
            const float s = scale[g], z = zero[g];                                          \
            const int64_t lo = g * g_len, hi = lo + g_len;                                  \
            if ((lo | hi) & 1) { /* odd groups: a byte spans two groups */                  \
                for (int64_t d = lo; d < hi; ++d)                                           \
                    STORE(d, (float)((q[d >> 1] >> ((d & 1) * 4)) & 15u) * s + z);          \
            } else {                                                                        \
                for (int64_t i = lo >> 1; i < hi >> 1; ++i) {                               \
                    STORE(2 * i, (float)(q[i] & 15u) * s + z);                              \
                    STORE(2 * i + 1, (float)(q[i] >> 4) * s + z);                           \
                }                                                                           \
            }                                                                               \
        }                                                                                   \
    } else if (qtype == PKV_INT8) {                                                         \
        const float s = scale[0], z = zero[0];                                              \
        for (int64_t d = 0; d < head_dim; ++d) STORE(d, ((float)(int8_t)q[d] + 128.0f) * s + z); \
    } else if (qtype == PKV_E4M3) {                                                         \
        const float s = scale[0];                                                           \
        for (int64_t d = 0; d < head_dim; ++d) STORE(d, pkv_fp8_decode(q[d], PKV_E4M3) * s);    \
    } else {                                                                                \
        const float s = scale[0];                                                           \
        for (int64_t d = 0; d < head_dim; ++d) STORE(d, pkv_fp8_decode(q[d], PKV_E5M2) * s);    \
    }

/* Dequantize a row into float32 ``o``; for a float16/bfloat16 output, ``o`` is the
 * caller's scratch row and pkv_narrow_row converts it. */
static inline __attribute__((always_inline)) void pkv_dequantize_f32(
        const uint8_t* q, int qtype, int64_t head_dim, int64_t groups, const float* scale, const float* zero,
        float* o) {
#define PKV_STORE_F32(d, y) (o[d] = (y))
    PKV_DEQUANT_LOOPS(PKV_STORE_F32)
}

static inline __attribute__((always_inline)) void pkv_narrow_row(const float* y, int64_t n, int out_type,
                                                                  uint16_t* out) {
    if (out_type == PKV_F16)
        for (int64_t d = 0; d < n; ++d) out[d] = pkv_f32_to_f16(y[d]);
    else
        for (int64_t d = 0; d < n; ++d) out[d] = pkv_f32_to_bf16(y[d]);
}

#define PKV_DEQUANT_ROW_ARGS                                                                     \
    const uint8_t *q, int qtype, int64_t head_dim, int64_t groups, const float *scale,           \
        const float *zero, int out_type, char *out, float *tmp

static void pkv_dequantize_row_base(PKV_DEQUANT_ROW_ARGS) {
    if (out_type == PKV_F32) {
        pkv_dequantize_f32(q, qtype, head_dim, groups, scale, zero, (float*)out);
        return;
    }
    pkv_dequantize_f32(q, qtype, head_dim, groups, scale, zero, tmp);
    pkv_narrow_row(tmp, head_dim, out_type, (uint16_t*)out);
}

/* The same row with 256-bit vectors, and float16 by the F16C instruction (round to
 * nearest even like pkv_f32_to_f16, which does the tail), chosen at run time. */
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
#include <immintrin.h>
#define PKV_HAVE_AVX2 1
__attribute__((target("avx2,f16c"))) static void pkv_dequantize_row_avx2(PKV_DEQUANT_ROW_ARGS) {
    if (out_type == PKV_F32) {
        pkv_dequantize_f32(q, qtype, head_dim, groups, scale, zero, (float*)out);
        return;
    }
    pkv_dequantize_f32(q, qtype, head_dim, groups, scale, zero, tmp);
    if (out_type == PKV_BF16) {
        pkv_narrow_row(tmp, head_dim, out_type, (uint16_t*)out);
        return;
    }
    int64_t d = 0;
    for (; d + 8 <= head_dim; d += 8)
        _mm_storeu_si128((__m128i*)(out + 2 * d), _mm256_cvtps_ph(_mm256_loadu_ps(tmp + d), _MM_FROUND_TO_NEAREST_INT));
    pkv_narrow_row(tmp + d, head_dim - d, out_type, (uint16_t*)out + d);
}
#else
#define PKV_HAVE_AVX2 0
#endif

typedef void (*pkv_dequantize_row_fn)(PKV_DEQUANT_ROW_ARGS);

/* the row function for this CPU */
static pkv_dequantize_row_fn pkv_pick_dequantize_row(void) {
#if PKV_HAVE_AVX2
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c")) return pkv_dequantize_row_avx2;
#endif
    return pkv_dequantize_row_base;
}

#endif
