/* key_seal.h - seal one (block, head) of int4 "block keys" on the CPU: the per-channel
 * requantization of pagedkv.quant.quantize_key_block, bit for bit, for the
 * seal_key_blocks loop of _cpu_quant.pyx.
 *
 * Per channel d over the block's bs tokens x[t][d] (widened exactly to float32):
 *   mn, mx = min, max (any NaN makes both NaN)
 *   z = bf16_down(mn), s = fix(bf16_up((mx - z) / 15))
 *   c[t] = clamp(rint((x[t] - z) / s), 0, 15), NaN -> 0
 * codes packed two per byte along d (element 2i in the low nibble), the bfloat16 bits
 * of s and z stored in the (block, head)'s key scale and zero rows. Wider keys
 * (``extra`` > 0): 15 becomes 2^(4 + extra) - 1, the nibble keeps c & 15, and c >> 4
 * goes to the token's K row parameter bytes (zeroed first), channel d's bits at bit
 * (d * extra) % 8 of byte (d * extra) / 8 of its scale row's bytes then its zero row's. Built with
 * quant_rows.h's flags (-ffp-contract=off, no fast math): each step rounds once, as
 * torch's float32 ops do. The AVX2 build runs eight channels per vector, the
 * baseline build one channel pair at a time; both are picked at run time like the
 * other row functions.
 */
#ifndef PAGEDKV_KEY_SEAL_H
#define PAGEDKV_KEY_SEAL_H

#include "key_rows.h"

/* x: token 0's head_dim values (in_type) of this head, x_tok bytes between tokens;
 * q: token 0's K row (head_dim / 2 bytes) in the arena, q_tok bytes between tokens;
 * scale, zero: the (block, head)'s head_dim bfloat16 parameters. head_dim is even.
 * extra > 0: hs, hz: token 0's K row scale and zero parameter rows (param_row bytes
 * each), h_tok bytes between tokens; they receive the high bits. */
#define PKV_SEAL_ARGS                                                                              \
    const char *x, int in_type, int64_t x_tok, int64_t bs, int64_t head_dim, uint8_t *q, int64_t q_tok, \
        uint16_t *scale, uint16_t *zero, char *hs, char *hz, int64_t h_tok, int64_t param_row, int extra

static inline float pkv_load_one(const char* p, int in_type) {
    uint16_t h;
    if (in_type == PKV_F32) {
        float f;
        memcpy(&f, p, 4);
        return f;
    }
    memcpy(&h, p, 2);
    return in_type == PKV_F16 ? pkv_f16_to_f32(h) : pkv_bf16_to_f32(h);
}

/* channel d's parameters: stores its scale and zero bits, returns s and z as floats */
static inline void pkv_seal_channel_params(const char* x, int in_type, int64_t x_tok, int64_t bs, float top,
                                           uint16_t* scale, uint16_t* zero, float* s_out, float* z_out) {
    float lo = pkv_float(0x7f800000u), hi = pkv_float(0xff800000u);
    uint32_t nan = 0;
    for (int64_t t = 0; t < bs; ++t) {
        const float v = pkv_load_one(x + t * x_tok, in_type);
        nan |= (uint32_t)(v != v);
        lo = v < lo ? v : lo;
        hi = v > hi ? v : hi;
    }
    if (nan) lo = hi = pkv_float(0x7fc00000u);
    const uint16_t zb = pkv_f32_to_bf16_directed(lo, 0);
    const float z = pkv_bf16_to_f32(zb);
    const float s = pkv_fix_scale(pkv_bf16_to_f32(pkv_f32_to_bf16_directed((hi - z) / top, 1)));
    *scale = pkv_f32_to_bf16(s); /* exact: s is a bfloat16 value (or 1) */
    *zero = zb;
    *s_out = s;
    *z_out = z;
}

static inline uint32_t pkv_seal_code(float x, float s, float z, float top) {
    return pkv_int_code((x - z) / s, top);
}

/* the top code of 4 + extra bits, as a float */
static inline float pkv_seal_top(int extra) { return (float)((1u << (4 + extra)) - 1u); }

/* ORs channel d's high bits (c >> 4) into a token's parameter rows (see the header) */
static inline void pkv_seal_put_high(char* hs, char* hz, int64_t param_row, int64_t d, int extra, uint32_t c) {
    const int64_t bit = d * extra, byte = bit >> 3;
    uint8_t* p = (uint8_t*)(byte < param_row ? hs + byte : hz + (byte - param_row));
    *p = (uint8_t)(*p | ((c >> 4) << (bit & 7)));
}

/* wider keys: a token's parameter rows start at zero, the high bits are ORed in */
static inline void pkv_seal_clear_high(char* hs, char* hz, int64_t h_tok, int64_t bs, int64_t param_row,
                                       int extra) {
    if (!extra) return;
    for (int64_t t = 0; t < bs; ++t) {
        memset(hs + t * h_tok, 0, (size_t)param_row);
        memset(hz + t * h_tok, 0, (size_t)param_row);
    }
}

/* channels [d0, head_dim) (d0 even), a pair (one code byte) at a time */
static inline void pkv_seal_channels_base(PKV_SEAL_ARGS, int64_t d0) {
    const int64_t es = in_type == PKV_F32 ? 4 : 2;
    const float top = pkv_seal_top(extra);
    for (int64_t d = d0; d < head_dim; d += 2) {
        float s0, z0, s1, z1;
        const char* x0 = x + d * es;
        const char* x1 = x0 + es;
        pkv_seal_channel_params(x0, in_type, x_tok, bs, top, scale + d, zero + d, &s0, &z0);
        pkv_seal_channel_params(x1, in_type, x_tok, bs, top, scale + d + 1, zero + d + 1, &s1, &z1);
        for (int64_t t = 0; t < bs; ++t) {
            const uint32_t c0 = pkv_seal_code(pkv_load_one(x0 + t * x_tok, in_type), s0, z0, top);
            const uint32_t c1 = pkv_seal_code(pkv_load_one(x1 + t * x_tok, in_type), s1, z1, top);
            q[t * q_tok + d / 2] = pkv_int4_pack(c0 & 15u, c1 & 15u);
            if (extra) {
                pkv_seal_put_high(hs + t * h_tok, hz + t * h_tok, param_row, d, extra, c0);
                pkv_seal_put_high(hs + t * h_tok, hz + t * h_tok, param_row, d + 1, extra, c1);
            }
        }
    }
}

static void pkv_seal_key_head_base(PKV_SEAL_ARGS) {
    pkv_seal_clear_high(hs, hz, h_tok, bs, param_row, extra);
    pkv_seal_channels_base(x, in_type, x_tok, bs, head_dim, q, q_tok, scale, zero, hs, hz, h_tok, param_row, extra,
                           0);
}

#if PKV_HAVE_AVX2
/* eight values of in_type widened exactly to float32 (F16C's conversion is exact) */
__attribute__((target("avx2,f16c"))) static inline __attribute__((always_inline)) __m256 pkv_load8_avx2(
        const char* p, int in_type) {
    if (in_type == PKV_F32) return _mm256_loadu_ps((const float*)p);
    if (in_type == PKV_F16) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p));
    return pkv_bf16x8_avx2((const uint16_t*)p);
}

/* pkv_f32_to_bf16_directed of eight lanes, the bfloat16 bits in the low half of each
 * 32-bit lane */
__attribute__((target("avx2,f16c"))) static inline __attribute__((always_inline)) __m256i pkv_bf16_directed_avx2(
        __m256 f, int up) {
    const __m256i u = _mm256_castps_si256(f);
    const __m256i a = _mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff));
    const __m256i hi16 = _mm256_set1_epi32((int)0xffff0000u);
    const __m256i away = _mm256_and_si256(_mm256_add_epi32(a, _mm256_set1_epi32(0xffff)), hi16);
    const __m256i trunc = _mm256_and_si256(a, hi16);
    const __m256 neg = _mm256_castsi256_ps(_mm256_srai_epi32(u, 31));
    /* away from zero when the sign differs from the wanted direction (neg != up) */
    const __m256i mag = up ? _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(away),
                                                                  _mm256_castsi256_ps(trunc), neg))
                           : _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(trunc),
                                                                  _mm256_castsi256_ps(away), neg));
    const __m256i r = _mm256_srli_epi32(
        _mm256_or_si256(_mm256_and_si256(u, _mm256_set1_epi32((int)0x80000000u)), mag), 16);
    const __m256i nan = _mm256_cmpgt_epi32(a, _mm256_set1_epi32(0x7f800000));
    return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), nan);
}

/* eight 32-bit lanes below 2^16 stored as eight uint16 */
__attribute__((target("avx2,f16c"))) static inline __attribute__((always_inline)) void pkv_store_u16x8_avx2(
        uint16_t* p, __m256i v) {
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(v, v), _MM_SHUFFLE(3, 1, 2, 0));
    _mm_storeu_si128((__m128i*)p, _mm256_castsi256_si128(packed));
}

/* eight channels per step: min/max over the tokens in registers, the parameters, then
 * the tokens again for the codes (four bytes per token); the channels past the last
 * whole eight take the baseline path */
__attribute__((target("avx2,f16c"))) static void pkv_seal_key_head_avx2(PKV_SEAL_ARGS) {
    const int64_t es = in_type == PKV_F32 ? 4 : 2;
    pkv_seal_clear_high(hs, hz, h_tok, bs, param_row, extra);
    const __m256 fifteen = _mm256_set1_ps(pkv_seal_top(extra)), zerof = _mm256_setzero_ps(),
                 one = _mm256_set1_ps(1.0f);
    const __m256i nib = _mm256_set1_epi32(15);
    const __m256i hshift = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(extra));
    const __m256 qnan = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fc00000));
    const __m256i exp_mask = _mm256_set1_epi32(0x7f800000);
    /* per 128-bit half: bytes 0 and 8 (the packed code bytes of its four lanes) first */
    const __m256i gather = _mm256_setr_epi8(0, 8, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                            0, 8, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
    int64_t d = 0;
    for (; d + 8 <= head_dim; d += 8) {
        const char* xd = x + d * es;
        __m256 lo = _mm256_castsi256_ps(_mm256_set1_epi32(0x7f800000));
        __m256 hi = _mm256_castsi256_ps(_mm256_set1_epi32((int)0xff800000u));
        __m256 nan = _mm256_setzero_ps();
        for (int64_t t = 0; t < bs; ++t) {
            const __m256 v = pkv_load8_avx2(xd + t * x_tok, in_type);
            nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
            lo = _mm256_min_ps(v, lo); /* a NaN v leaves lo: the nan mask takes over below */
            hi = _mm256_max_ps(v, hi);
        }
        lo = _mm256_blendv_ps(lo, qnan, nan);
        hi = _mm256_blendv_ps(hi, qnan, nan);
        const __m256i zb = pkv_bf16_directed_avx2(lo, 0);
        const __m256 z = _mm256_castsi256_ps(_mm256_slli_epi32(zb, 16));
        __m256 s = _mm256_castsi256_ps(
            _mm256_slli_epi32(pkv_bf16_directed_avx2(_mm256_div_ps(_mm256_sub_ps(hi, z), fifteen), 1), 16));
        const __m256 inf_or_nan = _mm256_castsi256_ps(
            _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_castps_si256(s), exp_mask), exp_mask));
        s = _mm256_blendv_ps(s, one, _mm256_or_ps(inf_or_nan, _mm256_cmp_ps(s, zerof, _CMP_EQ_OQ)));
        pkv_store_u16x8_avx2(scale + d, _mm256_srli_epi32(_mm256_castps_si256(s), 16)); /* exact */
        pkv_store_u16x8_avx2(zero + d, zb);
        for (int64_t t = 0; t < bs; ++t) {
            __m256 v = _mm256_div_ps(_mm256_sub_ps(pkv_load8_avx2(xd + t * x_tok, in_type), z), s);
            v = _mm256_and_ps(v, _mm256_cmp_ps(v, v, _CMP_ORD_Q));        /* NaN -> 0 */
            v = _mm256_min_ps(_mm256_max_ps(v, zerof), fifteen);          /* v not NaN here */
            v = _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            const __m256i cw = _mm256_cvttps_epi32(v);
            const __m256i c = _mm256_and_si256(cw, nib);
            /* lane 2i | lane 2i+1 << 4 in the low byte of each 64-bit lane pair */
            const __m256i p = _mm256_shuffle_epi8(_mm256_or_si256(c, _mm256_srli_epi64(c, 28)), gather);
            const uint32_t w = ((uint32_t)_mm_cvtsi128_si32(_mm256_castsi256_si128(p)) & 0xffffu) |
                               ((uint32_t)_mm_cvtsi128_si32(_mm256_extracti128_si256(p, 1)) << 16);
            memcpy(q + t * q_tok + d / 2, &w, 4);
            if (extra) {  /* lane i's c >> 4 at bits [i e, (i + 1) e): this chunk's ``extra`` bytes */
                uint32_t lanes[8], hw = 0;
                _mm256_storeu_si256((__m256i*)lanes, _mm256_sllv_epi32(_mm256_srli_epi32(cw, 4), hshift));
                for (int i = 0; i < 8; ++i) hw |= lanes[i];
                const int64_t byte = d * extra / 8;
                char* dst = byte < param_row ? hs + t * h_tok + byte : hz + t * h_tok + (byte - param_row);
                memcpy(dst, &hw, (size_t)extra);
            }
        }
    }
    if (d < head_dim)
        pkv_seal_channels_base(x, in_type, x_tok, bs, head_dim, q, q_tok, scale, zero, hs, hz, h_tok, param_row,
                               extra, d);
}
#endif

typedef void (*pkv_seal_head_fn)(PKV_SEAL_ARGS);

/* the sealing function for this CPU */
static pkv_seal_head_fn pkv_pick_seal_head(void) {
#if PKV_HAVE_AVX2
    if (pkv_use_avx2()) return pkv_seal_key_head_avx2;
#endif
    return pkv_seal_key_head_base;
}

#endif
