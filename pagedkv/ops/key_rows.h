/* key_rows.h - one K row of an int4 "block keys" block on the CPU (pagedkv/quant.py,
 * "block keys"), for the dequantizing gather of _cpu_quant.pyx.
 *
 * Built on quant_rows.h's conversions (the same -ffp-contract=off arithmetic, the same
 * float16/bfloat16 narrowing) and its run-time choice of the AVX2/F16C build.
 */
#ifndef PAGEDKV_KEY_ROWS_H
#define PAGEDKV_KEY_ROWS_H

#include "quant_rows.h"

/* A K row of a sealed block holds the int4 codes of the per-token format (same packing,
 * same bytes), dequantized with its block's per-channel bfloat16 parameters:
 * y[d] = (float(c[d]) * s[d]) + z[d], two roundings, then the output conversion. The row
 * is never unrotated (block keys are quantized unrotated). Widening bfloat16 is a
 * 16-bit shift, exact. ``scale``/``zero`` point at the (block, head)'s head_dim values;
 * ``tmp`` is head_dim floats of scratch for a narrowed output.
 *
 * Wider block keys (``extra`` > 0, pagedkv.format.quant "wider block keys"): c[d] also has
 * ``extra`` high bits, read from ``high``, the row's per-token parameter bytes (its scale
 * groups' bytes, then its zero points', as pkv_key_high lays them out): channel d's at bit
 * (d * extra) % 8 of byte (d * extra) / 8; c[d] = nibble | high << 4. */

#define PKV_KEY_ROW_ARGS                                                                           \
    const uint8_t *q, int64_t head_dim, const uint16_t *scale, const uint16_t *zero, const uint8_t *high, \
        int extra, int out_type, char *out, float *tmp

/* whether a (block, head) holds block keys: its first scale is a nonzero float (either
 * zero's sign means "still per token"; NaN counts as nonzero, as in the reference) */
static inline int pkv_key_sealed(const uint16_t* scale) { return (scale[0] & 0x7fffu) != 0u; }

/* the most high-bit bytes of a row: head_dim 1,024 at 4 bits */
#define PKV_KEY_HIGH_MAX 512

/* The high-bit bytes of a sealed K row: the ``need`` = ceil(head_dim * extra / 8) first bytes of
 * its scale row (``param_row`` bytes) followed by its zero row; copied into ``buf`` (at
 * least need bytes) unless the scale row alone holds them. */
static inline const uint8_t* pkv_key_high(const char* srow, const char* zrow, int64_t param_row, int64_t need,
                                          uint8_t* buf) {
    if (need <= param_row) return (const uint8_t*)srow;
    memcpy(buf, srow, (size_t)param_row);
    memcpy(buf + param_row, zrow, (size_t)(need - param_row));
    return buf;
}

/* channel d's high bits (``extra`` of them; 0 when extra is 0) */
static inline uint32_t pkv_key_high_at(const uint8_t* high, int extra, int64_t d) {
    if (!extra) return 0u;
    const int64_t bit = d * extra;
    return ((uint32_t)high[bit >> 3] >> (bit & 7)) & ((1u << extra) - 1u);
}

static inline __attribute__((always_inline)) void pkv_key_channels_f32(
        const uint8_t* q, int64_t head_dim, const uint16_t* scale, const uint16_t* zero, const uint8_t* high,
        int extra, float* o) {
    for (int64_t i = 0; i < head_dim / 2; ++i) {
        const uint32_t c0 = (q[i] & 15u) | (pkv_key_high_at(high, extra, 2 * i) << 4);
        const uint32_t c1 = (uint32_t)(q[i] >> 4) | (pkv_key_high_at(high, extra, 2 * i + 1) << 4);
        o[2 * i] = (float)c0 * pkv_bf16_to_f32(scale[2 * i]) + pkv_bf16_to_f32(zero[2 * i]);
        o[2 * i + 1] = (float)c1 * pkv_bf16_to_f32(scale[2 * i + 1]) + pkv_bf16_to_f32(zero[2 * i + 1]);
    }
}

static void pkv_key_channels_row_base(PKV_KEY_ROW_ARGS) {
    if (out_type == PKV_F32) {
        pkv_key_channels_f32(q, head_dim, scale, zero, high, extra, (float*)out);
        return;
    }
    pkv_key_channels_f32(q, head_dim, scale, zero, high, extra, tmp);
    pkv_narrow_row(tmp, head_dim, out_type, (uint16_t*)out);
}

#if PKV_HAVE_AVX2
/* eight bfloat16 values widened to float32 lanes */
__attribute__((target("avx2,f16c"))) static inline __attribute__((always_inline)) __m256 pkv_bf16x8_avx2(
        const uint16_t* p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}

/* pkv_f32_to_bf16 of eight lanes (round to nearest even; NaN: quiet, top payload bits) */
__attribute__((target("avx2,f16c"))) static inline __attribute__((always_inline)) __m128i pkv_bf16_round_avx2(
        __m256 v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i hi = _mm256_srli_epi32(u, 16);
    const __m256i lsb = _mm256_and_si256(hi, _mm256_set1_epi32(1));
    const __m256i biased = _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb);
    const __m256i rounded = _mm256_srli_epi32(biased, 16);
    const __m256i nan = _mm256_or_si256(hi, _mm256_set1_epi32(0x40));
    const __m256i r = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(rounded), _mm256_castsi256_ps(nan),
                                                           _mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
    /* every lane is below 2^16: the unsigned-saturating pack keeps it; packus works per
     * 128-bit half, so the halves' results are then brought together */
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), _MM_SHUFFLE(3, 1, 2, 0));
    return _mm256_castsi256_si128(packed);
}

/* pkv_key_channels_row_base with eight channels per step: the nibbles of four code bytes
 * shifted into eight lanes, the same multiply then add per lane */
__attribute__((target("avx2,f16c"))) static void pkv_key_channels_row_avx2(PKV_KEY_ROW_ARGS) {
    const __m256i shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
    const __m256i nibble = _mm256_set1_epi32(15);
    /* the high bits of eight channels: ``extra`` bytes, lane i's at bits [i e, (i + 1) e) */
    const __m256i hshift = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(extra));
    const __m256i hmask = _mm256_set1_epi32((int)((1u << extra) - 1u));
    int64_t d = 0;
    for (; d + 8 <= head_dim; d += 8) {
        uint32_t w, hw = 0;
        memcpy(&w, q + d / 2, 4);
        __m256i ci = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int)w), shifts), nibble);
        if (extra) {
            memcpy(&hw, high + d * extra / 8, (size_t)extra);
            const __m256i hi = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int)hw), hshift), hmask);
            ci = _mm256_or_si256(ci, _mm256_slli_epi32(hi, 4));
        }
        const __m256 c = _mm256_cvtepi32_ps(ci);
        const __m256 y = _mm256_add_ps(_mm256_mul_ps(c, pkv_bf16x8_avx2(scale + d)), pkv_bf16x8_avx2(zero + d));
        if (out_type == PKV_F32)
            _mm256_storeu_ps((float*)out + d, y);
        else if (out_type == PKV_F16)
            _mm_storeu_si128((__m128i*)(out + 2 * d), _mm256_cvtps_ph(y, _MM_FROUND_TO_NEAREST_INT));
        else
            _mm_storeu_si128((__m128i*)(out + 2 * d), pkv_bf16_round_avx2(y));
    }
    if (d < head_dim) {  /* fewer than 8 channels left (head_dim is even) */
        const int64_t n = head_dim - d;
        /* head_dim - d < 8 channels: their high bits start at bit d * extra, a whole byte */
        const uint8_t* hd = extra ? high + d * extra / 8 : high;
        if (out_type == PKV_F32) {
            pkv_key_channels_f32(q + d / 2, n, scale + d, zero + d, hd, extra, (float*)out + d);
        } else {
            pkv_key_channels_f32(q + d / 2, n, scale + d, zero + d, hd, extra, tmp);
            pkv_narrow_row(tmp, n, out_type, (uint16_t*)out + d);
        }
    }
}
#endif

typedef void (*pkv_key_row_fn)(PKV_KEY_ROW_ARGS);

/* the block-key row function for this CPU */
static pkv_key_row_fn pkv_pick_key_row(void) {
#if PKV_HAVE_AVX2
    if (pkv_use_avx2()) return pkv_key_channels_row_avx2;
#endif
    return pkv_key_channels_row_base;
}

#endif
