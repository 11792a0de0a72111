/* attention_rows.h - paged attention on the CPU, reading the arena in place.
 *
 * One work item is (sequence b, KV heads [h0, h1), key range [t0, t1)): every query row
 * of b served by those heads (its query tokens times the GQA group) against those keys.
 * A decode item covers all KV heads: in the NHD layout a token's rows of consecutive
 * heads are adjacent, so the item streams each page once, where one item per head read
 * the same cache lines once per head with a head-sized stride (latency-bound: the same
 * code ran 2x faster on HND). Keys are taken a tile of ``tile`` tokens (of every head)
 * at a time: each K and V row is read from its page in its own format and widened to
 * float32 into the tile (per-token code rows by the inlined lane loops below; sealed
 * block keys by key_rows.h's row function; fp16/bf16 and the exact rows by
 * pkv_widen_row; groups not whole 8-lane chunks by quant_rows.h's row function). Then the
 * rows of each query token's GQA group, up to four at once, score their head's part of
 * the tile (each K row load serves every row), and a float32 online softmax (running max
 * m, sum l, accumulator acc, per query row) takes it in, rescaling once per tile; the
 * values are added with 16 lanes of each row's accumulator kept in registers across the
 * tile. The item leaves (m, l, acc) unnormalized; the caller merges the items of one
 * sequence exactly (log-sum-exp) and divides once.
 *
 * Why widen rather than score the codes in place (3e7f933: s (q . c) + z sum(q) per
 * group, block keys as (q o s) . c + q . z): measured on these all-heads items, scoring
 * codes was slower than widening each row once into the tile that every query row of its
 * group then reads (1 thread, 32q/8kv/128, int4 block keys 47 ms vs 39 ms); its lane
 * decoding is what is kept. The fused item below (a->fused) decodes in registers with the
 * widening's own arithmetic, once per row for the GQA group's rows: it only reached parity
 * (1 thread, batch 8 x 4096, thread CPU time: int4 block keys 22.3 vs 23.5 ms, int3 26.0 vs
 * 27.5, int8 27.1 vs 25.7), after its tile had to be filled in address order (first
 * version 2x slower: misses) without a division per chunk; the affine V form (weights
 * p s per group, zeros summed apart) measured slower again (27.0 vs 23.6 ms).
 *
 * The loops use 8-lane GCC vector extensions: one AVX instruction per operation in the
 * AVX2/FMA builds, two SSE2 ones in the baseline build.
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
#define PKV_ATTN_MAX_TILE_ROWS 4096

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
    int kind;                /* quantized: its PKV_ROW_ kind where rows are widened here, else -1 */
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
    int prefetch;            /* PKV_ATTN_PREFETCH_ */
    int key_cache;           /* sealed block keys: 1 widen each block's bf16 parameters once per item */
    int fused;               /* code rows: decoded in registers where used (no widened tiles) */
} pkv_attn_args;

/* what the item prefetches of the next tile: nothing, every line, or the first lines of
 * each block's rows (a block's rows are contiguous; the hardware prefetcher follows them
 * once started). Measured (1 thread, batch 8 x 4096): every line wins for float32 rows
 * (32q/8kv/128: 33 ms against 36), the blocks' first lines for code rows (int4 block keys
 * 22.3 ms against 23.3, int8 23.2 against 24.1), within this machine's noise otherwise */
#define PKV_ATTN_PREFETCH_NONE 0
#define PKV_ATTN_PREFETCH_ALL 1
#define PKV_ATTN_PREFETCH_BLOCKS 2

/* The loops below may contract a * b + c into one fused multiply-add (the FMA build: half
 * the arithmetic instructions of a kernel that, with the rows in L1, is bound by them; a
 * fused result is the more exact one, and the tests' tolerance is unchanged) */
#pragma GCC push_options
#pragma GCC optimize("fp-contract=fast")

static inline int64_t pkv_attn_row(const pkv_attn_args* a, int64_t blk, int kv, int64_t off, int64_t h) {
    if (a->hnd) return ((blk * 2 + kv) * a->num_heads + h) * a->block_size + off;
    return ((blk * 2 + kv) * a->block_size + off) * a->num_heads + h;
}

/* a model-dtype row widened to float32 */
static inline __attribute__((always_inline)) void pkv_attn_widen(const char* x, int type, int64_t n, float* y) {
    pkv_widen_row(x, type, n, y);
}

typedef float pkv_attn_v8 __attribute__((vector_size(32)));

static inline __attribute__((always_inline)) float pkv_attn_dot(const float* x, const float* y, int64_t n) {
    pkv_attn_v8 s0 = {0}, s1 = {0};
    int64_t d = 0;
    for (; d + 16 <= n; d += 16) {
        pkv_attn_v8 a0, b0, a1, b1;
        memcpy(&a0, x + d, 32); memcpy(&b0, y + d, 32);
        memcpy(&a1, x + d + 8, 32); memcpy(&b1, y + d + 8, 32);
        s0 += a0 * b0;
        s1 += a1 * b1;
    }
    for (; d + 8 <= n; d += 8) {
        pkv_attn_v8 a0, b0;
        memcpy(&a0, x + d, 32); memcpy(&b0, y + d, 32);
        s0 += a0 * b0;
    }
    s0 += s1;
    float s = ((s0[0] + s0[4]) + (s0[1] + s0[5])) + ((s0[2] + s0[6]) + (s0[3] + s0[7]));
    for (; d < n; ++d) s += x[d] * y[d];
    return s;
}

/* acc = acc * c + sum_t p[t] * v[t] over a tile */
static inline __attribute__((always_inline)) void pkv_attn_axpy(float* acc, float p, const float* v, int64_t n) {
    int64_t d = 0;
    const pkv_attn_v8 pv = {p, p, p, p, p, p, p, p};
    for (; d + 8 <= n; d += 8) {
        pkv_attn_v8 a, b;
        memcpy(&a, acc + d, 32); memcpy(&b, v + d, 32);
        a += pv * b;
        memcpy(acc + d, &a, 32);
    }
    for (; d < n; ++d) acc[d] += p * v[d];
}

typedef int32_t pkv_attn_v8i __attribute__((vector_size(32)));
/* 8-lane vectors passed between always-inlined functions: no ABI is involved */
#pragma GCC diagnostic ignored "-Wpsabi"

static inline __attribute__((always_inline)) pkv_attn_v8 pkv_attn_ld(const float* p) {
    pkv_attn_v8 v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline __attribute__((always_inline)) void pkv_attn_st(float* p, pkv_attn_v8 v) { memcpy(p, &v, sizeof v); }

static inline __attribute__((always_inline)) float pkv_attn_hsum(pkv_attn_v8 s) {
    return ((s[0] + s[4]) + (s[1] + s[5])) + ((s[2] + s[6]) + (s[3] + s[7]));
}

/* e^x of 8 lanes (x <= 0 here): 2^n e^f with n = rint(x log2 e), f = x - n ln 2 (ln 2 in two
 * parts, |f| <= ln2 / 2) and e^f a degree-6 polynomial (Taylor, relative error < 2e-7 plus
 * a few roundings); lanes below -87 (e^x < 2^-125, no subnormal) and -inf give 0 */
static inline __attribute__((always_inline)) pkv_attn_v8 pkv_attn_exp8(pkv_attn_v8 x) {
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
static inline __attribute__((always_inline)) float pkv_attn_exp_tile(float* s, int64_t nt, float mx) {
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

/* query rows (of one query token's GQA group) that share each load of a K or V row */
#define PKV_ATTN_ROWS 4

/* out[r] = q_r . k for R (constant) rows q_r = q + r * D: each k load serves R rows */
static inline __attribute__((always_inline)) void pkv_attn_dots(const int R, const float* q, const float* k,
                                                                int64_t D, float* out) {
    pkv_attn_v8 acc[PKV_ATTN_ROWS], acc2[PKV_ATTN_ROWS];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) acc[r] = acc2[r] = (pkv_attn_v8){0};
    int64_t d = 0;
    for (; d + 16 <= D; d += 16) {
        pkv_attn_v8 c, c2;
        memcpy(&c, k + d, 32);
        memcpy(&c2, k + d + 8, 32);
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) {
            pkv_attn_v8 x, x2;
            memcpy(&x, q + r * D + d, 32);
            memcpy(&x2, q + r * D + d + 8, 32);
            acc[r] += x * c;
            acc2[r] += x2 * c2;
        }
    }
    for (; d + 8 <= D; d += 8) {
        pkv_attn_v8 c;
        memcpy(&c, k + d, 32);
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) {
            pkv_attn_v8 x;
            memcpy(&x, q + r * D + d, 32);
            acc[r] += x * c;
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
        const pkv_attn_v8 v = acc[r] + acc2[r];
        float x = ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
        for (int64_t e = d; e < D; ++e) x += q[r * D + e] * k[e];
        out[r] = x;
    }
}

/* acc_r += sum over visible t of w[r * T + t] * v_t, for R (constant) rows acc + r * D:
 * 16 lanes of every row's accumulator stay in registers across the tile's tokens */
static inline __attribute__((always_inline)) void pkv_attn_vtile(const int R, float* acc, const float* w,
                                                                 int64_t T, const uint8_t* vis, const float* v,
                                                                 int64_t nt, int64_t D) {
    int64_t d = 0;
    for (; d + 16 <= D; d += 16) {
        pkv_attn_v8 x[PKV_ATTN_ROWS], x2[PKV_ATTN_ROWS];
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) {
            memcpy(&x[r], acc + r * D + d, 32);
            memcpy(&x2[r], acc + r * D + d + 8, 32);
        }
        for (int64_t t = 0; t < nt; ++t) {
            if (!vis[t]) continue;
            pkv_attn_v8 c, c2;
            memcpy(&c, v + t * D + d, 32);
            memcpy(&c2, v + t * D + d + 8, 32);
#pragma GCC unroll 4
            for (int r = 0; r < R; ++r) {
                const pkv_attn_v8 wv = (pkv_attn_v8){0} + w[r * T + t];
                x[r] += wv * c;
                x2[r] += wv * c2;
            }
        }
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) {
            memcpy(acc + r * D + d, &x[r], 32);
            memcpy(acc + r * D + d + 8, &x2[r], 32);
        }
    }
    for (; d < D; ++d)
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) {
            float x = acc[r * D + d];
            for (int64_t t = 0; t < nt; ++t)
                if (vis[t]) x += w[r * T + t] * v[t * D + d];
            acc[r * D + d] = x;
        }
}

/* The rows [r0, r0 + R) (R constant) of one query token at position p and one KV head
 * take in a tile: scores, the online softmax, then the values. s: R * T floats. */
static inline __attribute__((always_inline)) void pkv_attn_rows_tile(const pkv_attn_args* a, const int R,
                                                                     int64_t r0, int64_t qoff, int64_t p,
                                                                     int64_t c0, int64_t nt, const float* kh,
                                                                     const float* vh, const uint8_t* ph,
                                                                     float* m, float* l, float* acc, float* s) {
    const int64_t D = a->head_dim, T = a->tile;
    uint8_t vis[PKV_ATTN_TILE];
    float mx[PKV_ATTN_ROWS], dots[PKV_ATTN_ROWS];
    int any = 0;
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) mx[r] = m[r0 + r];
    for (int64_t t = 0; t < nt; ++t) {
        const int64_t j = c0 + t;
        vis[t] = !(j > p || (a->window && j <= p - a->window && j >= a->sink_tokens));
        if (!vis[t]) {
#pragma GCC unroll 4
            for (int r = 0; r < R; ++r) s[r * T + t] = -INFINITY;
            continue;
        }
        any = 1;
        const float* qv = (a->qrot && !ph[t]) ? a->qrot + qoff : a->q + qoff;
        pkv_attn_dots(R, qv, kh + t * D, D, dots);
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) {
            float x = dots[r] * a->sm_scale;
            if (a->soft_cap > 0.0f) x = a->soft_cap * tanhf(x / a->soft_cap);
            s[r * T + t] = x;
            mx[r] = (x > mx[r] || x != x) ? x : mx[r];  /* a NaN score (a NaN or inf in q) wins: the row is NaN */
        }
    }
    if (!any) return;  /* nothing of the tile seen */
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
        const int64_t rr = r0 + r;
        float* ar = acc + rr * D;
        float* sr = s + r * T;
        if (mx[r] == -INFINITY) {  /* no finite score yet: nothing to add */
            for (int64_t t = 0; t < nt; ++t) sr[t] = 0.0f;
            continue;
        }
        if (mx[r] > m[rr] || mx[r] != mx[r]) {  /* NaN: c, l and acc become NaN, as the definition's */
            const float c = m[rr] == -INFINITY ? 0.0f : expf(m[rr] - mx[r]);
            l[rr] *= c;
            for (int64_t d = 0; d < D; ++d) ar[d] *= c;
            m[rr] = mx[r];
        }
        l[rr] += pkv_attn_exp_tile(sr, nt, mx[r]);  /* masked: e^-inf = 0 */
    }
    pkv_attn_vtile(R, acc + r0 * D, s, T, vis, vh, nt, D);
}

typedef uint32_t pkv_attn_v8u __attribute__((vector_size(32)));

static inline __attribute__((always_inline)) pkv_attn_v8u pkv_attn_sel(pkv_attn_v8i c, pkv_attn_v8u a, pkv_attn_v8u b) {
    return (a & (pkv_attn_v8u)c) | (b & ~(pkv_attn_v8u)c);
}

/* Elements [d, d + 8) of a row as float lanes: float32 values, or the codes of a format
 * exactly as quant_rows.h reads them (int8: the stored c - 128; int4: element 2i in the
 * low nibble of byte i; int3: 8 codes in 3 bytes; fp8: its value, NaN and subnormals
 * included, by integer operations). ``kind`` is a constant wherever this is inlined. */
static inline __attribute__((always_inline)) pkv_attn_v8 pkv_attn_lanes(const int kind, const uint8_t* row, int64_t d) {
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

/* The per-token parameters of a quantized row as per-group float scales ``s`` and offsets
 * ``z`` such that the row's value is s * lane + z (int8: its zero plus 128 s; fp8: z = 0) */
static inline __attribute__((always_inline)) void pkv_attn_params(const pkv_attn_args* a, int64_t r, int64_t groups, float* s, float* z) {
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

/* a per-token code row as float32: s * lane + z per group (pkv_attn_params), ``kind``
 * a constant */
static inline __attribute__((always_inline)) void pkv_attn_deq_codes(const int kind, const uint8_t* row,
                                                                     int64_t D, int64_t groups, const float* s,
                                                                     const float* z, float* out) {
    const int64_t g_len = D / groups;
    for (int64_t g = 0; g < groups; ++g) {
        const pkv_attn_v8 sv = (pkv_attn_v8){0} + s[g], zv = (pkv_attn_v8){0} + z[g];
        for (int64_t d = g * g_len; d < (g + 1) * g_len; d += 8)
            pkv_attn_st(out + d, pkv_attn_lanes(kind, row, d) * sv + zv);
    }
}

/* pkv_attn_deq_codes of the arena row r (the format a->kind) */
static inline __attribute__((always_inline)) void pkv_attn_deq(const pkv_attn_args* a, int64_t r, float* out) {
    float s[64], z[64];
    const int64_t groups = a->groups;
    const uint8_t* row = a->layer + r * a->row_bytes;
    pkv_attn_params(a, r, groups, s, z);
    switch (a->kind) {
        case PKV_ROW_I8: pkv_attn_deq_codes(PKV_ROW_I8, row, a->head_dim, groups, s, z, out); break;
        case PKV_ROW_I4: pkv_attn_deq_codes(PKV_ROW_I4, row, a->head_dim, groups, s, z, out); break;
        case PKV_ROW_I3: pkv_attn_deq_codes(PKV_ROW_I3, row, a->head_dim, groups, s, z, out); break;
        case PKV_ROW_E4M3: pkv_attn_deq_codes(PKV_ROW_E4M3, row, a->head_dim, groups, s, z, out); break;
        default: pkv_attn_deq_codes(PKV_ROW_E5M2, row, a->head_dim, groups, s, z, out); break;
    }
}

/* an item's sealed block keys' parameters as float32, per head: the block they are of */
typedef struct {
    float* s;
    float* z;
    int64_t h0;
    int64_t blk[256];
    uint8_t sealed[256];
} pkv_attn_keys;

/* Read K/V of token ``pos`` of sequence b into k/v (float32); returns whether the K row
 * is in the unrotated domain (a sealed block key or an exact row). A float32 arena's rows
 * are copied too: scoring them in place (the tile holding row pointers) was measured
 * slower (1 thread, 32q/8kv/128, batch 8 x 4096: 57 ms against 33): the copy streams each
 * block's rows in address order, and the scoring then reads them from L1/L2. */
static inline __attribute__((always_inline)) int pkv_attn_load(const pkv_attn_args* a, int64_t first, int64_t n,
                                                               int64_t pos, int64_t h, float* k, float* v,
                                                               float* tmp, pkv_attn_keys* kc) {
    const int64_t D = a->head_dim;
    const int64_t blk = a->indices[first + pos / a->block_size], off = pos % a->block_size;
    if (a->exact_data) {
        const int64_t lo = n - a->exact_recent > 0 ? n - a->exact_recent : 0;
        const int64_t head = a->exact_sink < lo ? a->exact_sink : lo;
        if (pos < head || pos >= lo) {
            const int64_t s = a->exact_slot[blk];
            if (s >= 0 && a->exact_valid[s * a->block_size + off]) {
                const int64_t es = a->exact_type == PKV_F32 ? 4 : 2;
                const char* base = a->exact_data + ((s * 2 * a->block_size + off) * a->num_heads + h) * D * es;
                pkv_attn_widen(base, a->exact_type, D, k);
                pkv_attn_widen(base + a->block_size * a->num_heads * D * es, a->exact_type, D, v);
                if (a->signs) pkv_rotate_row(v, D, a->signs);  /* the accumulator is in the rotated domain */
                return 1;
            }
        }
    }
    const int64_t rk = pkv_attn_row(a, blk, 0, off, h), rv = pkv_attn_row(a, blk, 1, off, h);
    if (!a->quantized) {
        pkv_attn_widen((const char*)a->layer + rk * D * a->elem_bytes, a->kv_type, D, k);
        pkv_attn_widen((const char*)a->layer + rv * D * a->elem_bytes, a->kv_type, D, v);
        return 0;
    }
    int plain = 0;
    const int64_t kp = (blk * a->num_heads + h) * D;
    if (a->key_scale && a->key_cache && a->kind == PKV_ROW_I4) {
        const int64_t hh = h - kc->h0;
        if (kc->blk[hh] != blk) {  /* a new block of this head: widen its parameters once */
            kc->blk[hh] = blk;
            kc->sealed[hh] = (uint8_t)pkv_key_sealed(a->key_scale + kp);
            if (kc->sealed[hh]) {
                pkv_widen_row((const char*)(a->key_scale + kp), PKV_BF16, D, kc->s + hh * D);
                pkv_widen_row((const char*)(a->key_zero + kp), PKV_BF16, D, kc->z + hh * D);
            }
        }
        if (kc->sealed[hh]) {
            const uint8_t* row = a->layer + rk * a->row_bytes;
            const float* ks = kc->s + hh * D;
            const float* kz = kc->z + hh * D;
            for (int64_t d = 0; d < D; d += 8)
                pkv_attn_st(k + d, pkv_attn_lanes(PKV_ROW_I4, row, d) * pkv_attn_ld(ks + d) + pkv_attn_ld(kz + d));
            plain = 1;
        } else {
            pkv_attn_deq(a, rk, k);
        }
    } else if (a->key_scale && pkv_key_sealed(a->key_scale + kp)) {
        a->key_row(a->layer + rk * a->row_bytes, D, a->key_scale + kp, a->key_zero + kp, PKV_F32, (char*)k, tmp);
        plain = 1;
    } else if (a->kind >= 0) {
        pkv_attn_deq(a, rk, k);
    } else {
        a->deq(a->layer + rk * a->row_bytes, a->kv_type, D, a->groups, (const float*)(a->scale + rk * a->param_row),
               a->zero ? (const float*)(a->zero + rk * a->param_row) : NULL, PKV_F32, (char*)k, tmp, NULL);
    }
    if (a->kind >= 0) {
        pkv_attn_deq(a, rv, v);
        return plain;
    }
    a->deq(a->layer + rv * a->row_bytes, a->kv_type, D, a->groups, (const float*)(a->scale + rv * a->param_row),
           a->zero ? (const float*)(a->zero + rv * a->param_row) : NULL, PKV_F32, (char*)v, tmp, NULL);
    return plain;
}

/* Prefetch the K and V rows (and their parameters) of tokens [c0, c1) of heads [h0, h1):
 * blocks come in table order, not address order, so no hardware prefetcher starts a new
 * block's rows (or its block-key parameters) before they are read */
static inline __attribute__((always_inline)) void pkv_attn_prefetch(const pkv_attn_args* a, int64_t first,
                                                                    int64_t h0, int64_t h1, int64_t c0,
                                                                    int64_t c1) {
    const int64_t bytes = a->quantized ? a->row_bytes : a->head_dim * a->elem_bytes;
    const int blocks = a->prefetch == PKV_ATTN_PREFETCH_BLOCKS;
    int64_t last_blk = -1;
    for (int64_t j = c0; j < c1; ++j) {
        const int64_t blk = a->indices[first + j / a->block_size], off = j % a->block_size;
        if (blocks && j != c0 && off != 0) continue;  /* the rest of a started block streams */
        for (int kv = 0; kv < 2; ++kv)
            for (int64_t h = h0; h < h1; h += a->hnd ? 1 : h1 - h0) {
                const int64_t r = pkv_attn_row(a, blk, kv, off, h), nr = a->hnd ? 1 : h1 - h0;
                const char* p = (const char*)a->layer + r * bytes;
                const int64_t len = blocks && nr * bytes > 256 ? 256 : nr * bytes;
                for (int64_t i = 0; i < len; i += 64) __builtin_prefetch(p + i);
                __builtin_prefetch(p + len - 1);
                if (a->quantized) {
                    __builtin_prefetch(a->scale + r * a->param_row);
                    __builtin_prefetch(a->scale + (r + nr) * a->param_row - 1);
                    if (a->zero) {
                        __builtin_prefetch(a->zero + r * a->param_row);
                        __builtin_prefetch(a->zero + (r + nr) * a->param_row - 1);
                    }
                }
            }
        if (a->key_scale && blk != last_blk) {
            last_blk = blk;
            const int64_t kp = (blk * a->num_heads + h0) * a->head_dim * 2, kb = (h1 - h0) * a->head_dim * 2;
            for (int64_t i = 0; i < kb; i += 64) {
                __builtin_prefetch((const char*)a->key_scale + kp + i);
                __builtin_prefetch((const char*)a->key_zero + kp + i);
            }
        }
    }
}

/* ---- code rows decoded in registers (a->fused) ----------------------------------------
 * The same arithmetic as the tiles above (each K and V lane is s * lane + z, then the
 * same dots and value sums in the same order), but nothing is written: a tile holds each
 * token's code row pointers and its parameters, one (s, z) per 8-lane chunk (sealed block
 * keys: a pointer to their block's widened per-channel parameters), and every row chunk
 * is decoded in registers where it is used, once for all the query rows of its GQA group
 * that share the pass (up to PKV_ATTN_ROWS). The widened K/V tiles cost a store and a
 * reload of every element (the tiles spill out of L1: 8 heads x 32 tokens x 128 floats). */

typedef struct {
    const uint8_t** krow;    /* [nh * T] code rows */
    const uint8_t** vrow;
    float* kp;               /* [nh * T, 2, groups]: s, then z (per-token keys) */
    float* vp;
    const int32_t* cg;       /* [D / 8] the group of each 8-lane chunk */
    int64_t ng;              /* groups */
    int32_t* kslot;          /* [nh * T] sealed block keys: their slot in bp, else -1 */
    float* bp;               /* [slots, 2, D]: widened block-key s, then z */
} pkv_attn_ftile;

static inline int64_t pkv_attn_fused_floats(int64_t tile, int64_t heads, int64_t head_dim) {
    /* bp: at most one slot per tile row; kp, vp; kslot; krow, vrow (two floats a pointer) */
    return tile * heads * (2 * head_dim + head_dim / 2 + 2 + 1 + 4 + 1);
}

/* the K lanes [d, d + 8) of tile row t: per-chunk or per-channel parameters */
static inline __attribute__((always_inline)) pkv_attn_v8 pkv_attn_fk(const int kind, const pkv_attn_ftile* f,
                                                                    int64_t t, int64_t d, int64_t nc,
                                                                    const float* bs, int64_t D) {
    if (bs) return pkv_attn_lanes(PKV_ROW_I4, f->krow[t], d) * pkv_attn_ld(bs + d) + pkv_attn_ld(bs + D + d);
    const float* p = f->kp + t * 2 * nc;
    const int64_t g = f->cg[d >> 3];
    return pkv_attn_lanes(kind, f->krow[t], d) * ((pkv_attn_v8){0} + p[g]) + ((pkv_attn_v8){0} + p[nc + g]);
}

/* out[r] = q_r . k_t for R rows, k_t decoded in registers */
static inline __attribute__((always_inline)) void pkv_attn_fdots(const int kind, const int R, const float* q,
                                                                 const pkv_attn_ftile* f, int64_t t, int64_t D,
                                                                 float* out) {
    const int64_t nc = f->ng;
    const float* bs = f->kslot[t] >= 0 ? f->bp + (int64_t)f->kslot[t] * 2 * D : NULL;
    pkv_attn_v8 acc[PKV_ATTN_ROWS], acc2[PKV_ATTN_ROWS];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) acc[r] = acc2[r] = (pkv_attn_v8){0};
    int64_t d = 0;
    for (; d + 16 <= D; d += 16) {
        const pkv_attn_v8 c = pkv_attn_fk(kind, f, t, d, nc, bs, D), c2 = pkv_attn_fk(kind, f, t, d + 8, nc, bs, D);
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) {
            acc[r] += pkv_attn_ld(q + r * D + d) * c;
            acc2[r] += pkv_attn_ld(q + r * D + d + 8) * c2;
        }
    }
    if (d < D) {
        const pkv_attn_v8 c = pkv_attn_fk(kind, f, t, d, nc, bs, D);
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) acc[r] += pkv_attn_ld(q + r * D + d) * c;
    }
    /* the R horizontal sums at once (vshufps pairs in the AVX2 build): a per-row sum was
     * 9% of the loop */
    pkv_attn_v8 v[4];
#pragma GCC unroll 4
    for (int r = 0; r < 4; ++r) v[r] = r < R ? acc[r] + acc2[r] : (pkv_attn_v8){0};
    const pkv_attn_v8i even = {0, 2, 8, 10, 4, 6, 12, 14}, odd = {1, 3, 9, 11, 5, 7, 13, 15};
    const pkv_attn_v8 u01 = __builtin_shuffle(v[0], v[1], even) + __builtin_shuffle(v[0], v[1], odd);
    const pkv_attn_v8 u23 = __builtin_shuffle(v[2], v[3], even) + __builtin_shuffle(v[2], v[3], odd);
    const pkv_attn_v8 w = __builtin_shuffle(u01, u23, even) + __builtin_shuffle(u01, u23, odd);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) out[r] = w[r] + w[r + 4];
}

/* the V lanes [d, d + 8) of tile row t */
static inline __attribute__((always_inline)) pkv_attn_v8 pkv_attn_fv(const int kind, const pkv_attn_ftile* f,
                                                                    int64_t t, int64_t d, int64_t nc) {
    const float* p = f->vp + t * 2 * nc;
    const int64_t g = f->cg[d >> 3];
    return pkv_attn_lanes(kind, f->vrow[t], d) * ((pkv_attn_v8){0} + p[g]) + ((pkv_attn_v8){0} + p[nc + g]);
}

/* pkv_attn_vtile with V decoded in registers */
static inline __attribute__((always_inline)) void pkv_attn_fvtile(const int kind, const int R, float* acc,
                                                                  const float* w, int64_t T, const uint8_t* vis,
                                                                  const pkv_attn_ftile* f, int64_t nt, int64_t D) {
    const int64_t nc = f->ng;
    int64_t d = 0;
    for (; d + 16 <= D; d += 16) {
        pkv_attn_v8 x[PKV_ATTN_ROWS], x2[PKV_ATTN_ROWS];
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) {
            x[r] = pkv_attn_ld(acc + r * D + d);
            x2[r] = pkv_attn_ld(acc + r * D + d + 8);
        }
        for (int64_t t = 0; t < nt; ++t) {
            if (!vis[t]) continue;
            const pkv_attn_v8 c = pkv_attn_fv(kind, f, t, d, nc), c2 = pkv_attn_fv(kind, f, t, d + 8, nc);
#pragma GCC unroll 4
            for (int r = 0; r < R; ++r) {
                const pkv_attn_v8 wv = (pkv_attn_v8){0} + w[r * T + t];
                x[r] += wv * c;
                x2[r] += wv * c2;
            }
        }
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) {
            pkv_attn_st(acc + r * D + d, x[r]);
            pkv_attn_st(acc + r * D + d + 8, x2[r]);
        }
    }
    if (d < D) {
        pkv_attn_v8 x[PKV_ATTN_ROWS];
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) x[r] = pkv_attn_ld(acc + r * D + d);
        for (int64_t t = 0; t < nt; ++t) {
            if (!vis[t]) continue;
            const pkv_attn_v8 c = pkv_attn_fv(kind, f, t, d, nc);
#pragma GCC unroll 4
            for (int r = 0; r < R; ++r) x[r] += ((pkv_attn_v8){0} + w[r * T + t]) * c;
        }
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) pkv_attn_st(acc + r * D + d, x[r]);
    }
}

/* pkv_attn_rows_tile over a code tile (head hh's rows of f, offset already applied) */
static inline __attribute__((always_inline)) void pkv_attn_frows_tile(const pkv_attn_args* a, const int kind,
                                                                      const int R, int64_t r0, int64_t qoff,
                                                                      int64_t p, int64_t c0, int64_t nt,
                                                                      const pkv_attn_ftile* f, float* m, float* l,
                                                                      float* acc, float* s) {
    const int64_t D = a->head_dim, T = a->tile;
    uint8_t vis[PKV_ATTN_TILE];
    float mx[PKV_ATTN_ROWS], dots[PKV_ATTN_ROWS];
    int any = 0;
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) mx[r] = m[r0 + r];
    for (int64_t t = 0; t < nt; ++t) {
        const int64_t j = c0 + t;
        vis[t] = !(j > p || (a->window && j <= p - a->window && j >= a->sink_tokens));
        if (!vis[t]) {
#pragma GCC unroll 4
            for (int r = 0; r < R; ++r) s[r * T + t] = -INFINITY;
            continue;
        }
        any = 1;
        const float* qv = (a->qrot && f->kslot[t] < 0) ? a->qrot + qoff : a->q + qoff;
        pkv_attn_fdots(kind, R, qv, f, t, D, dots);
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) {
            float x = dots[r] * a->sm_scale;
            if (a->soft_cap > 0.0f) x = a->soft_cap * tanhf(x / a->soft_cap);
            s[r * T + t] = x;
            mx[r] = (x > mx[r] || x != x) ? x : mx[r];  /* a NaN score (a NaN or inf in q) wins: the row is NaN */
        }
    }
    if (!any) return;
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
        const int64_t rr = r0 + r;
        float* ar = acc + rr * D;
        float* sr = s + r * T;
        if (mx[r] == -INFINITY) {
            for (int64_t t = 0; t < nt; ++t) sr[t] = 0.0f;
            continue;
        }
        if (mx[r] > m[rr] || mx[r] != mx[r]) {  /* NaN: c, l and acc become NaN, as the definition's */
            const float c = m[rr] == -INFINITY ? 0.0f : expf(m[rr] - mx[r]);
            l[rr] *= c;
            for (int64_t d = 0; d < D; ++d) ar[d] *= c;
            m[rr] = mx[r];
        }
        l[rr] += pkv_attn_exp_tile(sr, nt, mx[r]);
    }
    pkv_attn_fvtile(kind, R, acc + r0 * D, s, T, vis, f, nt, D);
}

/* a row's per-token parameters, expanded to one (s, z) per 8-lane chunk: out[c], out[nc + c] */
static inline __attribute__((always_inline)) void pkv_attn_fparams(const pkv_attn_args* a, int64_t r, float* out) {
    pkv_attn_params(a, r, a->groups, out, out + a->groups);
}

/* the head-hh rows of one query token's GQA groups over a code tile, by kind */
static inline __attribute__((always_inline)) void pkv_attn_fkind(const pkv_attn_args* a, const int kind, int64_t nq,
                                                                 int64_t p_min, int64_t q0, int64_t h, int64_t c0,
                                                                 int64_t nt, const pkv_attn_ftile* f, float* m,
                                                                 float* l, float* acc, float* s) {
    const int64_t G = a->group, Hq = a->num_q_heads;
    for (int64_t i = 0; i < nq; ++i) {
        const int64_t p = p_min + i;
        for (int64_t g0 = 0; g0 < G; g0 += PKV_ATTN_ROWS) {
            const int64_t r0 = i * Hq + h * G + g0, qoff = (q0 * Hq + r0) * a->head_dim;
            switch (G - g0 < PKV_ATTN_ROWS ? G - g0 : PKV_ATTN_ROWS) {
                case 1: pkv_attn_frows_tile(a, kind, 1, r0, qoff, p, c0, nt, f, m, l, acc, s); break;
                case 2: pkv_attn_frows_tile(a, kind, 2, r0, qoff, p, c0, nt, f, m, l, acc, s); break;
                case 3: pkv_attn_frows_tile(a, kind, 3, r0, qoff, p, c0, nt, f, m, l, acc, s); break;
                default: pkv_attn_frows_tile(a, kind, 4, r0, qoff, p, c0, nt, f, m, l, acc, s); break;
            }
        }
    }
}

/* pkv_attn_item_body for code rows (a->kind >= 0) without exact rows */
static inline __attribute__((always_inline)) void pkv_attn_item_fused(const pkv_attn_args* a, int64_t b,
                                                                      int64_t h0, int64_t h1, int64_t t0,
                                                                      int64_t t1, float* m, float* l, float* acc,
                                                                      float* scratch) {
    const int64_t D = a->head_dim, Hq = a->num_q_heads, T = a->tile, nh = h1 - h0, nc = a->groups;
    const int64_t n = a->seq_lens[b], q0 = a->q_indptr[b], nq = a->q_indptr[b + 1] - q0;
    const int64_t first = a->indptr[b], G = a->group;
    const int64_t rows = nh * T;
    float* s = scratch;                       /* [PKV_ATTN_ROWS, T] */
    pkv_attn_ftile ft;
    ft.bp = s + 4 * T;                        /* [rows, 2, D] */
    ft.kp = ft.bp + rows * 2 * D;             /* [rows, 2, nc] */
    ft.vp = ft.kp + rows * 2 * nc;
    ft.kslot = (int32_t*)(ft.vp + rows * 2 * nc);
    ft.krow = (const uint8_t**)(void*)(((uintptr_t)(ft.kslot + rows) + 7) & ~(uintptr_t)7);
    ft.vrow = ft.krow + rows;
    int32_t cg[512];                          /* head_dim / 8 chunks (the caller: at most 512) */
    ft.ng = a->groups;
    for (int64_t c = 0; c < D >> 3; ++c) cg[c] = (int32_t)(c / ((D >> 3) / a->groups));
    ft.cg = cg;
    for (int64_t i = 0; i < nq; ++i)
        for (int64_t r = i * Hq + h0 * G; r < i * Hq + h1 * G; ++r) {
            m[r] = -INFINITY;
            l[r] = 0.0f;
            memset(acc + r * D, 0, (size_t)D * sizeof(float));
        }
    const int64_t p_min = n - nq;
    for (int64_t c0 = t0; c0 < t1; c0 += T) {
        const int64_t c1 = c0 + T < t1 ? c0 + T : t1, nt = c1 - c0;
        if (c0 > n - 1) break;
        if (a->window && c1 - 1 <= p_min - a->window && c0 >= a->sink_tokens) continue;
        if (c1 < t1 && a->prefetch != PKV_ATTN_PREFETCH_NONE)
            pkv_attn_prefetch(a, first, h0, h1, c1, c1 + T < t1 ? c1 + T : t1);
        int32_t slots = 0;
        int64_t last[256];
        int32_t last_slot[256];
        for (int64_t hh = 0; hh < nh; ++hh) last[hh] = -1;
        /* in address order (NHD: a token's heads are adjacent), touching each row's lines
         * so that the scoring finds them in cache */
        for (int64_t o = 0; o < nh * nt; ++o) {
            const int64_t hh = a->hnd ? o / nt : o % nh, t = a->hnd ? o % nt : o / nh;
            {
                const int64_t x = hh * T + t, pos = c0 + t, h = h0 + hh;
                const int64_t blk = a->indices[first + pos / a->block_size], off = pos % a->block_size;
                const int64_t rk = pkv_attn_row(a, blk, 0, off, h), rv = pkv_attn_row(a, blk, 1, off, h);
                ft.krow[x] = a->layer + rk * a->row_bytes;
                ft.vrow[x] = a->layer + rv * a->row_bytes;
                for (int64_t i = 0; i < a->row_bytes; i += 64) {
                    __builtin_prefetch(ft.krow[x] + i);
                    __builtin_prefetch(ft.vrow[x] + i);
                }
                pkv_attn_fparams(a, rv, ft.vp + x * 2 * nc);
                ft.kslot[x] = -1;
                if (a->key_scale) {
                    const int64_t kp = (blk * a->num_heads + h) * D;
                    if (blk != last[hh]) {  /* a new block of this head: widen its parameters once */
                        last[hh] = blk;
                        last_slot[hh] = -1;
                        if (pkv_key_sealed(a->key_scale + kp)) {
                            const int32_t sl = slots++;
                            last_slot[hh] = sl;
                            pkv_widen_row((const char*)(a->key_scale + kp), PKV_BF16, D, ft.bp + sl * 2 * D);
                            pkv_widen_row((const char*)(a->key_zero + kp), PKV_BF16, D, ft.bp + sl * 2 * D + D);
                        }
                    }
                    ft.kslot[x] = last_slot[hh];
                }
                if (ft.kslot[x] < 0) pkv_attn_fparams(a, rk, ft.kp + x * 2 * nc);
            }
        }
        for (int64_t hh = 0; hh < nh; ++hh) {
            pkv_attn_ftile fh = ft;
            fh.krow += hh * T;
            fh.vrow += hh * T;
            fh.kp += hh * T * 2 * nc;
            fh.vp += hh * T * 2 * nc;
            fh.kslot += hh * T;
            switch (a->kind) {
                case PKV_ROW_I8: pkv_attn_fkind(a, PKV_ROW_I8, nq, p_min, q0, h0 + hh, c0, nt, &fh, m, l, acc, s); break;
                case PKV_ROW_I4: pkv_attn_fkind(a, PKV_ROW_I4, nq, p_min, q0, h0 + hh, c0, nt, &fh, m, l, acc, s); break;
                case PKV_ROW_I3: pkv_attn_fkind(a, PKV_ROW_I3, nq, p_min, q0, h0 + hh, c0, nt, &fh, m, l, acc, s); break;
                case PKV_ROW_E4M3: pkv_attn_fkind(a, PKV_ROW_E4M3, nq, p_min, q0, h0 + hh, c0, nt, &fh, m, l, acc, s); break;
                default: pkv_attn_fkind(a, PKV_ROW_E5M2, nq, p_min, q0, h0 + hh, c0, nt, &fh, m, l, acc, s); break;
            }
        }
    }
}

/* The item (b, KV heads [h0, h1), keys [t0, t1)). m, l and acc point at the item's split
 * of sequence b, laid out as the queries are: row i * Hq + hq (query token q_indptr[b] + i,
 * query head hq), nq * Hq rows; the item writes the rows of its heads, unnormalized.
 * A tile is ``tile`` tokens of every head in the item, read in memory order (NHD: a
 * token's heads are adjacent, so one item streams its pages once instead of once per
 * head; HND: each head's tokens run contiguously). scratch: pkv_attn_scratch_floats. */
static inline int64_t pkv_attn_scratch_floats(int64_t tile, int64_t heads, int64_t head_dim) {
    const int64_t widened = 2 * tile * heads * head_dim + head_dim + 4 * tile + 2 * heads * head_dim;
    const int64_t fused = 4 * tile + pkv_attn_fused_floats(tile, heads, head_dim) + 2;
    return widened > fused ? widened : fused;
}

static inline __attribute__((always_inline)) void pkv_attn_item_body(const pkv_attn_args* a, int64_t b,
                                                                     int64_t h0, int64_t h1, int64_t t0,
                                                                     int64_t t1, float* m, float* l, float* acc,
                                                                     float* scratch) {
    if (a->fused && a->kind >= 0 && !a->exact_data && a->head_dim <= 8 * 512) {  /* cg: 512 chunks */
        pkv_attn_item_fused(a, b, h0, h1, t0, t1, m, l, acc, scratch);
        return;
    }
    const int64_t D = a->head_dim, G = a->group, Hq = a->num_q_heads, T = a->tile, nh = h1 - h0;
    const int64_t n = a->seq_lens[b], q0 = a->q_indptr[b], nq = a->q_indptr[b + 1] - q0;
    const int64_t first = a->indptr[b];
    float* kt = scratch;                 /* [nh, T, D] */
    float* vt = kt + nh * T * D;
    float* tmp = vt + nh * T * D;
    float* s = tmp + D;                  /* [PKV_ATTN_ROWS, T] a few rows' scores, then weights */
    pkv_attn_keys kc;                    /* sealed block keys' parameters, widened once per block */
    kc.s = s + 4 * T;                    /* [nh, D] */
    kc.z = kc.s + nh * D;
    kc.h0 = h0;
    for (int64_t hh = 0; hh < nh; ++hh) kc.blk[hh] = -1;
    uint8_t plain[PKV_ATTN_MAX_TILE_ROWS];
    for (int64_t i = 0; i < nq; ++i)
        for (int64_t r = i * Hq + h0 * G; r < i * Hq + h1 * G; ++r) {
            m[r] = -INFINITY;
            l[r] = 0.0f;
            memset(acc + r * D, 0, (size_t)D * sizeof(float));
        }
    const int64_t p_min = n - nq;  /* the first query's position */
    for (int64_t c0 = t0; c0 < t1; c0 += T) {
        const int64_t c1 = c0 + T < t1 ? c0 + T : t1, nt = c1 - c0;
        if (c0 > n - 1) break;
        if (a->window && c1 - 1 <= p_min - a->window && c0 >= a->sink_tokens) continue;  /* seen by no query */
        if (c1 < t1 && a->prefetch != PKV_ATTN_PREFETCH_NONE)
            pkv_attn_prefetch(a, first, h0, h1, c1, c1 + T < t1 ? c1 + T : t1);
        if (a->hnd) {
            for (int64_t hh = 0; hh < nh; ++hh)
                for (int64_t t = 0; t < nt; ++t)
                    plain[hh * T + t] = (uint8_t)pkv_attn_load(a, first, n, c0 + t, h0 + hh, kt + (hh * T + t) * D,
                                                               vt + (hh * T + t) * D, tmp, &kc);
        } else {
            for (int64_t t = 0; t < nt; ++t)
                for (int64_t hh = 0; hh < nh; ++hh)
                    plain[hh * T + t] = (uint8_t)pkv_attn_load(a, first, n, c0 + t, h0 + hh, kt + (hh * T + t) * D,
                                                               vt + (hh * T + t) * D, tmp, &kc);
        }
        for (int64_t hh = 0; hh < nh; ++hh) {
            const float* kh = kt + hh * T * D;
            const float* vh = vt + hh * T * D;
            const uint8_t* ph = plain + hh * T;
            for (int64_t i = 0; i < nq; ++i) {
                const int64_t p = p_min + i;
                for (int64_t g0 = 0; g0 < G; g0 += PKV_ATTN_ROWS) {
                    const int64_t r0 = i * Hq + (h0 + hh) * G + g0, qoff = (q0 * Hq + r0) * D;
                    switch (G - g0 < PKV_ATTN_ROWS ? G - g0 : PKV_ATTN_ROWS) {
                        case 1: pkv_attn_rows_tile(a, 1, r0, qoff, p, c0, nt, kh, vh, ph, m, l, acc, s); break;
                        case 2: pkv_attn_rows_tile(a, 2, r0, qoff, p, c0, nt, kh, vh, ph, m, l, acc, s); break;
                        case 3: pkv_attn_rows_tile(a, 3, r0, qoff, p, c0, nt, kh, vh, ph, m, l, acc, s); break;
                        default: pkv_attn_rows_tile(a, 4, r0, qoff, p, c0, nt, kh, vh, ph, m, l, acc, s); break;
                    }
                }
            }
        }
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
__attribute__((target("avx2,f16c,fma"))) static void pkv_attn_item_fma(const pkv_attn_args* a, int64_t b,
                                                                       int64_t h0, int64_t h1, int64_t t0,
                                                                       int64_t t1, float* m, float* l, float* acc,
                                                                       float* scratch) {
    pkv_attn_item_body(a, b, h0, h1, t0, t1, m, l, acc, scratch);
}
#endif

typedef void (*pkv_attn_item_fn)(const pkv_attn_args*, int64_t, int64_t, int64_t, int64_t, int64_t, float*, float*,
                                 float*, float*);

static pkv_attn_item_fn pkv_pick_attn_item(void) {
#if PKV_HAVE_AVX2
    if (pkv_use_avx2()) return __builtin_cpu_supports("fma") ? pkv_attn_item_fma : pkv_attn_item_avx2;
#endif
    return pkv_attn_item_base;
}

#pragma GCC pop_options

#endif
