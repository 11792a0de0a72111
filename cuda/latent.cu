// latent.cu - MLA latent KV: write, gather and absorbed-weight attention over paged
// latent rows (pagedkv/store/latent.py defines the rows and their arithmetic).
//
// A layer's arena is [num_blocks, block_size, row] with one row per token: a model
// dtype row of R + P elements (c_kv then k_pe), or a quantized row of row_bytes bytes:
// R codes (int4: R / 2 bytes, two codes per byte, low nibble first), one float32 scale
// per group of G codes (fp8: G = 128), one float32 zero point per group (int8, int4),
// then P positional values (fp8: bfloat16; int8/int4: the model dtype). Slot s is row
// s of the arena viewed as [num_blocks * block_size, row].
//
// Write: rows (y) are tokens, columns (x) are "units": an element of a model-dtype row;
// for a quantized row a whole scale group (one thread reduces it, then writes its
// codes and parameters, so no two threads touch one byte) or one positional value. A
// negative or out-of-range slot is skipped.
//
// Gather: rows are output tokens (the concatenation of every sequence's first
// seq_lens[b] positions, found from the int64 prefix sums cu), columns the R + P
// elements; c_kv goes to out_kv [T, R], k_pe to out_pe [T, P]. A table entry outside
// the sequence's CSR row or a block id out of range reads as zeros.
//
// Attention (absorbed weights, as FlashMLA and FlashInfer's MLA wrapper): query token
// i of sequence b (its queries are q_indptr[b]..q_indptr[b+1], the sequence's last
// tokens, causal) at position p = seq_len - nq + j sees keys 0..p. For a query head h
// the logit of key t is (q_nope[i, h] . c_kv[t] + q_pe[i, h] . k_pe[t]) * sm_scale and
// the output o[i, h] = sum_t softmax_t * c_kv[t] (R elements; the caller applies W_UV).
// A CTA serves one query token and heads_per_cta heads over one split of the keys
// (grid.x), in tiles of kv_tile keys, four barrier phases per tile (common.cuh,
// "Cooperative kernels"): dequantize the tile's rows into shared memory; logits;
// online softmax (running max m, sum l, rescale alpha); acc = acc * alpha + P V.
// With one split the CTA writes acc / l; with several it writes (acc, m, l) to the
// float32 workspace and paged_attention.cu's pkv_attn_merge_* combines them.
//
// Entry points (pagedkv/kernels/sources.py lists the same names):
//   pkv_latent_write_{in}_to_{fmt}       in: f32, f16, bf16
//   pkv_latent_gather_{fmt}_to_{out}     out: f32, f16, bf16
//   pkv_latent_attn_{fmt}_q{q}           model formats: q of the row's dtype; e4m3: any q;
//                                        int8/int4: q of the positional slice's dtype
// with fmt one of f32, f16, bf16 (model rows), e4m3 (positional slice bfloat16),
// int8_r{f32,f16,bf16}, int4_r{f32,f16,bf16} (r: the positional slice's dtype).
#include "common.cuh"

#define PKV_LATENT_FLOATS 11264  // shared floats of an attention CTA (44 KiB; latent_plans.LATENT_FLOATS)

// Row formats beyond the PKV_Q_* codes: the model dtypes.
#define PKV_LF_F32 10
#define PKV_LF_F16 11
#define PKV_LF_BF16 12

template <int F>
struct pkv_latent_model;
template <>
struct pkv_latent_model<PKV_LF_F32> {
  typedef float T;
};
template <>
struct pkv_latent_model<PKV_LF_F16> {
  typedef pkv_f16 T;
};
template <>
struct pkv_latent_model<PKV_LF_BF16> {
  typedef pkv_bf16 T;
};

#define PKV_LATENT_QUANT(F) ((F) == PKV_Q_E4M3 || (F) == PKV_Q_INT8 || (F) == PKV_Q_INT4)

// Element e (< R + P) of a stored row as float32.
template <int F, typename RT>
__device__ __forceinline__ float pkv_latent_elem(const pkv_u8* __restrict__ row, pkv_i64 e, pkv_i64 R, pkv_i64 G,
                                                 pkv_i64 scale_off, pkv_i64 zero_off, pkv_i64 rope_off) {
  if (F == PKV_LF_F32) return ((const float*)row)[e];
  if (F == PKV_LF_F16) return pkv_f16_to_f32(((const pkv_u16*)row)[e]);
  if (F == PKV_LF_BF16) return pkv_bf16_to_f32(((const pkv_u16*)row)[e]);
  if (e >= R) return pkv_dtype<RT>::to_f32(((const RT*)(row + rope_off))[e - R]);
  const pkv_i64 g = pkv_div(e, G);
  const float s = ((const float*)(row + scale_off))[g];
  const float z = F == PKV_Q_E4M3 ? 0.0f : ((const float*)(row + zero_off))[g];
  const pkv_u32 code = F == PKV_Q_INT4 ? pkv_int4_code(row[e / 2], e) : (pkv_u32)row[e];
  return pkv_dequantize<F>(code, s, z);
}

// The attention CTA is one flat team of threads, whatever the shape of its block.
__device__ __forceinline__ pkv_i64 pkv_latent_tid() {
  return ((pkv_i64)threadIdx.z * blockDim.y + threadIdx.y) * blockDim.x + threadIdx.x;
}
__device__ __forceinline__ pkv_i64 pkv_latent_threads() {
  return (pkv_i64)blockDim.x * blockDim.y * blockDim.z;
}

// The last b in [0, n) with v[b] <= x (v non-decreasing, v[0] <= x).
template <typename V>
__device__ __forceinline__ pkv_i64 pkv_latent_find(const V* __restrict__ v, pkv_i64 n, pkv_i64 x) {
  pkv_i64 lo = 0, hi = n - 1;
  while (lo < hi) {
    const pkv_i64 mid = lo + (hi - lo + 1) / 2;
    if ((pkv_i64)v[mid] <= x) lo = mid; else hi = mid - 1;
  }
  return lo;
}

// The arena row (in rows of the [num_blocks * block_size, row] view) of position pos
// of sequence b, or -1 (read as zeros).
__device__ __forceinline__ pkv_i64 pkv_latent_row(const int* __restrict__ indptr, const int* __restrict__ indices,
                                                  pkv_i64 b, pkv_i64 pos, pkv_i64 block_size, pkv_i64 num_entries,
                                                  pkv_i64 num_blocks) {
  const pkv_i64 first = indptr[b];
  const pkv_i64 q = pkv_div(pos, block_size);
  const pkv_i64 entry = first + q;
  if (entry < first || entry >= indptr[b + 1] || entry < 0 || entry >= num_entries) return -1;
  const pkv_i64 block = indices[entry];
  if (block < 0 || block >= num_blocks) return -1;
  return block * block_size + (pos - q * block_size);
}

// ---------------------------------------------------------------------------
// write

template <typename IN, int F, typename RT>
__device__ __forceinline__ void pkv_latent_write(pkv_u8* __restrict__ arena, const pkv_i64* __restrict__ slots,
                                                 const IN* __restrict__ kv_c, const IN* __restrict__ k_pe,
                                                 pkv_i64 num_tokens, pkv_i64 kc_stride, pkv_i64 kp_stride,
                                                 pkv_i64 R, pkv_i64 P, pkv_i64 G, pkv_i64 row_bytes,
                                                 pkv_i64 scale_off, pkv_i64 zero_off, pkv_i64 rope_off,
                                                 pkv_i64 num_slots) {
  const pkv_i64 groups = PKV_LATENT_QUANT(F) ? R / G : 0;
  const pkv_i64 units = PKV_LATENT_QUANT(F) ? groups + P : R + P;
  for (pkv_i64 t = pkv_row_begin(); t < num_tokens; t += pkv_row_step()) {
    const pkv_i64 s = slots[t];
    if (s < 0 || s >= num_slots) continue;
    pkv_u8* row = arena + s * row_bytes;
    const IN* c = kv_c + t * kc_stride;
    const IN* pe = k_pe + t * kp_stride;
    for (pkv_i64 u = pkv_col_begin(); u < units; u += pkv_col_step()) {
      if (!PKV_LATENT_QUANT(F)) {
        typedef typename pkv_latent_model<PKV_LATENT_QUANT(F) ? PKV_LF_F32 : F>::T ST;
        const float x = u < R ? pkv_dtype<IN>::to_f32(c[u]) : pkv_dtype<IN>::to_f32(pe[u - R]);
        ((ST*)row)[u] = pkv_dtype<ST>::from_f32(x);
      } else if (u >= groups) {
        const pkv_i64 j = u - groups;
        ((RT*)(row + rope_off))[j] = pkv_dtype<RT>::from_f32(pkv_dtype<IN>::to_f32(pe[j]));
      } else {
        float a, b;
        pkv_reduce_init<F>(&a, &b);
        const pkv_i64 first = u * G;
        for (pkv_i64 i = 0; i < G; ++i) pkv_reduce_add<F>(&a, &b, pkv_dtype<IN>::to_f32(c[first + i]));
        const bool fp8 = F == PKV_Q_E4M3;
        const float zero = fp8 ? 0.0f : pkv_group_zero<F>(a);
        const float scale = pkv_group_scale<F>(fp8 ? a : zero, b);
        if (F == PKV_Q_INT4) {
          for (pkv_i64 i = 0; i < G; i += 2) {
            const pkv_u32 lo = pkv_quantize<F>(pkv_dtype<IN>::to_f32(c[first + i]), scale, zero);
            const pkv_u32 hi = pkv_quantize<F>(pkv_dtype<IN>::to_f32(c[first + i + 1]), scale, zero);
            row[(first + i) / 2] = pkv_int4_pack(lo, hi);
          }
        } else {
          for (pkv_i64 i = 0; i < G; ++i)
            row[first + i] = (pkv_u8)pkv_quantize<F>(pkv_dtype<IN>::to_f32(c[first + i]), scale, zero);
        }
        ((float*)(row + scale_off))[u] = scale;
        if (!fp8) ((float*)(row + zero_off))[u] = zero;
      }
    }
  }
}

#define PKV_LATENT_WRITE(NAME, IN, F, RT)                                                                     \
  extern "C" __global__ void NAME(pkv_u8* __restrict__ arena, const pkv_i64* __restrict__ slots,             \
                                  const IN* __restrict__ kv_c, const IN* __restrict__ k_pe,                  \
                                  pkv_i64 num_tokens, pkv_i64 kc_stride, pkv_i64 kp_stride, pkv_i64 R,       \
                                  pkv_i64 P, pkv_i64 G, pkv_i64 row_bytes, pkv_i64 scale_off,                \
                                  pkv_i64 zero_off, pkv_i64 rope_off, pkv_i64 num_slots) {                   \
    pkv_latent_write<IN, F, RT>(arena, slots, kv_c, k_pe, num_tokens, kc_stride, kp_stride, R, P, G,         \
                                row_bytes, scale_off, zero_off, rope_off, num_slots);                        \
  }

// ---------------------------------------------------------------------------
// gather

template <int F, typename RT, typename O>
__device__ __forceinline__ void pkv_latent_gather(const pkv_u8* __restrict__ arena, const int* __restrict__ indptr,
                                                  const int* __restrict__ indices, const pkv_i64* __restrict__ cu,
                                                  O* __restrict__ out_kv, O* __restrict__ out_pe, pkv_i64 batch,
                                                  pkv_i64 total, pkv_i64 R, pkv_i64 P, pkv_i64 G, pkv_i64 row_bytes,
                                                  pkv_i64 scale_off, pkv_i64 zero_off, pkv_i64 rope_off,
                                                  pkv_i64 block_size, pkv_i64 num_entries, pkv_i64 num_blocks) {
  const pkv_i64 W = R + P;
  for (pkv_i64 t = pkv_row_begin(); t < total; t += pkv_row_step()) {
    const pkv_i64 b = pkv_latent_find(cu, batch, t);
    const pkv_i64 r = pkv_latent_row(indptr, indices, b, t - cu[b], block_size, num_entries, num_blocks);
    for (pkv_i64 e = pkv_col_begin(); e < W; e += pkv_col_step()) {
      const float x = r < 0 ? 0.0f
                            : pkv_latent_elem<F, RT>(arena + r * row_bytes, e, R, G, scale_off, zero_off, rope_off);
      if (e < R)
        out_kv[t * R + e] = pkv_dtype<O>::from_f32(x);
      else
        out_pe[t * P + e - R] = pkv_dtype<O>::from_f32(x);
    }
  }
}

#define PKV_LATENT_GATHER(NAME, F, RT, O)                                                                     \
  extern "C" __global__ void NAME(const pkv_u8* __restrict__ arena, const int* __restrict__ indptr,          \
                                  const int* __restrict__ indices, const pkv_i64* __restrict__ cu,           \
                                  O* __restrict__ out_kv, O* __restrict__ out_pe, pkv_i64 batch,             \
                                  pkv_i64 total, pkv_i64 R, pkv_i64 P, pkv_i64 G, pkv_i64 row_bytes,         \
                                  pkv_i64 scale_off, pkv_i64 zero_off, pkv_i64 rope_off,                     \
                                  pkv_i64 block_size, pkv_i64 num_entries, pkv_i64 num_blocks) {             \
    pkv_latent_gather<F, RT, O>(arena, indptr, indices, cu, out_kv, out_pe, batch, total, R, P, G, row_bytes, \
                                scale_off, zero_off, rope_off, block_size, num_entries, num_blocks);         \
  }

// ---------------------------------------------------------------------------
// attention

template <int F, typename RT, typename Q>
__device__ __forceinline__ void pkv_latent_attn(
    const pkv_u8* __restrict__ arena, const Q* __restrict__ q_nope, const Q* __restrict__ q_pe, Q* __restrict__ out,
    float* __restrict__ part_o, float* __restrict__ part_ml, const int* __restrict__ indptr,
    const int* __restrict__ indices, const int* __restrict__ seq_lens, const int* __restrict__ q_indptr,
    pkv_i64 num_q, pkv_i64 heads, pkv_i64 batch, pkv_i64 R, pkv_i64 P, pkv_i64 G, pkv_i64 row_bytes,
    pkv_i64 scale_off, pkv_i64 zero_off, pkv_i64 rope_off, pkv_i64 block_size, pkv_i64 num_entries,
    pkv_i64 num_blocks, pkv_i64 qn_tok, pkv_i64 qn_head, pkv_i64 qp_tok, pkv_i64 qp_head, pkv_i64 ht, pkv_i64 kt,
    pkv_i64 num_splits, float sm_scale) {
  PKV_COOPERATIVE();
  PKV_SHARED float sm[PKV_LATENT_FLOATS];
  const pkv_i64 W = R + P;
  if (kt * W + ht * kt + ht * R + 3 * ht > PKV_LATENT_FLOATS) return;  // not a planned launch
  float* kbuf = sm;             // [kt, W] the tile's rows
  float* sc = kbuf + kt * W;    // [ht, kt] logits, then probabilities
  float* acc = sc + ht * kt;    // [ht, R]
  float* st = acc + ht * R;     // [ht, 3] running max, running sum, rescale
  const float neg_inf = __uint_as_float(0xff800000u);
  const pkv_i64 tiles = (heads + ht - 1) / ht;
  const pkv_i64 items = num_q * tiles;
  const pkv_i64 split = blockIdx.x;
  const pkv_i64 rows = num_q * heads;
  for (pkv_i64 item = blockIdx.y; item < items; item += gridDim.y) {
    const pkv_i64 i = item / tiles;
    const pkv_i64 h0 = (item - i * tiles) * ht;
    const pkv_i64 nh = heads - h0 < ht ? heads - h0 : ht;
    const pkv_i64 b = pkv_latent_find(q_indptr, batch, i);
    const pkv_i64 nq = (pkv_i64)q_indptr[b + 1] - q_indptr[b];
    const pkv_i64 p = (pkv_i64)seq_lens[b] - nq + (i - q_indptr[b]);
    const pkv_i64 hi = p + 1 > 0 ? p + 1 : 0;
    const pkv_i64 per = (hi + num_splits - 1) / num_splits;
    const pkv_i64 lo = split * per < hi ? split * per : hi;
    const pkv_i64 end = lo + per < hi ? lo + per : hi;
    PKV_PHASE({
      for (pkv_i64 x = pkv_latent_tid(); x < nh * R; x += pkv_latent_threads()) acc[x] = 0.0f;
      for (pkv_i64 h = pkv_latent_tid(); h < nh; h += pkv_latent_threads()) {
        st[h * 3] = neg_inf;
        st[h * 3 + 1] = 0.0f;
        st[h * 3 + 2] = 0.0f;
      }
    });
    for (pkv_i64 t0 = lo; t0 < end; t0 += kt) {
      const pkv_i64 n = end - t0 < kt ? end - t0 : kt;
      PKV_PHASE({
        for (pkv_i64 x = pkv_latent_tid(); x < n * W; x += pkv_latent_threads()) {
          const pkv_i64 t = pkv_div(x, W), e = x - t * W;
          const pkv_i64 r = pkv_latent_row(indptr, indices, b, t0 + t, block_size, num_entries, num_blocks);
          kbuf[x] = r < 0 ? 0.0f
                          : pkv_latent_elem<F, RT>(arena + r * row_bytes, e, R, G, scale_off, zero_off, rope_off);
        }
      });
      PKV_PHASE({
        for (pkv_i64 x = pkv_latent_tid(); x < nh * n; x += pkv_latent_threads()) {
          const pkv_i64 h = pkv_div(x, n), t = x - h * n;
          const Q* qn = q_nope + i * qn_tok + (h0 + h) * qn_head;
          const Q* qp = q_pe + i * qp_tok + (h0 + h) * qp_head;
          const float* k = kbuf + t * W;
          float dot = 0.0f;
          for (pkv_i64 e = 0; e < R; ++e) dot = __fadd_rn(dot, __fmul_rn(pkv_dtype<Q>::to_f32(qn[e]), k[e]));
          for (pkv_i64 e = 0; e < P; ++e) dot = __fadd_rn(dot, __fmul_rn(pkv_dtype<Q>::to_f32(qp[e]), k[R + e]));
          sc[h * kt + t] = __fmul_rn(dot, sm_scale);
        }
      });
      PKV_PHASE({
        for (pkv_i64 h = pkv_latent_tid(); h < nh; h += pkv_latent_threads()) {
          const float m_old = st[h * 3];
          float m = m_old;
          for (pkv_i64 t = 0; t < n; ++t) m = sc[h * kt + t] > m ? sc[h * kt + t] : m;
          const float alpha = m_old == neg_inf ? 0.0f : expf(__fsub_rn(m_old, m));
          float l = __fmul_rn(st[h * 3 + 1], alpha);
          for (pkv_i64 t = 0; t < n; ++t) {
            const float e = expf(__fsub_rn(sc[h * kt + t], m));
            sc[h * kt + t] = e;
            l = __fadd_rn(l, e);
          }
          st[h * 3] = m;
          st[h * 3 + 1] = l;
          st[h * 3 + 2] = alpha;
        }
      });
      PKV_PHASE({
        for (pkv_i64 x = pkv_latent_tid(); x < nh * R; x += pkv_latent_threads()) {
          const pkv_i64 h = pkv_div(x, R), d = x - h * R;
          float a = __fmul_rn(acc[x], st[h * 3 + 2]);
          for (pkv_i64 t = 0; t < n; ++t) a = __fadd_rn(a, __fmul_rn(sc[h * kt + t], kbuf[t * W + d]));
          acc[x] = a;
        }
      });
    }
    PKV_PHASE({
      for (pkv_i64 x = pkv_latent_tid(); x < nh * R; x += pkv_latent_threads()) {
        const pkv_i64 h = pkv_div(x, R), d = x - h * R;
        const pkv_i64 r = i * heads + h0 + h;
        const float l = st[h * 3 + 1];
        if (num_splits == 1) {
          out[r * R + d] = pkv_dtype<Q>::from_f32(l > 0.0f ? __fdiv_rn(acc[x], l) : 0.0f);
        } else {
          part_o[(split * rows + r) * R + d] = acc[x];
          if (d == 0) {
            part_ml[(split * rows + r) * 2] = st[h * 3];
            part_ml[(split * rows + r) * 2 + 1] = l;
          }
        }
      }
    });
  }
}

#define PKV_LATENT_ATTN(NAME, F, RT, Q)                                                                       \
  extern "C" __global__ void NAME(                                                                           \
      const pkv_u8* __restrict__ arena, const Q* __restrict__ q_nope, const Q* __restrict__ q_pe,             \
      Q* __restrict__ out, float* __restrict__ part_o, float* __restrict__ part_ml,                          \
      const int* __restrict__ indptr, const int* __restrict__ indices, const int* __restrict__ seq_lens,     \
      const int* __restrict__ q_indptr, pkv_i64 num_q, pkv_i64 heads, pkv_i64 batch, pkv_i64 R, pkv_i64 P,   \
      pkv_i64 G, pkv_i64 row_bytes, pkv_i64 scale_off, pkv_i64 zero_off, pkv_i64 rope_off,                  \
      pkv_i64 block_size, pkv_i64 num_entries, pkv_i64 num_blocks, pkv_i64 qn_tok, pkv_i64 qn_head,          \
      pkv_i64 qp_tok, pkv_i64 qp_head, pkv_i64 ht, pkv_i64 kt, pkv_i64 num_splits, float sm_scale) {         \
    pkv_latent_attn<F, RT, Q>(arena, q_nope, q_pe, out, part_o, part_ml, indptr, indices, seq_lens, q_indptr, \
                              num_q, heads, batch, R, P, G, row_bytes, scale_off, zero_off, rope_off,        \
                              block_size, num_entries, num_blocks, qn_tok, qn_head, qp_tok, qp_head, ht, kt, \
                              num_splits, sm_scale);                                                         \
  }

// ---------------------------------------------------------------------------
// instantiations: every (input/output/query type, row format) the launch plans use

#define PKV_LATENT_FOR_IN(M, STEM, F, RT, FN) \
  M(STEM##f32_to_##FN, float, F, RT)          \
  M(STEM##f16_to_##FN, pkv_f16, F, RT)        \
  M(STEM##bf16_to_##FN, pkv_bf16, F, RT)

#define PKV_LATENT_WRITES(FN, F, RT) PKV_LATENT_FOR_IN(PKV_LATENT_WRITE, pkv_latent_write_, F, RT, FN)

PKV_LATENT_WRITES(f32, PKV_LF_F32, float)
PKV_LATENT_WRITES(f16, PKV_LF_F16, pkv_f16)
PKV_LATENT_WRITES(bf16, PKV_LF_BF16, pkv_bf16)
PKV_LATENT_WRITES(e4m3, PKV_Q_E4M3, pkv_bf16)
PKV_LATENT_WRITES(int8_rf32, PKV_Q_INT8, float)
PKV_LATENT_WRITES(int8_rf16, PKV_Q_INT8, pkv_f16)
PKV_LATENT_WRITES(int8_rbf16, PKV_Q_INT8, pkv_bf16)
PKV_LATENT_WRITES(int4_rf32, PKV_Q_INT4, float)
PKV_LATENT_WRITES(int4_rf16, PKV_Q_INT4, pkv_f16)
PKV_LATENT_WRITES(int4_rbf16, PKV_Q_INT4, pkv_bf16)

#define PKV_LATENT_GATHERS(FN, F, RT)                                \
  PKV_LATENT_GATHER(pkv_latent_gather_##FN##_to_f32, F, RT, float)   \
  PKV_LATENT_GATHER(pkv_latent_gather_##FN##_to_f16, F, RT, pkv_f16) \
  PKV_LATENT_GATHER(pkv_latent_gather_##FN##_to_bf16, F, RT, pkv_bf16)

PKV_LATENT_GATHERS(f32, PKV_LF_F32, float)
PKV_LATENT_GATHERS(f16, PKV_LF_F16, pkv_f16)
PKV_LATENT_GATHERS(bf16, PKV_LF_BF16, pkv_bf16)
PKV_LATENT_GATHERS(e4m3, PKV_Q_E4M3, pkv_bf16)
PKV_LATENT_GATHERS(int8_rf32, PKV_Q_INT8, float)
PKV_LATENT_GATHERS(int8_rf16, PKV_Q_INT8, pkv_f16)
PKV_LATENT_GATHERS(int8_rbf16, PKV_Q_INT8, pkv_bf16)
PKV_LATENT_GATHERS(int4_rf32, PKV_Q_INT4, float)
PKV_LATENT_GATHERS(int4_rf16, PKV_Q_INT4, pkv_f16)
PKV_LATENT_GATHERS(int4_rbf16, PKV_Q_INT4, pkv_bf16)

PKV_LATENT_ATTN(pkv_latent_attn_f32_qf32, PKV_LF_F32, float, float)
PKV_LATENT_ATTN(pkv_latent_attn_f16_qf16, PKV_LF_F16, pkv_f16, pkv_f16)
PKV_LATENT_ATTN(pkv_latent_attn_bf16_qbf16, PKV_LF_BF16, pkv_bf16, pkv_bf16)
PKV_LATENT_ATTN(pkv_latent_attn_e4m3_qf32, PKV_Q_E4M3, pkv_bf16, float)
PKV_LATENT_ATTN(pkv_latent_attn_e4m3_qf16, PKV_Q_E4M3, pkv_bf16, pkv_f16)
PKV_LATENT_ATTN(pkv_latent_attn_e4m3_qbf16, PKV_Q_E4M3, pkv_bf16, pkv_bf16)
PKV_LATENT_ATTN(pkv_latent_attn_int8_rf32_qf32, PKV_Q_INT8, float, float)
PKV_LATENT_ATTN(pkv_latent_attn_int8_rf16_qf16, PKV_Q_INT8, pkv_f16, pkv_f16)
PKV_LATENT_ATTN(pkv_latent_attn_int8_rbf16_qbf16, PKV_Q_INT8, pkv_bf16, pkv_bf16)
PKV_LATENT_ATTN(pkv_latent_attn_int4_rf32_qf32, PKV_Q_INT4, float, float)
PKV_LATENT_ATTN(pkv_latent_attn_int4_rf16_qf16, PKV_Q_INT4, pkv_f16, pkv_f16)
PKV_LATENT_ATTN(pkv_latent_attn_int4_rbf16_qbf16, PKV_Q_INT4, pkv_bf16, pkv_bf16)
