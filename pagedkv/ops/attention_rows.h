/* attention_rows.h - paged attention on the CPU, reading the arena in place.
 *
 * One work item is (sequence b, KV heads [h0, h1), key range [t0, t1)): every query row
 * of b served by those heads (its query tokens times the GQA group) against those keys.
 * A decode item covers all KV heads: in the NHD layout a token's rows of consecutive
 * heads are adjacent, so the item streams each page once, where one item per head read
 * the same cache lines once per head with a head-sized stride (latency-bound: the same
 * code ran 2x faster on HND). Keys are taken a tile of ``tile`` tokens (of every head)
 * at a time: each K and V row is read from its page in its own format and widened to
 * float32 into the tile (quant_rows.h's row functions, key_rows.h's for sealed block
 * keys), then every row scores its head's part of the tile, and a float32 online softmax
 * (running max m, sum l, accumulator acc, per query row) takes it in, rescaling once per
 * tile. The item leaves (m, l, acc) unnormalized; the caller merges the items of one
 * sequence exactly (log-sum-exp) and divides once.
 *
 * Quantized rows are read as codes, never widened into a float row: a code row is
 * converted to float lanes in registers, 8 at a time, once per token for up to four
 * query rows, and the row's parameters are applied once per row (group) instead of once
 * per element:
 *   - per-token keys (int8, fp8, int4 and int3 groups): q . (s c + z) = s (q . c) + z sum(q)
 *     per group (int8's stored c - 128 puts 128 s into its zero);
 *   - block keys (per-channel s, z of a block and head): (q o s) . c + q . z, with q o s and
 *     q . z formed once per block;
 *   - values: acc += (p s) c per group, and sum(p z) kept per row and group, added to the
 *     row once at the end of the item.
 * float32 rows are scored where they lie; float16/bfloat16 rows, the exact window/sink
 * rows and rows whose groups are not a multiple of 8 wide go through a float32 row
 * (quant_rows.h's and key_rows.h's row functions). Every result differs from scoring the
 * dequantized rows only by float32 rounding (tests/test_paged_attention.py states the
 * tolerance).
 *
 * The loops use GCC vector extensions on 8 float lanes: one AVX instruction per operation
 * in the AVX2 build, two SSE2 ones in the baseline build.
 */
#ifndef PAGEDKV_ATTENTION_ROWS_H
#define PAGEDKV_ATTENTION_ROWS_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "key_rows.h"
#include "quant_rows.h"

/* tokens per tile at most, and tile rows (tokens x heads) at most */
#define PKV_ATTN_TILE 32
#define PKV_ATTN_MAX_TILE_ROWS 1024
/* query rows that share one conversion of a code row (kept in registers) */
#define PKV_ATTN_ROWS 4

/* how a token's row is read: float32 lanes, or codes of a storage format */
#define PKV_ROW_F32 0
#define PKV_ROW_I8 1
#define PKV_ROW_I4 2
#define PKV_ROW_I3 3
#define PKV_ROW_E4M3 4
#define PKV_ROW_E5M2 5

typedef struct {
    const float* q;          /* [num_q, Hq, D] float32, unrotated */
    const float* qrot;       /* the same rotated (rotated arena), or NULL */
    const uint8_t* layer;    /* the arena's layer view (contiguous) */
    const char* scale;       /* quantized: scale/zero views (contiguous) */
    const char* zero;
    const uint16_t* key_scale; /* int4 block keys, or NULL */
    const uint16_t* key_zero;
    int quantized;
    int kv_type;             /* quantized: PKV_E4M3.. ; else PKV_F32/F16/BF16 */
    const int32_t* indptr;
    const int32_t* indices;
    const int32_t* seq_lens;
    const int32_t* q_indptr;
    int64_t block_size, num_heads, head_dim, groups, group, num_q_heads;
    int64_t tile;            /* tokens per tile, 1..PKV_ATTN_TILE */
    int hnd;
    float sm_scale, soft_cap; /* soft_cap 0: none */
    int64_t window;          /* 0: none */
    int64_t sink_tokens;
    const char* exact_data;  /* [cap, 2, bs, H, D] model dtype, or NULL */
    int exact_type;
    const int64_t* exact_slot;
    const uint8_t* exact_valid;
    int64_t exact_recent, exact_sink;
    const float* signs;      /* rotation signs (rotating exact V rows), NULL without rotation */
    pkv_dequantize_row_fn deq;
    pkv_key_row_fn key_row;
    int64_t row_bytes, param_row, elem_bytes;
} pkv_attn_args;

/* floats of scratch one item of ``heads`` KV heads and ``rows`` query rows per head needs
 * (see pkv_attn_item_body) */
static inline int64_t pkv_attn_scratch_floats(int64_t tile, int64_t heads, int64_t rows, int64_t head_dim,
                                              int64_t groups) {
    const int64_t all = heads * rows;
    return rows * tile + all * (4 * head_dim + 2 * groups + 3) + 2 * tile * heads * (head_dim + 2 * groups) +
           head_dim + 32;
}

static inline int64_t pkv_attn_row(const pkv_attn_args* a, int64_t blk, int kv, int64_t off, int64_t h) {
    if (a->hnd) return ((blk * 2 + kv) * a->num_heads + h) * a->block_size + off;
    return ((blk * 2 + kv) * a->block_size + off) * a->num_heads + h;
}

typedef float pkv_attn_v8 __attribute__((vector_size(32)));
typedef int32_t pkv_attn_v8i __attribute__((vector_size(32)));
typedef uint32_t pkv_attn_v8u __attribute__((vector_size(32)));

#define PKV_AI static inline __attribute__((always_inline))
/* 8-lane vectors passed between always-inlined functions: no ABI is involved */
#pragma GCC diagnostic ignored "-Wpsabi"

PKV_AI pkv_attn_v8 pkv_attn_ld(const float* p) {
    pkv_attn_v8 v;
    memcpy(&v, p, sizeof v);
    return v;
}

PKV_AI void pkv_attn_st(float* p, pkv_attn_v8 v) { memcpy(p, &v, sizeof v); }

PKV_AI float pkv_attn_hsum(pkv_attn_v8 s) {
    return ((s[0] + s[4]) + (s[1] + s[5])) + ((s[2] + s[6]) + (s[3] + s[7]));
}

PKV_AI pkv_attn_v8u pkv_attn_sel(pkv_attn_v8i c, pkv_attn_v8u a, pkv_attn_v8u b) {
    return (a & (pkv_attn_v8u)c) | (b & ~(pkv_attn_v8u)c);
}

/* Elements [d, d + 8) of a row as float lanes: float32 values, or the codes of a format
 * exactly as quant_rows.h reads them (int8: the stored c - 128; int4: element 2i in the
 * low nibble of byte i; int3: 8 codes in 3 bytes; fp8: its value, NaN and subnormals
 * included, by integer operations). ``kind`` is a constant wherever this is inlined. */
PKV_AI pkv_attn_v8 pkv_attn_lanes(const int kind, const uint8_t* row, int64_t d) {
    /* bytes reach their lanes by a broadcast and per-lane shifts (a vpsllvd / vpsrlvd each
     * in the AVX2 build): GCC turns a conversion from an 8-byte vector into scalar code */
    if (kind == PKV_ROW_I8) {
        uint32_t w[2];
        memcpy(w, row + d, 8);
        const pkv_attn_v8u up = {24u, 16u, 8u, 0u, 24u, 16u, 8u, 0u};
        const pkv_attn_v8i c = (pkv_attn_v8i)((pkv_attn_v8u){w[0], w[0], w[0], w[0], w[1], w[1], w[1], w[1]} << up) >> 24;
        return __builtin_convertvector(c, pkv_attn_v8);
    }
    if (kind == PKV_ROW_I4) {
        uint32_t w;
        memcpy(&w, row + d / 2, 4);
        const pkv_attn_v8u shifts = {0u, 4u, 8u, 12u, 16u, 20u, 24u, 28u};
        const pkv_attn_v8u c = ((pkv_attn_v8u){w, w, w, w, w, w, w, w} >> shifts) & 15u;
        return __builtin_convertvector((pkv_attn_v8i)c, pkv_attn_v8);
    }
    if (kind == PKV_ROW_I3) {
        const uint8_t* p = row + d / 8 * 3;
        const uint32_t w = (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16);
        const pkv_attn_v8u shifts = {0u, 3u, 6u, 9u, 12u, 15u, 18u, 21u};
        const pkv_attn_v8u c = ((pkv_attn_v8u){w, w, w, w, w, w, w, w} >> shifts) & 7u;
        return __builtin_convertvector((pkv_attn_v8i)c, pkv_attn_v8);
    }
    if (kind == PKV_ROW_E4M3 || kind == PKV_ROW_E5M2) {
        uint32_t w[2];
        memcpy(w, row + d, 8);
        const pkv_attn_v8u down = {0u, 8u, 16u, 24u, 0u, 8u, 16u, 24u};
        const pkv_attn_v8u u = ((pkv_attn_v8u){w[0], w[0], w[0], w[0], w[1], w[1], w[1], w[1]} >> down) & 0xffu;
        const pkv_attn_v8u sign = (u & 0x80u) << 24, m = u & 0x7fu;
        pkv_attn_v8u r;
        if (kind == PKV_ROW_E4M3) {  /* pkv_fp8_decode, lane by lane */
            const pkv_attn_v8 sub = __builtin_convertvector((pkv_attn_v8i)(m & 7u), pkv_attn_v8) * 0.001953125f;
            r = pkv_attn_sel(m > 7u, (m << 20) + (120u << 23), (pkv_attn_v8u)sub);
            r = pkv_attn_sel(m == 0x7fu, (pkv_attn_v8u){0} + 0x7fc00000u, r);
        } else {
            const pkv_attn_v8 sub = __builtin_convertvector((pkv_attn_v8i)(m & 3u), pkv_attn_v8) * 1.52587890625e-05f;
            r = pkv_attn_sel(m > 3u, (m << 21) + (112u << 23), (pkv_attn_v8u)sub);
            r = pkv_attn_sel(m >= 0x7cu, 0x7f800000u | ((m & 3u) << 21), r);
        }
        return (pkv_attn_v8)(r | sign);
    }
    return pkv_attn_ld((const float*)row + d);
}

/* out[r] = sum over groups g of gs[g] * (q_r[g] . c[g]) for R (constant) query rows
 * q_r = q + r * D; each group a multiple of 8 wide (``gs`` NULL: one group, scale 1) */
PKV_AI void pkv_attn_kdots(const int kind, const int R, const uint8_t* row, const float* q, int64_t D,
                           int64_t groups, const float* gs, float* out) {
    pkv_attn_v8 tot[PKV_ATTN_ROWS];
    const int64_t g_len = D / groups;
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) tot[r] = (pkv_attn_v8){0};
    for (int64_t g = 0; g < groups; ++g) {
        pkv_attn_v8 acc[PKV_ATTN_ROWS];
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) acc[r] = (pkv_attn_v8){0};
        for (int64_t d = g * g_len; d < (g + 1) * g_len; d += 8) {
            const pkv_attn_v8 c = pkv_attn_lanes(kind, row, d);
#pragma GCC unroll 4
            for (int r = 0; r < R; ++r) acc[r] += pkv_attn_ld(q + r * D + d) * c;
        }
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) tot[r] += gs ? acc[r] * gs[g] : acc[r];
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) out[r] = pkv_attn_hsum(tot[r]);
}

/* out[r] = q_r . k for a float32 row k of any length */
PKV_AI void pkv_attn_kdots_f32(const int R, const float* k, const float* q, int64_t D, float* out) {
    pkv_attn_v8 acc[PKV_ATTN_ROWS];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) acc[r] = (pkv_attn_v8){0};
    int64_t d = 0;
    for (; d + 8 <= D; d += 8) {
        const pkv_attn_v8 c = pkv_attn_ld(k + d);
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) acc[r] += pkv_attn_ld(q + r * D + d) * c;
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
        float s = pkv_attn_hsum(acc[r]);
        for (int64_t e = d; e < D; ++e) s += q[r * D + e] * k[e];
        out[r] = s;
    }
}

/* acc_r[d] += w[r * groups + g] * c[d] for d in group g, R (constant) rows acc + r * D */
PKV_AI void pkv_attn_vaxpy(const int kind, const int R, const uint8_t* row, float* acc, int64_t D, int64_t groups,
                           const float* w) {
    const int64_t g_len = D / groups;
    for (int64_t g = 0; g < groups; ++g) {
        pkv_attn_v8 wv[PKV_ATTN_ROWS];
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) wv[r] = (pkv_attn_v8){0} + w[r * groups + g];
        for (int64_t d = g * g_len; d < (g + 1) * g_len; d += 8) {
            const pkv_attn_v8 c = pkv_attn_lanes(kind, row, d);
#pragma GCC unroll 4
            for (int r = 0; r < R; ++r) pkv_attn_st(acc + r * D + d, pkv_attn_ld(acc + r * D + d) + wv[r] * c);
        }
    }
}

/* acc_r += w[r] * v for a float32 row v of any length */
PKV_AI void pkv_attn_vaxpy_f32(const int R, const float* v, float* acc, int64_t D, const float* w) {
    int64_t d = 0;
    pkv_attn_v8 wv[PKV_ATTN_ROWS];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) wv[r] = (pkv_attn_v8){0} + w[r];
    for (; d + 8 <= D; d += 8) {
        const pkv_attn_v8 c = pkv_attn_ld(v + d);
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) pkv_attn_st(acc + r * D + d, pkv_attn_ld(acc + r * D + d) + wv[r] * c);
    }
    for (int r = 0; r < R; ++r)
        for (int64_t e = d; e < D; ++e) acc[r * D + e] += w[r] * v[e];
}

/* the R of a chunk of rows as a constant: one inlined copy of CALL per R */
#define PKV_ATTN_BY_R(nr, CALL)            \
    switch (nr) {                          \
        case 1: { const int R = 1; CALL; } break; \
        case 2: { const int R = 2; CALL; } break; \
        case 3: { const int R = 3; CALL; } break; \
        default: { const int R = 4; CALL; } break; \
    }

/* the format of a row as a constant: one inlined copy of CALL per kind */
#define PKV_ATTN_BY_KIND(kind, CALL)                                  \
    switch (kind) {                                                   \
        case PKV_ROW_F32: { const int K = PKV_ROW_F32; CALL; } break; \
        case PKV_ROW_I8: { const int K = PKV_ROW_I8; CALL; } break;   \
        case PKV_ROW_I4: { const int K = PKV_ROW_I4; CALL; } break;   \
        case PKV_ROW_I3: { const int K = PKV_ROW_I3; CALL; } break;   \
        case PKV_ROW_E4M3: { const int K = PKV_ROW_E4M3; CALL; } break; \
        default: { const int K = PKV_ROW_E5M2; CALL; } break;         \
    }

/* The per-token parameters of a quantized row as per-group float scales ``s`` and offsets
 * ``z`` such that the row's value is s * lane + z (int8: its zero plus 128 s; fp8: z = 0) */
PKV_AI void pkv_attn_params(const pkv_attn_args* a, int64_t r, int64_t groups, float* s, float* z) {
    const char* sp = a->scale + r * a->param_row;
    const char* zp = a->zero ? a->zero + r * a->param_row : NULL;
    if (a->kv_type == PKV_INT3) {
        for (int64_t g = 0; g < groups; ++g) {
            s[g] = pkv_bf16_to_f32(((const uint16_t*)sp)[g]);
            z[g] = zp ? pkv_bf16_to_f32(((const uint16_t*)zp)[g]) : 0.0f;
        }
    } else if (a->kv_type == PKV_INT8) {
        s[0] = ((const float*)sp)[0];
        z[0] = (zp ? ((const float*)zp)[0] : 0.0f) + 128.0f * s[0];
    } else if (a->kv_type == PKV_INT4) {
        for (int64_t g = 0; g < groups; ++g) {
            s[g] = ((const float*)sp)[g];
            z[g] = zp ? ((const float*)zp)[g] : 0.0f;
        }
    } else {
        s[0] = ((const float*)sp)[0];
        z[0] = 0.0f;
    }
}

/* the exact-rows slot row of token ``pos`` in block ``blk`` (or NULL): its K row, the V
 * row lies block_size * num_heads * D elements after */
PKV_AI const char* pkv_attn_exact(const pkv_attn_args* a, int64_t n, int64_t pos, int64_t blk, int64_t off,
                                  int64_t h) {
    if (!a->exact_data) return NULL;
    const int64_t lo = n - a->exact_recent > 0 ? n - a->exact_recent : 0;
    const int64_t head = a->exact_sink < lo ? a->exact_sink : lo;
    if (pos >= head && pos < lo) return NULL;
    const int64_t s = a->exact_slot[blk];
    if (s < 0 || !a->exact_valid[s * a->block_size + off]) return NULL;
    const int64_t es = a->exact_type == PKV_F32 ? 4 : 2;
    return a->exact_data + ((s * 2 * a->block_size + off) * a->num_heads + h) * a->head_dim * es;
}

/* e^x of 8 lanes (x <= 0 here): 2^n e^f with n = rint(x log2 e), f = x - n ln 2 (ln 2 in two
 * parts, |f| <= ln2 / 2) and e^f a degree-6 polynomial (Taylor, relative error < 2e-7 plus
 * a few roundings); lanes below -87 (e^x < 2^-125, no subnormal) and -inf give 0 */
PKV_AI pkv_attn_v8 pkv_attn_exp8(pkv_attn_v8 x) {
    const pkv_attn_v8i dead = x < -87.0f;
    x = (pkv_attn_v8)((pkv_attn_v8i)x & ~dead);  /* keep the arithmetic finite */
    const pkv_attn_v8 n = (x * 1.44269504088896341f - 12582912.0f) + 12582912.0f;  /* rint for |v| < 2^22 */
    const pkv_attn_v8 f = (x - n * 0.693359375f) - n * -2.12194440e-4f;
    pkv_attn_v8 y = f * (1.0f / 720.0f) + (1.0f / 120.0f);
    y = y * f + (1.0f / 24.0f);
    y = y * f + (1.0f / 6.0f);
    y = y * f + 0.5f;
    y = y * f + 1.0f;
    y = y * f + 1.0f;
    const pkv_attn_v8i e = (__builtin_convertvector(n, pkv_attn_v8i) + 127) << 23;
    y = y * (pkv_attn_v8)e;
    return (pkv_attn_v8)((pkv_attn_v8i)y & ~dead);
}

/* s[t] = e^(s[t] - mx) over a tile row (-inf gives 0); returns their sum */
PKV_AI float pkv_attn_exp_tile(float* s, int64_t nt, float mx) {
    pkv_attn_v8 sum = {0};
    int64_t t = 0;
    for (; t + 8 <= nt; t += 8) {
        const pkv_attn_v8 e = pkv_attn_exp8(pkv_attn_ld(s + t) - mx);
        pkv_attn_st(s + t, e);
        sum += e;
    }
    float total = pkv_attn_hsum(sum);
    if (t < nt) {  /* the tail through the same lanes */
        float buf[8];
        for (int64_t i = 0; i < 8; ++i) buf[i] = t + i < nt ? s[t + i] - mx : -INFINITY;
        const pkv_attn_v8 e = pkv_attn_exp8(pkv_attn_ld(buf));
        for (int64_t i = 0; t + i < nt; ++i) {
            s[t + i] = e[i];
            total += e[i];
        }
    }
    return total;
}

/* copy n bytes, 32 at a time inline (the libc call per short row was measured slower) */
PKV_AI void pkv_attn_copy(void* dst, const void* src, int64_t n) {
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        pkv_attn_v8 v;
        memcpy(&v, (const char*)src + i, 32);
        memcpy((char*)dst + i, &v, 32);
    }
    if (i < n) memcpy((char*)dst + i, (const char*)src + i, (size_t)(n - i));
}

/* how a staged token row is scored / added */
#define PKV_TOK_FLOAT 0     /* a float32 row met by the unrotated q */
#define PKV_TOK_CODES 1     /* per-token codes, with (s, z) per group */
#define PKV_TOK_BLOCK_KEY 2 /* int4 codes of a sealed block key */
#define PKV_TOK_FLOAT_ROT 3 /* a float32 row of the rotated domain */

/* Copy token ``j``'s K (kv 0) or V (kv 1) row into its tile slot ``dst`` (D floats): codes
 * as stored where they are read fused (their parameters into ``par``: s then z, per
 * group), else the row as float32. Returns its PKV_TOK_ kind. */
PKV_AI int pkv_attn_stage(const pkv_attn_args* a, int kv, int64_t n, int64_t j, int64_t blk, int64_t off, int64_t h,
                          int fused, int64_t groups, float* dst, float* par, int64_t* key_param, float* tmp) {
    const int64_t D = a->head_dim;
    const char* ex = pkv_attn_exact(a, n, j, blk, off, h);
    if (ex) {
        if (kv) ex += a->block_size * a->num_heads * D * (a->exact_type == PKV_F32 ? 4 : 2);
        pkv_widen_row(ex, a->exact_type, D, dst);
        if (kv && a->signs) pkv_rotate_row(dst, D, a->signs);  /* the accumulator is in the rotated domain */
        return PKV_TOK_FLOAT;
    }
    const int64_t r = pkv_attn_row(a, blk, kv, off, h);
    if (!a->quantized) {
        if (a->kv_type == PKV_F32)
            pkv_attn_copy(dst, a->layer + r * D * 4, D * 4);
        else
            pkv_widen_row((const char*)a->layer + r * D * a->elem_bytes, a->kv_type, D, dst);
        return PKV_TOK_FLOAT;
    }
    const uint8_t* row = a->layer + r * a->row_bytes;
    const int64_t kp = (blk * a->num_heads + h) * D;
    if (!kv && a->key_scale && pkv_key_sealed(a->key_scale + kp)) {
        if (D % 8 == 0) {
            pkv_attn_copy(dst, row, a->row_bytes);
            *key_param = kp;
            return PKV_TOK_BLOCK_KEY;
        }
        a->key_row(row, D, a->key_scale + kp, a->key_zero + kp, PKV_F32, (char*)dst, tmp);
        return PKV_TOK_FLOAT;
    }
    if (fused) {
        pkv_attn_copy(dst, row, a->row_bytes);
        pkv_attn_params(a, r, groups, par, par + groups);
        return PKV_TOK_CODES;
    }
    a->deq(row, a->kv_type, D, a->groups, (const float*)(a->scale + r * a->param_row),
           a->zero ? (const float*)(a->zero + r * a->param_row) : NULL, PKV_F32, (char*)dst, tmp, NULL);
    return kv ? PKV_TOK_FLOAT : PKV_TOK_FLOAT_ROT;
}

/* Scores sc[r * T + t] of R (constant) query rows against a staged tile of keys. qp/qr: the
 * rows' unrotated / rotated q; qsum their per-group sums of qr; qk, qz: R * D and R floats
 * for block keys (q o s and q . z, formed once per block: *kp_last names the block whose
 * they hold, kept across tiles). */
PKV_AI void pkv_attn_score_tile(const pkv_attn_args* a, const int kind, const int R, int64_t nt, const int8_t* tk,
                                const int64_t* tkp, const float* ktile, const float* kpar, const float* qp,
                                const float* qr, const float* qsum, int64_t groups, float* qk, float* qz,
                                int64_t* kp_last, float* sc) {
    const int64_t D = a->head_dim, T = a->tile;
    int64_t key_param = *kp_last;
    float dots[PKV_ATTN_ROWS];
    for (int64_t t = 0; t < nt; ++t) {
        const float* row = ktile + t * D;
        if (tk[t] == PKV_TOK_FLOAT) {
            pkv_attn_kdots_f32(R, row, qp, D, dots);
        } else if (tk[t] == PKV_TOK_FLOAT_ROT) {
            pkv_attn_kdots_f32(R, row, qr, D, dots);
        } else if (tk[t] == PKV_TOK_CODES) {
            const float* s = kpar + t * 2 * groups;
            pkv_attn_kdots(kind, R, (const uint8_t*)row, qr, D, groups, s, dots);
#pragma GCC unroll 4
            for (int r = 0; r < R; ++r)
                for (int64_t g = 0; g < groups; ++g) dots[r] += s[groups + g] * qsum[r * groups + g];
        } else {
            if (tkp[t] != key_param) {
                key_param = tkp[t];
                const uint16_t* ks = a->key_scale + key_param;
                const uint16_t* kz = a->key_zero + key_param;
                for (int r = 0; r < R; ++r) {
                    float zs = 0.0f;
                    for (int64_t d = 0; d < D; ++d) {
                        qk[r * D + d] = qp[r * D + d] * pkv_bf16_to_f32(ks[d]);
                        zs += qp[r * D + d] * pkv_bf16_to_f32(kz[d]);
                    }
                    qz[r] = zs;
                }
            }
            pkv_attn_kdots(PKV_ROW_I4, R, (const uint8_t*)row, qk, D, 1, NULL, dots);
#pragma GCC unroll 4
            for (int r = 0; r < R; ++r) dots[r] += qz[r];
        }
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) sc[r * T + t] = dots[r];
    }
    *kp_last = key_param;
}

/* acc_r += sum_t p[r * T + t] * v_t for R (constant) rows over a staged tile of values;
 * code rows add (p s) c per group and keep sum p z in vz[r * groups + g] */
PKV_AI void pkv_attn_value_tile(const pkv_attn_args* a, const int kind, const int R, int64_t nt, const int8_t* tv,
                                const float* vtile, const float* vpar, const float* p, int64_t groups, float* acc,
                                float* vz) {
    const int64_t D = a->head_dim, T = a->tile;
    float w[PKV_ATTN_ROWS * 64];
    for (int64_t t = 0; t < nt; ++t) {
        int any = 0;
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) {
            w[r] = p[r * T + t];
            any |= w[r] != 0.0f;
        }
        if (!any) continue;
        const float* row = vtile + t * D;
        if (tv[t] != PKV_TOK_CODES) {
            pkv_attn_vaxpy_f32(R, row, acc, D, w);
            continue;
        }
        const float* s = vpar + t * 2 * groups;
#pragma GCC unroll 4
        for (int r = R - 1; r >= 0; --r) {
            const float pr = w[r];
            for (int64_t g = 0; g < groups; ++g) {
                w[r * groups + g] = pr * s[g];
                vz[r * groups + g] += pr * s[groups + g];
            }
        }
        pkv_attn_vaxpy(kind, R, (const uint8_t*)row, acc, D, groups, w);
    }
}

/* The item (b, KV heads [h0, h1), keys [t0, t1)): m, l ``[rows]`` and acc ``[rows, D]``
 * point at its first head's rows; rows = nh * nq * group, row (hh * nq + i) * group + g
 * is query token q_indptr[b] + i, head (h0 + hh) * group + g; unnormalized. scratch:
 * pkv_attn_scratch_floats(tile, nh, nq * group, D, groups) floats. Each tile's rows of
 * every head are first staged (copied as stored, or widened) in memory order (NHD: a
 * token's heads are adjacent; HND: a head's tokens are) into two L1-sized tiles: the
 * copies stream the pages once and keep many loads in flight, the scoring then runs on L1. */
PKV_AI void pkv_attn_item_body(const pkv_attn_args* a, int64_t b, int64_t h0, int64_t h1, int64_t t0, int64_t t1,
                               float* m, float* l, float* acc, float* scratch) {
    const int64_t D = a->head_dim, G = a->group, T = a->tile, nh = h1 - h0;
    const int64_t n = a->seq_lens[b], q0 = a->q_indptr[b], nq = a->q_indptr[b + 1] - q0;
    const int64_t rows_h = nq * G, rows = nh * rows_h;
    const int64_t first = a->indptr[b];
    const int64_t groups = a->quantized ? a->groups : 1;
    const int kind = !a->quantized ? PKV_ROW_F32
                     : a->kv_type == PKV_INT8 ? PKV_ROW_I8
                     : a->kv_type == PKV_INT4 ? PKV_ROW_I4
                     : a->kv_type == PKV_INT3 ? PKV_ROW_I3
                     : a->kv_type == PKV_E4M3 ? PKV_ROW_E4M3 : PKV_ROW_E5M2;
    /* codes are read as lanes when every group is whole 8-lane chunks */
    const int fused = a->quantized && D % 8 == 0 && (D / groups) % 8 == 0 && groups <= 64;
    float* sc = scratch;                  /* [rows_h, T] one head's scores, then weights */
    float* qp = sc + rows_h * T;          /* [rows, D] q, unrotated */
    float* qr_own = qp + rows * D;        /* [rows, D] q rotated (rotated arena) */
    float* qsum = qr_own + rows * D;      /* [rows, groups] per-group sums of qr */
    float* vz = qsum + rows * groups;     /* [rows, groups] sum of p * zero */
    float* qk = vz + rows * groups;       /* [rows, D] q o s of a block key's block */
    float* qz = qk + rows * D;            /* [rows] q . z of it */
    int64_t* kp_last = (int64_t*)(qz + rows + (rows & 1)); /* [rows] which block qk, qz hold */
    /* [nh, T, D] staged K rows, on a cache line (a misaligned copy target was measured 2x slower) */
    float* ktile = (float*)(((uintptr_t)(kp_last + rows) + 63) & ~(uintptr_t)63);
    float* vtile = ktile + nh * T * D;    /* [nh, T, D] staged V rows */
    float* kpar = vtile + nh * T * D;     /* [nh, T, 2, groups] their (s, z) */
    float* vpar = kpar + nh * T * 2 * groups;
    float* tmp = vpar + nh * T * 2 * groups; /* [D] */
    int8_t tk[PKV_ATTN_MAX_TILE_ROWS], tv[PKV_ATTN_MAX_TILE_ROWS];
    int64_t tkp[PKV_ATTN_MAX_TILE_ROWS];
    const float* qr = a->qrot ? qr_own : qp;  /* the q that per-token code rows meet */
    for (int64_t r = 0; r < rows; ++r) {
        const int64_t hh = r / rows_h, i = (r % rows_h) / G, g = r % G;
        const int64_t off = ((q0 + i) * a->num_q_heads + (h0 + hh) * G + g) * D;
        memcpy(qp + r * D, a->q + off, (size_t)D * sizeof(float));
        if (a->qrot) memcpy(qr_own + r * D, a->qrot + off, (size_t)D * sizeof(float));
        m[r] = -INFINITY;
        l[r] = 0.0f;
        kp_last[r] = -1;
    }
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t g = 0; g < groups; ++g) {
            float s = 0.0f;
            for (int64_t d = g * (D / groups); d < (g + 1) * (D / groups); ++d) s += qr[r * D + d];
            qsum[r * groups + g] = s;
            vz[r * groups + g] = 0.0f;
        }
    memset(acc, 0, (size_t)(rows * D) * sizeof(float));
    const int64_t p_min = n - nq;  /* the first query's position */
    const float sm_scale = a->sm_scale, soft_cap = a->soft_cap;
    const int64_t window = a->window, sink = a->sink_tokens;
    for (int64_t c0 = t0; c0 < t1; c0 += T) {
        const int64_t c1 = c0 + T < t1 ? c0 + T : t1, nt = c1 - c0;
        if (c0 > n - 1) break;
        if (a->window && c1 - 1 <= p_min - a->window && c0 >= a->sink_tokens) continue;  /* seen by no query */
        for (int64_t x = 0; x < nh * nt; ++x) {
            const int64_t hh = a->hnd ? x / nt : x % nh, t = a->hnd ? x % nt : x / nh, u = hh * T + t;
            const int64_t j = c0 + t, blk = a->indices[first + j / a->block_size], off = j % a->block_size;
            tk[u] = (int8_t)pkv_attn_stage(a, 0, n, j, blk, off, h0 + hh, fused, groups, ktile + u * D,
                                           kpar + u * 2 * groups, tkp + u, tmp);
            tv[u] = (int8_t)pkv_attn_stage(a, 1, n, j, blk, off, h0 + hh, fused, groups, vtile + u * D,
                                           vpar + u * 2 * groups, tkp + u, tmp);
        }
        for (int64_t hh = 0; hh < nh; ++hh) {
            const int64_t rb = hh * rows_h, u = hh * T;
            for (int64_t r0 = 0; r0 < rows_h; r0 += PKV_ATTN_ROWS) {
                const int64_t nr = rows_h - r0 < PKV_ATTN_ROWS ? rows_h - r0 : PKV_ATTN_ROWS, x = rb + r0;
                PKV_ATTN_BY_KIND(kind, PKV_ATTN_BY_R(nr, pkv_attn_score_tile(a, K, R, nt, tk + u, tkp + u,
                                                                             ktile + u * D, kpar + u * 2 * groups,
                                                                             qp + x * D, qr + x * D,
                                                                             qsum + x * groups, groups, qk + x * D,
                                                                             qz + x, kp_last + x, sc + r0 * T)))
            }
            /* masks, logits and the online softmax: sc becomes the weights */
            for (int64_t rr = 0; rr < rows_h; ++rr) {
                const int64_t p = p_min + rr / G, r = rb + rr;
                float* s = sc + rr * T;
                for (int64_t t = 0; t < nt; ++t) s[t] *= sm_scale;
                if (soft_cap > 0.0f)
                    for (int64_t t = 0; t < nt; ++t) s[t] = soft_cap * tanhf(s[t] / soft_cap);
                if (c1 - 1 > p || (window && c0 <= p - window))
                    for (int64_t t = 0; t < nt; ++t) {
                        const int64_t j = c0 + t;
                        if (j > p || (window && j <= p - window && j >= sink)) s[t] = -INFINITY;
                    }
                float mx = m[r];
                for (int64_t t = 0; t < nt; ++t) mx = s[t] > mx ? s[t] : mx;
                if (mx == -INFINITY) {  /* nothing seen yet */
                    for (int64_t t = 0; t < nt; ++t) s[t] = 0.0f;
                    continue;
                }
                if (mx > m[r]) {
                    const float c = m[r] == -INFINITY ? 0.0f : expf(m[r] - mx);
                    l[r] *= c;
                    float* ar = acc + r * D;
                    for (int64_t d = 0; d < D; ++d) ar[d] *= c;
                    for (int64_t g = 0; g < groups; ++g) vz[r * groups + g] *= c;
                    m[r] = mx;
                }
                l[r] += pkv_attn_exp_tile(s, nt, mx);
            }
            for (int64_t r0 = 0; r0 < rows_h; r0 += PKV_ATTN_ROWS) {
                const int64_t nr = rows_h - r0 < PKV_ATTN_ROWS ? rows_h - r0 : PKV_ATTN_ROWS, x = rb + r0;
                PKV_ATTN_BY_KIND(kind, PKV_ATTN_BY_R(nr, pkv_attn_value_tile(a, K, R, nt, tv + u, vtile + u * D,
                                                                             vpar + u * 2 * groups, sc + r0 * T,
                                                                             groups, acc + x * D,
                                                                             vz + x * groups)))
            }
        }
    }
    if (fused)  /* the values' offsets, once per row (zero where no code row was read) */
        for (int64_t r = 0; r < rows; ++r)
            for (int64_t g = 0; g < groups; ++g) {
                const float z = vz[r * groups + g];
                float* ar = acc + r * D + g * (D / groups);
                for (int64_t d = 0; d < D / groups; ++d) ar[d] += z;
            }
}

static void pkv_attn_item_base(const pkv_attn_args* a, int64_t b, int64_t h0, int64_t h1, int64_t t0, int64_t t1,
                               float* m, float* l, float* acc, float* scratch) {
    pkv_attn_item_body(a, b, h0, h1, t0, t1, m, l, acc, scratch);
}

#if PKV_HAVE_AVX2
__attribute__((target("avx2,f16c"))) static void pkv_attn_item_avx2(const pkv_attn_args* a, int64_t b, int64_t h0,
                                                                    int64_t h1, int64_t t0, int64_t t1, float* m,
                                                                    float* l, float* acc, float* scratch) {
    pkv_attn_item_body(a, b, h0, h1, t0, t1, m, l, acc, scratch);
}
#endif

typedef void (*pkv_attn_item_fn)(const pkv_attn_args*, int64_t, int64_t, int64_t, int64_t, int64_t, float*, float*,
                                 float*, float*);

static pkv_attn_item_fn pkv_pick_attn_item(void) {
#if PKV_HAVE_AVX2
    if (pkv_use_avx2()) return pkv_attn_item_avx2;
#endif
    return pkv_attn_item_base;
}

#endif
