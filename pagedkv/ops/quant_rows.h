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

static inline uint16_t pkv_f32_to_f16(float f) {
    uint32_t u = pkv_bits(f), sign = (u >> 16) & 0x8000u, a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return (uint16_t)(sign | 0x7e00u | ((a >> 13) & 0x3ffu));
    if (a >= 0x47800000u) return (uint16_t)(sign | 0x7c00u);
    if (a >= 0x38800000u) return (uint16_t)(sign | (((a + 0xfffu + ((a >> 13) & 1u)) >> 13) - (112u << 10)));
    return (uint16_t)(sign | (uint32_t)pkv_rint_small(pkv_float(a) * 16777216.0f));
}

static inline float pkv_bf16_to_f32(uint16_t b) { return pkv_float((uint32_t)b << 16); }

static inline uint16_t pkv_f32_to_bf16(float f) {
    uint32_t u = pkv_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x0040u);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
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

static inline float pkv_e4m3_to_f32(uint8_t q) {
    uint32_t sign = (uint32_t)(q & 0x80u) << 24, exp = (q >> 3) & 0xfu, mant = q & 0x7u;
    if (exp == 15 && mant == 7) return pkv_float(sign | 0x7ff00000u);
    if (exp == 0) return pkv_float(pkv_bits((float)mant * 0.001953125f) | sign);
    return pkv_float(sign | ((exp + 120u) << 23) | (mant << 20));
}

static inline float pkv_e5m2_to_f32(uint8_t q) { return pkv_f16_to_f32((uint16_t)((uint32_t)q << 8)); }

/* code -> float32 of every byte, per 8-bit format (filled once by pkv_init_tables) */
static float pkv_decode[3][256];

static void pkv_init_tables(void) {
    for (int c = 0; c < 256; ++c) {
        pkv_decode[PKV_E4M3][c] = pkv_e4m3_to_f32((uint8_t)c);
        pkv_decode[PKV_E5M2][c] = pkv_e5m2_to_f32((uint8_t)c);
        pkv_decode[PKV_INT8][c] = (float)((int)(int8_t)(uint8_t)c + 128);  /* q + 128, exact */
    }
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

static inline void pkv_store(char* row, int dtype, int64_t i, float y) {
    uint16_t h;
    if (dtype == PKV_F32) { memcpy(row + 4 * i, &y, 4); return; }
    h = dtype == PKV_F16 ? pkv_f32_to_f16(y) : pkv_f32_to_bf16(y);
    memcpy(row + 2 * i, &h, 2);
}

/* y = float(q) * s (fp8) or (float(c) * s) + mn (int8: c = q + 128; int4: the nibble) */
static inline void pkv_dequantize_row(const uint8_t* q, int qtype, int64_t head_dim, int64_t groups,
                                      const float* scale, const float* zero, int out_type, char* out) {
    if (qtype == PKV_INT4) {
        int64_t g_len = head_dim / groups;
        for (int64_t g = 0; g < groups; ++g) {
            const float s = scale[g], z = zero[g];
            for (int64_t d = g * g_len; d < (g + 1) * g_len; ++d) {
                const float c = (float)((q[d >> 1] >> ((d & 1) * 4)) & 15u);
                pkv_store(out, out_type, d, c * s + z);
            }
        }
        return;
    }
    const float* lut = pkv_decode[qtype];
    const float s = scale[0];
    if (qtype == PKV_INT8) {
        const float z = zero[0];
        if (out_type == PKV_F32) {
            float* o = (float*)out;
            for (int64_t d = 0; d < head_dim; ++d) o[d] = lut[q[d]] * s + z;
        } else {
            for (int64_t d = 0; d < head_dim; ++d) pkv_store(out, out_type, d, lut[q[d]] * s + z);
        }
    } else if (out_type == PKV_F32) {
        float* o = (float*)out;
        for (int64_t d = 0; d < head_dim; ++d) o[d] = lut[q[d]] * s;
    } else {
        for (int64_t d = 0; d < head_dim; ++d) pkv_store(out, out_type, d, lut[q[d]] * s);
    }
}

#endif
