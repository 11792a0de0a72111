/* quant_rows.h - quantize and dequantize one (token, head) row on the CPU.
 *
 * The arithmetic of pagedkv/quant.py, bit for bit: float32 throughout, each step
 * rounds once (the module is built with -ffp-contract=off, no -ffast-math; its
 * -fno-trapping-math only lets selects between computed values vectorize), NaN and
 * infinities as torch treats them. The number conversions compute what
 * cuda/common.cuh's do, without branches so that row loops vectorize;
 * tests/test_cpu_quant.py sweeps them over every rounding case against torch's casts.
 * Each row function has a baseline build and an AVX2/F16C build, picked at run time.
 * A rotated cache (pagedkv/rotation.py) passes its float32 signs: a write rotates the
 * widened row before quantizing it, a gather unrotates the dequantized float32 row
 * before narrowing it, in the same per-row pass (pkv_hadamard_row).
 */
#ifndef PAGEDKV_QUANT_ROWS_H
#define PAGEDKV_QUANT_ROWS_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* model dtypes (input of a write, output of a gather) */
#define PKV_F32 0
#define PKV_F16 1
#define PKV_BF16 2
/* storage formats */
#define PKV_E4M3 PKV_Q_E4M3
#define PKV_E5M2 PKV_Q_E5M2
#define PKV_INT8 PKV_Q_INT8
#define PKV_INT4 PKV_Q_INT4
#define PKV_INT3 PKV_Q_INT3

/* The scalar conversions (float16/bfloat16, fp8 encode and decode, directed bfloat16
 * rounding, fix_scale, pkv_rint_small, pkv_sel...) are cuda/quant_scalar.h, shared with
 * the CUDA kernels (setup.py puts cuda/ on this module's include path). */
#include "quant_scalar.h"

/* fp8 code -> float32 (exact) of either fp8 format */
static inline float pkv_fp8_decode(uint8_t q, int qtype) {
    return qtype == PKV_E4M3 ? pkv_e4m3_to_f32(q) : pkv_e5m2_to_f32(q);
}

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

/* amax (fp8: absolute) or min and max (int8/int4) of y[0, n), NaN-propagating like
 * torch.amax/amin: any NaN makes the result NaN. With SSE2, four lanes at a time
 * (maxps(v, acc) is exactly v > acc ? v : acc); the lanes only change which of two
 * equal zeros wins (the sign of a zero minimum is not part of the contract: torch.amin
 * itself picks either, by position and vector width). */
static inline __attribute__((always_inline)) void pkv_reduce(const float* y, int64_t n, int absolute,
                                                             float* lo_out, float* hi_out) {
    float lo = pkv_float(0x7f800000u), hi = absolute ? 0.0f : pkv_float(0xff800000u);
    uint32_t nan = 0;
    int64_t d = 0;
#if defined(__SSE2__)
    if (n >= 4) {
        const __m128 mask = _mm_castsi128_ps(_mm_set1_epi32(absolute ? 0x7fffffff : -1));
        __m128 vlo = _mm_set1_ps(lo), vhi = _mm_set1_ps(hi), vnan = _mm_setzero_ps();
        for (; d + 4 <= n; d += 4) {
            const __m128 v = _mm_and_ps(_mm_loadu_ps(y + d), mask);
            vnan = _mm_or_ps(vnan, _mm_cmpunord_ps(v, v));
            vlo = _mm_min_ps(v, vlo);
            vhi = _mm_max_ps(v, vhi);
        }
        float l[4], h[4];
        _mm_storeu_ps(l, vlo);
        _mm_storeu_ps(h, vhi);
        nan = (uint32_t)_mm_movemask_ps(vnan);
        for (int i = 0; i < 4; ++i) {
            lo = l[i] < lo ? l[i] : lo;
            hi = h[i] > hi ? h[i] : hi;
        }
    }
#endif
    for (; d < n; ++d) {
        const uint32_t bits = pkv_bits(y[d]) & 0x7fffffffu;
        const float v = absolute ? pkv_float(bits) : y[d];
        nan |= (uint32_t)(bits > 0x7f800000u);
        lo = v < lo ? v : lo;
        hi = v > hi ? v : hi;
    }
    *lo_out = nan ? pkv_float(0x7fc00000u) : lo;
    *hi_out = nan ? pkv_float(0x7fc00000u) : hi;
}

/* ---- int3: bfloat16 params rounded outward, eight 3-bit codes in three bytes ---- */

/* int3 works a pack (8 codes, 3 bytes) at a time as one 8-lane vector (GCC/Clang vector
 * extensions): the AVX2 build runs each operation as one 256-bit instruction (vpsrlvd
 * for the per-lane shifts), the baseline build lowers the same operations to SSE2. A
 * group holds too few packs (4 at G = 32) for the loop vectorizer to pay off. */
typedef uint32_t pkv_v8u __attribute__((vector_size(32)));
typedef int32_t pkv_v8i __attribute__((vector_size(32)));
typedef float pkv_v8f __attribute__((vector_size(32)));

/* The 24 bits c0 | c1 << 3 | ... | c7 << 21 of y[0, 8): c = clamp(rint((y - z) / s), 0, 7),
 * NaN -> 0; the same operations, each rounding once, as the scalar int4 loop. */
static inline __attribute__((always_inline)) uint32_t pkv_int3_pack_codes(const float* y, float s, float z) {
    const pkv_v8u shifts = {0u, 3u, 6u, 9u, 12u, 15u, 18u, 21u};
    pkv_v8f v;
    memcpy(&v, y, sizeof v);
    v = (v - z) / s;
    v = (pkv_v8f)((pkv_v8i)v & (v == v));                /* NaN -> 0 */
    v = (pkv_v8f)((pkv_v8i)v & (v > 0.0f));              /* below 0 (and -0) -> 0 */
    const pkv_v8i big = v > 7.0f;
    v = (pkv_v8f)(((pkv_v8i)v & ~big) | ((pkv_v8i)((pkv_v8f){7, 7, 7, 7, 7, 7, 7, 7}) & big));
    v = (v + 8388608.0f) - 8388608.0f;                   /* rint, as pkv_rint_small */
    const pkv_v8u c = (pkv_v8u)__builtin_convertvector(v, pkv_v8i) << shifts;
    return c[0] | c[1] | c[2] | c[3] | c[4] | c[5] | c[6] | c[7];
}

/* Per group: z = bf16_down(min), s = fix(bf16_up((max - z) / 7)), c = clamp(rint((y - z) / s),
 * 0, 7) with NaN -> 0; codes 8j..8j+7 packed as 24 bits c0 | c1 << 3 | ... little-endian in
 * bytes 3j..3j+2; head_dim / groups is a multiple of 8. */
static inline __attribute__((always_inline)) void pkv_quantize_int3_values(
        const float* y, int64_t head_dim, int64_t groups, uint8_t* q, uint16_t* scale, uint16_t* zero) {
    const int64_t g_len = head_dim / groups;
    for (int64_t g = 0; g < groups; ++g) {
        const float* yg = y + g * g_len;
        float mn, mx;
        pkv_reduce(yg, g_len, 0, &mn, &mx);
        const uint16_t zb = pkv_f32_to_bf16_directed(mn, 0);
        const float z = pkv_bf16_to_f32(zb);
        const float s = pkv_fix_scale(pkv_bf16_to_f32(pkv_f32_to_bf16_directed((mx - z) / 7.0f, 1)));
        for (int64_t j = g * g_len / 8; j < (g + 1) * g_len / 8; ++j) {
            const uint32_t bits = pkv_int3_pack_codes(y + 8 * j, s, z);
            pkv_int3_store(q + 3 * j, bits);
        }
        scale[g] = pkv_f32_to_bf16(s);  /* exact: s is a bfloat16 value (or 1) */
        zero[g] = zb;
    }
}

/* One pack's 8 values (float(c_i) * s) + z (two roundings) into o[0, 8), as one 8-lane
 * vector (pkv_int3_pack_codes says why). */
static inline __attribute__((always_inline)) void pkv_int3_pack_f32(uint32_t bits, float s, float z, float* o) {
    const pkv_v8u shifts = {0u, 3u, 6u, 9u, 12u, 15u, 18u, 21u};
    const pkv_v8u c = ((pkv_v8u){bits, bits, bits, bits, bits, bits, bits, bits} >> shifts) & 7u;
    const pkv_v8f y = __builtin_convertvector((pkv_v8i)c, pkv_v8f) * s + z;
    memcpy(o, &y, sizeof y);
}

/* y = (float(c) * s) + z per element of each group (two roundings), into float32 ``o`` */
static inline __attribute__((always_inline)) void pkv_dequantize_int3_f32(
        const uint8_t* q, int64_t head_dim, int64_t groups, const uint16_t* scale, const uint16_t* zero, float* o) {
    const int64_t packs = head_dim / groups / 8;
    for (int64_t g = 0; g < groups; ++g) {
        const float s = pkv_bf16_to_f32(scale[g]), z = pkv_bf16_to_f32(zero[g]);
        for (int64_t j = g * packs; j < (g + 1) * packs; ++j) {
            const uint32_t bits = pkv_int3_load(q + 3 * j);
            pkv_int3_pack_f32(bits, s, z, o + 8 * j);
        }
    }
}

/* The row's codes from its float32 values y (the caller's scratch row): per group,
 * fp8 q = fp8(clamp(y / s, -FMAX, FMAX)) with s = fix(amax / FMAX) (a NaN keeps its
 * sign); int8/int4 c = clamp(rint((y - mn) / s), 0, top) with s = fix((mx - mn) / top)
 * and NaN -> 0, stored as c - 128 (int8) or packed two per byte, element 2i in the low
 * nibble (int4; ``codes`` is the caller's scratch of head_dim bytes). */
static inline __attribute__((always_inline)) void pkv_quantize_values(
        const float* y, int qtype, int64_t head_dim, int64_t groups, uint8_t* q, float* scale, float* zero,
        uint8_t* codes) {
    if (qtype == PKV_INT3) {  /* its scale and zero arenas hold bfloat16 */
        pkv_quantize_int3_values(y, head_dim, groups, q, (uint16_t*)scale, (uint16_t*)zero);
        return;
    }
    if (qtype == PKV_E4M3 || qtype == PKV_E5M2) {
        float unused, amax;
        pkv_reduce(y, head_dim, 1, &unused, &amax);
        const float s = pkv_fix_scale(amax / (qtype == PKV_E4M3 ? 448.0f : 57344.0f));
        /* y / s is computed for NaN too and then replaced: the NaN keeps its own sign */
        if (qtype == PKV_E4M3)
            for (int64_t d = 0; d < head_dim; ++d) {
                const float v = y[d] / s;
                q[d] = pkv_f32_to_e4m3(y[d] != y[d] ? y[d] : v);
            }
        else
            for (int64_t d = 0; d < head_dim; ++d) {
                const float v = y[d] / s;
                q[d] = pkv_f32_to_e5m2(y[d] != y[d] ? y[d] : v);
            }
        *scale = s;
        return;
    }
    const float top = qtype == PKV_INT8 ? PKV_TOP_INT8 : PKV_TOP_INT4;
    const uint32_t offset = qtype == PKV_INT8 ? 128u : 0u;
    uint8_t* out = qtype == PKV_INT8 ? q : codes;
    const int64_t g_len = head_dim / groups;
    for (int64_t g = 0; g < groups; ++g) {
        const float* yg = y + g * g_len;
        uint8_t* og = out + g * g_len;
        float mn, mx;
        pkv_reduce(yg, g_len, 0, &mn, &mx);
        const float s = pkv_fix_scale((mx - mn) / top);
        for (int64_t d = 0; d < g_len; ++d) {
            og[d] = (uint8_t)(pkv_int_code((yg[d] - mn) / s, top) - offset);
        }
        scale[g] = s;
        zero[g] = mn;
    }
    if (qtype == PKV_INT4)
        for (int64_t i = 0; i < head_dim / 2; ++i) q[i] = pkv_int4_pack(codes[2 * i], codes[2 * i + 1]);
}

static inline __attribute__((always_inline)) void pkv_widen_row(const char* x, int in_type, int64_t n, float* y) {
    if (in_type == PKV_F32) {
        memcpy(y, x, (size_t)n * 4);
    } else if (in_type == PKV_F16) {
        const uint16_t* h = (const uint16_t*)x;
        for (int64_t d = 0; d < n; ++d) y[d] = pkv_f16_to_f32(h[d]);
    } else {
        const uint16_t* h = (const uint16_t*)x;
        for (int64_t d = 0; d < n; ++d) y[d] = pkv_bf16_to_f32(h[d]);
    }
}

/* ---- rotation (pagedkv/rotation.py, bit for bit) ---------------------------- */

/* float32(1 / sqrt(n)) for n = 2^b: 2^(-b/2) exactly for even b, else that power of
 * two times float32(1 / sqrt(2)) (scaling by a power of two keeps the rounding) */
static inline float pkv_hadamard_scale(int64_t n) {
    const int b = __builtin_ctzll((unsigned long long)n);
    const float pow2 = pkv_float((uint32_t)(127 - (b >> 1)) << 23);
    return (b & 1) ? pow2 * pkv_float(0x3f3504f3u) : pow2;
}

/* The butterfly stages of the normalized Walsh-Hadamard transform of each power-of-two
 * block of y[0, d) (largest block first). Every block of size >= 2h starts at a multiple
 * of 2h, so stage h runs over the prefix d & ~(2h - 1) as if it were one block. Two
 * stages (h, 2h) run in one pass over each 4h chunk, held in registers: the same adds
 * and subtracts, each rounding once (the module is built without FMA contraction and
 * without reassociation), in fewer passes over the row. */

/* one stage h over y[lo, end) (2h chunks) */
static inline __attribute__((always_inline)) void pkv_stage(float* y, int64_t lo, int64_t end, int64_t h) {
    for (int64_t i = lo; i < end; i += 2 * h) {
        int64_t j = i;
#if defined(__SSE2__)
        for (; j + 4 <= i + h; j += 4) {
            const __m128 a = _mm_loadu_ps(y + j), b = _mm_loadu_ps(y + j + h);
            _mm_storeu_ps(y + j, _mm_add_ps(a, b));
            _mm_storeu_ps(y + j + h, _mm_sub_ps(a, b));
        }
#endif
        for (; j < i + h; ++j) {
            const float a = y[j], b = y[j + h];
            y[j] = a + b;
            y[j + h] = a - b;
        }
    }
}

/* stages h and 2h (h >= 4) over y[0, end) (4h chunks) */
static inline __attribute__((always_inline)) void pkv_stage_pair(float* y, int64_t end, int64_t h) {
    for (int64_t i = 0; i < end; i += 4 * h) {
        int64_t j = i;
#if defined(__SSE2__)
        for (; j + 4 <= i + h; j += 4) {
            const __m128 x0 = _mm_loadu_ps(y + j), x1 = _mm_loadu_ps(y + j + h);
            const __m128 x2 = _mm_loadu_ps(y + j + 2 * h), x3 = _mm_loadu_ps(y + j + 3 * h);
            const __m128 a0 = _mm_add_ps(x0, x1), a1 = _mm_sub_ps(x0, x1);
            const __m128 a2 = _mm_add_ps(x2, x3), a3 = _mm_sub_ps(x2, x3);
            _mm_storeu_ps(y + j, _mm_add_ps(a0, a2));
            _mm_storeu_ps(y + j + h, _mm_add_ps(a1, a3));
            _mm_storeu_ps(y + j + 2 * h, _mm_sub_ps(a0, a2));
            _mm_storeu_ps(y + j + 3 * h, _mm_sub_ps(a1, a3));
        }
#endif
        for (; j < i + h; ++j) {
            const float x0 = y[j], x1 = y[j + h], x2 = y[j + 2 * h], x3 = y[j + 3 * h];
            const float a0 = x0 + x1, a1 = x0 - x1, a2 = x2 + x3, a3 = x2 - x3;
            y[j] = a0 + a2;
            y[j + h] = a1 + a3;
            y[j + 2 * h] = a0 - a2;
            y[j + 3 * h] = a1 - a3;
        }
    }
}

/* In place: y = H(pre * y) * post, where H includes each block's float32(1 / sqrt(n))
 * (multiplied after the block's last stage, then post); pre/post: NULL or d signs.
 * rotate(y) is (signs, NULL), unrotate(y) is (NULL, signs). */
static inline __attribute__((always_inline)) void pkv_hadamard_row(float* y, int64_t d, const float* pre,
                                                                    const float* post) {
    /* stages 1 and 2 over whole 4-element chunks, with the pre-multiply fused */
    const int64_t end2 = d & ~(int64_t)3, end1 = d & ~(int64_t)1;
    int64_t i = 0;
#if defined(__SSE2__)
    {
        const __m128 neg13 = _mm_castsi128_ps(_mm_set_epi32((int)0x80000000, 0, (int)0x80000000, 0));
        const __m128 neg23 = _mm_castsi128_ps(_mm_set_epi32((int)0x80000000, (int)0x80000000, 0, 0));
        for (; i < end2; i += 4) {
            __m128 v = _mm_loadu_ps(y + i);
            if (pre) v = _mm_mul_ps(v, _mm_loadu_ps(pre + i));
            /* (a, b) pairs as [a0 a0 a1 a1] + [b0 -b0 b1 -b1], then [a0 a1 a0 a1] + [b0 b1 -b0 -b1]:
             * x + (-y) is x - y exactly */
            v = _mm_add_ps(_mm_shuffle_ps(v, v, _MM_SHUFFLE(2, 2, 0, 0)),
                           _mm_xor_ps(_mm_shuffle_ps(v, v, _MM_SHUFFLE(3, 3, 1, 1)), neg13));
            v = _mm_add_ps(_mm_shuffle_ps(v, v, _MM_SHUFFLE(1, 0, 1, 0)),
                           _mm_xor_ps(_mm_shuffle_ps(v, v, _MM_SHUFFLE(3, 2, 3, 2)), neg23));
            _mm_storeu_ps(y + i, v);
        }
    }
#endif
    if (pre)
        for (int64_t j = i; j < d; ++j) y[j] = y[j] * pre[j];
    for (; i < end2; i += 4) {
        const float x0 = y[i], x1 = y[i + 1], x2 = y[i + 2], x3 = y[i + 3];
        const float a0 = x0 + x1, a1 = x0 - x1, a2 = x2 + x3, a3 = x2 - x3;
        y[i] = a0 + a2;
        y[i + 1] = a1 + a3;
        y[i + 2] = a0 - a2;
        y[i + 3] = a1 - a3;
    }
    pkv_stage(y, end2, end1, 1);  /* a block of 2 at the end has only stage 1 */
    for (int64_t h = 4; h < d;) {
        const int64_t end_h = d & ~(2 * h - 1), end_2h = d & ~(4 * h - 1);
        if (2 * h < d && end_2h > 0) {
            pkv_stage_pair(y, end_2h, h);
            pkv_stage(y, end_2h, end_h, h);
            h *= 4;
        } else {
            pkv_stage(y, 0, end_h, h);
            h *= 2;
        }
    }
    for (int64_t start = 0; start < d;) {
        const int64_t n = (int64_t)1 << (63 - __builtin_clzll((unsigned long long)(d - start)));
        const float c = pkv_hadamard_scale(n);
        if (post)
            for (int64_t j = start; j < start + n; ++j) y[j] = (y[j] * c) * post[j];
        else
            for (int64_t j = start; j < start + n; ++j) y[j] = y[j] * c;
        start += n;
    }
}

/* rotate(y) = H(signs * y), in place */
static inline __attribute__((always_inline)) void pkv_rotate_row(float* y, int64_t d, const float* signs) {
    pkv_hadamard_row(y, d, signs, NULL);
}

/* unrotate(y) = signs * H(y), in place */
static inline __attribute__((always_inline)) void pkv_unrotate_row(float* y, int64_t d, const float* signs) {
    pkv_hadamard_row(y, d, NULL, signs);
}

#define PKV_QUANTIZE_ROW_ARGS                                                                    \
    const char *x, int in_type, int64_t head_dim, int qtype, int64_t groups, uint8_t *q,          \
        float *scale, float *zero, float *tmp, uint8_t *codes, const float *signs

/* one (token, head) row of the model dtype; tmp: head_dim floats, codes: head_dim bytes;
 * signs: NULL, or the rotation's head_dim signs */
static void pkv_quantize_row_base(PKV_QUANTIZE_ROW_ARGS) {
    pkv_widen_row(x, in_type, head_dim, tmp);
    if (signs) pkv_rotate_row(tmp, head_dim, signs);
    pkv_quantize_values(tmp, qtype, head_dim, groups, q, scale, zero, codes);
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
                    STORE(d, pkv_affine((float)pkv_int4_code(q[d >> 1], d), s, z));          \
            } else {                                                                        \
                for (int64_t i = lo >> 1; i < hi >> 1; ++i) {                               \
                    STORE(2 * i, pkv_affine((float)(q[i] & 15u), s, z));                   \
                    STORE(2 * i + 1, pkv_affine((float)(q[i] >> 4), s, z));                \
                }                                                                           \
            }                                                                               \
        }                                                                                   \
    } else if (qtype == PKV_INT8) {                                                         \
        const float s = scale[0], z = zero[0];                                              \
        for (int64_t d = 0; d < head_dim; ++d) STORE(d, pkv_affine(pkv_int8_value(q[d]), s, z)); \
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
    if (qtype == PKV_INT3) {  /* its scale and zero arenas hold bfloat16 */
        pkv_dequantize_int3_f32(q, head_dim, groups, (const uint16_t*)scale, (const uint16_t*)zero, o);
        return;
    }
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
        const float *zero, int out_type, char *out, float *tmp, const float *signs

static void pkv_dequantize_row_base(PKV_DEQUANT_ROW_ARGS) {
    if (out_type == PKV_F32) {
        pkv_dequantize_f32(q, qtype, head_dim, groups, scale, zero, (float*)out);
        if (signs) pkv_unrotate_row((float*)out, head_dim, signs);
        return;
    }
    pkv_dequantize_f32(q, qtype, head_dim, groups, scale, zero, tmp);
    if (signs) pkv_unrotate_row(tmp, head_dim, signs);
    pkv_narrow_row(tmp, head_dim, out_type, (uint16_t*)out);
}

/* The same row with 256-bit vectors, and float16 by the F16C instruction (round to
 * nearest even like pkv_f32_to_f16, which does the tail), chosen at run time. */
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
#include <immintrin.h>
#define PKV_HAVE_AVX2 1

/* stages 1, 2 and 4 of one 8-float chunk, in registers: (a, b) pairs as
 * [a0 a0 a1 a1] + [b0 -b0 b1 -b1], then the same on pairs of pairs and on the two
 * 128-bit halves (x + (-y) is x - y exactly) */
__attribute__((target("avx2"))) static inline __attribute__((always_inline)) __m256 pkv_stages124(__m256 v) {
    const __m256 neg13 = _mm256_castsi256_ps(_mm256_set_epi32((int)0x80000000, 0, (int)0x80000000, 0,
                                                              (int)0x80000000, 0, (int)0x80000000, 0));
    const __m256 neg23 = _mm256_castsi256_ps(_mm256_set_epi32((int)0x80000000, (int)0x80000000, 0, 0,
                                                              (int)0x80000000, (int)0x80000000, 0, 0));
    const __m256 neg_hi = _mm256_castsi256_ps(_mm256_set_epi32((int)0x80000000, (int)0x80000000, (int)0x80000000,
                                                               (int)0x80000000, 0, 0, 0, 0));
    v = _mm256_add_ps(_mm256_shuffle_ps(v, v, _MM_SHUFFLE(2, 2, 0, 0)),
                      _mm256_xor_ps(_mm256_shuffle_ps(v, v, _MM_SHUFFLE(3, 3, 1, 1)), neg13));
    v = _mm256_add_ps(_mm256_shuffle_ps(v, v, _MM_SHUFFLE(1, 0, 1, 0)),
                      _mm256_xor_ps(_mm256_shuffle_ps(v, v, _MM_SHUFFLE(3, 2, 3, 2)), neg23));
    return _mm256_add_ps(_mm256_permute2f128_ps(v, v, 0x00),
                         _mm256_xor_ps(_mm256_permute2f128_ps(v, v, 0x11), neg_hi));
}

/* pkv_hadamard_row with 256-bit vectors: stages 1, 2 and 4 in one register pass over
 * whole 8-element chunks, then stage pairs of 8-float vectors; the same operations
 * (x + (-y) is x - y exactly), so the same bits. */
__attribute__((target("avx2"))) static inline void pkv_hadamard_row_avx2(float* y, int64_t d, const float* pre,
                                                                         const float* post) {
    const int64_t end8 = d & ~(int64_t)7, end2 = d & ~(int64_t)3, end1 = d & ~(int64_t)1;
    int64_t i = 0;
    for (; i < end8; i += 8) {
        __m256 v = _mm256_loadu_ps(y + i);
        if (pre) v = _mm256_mul_ps(v, _mm256_loadu_ps(pre + i));
        _mm256_storeu_ps(y + i, pkv_stages124(v));
    }
    if (pre)
        for (int64_t j = i; j < d; ++j) y[j] = y[j] * pre[j];
    for (; i < end2; i += 4) {  /* a block of 4 at the end: stages 1 and 2 */
        const float x0 = y[i], x1 = y[i + 1], x2 = y[i + 2], x3 = y[i + 3];
        const float a0 = x0 + x1, a1 = x0 - x1, a2 = x2 + x3, a3 = x2 - x3;
        y[i] = a0 + a2;
        y[i + 1] = a1 + a3;
        y[i + 2] = a0 - a2;
        y[i + 3] = a1 - a3;
    }
    pkv_stage(y, end2, end1, 1);  /* a block of 2 at the end: stage 1 */
    for (int64_t h = 8; h < d;) {
        const int64_t end_h = d & ~(2 * h - 1), end_2h = d & ~(4 * h - 1);
        const int64_t pair_end = 2 * h < d ? end_2h : 0;
        for (int64_t g = 0; g < pair_end; g += 4 * h)
            for (int64_t j = g; j < g + h; j += 8) {
                const __m256 x0 = _mm256_loadu_ps(y + j), x1 = _mm256_loadu_ps(y + j + h);
                const __m256 x2 = _mm256_loadu_ps(y + j + 2 * h), x3 = _mm256_loadu_ps(y + j + 3 * h);
                const __m256 a0 = _mm256_add_ps(x0, x1), a1 = _mm256_sub_ps(x0, x1);
                const __m256 a2 = _mm256_add_ps(x2, x3), a3 = _mm256_sub_ps(x2, x3);
                _mm256_storeu_ps(y + j, _mm256_add_ps(a0, a2));
                _mm256_storeu_ps(y + j + h, _mm256_add_ps(a1, a3));
                _mm256_storeu_ps(y + j + 2 * h, _mm256_sub_ps(a0, a2));
                _mm256_storeu_ps(y + j + 3 * h, _mm256_sub_ps(a1, a3));
            }
        for (int64_t g = pair_end; g < end_h; g += 2 * h)  /* stage h alone past the pairs */
            for (int64_t j = g; j < g + h; j += 8) {
                const __m256 a = _mm256_loadu_ps(y + j), b = _mm256_loadu_ps(y + j + h);
                _mm256_storeu_ps(y + j, _mm256_add_ps(a, b));
                _mm256_storeu_ps(y + j + h, _mm256_sub_ps(a, b));
            }
        h *= pair_end > 0 ? 4 : 2;
    }
    for (int64_t start = 0; start < d;) {
        const int64_t n = (int64_t)1 << (63 - __builtin_clzll((unsigned long long)(d - start)));
        const float c = pkv_hadamard_scale(n);
        if (post)
            for (int64_t j = start; j < start + n; ++j) y[j] = (y[j] * c) * post[j];
        else
            for (int64_t j = start; j < start + n; ++j) y[j] = y[j] * c;
        start += n;
    }
}
/* Unrotating a power-of-two row of 16 to 128 floats with the row in registers: the
 * stages of pkv_hadamard_row_avx2 in the same order (each element sees the same adds and
 * subtracts), then one multiply by ``cpost`` = c * post. That multiply is (y * c) * post
 * bit for bit when every post is +1 or -1: rounding is symmetric in the sign, and x86
 * returns a NaN operand unchanged either way (the caller checks the signs). One load and
 * one store per vector instead of one per pass. */

/* stages 1 to 4 * nv of y[0, 8 nv) into v (nv = 2, 4 or 8: at most 8 live vectors, so
 * nothing spills) */
__attribute__((target("avx2,f16c"))) static inline __attribute__((always_inline)) void pkv_hadamard_regs(
        const float* y, const int nv, __m256* v) {
#pragma GCC unroll 8
    for (int r = 0; r < nv; ++r) v[r] = pkv_stages124(_mm256_loadu_ps(y + 8 * r));
#pragma GCC unroll 3
    for (int h = 1; h < nv; h *= 2)  /* stage 8h: registers h apart */
#pragma GCC unroll 8
        for (int k = 0; k < nv; ++k)
            if (!(k & h)) {
                const __m256 a = v[k], b = v[k + h];
                v[k] = _mm256_add_ps(a, b);
                v[k + h] = _mm256_sub_ps(a, b);
            }
}

/* elements [8 r, 8 r + 8) of the output row: v * cpost, narrowed; bfloat16 goes through
 * ``tmp`` (pkv_narrow_row, by the caller) */
__attribute__((target("avx2,f16c"))) static inline __attribute__((always_inline)) void pkv_store_regs(
        __m256 v, const float* cpost, int r, int out_type, char* out, float* tmp) {
    v = _mm256_mul_ps(v, _mm256_loadu_ps(cpost + 8 * r));
    if (out_type == PKV_F32)
        _mm256_storeu_ps((float*)out + 8 * r, v);
    else if (out_type == PKV_F16)
        _mm_storeu_si128((__m128i*)(out + 16 * r), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
    else
        _mm256_storeu_ps(tmp + 8 * r, v);
}

/* the unrotated row of y = tmp (8 nv floats, nv = 2, 4, 8 or 16) into ``out`` */
__attribute__((target("avx2,f16c"))) static inline __attribute__((always_inline)) void pkv_unrotate_regs(
        const int nv, const float* cpost, int out_type, char* out, float* tmp) {
    __m256 v[8];
    if (nv <= 8) {
        pkv_hadamard_regs(tmp, nv, v);
#pragma GCC unroll 8
        for (int r = 0; r < nv; ++r) pkv_store_regs(v[r], cpost, r, out_type, out, tmp);
    } else {
        /* 128 floats: all stages but the last on each half, the first half parked in tmp
         * (16 live vectors would spill), then the last stage half against half */
        __m256 w[8];
        pkv_hadamard_regs(tmp, 8, v);
#pragma GCC unroll 8
        for (int r = 0; r < 8; ++r) _mm256_storeu_ps(tmp + 8 * r, v[r]);
        pkv_hadamard_regs(tmp + 64, 8, w);
#pragma GCC unroll 8
        for (int r = 0; r < 8; ++r) {
            const __m256 a = _mm256_loadu_ps(tmp + 8 * r);
            pkv_store_regs(_mm256_add_ps(a, w[r]), cpost, r, out_type, out, tmp);
            pkv_store_regs(_mm256_sub_ps(a, w[r]), cpost, r + 8, out_type, out, tmp);
        }
    }
    if (out_type == PKV_BF16) pkv_narrow_row(tmp, 8 * nv, out_type, (uint16_t*)out);
}

/* pkv_dequantize_f32 with fp8 decoded by F16C, eight codes at a time. e5m2 is the top
 * byte of a float16. e4m3's exponent bias is 8 below float16's, so its magnitude bits
 * shifted into float16's place read 2^-8 of its value, subnormals included (float16
 * holds them all); times 2^8 (exact) that is the code's value, and its NaN codes (0x7f,
 * 0xff) get pkv_fp8_decode's NaN. Every step is exact but the multiply by s, so the
 * result equals PKV_DEQUANT_LOOPS'. */
__attribute__((target("avx2,f16c"))) static inline __attribute__((always_inline)) void pkv_dequantize_f32_avx2(
        const uint8_t* q, int qtype, int64_t head_dim, int64_t groups, const float* scale, const float* zero,
        float* o) {
    if (qtype != PKV_E4M3 && qtype != PKV_E5M2) {
        pkv_dequantize_f32(q, qtype, head_dim, groups, scale, zero, o);
        return;
    }
    const __m256 s = _mm256_set1_ps(scale[0]);
    int64_t d = 0;
    if (qtype == PKV_E5M2) {
        for (; d + 8 <= head_dim; d += 8) {
            const __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i*)(q + d)));
            _mm256_storeu_ps(o + d, _mm256_mul_ps(_mm256_cvtph_ps(_mm_slli_epi16(b, 8)), s));
        }
    } else {
        const __m128i mag7 = _mm_set1_epi16(0x7f), sign8 = _mm_set1_epi16(0x80);
        const __m256 two8 = _mm256_set1_ps(256.0f), qnan = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fc00000));
        const __m256 sign32 = _mm256_castsi256_ps(_mm256_set1_epi32((int)0x80000000));
        for (; d + 8 <= head_dim; d += 8) {
            const __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i*)(q + d)));
            const __m128i m = _mm_and_si128(b, mag7);
            const __m128i h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(b, sign8), 8), _mm_slli_epi16(m, 7));
            const __m256 x = _mm256_mul_ps(_mm256_cvtph_ps(h), two8);
            const __m256 nan = _mm256_castsi256_ps(_mm256_cvtepi16_epi32(_mm_cmpeq_epi16(m, mag7)));
            const __m256 v = _mm256_blendv_ps(x, _mm256_or_ps(qnan, _mm256_and_ps(x, sign32)), nan);
            _mm256_storeu_ps(o + d, _mm256_mul_ps(v, s));
        }
    }
    for (; d < head_dim; ++d) o[d] = pkv_fp8_decode(q[d], qtype) * scale[0];
}

/* pkv_dequantize_row_avx2 for a rotated power-of-two row of 16 to 128 floats whose
 * signs are all +-1: ``signs`` here is c * post (pkv_unrotate_regs), prepared once per
 * call by the caller. */
__attribute__((target("avx2,f16c"))) static void pkv_dequantize_row_avx2_regs(PKV_DEQUANT_ROW_ARGS) {
    /* dequantizing into registers instead of the scratch row was measured slower (the
     * 128-float row then runs out of vector registers) */
    pkv_dequantize_f32_avx2(q, qtype, head_dim, groups, scale, zero, tmp);
    switch (head_dim) {
        case 16: pkv_unrotate_regs(2, signs, out_type, out, tmp); break;
        case 32: pkv_unrotate_regs(4, signs, out_type, out, tmp); break;
        case 64: pkv_unrotate_regs(8, signs, out_type, out, tmp); break;
        default: pkv_unrotate_regs(16, signs, out_type, out, tmp); break;
    }
}

__attribute__((target("avx2,f16c"))) static void pkv_dequantize_row_avx2(PKV_DEQUANT_ROW_ARGS) {
    if (out_type == PKV_F32) {
        pkv_dequantize_f32_avx2(q, qtype, head_dim, groups, scale, zero, (float*)out);
        if (signs) pkv_hadamard_row_avx2((float*)out, head_dim, NULL, signs);
        return;
    }
    pkv_dequantize_f32_avx2(q, qtype, head_dim, groups, scale, zero, tmp);
    if (signs) pkv_hadamard_row_avx2(tmp, head_dim, NULL, signs);
    if (out_type == PKV_BF16) {
        pkv_narrow_row(tmp, head_dim, out_type, (uint16_t*)out);
        return;
    }
    int64_t d = 0;
    for (; d + 8 <= head_dim; d += 8)
        _mm_storeu_si128((__m128i*)(out + 2 * d), _mm256_cvtps_ph(_mm256_loadu_ps(tmp + d), _MM_FROUND_TO_NEAREST_INT));
    pkv_narrow_row(tmp + d, head_dim - d, out_type, (uint16_t*)out + d);
}

__attribute__((target("avx2,f16c"))) static void pkv_quantize_row_avx2(PKV_QUANTIZE_ROW_ARGS) {
    if (in_type == PKV_F16) {  /* the F16C widening is exact, like pkv_f16_to_f32 */
        int64_t d = 0;
        for (; d + 8 <= head_dim; d += 8)
            _mm256_storeu_ps(tmp + d, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(x + 2 * d))));
        pkv_widen_row(x + 2 * d, in_type, head_dim - d, tmp + d);
    } else {
        pkv_widen_row(x, in_type, head_dim, tmp);
    }
    if (signs) pkv_hadamard_row_avx2(tmp, head_dim, signs, NULL);
    pkv_quantize_values(tmp, qtype, head_dim, groups, q, scale, zero, codes);
}
#else
#define PKV_HAVE_AVX2 0
#endif

typedef void (*pkv_dequantize_row_fn)(PKV_DEQUANT_ROW_ARGS);
typedef void (*pkv_quantize_row_fn)(PKV_QUANTIZE_ROW_ARGS);

/* Whether this process runs the 256-bit row functions: the CPU has AVX2 and F16C, and
 * PAGEDKV_CPU_BASELINE is unset (or "0"; set, it makes the tests run the baseline
 * build on a machine that would otherwise never run it). */
static int pkv_use_avx2(void) {
#if PKV_HAVE_AVX2
    const char* baseline = getenv("PAGEDKV_CPU_BASELINE");
    if (baseline && baseline[0] && strcmp(baseline, "0") != 0) return 0;
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
#else
    return 0;
#endif
}

/* the quantizing row function for this CPU */
static pkv_quantize_row_fn pkv_pick_quantize_row(void) {
#if PKV_HAVE_AVX2
    if (pkv_use_avx2()) return pkv_quantize_row_avx2;
#endif
    return pkv_quantize_row_base;
}

/* the row function for this CPU */
static pkv_dequantize_row_fn pkv_pick_dequantize_row(void) {
#if PKV_HAVE_AVX2
    if (pkv_use_avx2()) return pkv_dequantize_row_avx2;
#endif
    return pkv_dequantize_row_base;
}

/* The gather row function that unrotates with the row in registers, for ``signs`` of
 * ``head_dim``, with its c * post vector written to ``cpost`` (head_dim floats, may be
 * ``signs`` itself); NULL
 * when that path does not apply (no AVX2, a head_dim other than 16, 32, 64 or 128, a
 * sign other than +-1): the caller then runs pkv_pick_dequantize_row's with the signs. */
static pkv_dequantize_row_fn pkv_pick_unrotating_row(const float* signs, int64_t head_dim, float* cpost) {
#if PKV_HAVE_AVX2
    if (!pkv_use_avx2() || (head_dim != 16 && head_dim != 32 && head_dim != 64 && head_dim != 128)) return NULL;
    for (int64_t j = 0; j < head_dim; ++j)
        if (signs[j] != 1.0f && signs[j] != -1.0f) return NULL;
    /* every sign checked before the first write: cpost may be signs itself */
    const float c = pkv_hadamard_scale(head_dim);
    for (int64_t j = 0; j < head_dim; ++j) cpost[j] = c * signs[j];
    return pkv_dequantize_row_avx2_regs;
#else
    (void)signs; (void)head_dim; (void)cpost;
    return NULL;
#endif
}

#endif
