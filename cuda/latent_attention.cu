// latent_attention.cu - MLA latent KV: absorbed-weight attention over paged latent rows
// (latent_common.cuh has the row formats).
//
// As FlashMLA and FlashInfer's MLA wrapper: query token i of sequence b (its queries
// are q_indptr[b]..q_indptr[b+1], the sequence's last tokens, causal) at position
// p = seq_len - nq + j sees keys 0..p. For a query head h the logit of key t is
// (q_nope[i, h] . c_kv[t] + q_pe[i, h] . k_pe[t]) * sm_scale and the output
// o[i, h] = sum_t softmax_t * c_kv[t] (R elements; the caller applies W_UV).
// A CTA serves one query token and heads_per_cta heads over one split of the keys
// (grid.x), in tiles of kv_tile keys, four barrier phases per tile (common.cuh,
// "Cooperative kernels"): dequantize the tile's rows into shared memory; logits;
// online softmax (running max m, sum l, rescale alpha); acc = acc * alpha + P V.
// With one split the CTA writes acc / l; with several it writes (acc, m, l) to the
// float32 workspace and paged_attention.cu's pkv_attn_merge_* combines them.
//
// Entry points (pagedkv/kernels/sources.py lists the same names):
//   pkv_latent_attn_{fmt}_q{q}           model formats: q of the row's dtype; e4m3: any q;
//                                        int8/int4: q of the positional slice's dtype
#include "latent_common.cuh"

#define PKV_LATENT_FLOATS 11264  // shared floats of an attention CTA (44 KiB; latent_plans.LATENT_FLOATS)

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

// instantiations: every (query type, row format) the launch plans use
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
