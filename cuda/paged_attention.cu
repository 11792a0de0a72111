// paged_attention.cu - attention of a batch of query tokens over their sequences'
// paged K/V, read in place in every storage format (no gathered K/V tensor).
//
// A CTA serves one "work item": one query tile of one sequence (decode: one query
// token; prefill: up to q_tile consecutive query tokens, causal among themselves),
// one KV head, and heads_per_cta of the query heads that share it (GQA: a whole group
// when it fits, so the group is served by one pass over its KV head). Its rows are
// (query token, query head) pairs, r = token * heads_per_cta + head. grid.x is the
// split (flash-decoding): the keys the tile can see are cut into num_splits equal
// ranges; grid.y strides over the work items and grid.x over the splits.
//
// The keys a tile can see, in order: the sink positions [0, ns) and then the window
// [w_lo, hi), where hi = min(seq_len, last query position + 1); without a window
// ns = 0 and w_lo = 0 (every earlier key). Inside that span each row applies its own
// mask: key j is visible to the query at position p iff j <= p and (no window, or
// j > p - window, or j < sink_tokens).
//
// Per tile of kv_tile keys, five barrier phases (common.cuh, "Cooperative kernels"):
//   1. look up each key's block and rows once, then dequantize the tile's K and V into
//      shared memory, a warp per key and a lane per channel so that the loads coalesce
//      (zeros for a key outside the tables, as the gather reads it);
//   2. logits S[r, t] = (q_r . k_t) * sm_scale, soft-capped, -inf where masked;
//   3. online softmax per row: the new running max m, rescale factor alpha, and
//      S[r, t] <- exp(S[r, t] - m), l <- l * alpha + sum_t S[r, t];
//   4. acc[r, :] <- acc[r, :] * alpha + sum_t S[r, t] * v_t.
// Everything is float32. With one split the CTA normalizes, unrotates and writes
// its rows; with several it writes (acc, m, l) to the float32 workspace and
// pkv_attn_merge_* combines the splits exactly: M = max_s m_s,
// o = sum_s acc_s e^(m_s - M) / sum_s l_s e^(m_s - M).
//
// Rotation (rotation_signs non-null, quantized layers): the cached rows hold
// rotate(x) = H(signs * x); H is orthonormal, so q . k = rotate(q) . rotate(k) and
// o = unrotate(sum p rotate(v)). The CTA rotates its queries once into shared memory
// and the output is unrotated once per row; no cached token is unrotated. int4 block
// keys (key_scale non-null, key_scale[block, head, 0] != 0) are stored unrotated, so
// their logits take the query as given.
//
// The launcher does not read device-resident tables (no sync), so the kernel guards
// every index: a table entry outside the sequence's CSR row or a block id outside
// [0, num_blocks) reads as zeros; a query tile outside [0, num_q_tokens) or at a
// negative position (q_len > seq_len) is not written.
//
// Entry points (pagedkv/kernels/sources.py lists the same names):
//   pkv_attn_{decode,prefill}_{nhd,hnd}_{f32,f16,bf16}           model-dtype K/V, q of that dtype
//   pkv_attn_{decode,prefill}_{nhd,hnd}_{e4m3,e5m2,int8,int4,int3}_q{f32,f16,bf16}
//   pkv_attn_merge_{f32,f16,bf16}                                 split merge, output dtype
#include "common.cuh"

#define PKV_ATTN_FLOATS 11264  // shared floats of a CTA's buffers (44 KiB; attention_plans.ATTN_FLOATS)
#define PKV_ATTN_MAX_TILE 64   // keys per tile (attention_plans.ATTN_MAX_TILE)
#define PKV_ATTN_MAX_ROWS 64   // rows per CTA (attention_plans.ATTN_MAX_ROWS)
#define PKV_ATTN_LANE_ELEMS 4  // channels of K and of V a lane loads per key before it stores any

// K/V storage formats beyond the PKV_Q_* codes: the model dtypes, read as they are.
#define PKV_F_F32 10
#define PKV_F_F16 11
#define PKV_F_BF16 12

#define PKV_ATTN_DECODE 0
#define PKV_ATTN_PREFILL 1

// Element d of K/V row `row` (in rows of the per-layer view) as float32.
template <int F>
__device__ __forceinline__ float pkv_attn_elem(const void* __restrict__ kv, const float* __restrict__ scale,
                                               const float* __restrict__ zero, pkv_i64 row, pkv_i64 head_dim,
                                               pkv_i64 groups, pkv_i64 g_len, pkv_i64 d) {
  if (F == PKV_F_F32) return ((const float*)kv)[row * head_dim + d];
  if (F == PKV_F_F16) return pkv_f16_to_f32(((const pkv_u16*)kv)[row * head_dim + d]);
  if (F == PKV_F_BF16) return pkv_bf16_to_f32(((const pkv_u16*)kv)[row * head_dim + d]);
  const pkv_i64 g = groups == 1 ? 0 : pkv_div(d, g_len);
  const bool has_zero = F == PKV_Q_INT8 || F == PKV_Q_INT4 || F == PKV_Q_INT3;
  return pkv_dequantize<F>(pkv_code_at<F>((const pkv_u8*)kv, row, head_dim, d),
                           pkv_param_load<F>(scale, row * groups + g),
                           has_zero ? pkv_param_load<F>(zero, row * groups + g) : 0.0f);
}

// The physical block of key position pos of sequence b, or -1 (read as zeros).
__device__ __forceinline__ pkv_i64 pkv_attn_block(const int* __restrict__ indptr, const int* __restrict__ indices,
                                                  pkv_i64 b, pkv_i64 pos, pkv_i64 block_size,
                                                  pkv_i64 num_entries, pkv_i64 num_blocks) {
  const pkv_i64 entry = (pkv_i64)indptr[b] + pkv_div(pos, block_size);
  if (entry < indptr[b] || entry >= indptr[b + 1] || entry < 0 || entry >= num_entries) return -1;
  const pkv_i64 block = indices[entry];
  return block >= 0 && block < num_blocks ? block : -1;
}

// The last b in [0, n) with v[b] <= x (v non-decreasing, v[0] <= x), for int or i64 v.
template <typename V>
__device__ __forceinline__ pkv_i64 pkv_attn_find(const V* __restrict__ v, pkv_i64 n, pkv_i64 x) {
  pkv_i64 lo = 0, hi = n - 1;
  while (lo < hi) {
    const pkv_i64 mid = lo + (hi - lo + 1) / 2;
    if ((pkv_i64)v[mid] <= x) lo = mid; else hi = mid - 1;
  }
  return lo;
}

template <typename Q>
__device__ __forceinline__ float pkv_attn_q(const Q* __restrict__ q, pkv_i64 i) {
  return pkv_dtype<Q>::to_f32(q[i]);
}

// The attention CTA is one flat team of threads, whatever the shape of its block.
__device__ __forceinline__ pkv_i64 pkv_attn_tid() {
  return ((pkv_i64)threadIdx.z * blockDim.y + threadIdx.y) * blockDim.x + threadIdx.x;
}
__device__ __forceinline__ pkv_i64 pkv_attn_threads() {
  return (pkv_i64)blockDim.x * blockDim.y * blockDim.z;
}

// Stage h of the butterflies over `rows` rows of length d held at buf (row stride d).
__device__ __forceinline__ void pkv_attn_butterflies(float* buf, pkv_i64 rows, pkv_i64 d, pkv_i64 h) {
  for (pkv_i64 r = 0; r < rows; ++r) pkv_butterflies(buf + r * d, d, h, pkv_attn_tid(), pkv_attn_threads());
}

template <int F, typename Q, int LAYOUT, int MODE>
__device__ __forceinline__ void pkv_attn(
    const void* __restrict__ kv, const float* __restrict__ scale, const float* __restrict__ zero,
    const pkv_u16* __restrict__ key_scale, const pkv_u16* __restrict__ key_zero, const float* __restrict__ signs,
    const Q* __restrict__ q, Q* __restrict__ out, float* __restrict__ part_o, float* __restrict__ part_ml,
    const int* __restrict__ indptr, const int* __restrict__ indices, const int* __restrict__ seq_lens,
    const int* __restrict__ q_indptr, const pkv_i64* __restrict__ tile_ends, pkv_i64 batch,
    pkv_i64 num_entries, pkv_i64 num_blocks, pkv_i64 block_size, pkv_i64 num_kv_heads, pkv_i64 head_dim,
    pkv_i64 groups, pkv_i64 num_q_tokens, pkv_i64 num_q_heads, pkv_i64 q_stride0, pkv_i64 q_stride1,
    pkv_i64 heads_per_cta, pkv_i64 q_tile, pkv_i64 kv_tile, pkv_i64 num_splits, pkv_i64 num_tiles,
    float sm_scale, float soft_cap, pkv_i64 window, pkv_i64 sink_tokens) {
  PKV_COOPERATIVE();
  PKV_SHARED float smem[PKV_ATTN_FLOATS];
  PKV_SHARED pkv_i64 kpos[PKV_ATTN_MAX_TILE];  // per tile key: its position, or -1 (none)
  PKV_SHARED bool ksealed[PKV_ATTN_MAX_TILE];  // per tile key: an int4 block key (unrotated)
  PKV_SHARED pkv_i64 kblock[PKV_ATTN_MAX_TILE];  // per tile key: its physical block, or -1 (zeros)
  PKV_SHARED pkv_i64 krow[PKV_ATTN_MAX_TILE];    // per tile key: its K row in the per-layer view
  PKV_SHARED pkv_i64 vrow[PKV_ATTN_MAX_TILE];    // and its V row
  const pkv_i64 D = head_dim, T = kv_tile, KS = head_dim | 1;  // odd K/V row stride: no bank conflicts
  const pkv_i64 qt = MODE == PKV_ATTN_DECODE ? 1 : q_tile;
  const pkv_i64 R = qt * heads_per_cta;
  const bool rotated = signs != 0;
  if (batch <= 0 || num_kv_heads <= 0 || T < 1 || T > PKV_ATTN_MAX_TILE || R > PKV_ATTN_MAX_ROWS) return;
  if ((rotated ? 3 : 2) * R * D + 2 * T * KS + R * T + 3 * R > PKV_ATTN_FLOATS) return;  // not a planned launch
  float* qr = smem;                      // [R, D] queries as the logits take them (rotated)
  float* qo = rotated ? qr + R * D : qr;  // [R, D] queries as given (for block keys)
  float* acc = qo + R * D;               // [R, D] unnormalized output
  float* ks = acc + R * D;               // [T, KS] keys of the tile
  float* vs = ks + T * KS;               // [T, KS] values
  float* sc = vs + T * KS;               // [R, T] logits, then probabilities
  float* mrow = sc + R * T;              // [R] running max
  float* lrow = mrow + R;                // [R] running sum
  float* alpha = lrow + R;               // [R] this tile's rescale factor
  const pkv_i64 group = num_q_heads / num_kv_heads;
  const pkv_i64 chunks = (group + heads_per_cta - 1) / heads_per_cta;
  const pkv_i64 works = num_tiles * num_kv_heads * chunks;
  const pkv_i64 g_len = pkv_div(head_dim, groups);
  const float neg_inf = __uint_as_float(0xff800000u);
  for (pkv_i64 w = blockIdx.y; w < works; w += gridDim.y) {
   for (pkv_i64 split = blockIdx.x; split < num_splits; split += gridDim.x) {
    const pkv_i64 tile = pkv_div(w, num_kv_heads * chunks);
    const pkv_i64 hk = pkv_div(w - tile * num_kv_heads * chunks, chunks);
    const pkv_i64 chunk = w - (tile * num_kv_heads + hk) * chunks;
    // the tile's sequence b and its first query token
    pkv_i64 b, tok0;
    if (MODE == PKV_ATTN_DECODE) {
      if (q_indptr[0] > tile) continue;
      b = pkv_attn_find(q_indptr, batch + 1, tile);
      if (b >= batch) continue;  // past the last sequence's queries
      tok0 = tile;
    } else {
      if (tile_ends[batch - 1] <= tile) continue;
      b = tile < tile_ends[0] ? 0 : pkv_attn_find(tile_ends, batch, tile) + 1;
      const pkv_i64 first_tile = b == 0 ? 0 : tile_ends[b - 1];
      tok0 = (pkv_i64)q_indptr[b] + (tile - first_tile) * qt;
    }
    const pkv_i64 q_begin = q_indptr[b], q_end = q_indptr[b + 1];
    if (tok0 < q_begin || tok0 >= q_end) continue;
    const pkv_i64 ntok = q_end - tok0 < qt ? q_end - tok0 : qt;
    const pkv_i64 len = seq_lens[b];
    const pkv_i64 pos0 = len - (q_end - q_begin) + (tok0 - q_begin);  // position of the tile's first query
    const pkv_i64 hi = pos0 + ntok < len ? pos0 + ntok : len;
    pkv_i64 ns = 0, w_lo = 0;
    if (window > 0) {
      ns = sink_tokens < hi ? sink_tokens : hi;
      w_lo = pos0 - window + 1 > ns ? pos0 - window + 1 : ns;
    }
    const pkv_i64 span = ns + (hi > w_lo ? hi - w_lo : 0);
    pkv_i64 per = (span + num_splits - 1) / num_splits;
    per = (per + T - 1) / T * T;
    const pkv_i64 k_begin = split * per < span ? split * per : span;
    const pkv_i64 k_end = k_begin + per < span ? k_begin + per : span;
    const pkv_i64 head0 = hk * group + chunk * heads_per_cta;  // the CTA's first query head

    PKV_PHASE({  // the queries (rotated once), and the row state
      for (pkv_i64 e = pkv_attn_tid(); e < R * D; e += pkv_attn_threads()) {
        const pkv_i64 r = pkv_div(e, D), d = e - r * D;
        const pkv_i64 i = pkv_div(r, heads_per_cta), g = r - i * heads_per_cta;
        float x = 0.0f;
        if (i < ntok && chunk * heads_per_cta + g < group && tok0 + i < num_q_tokens && tok0 + i >= 0)
          x = pkv_attn_q(q, (tok0 + i) * q_stride0 + (head0 + g) * q_stride1 + d);
        qo[e] = x;
        if (rotated) qr[e] = __fmul_rn(x, signs[d]);
        acc[e] = 0.0f;
      }
      for (pkv_i64 r = pkv_attn_tid(); r < R; r += pkv_attn_threads()) {
        mrow[r] = neg_inf;
        lrow[r] = 0.0f;
      }
    });
    if (rotated) {
      for (pkv_i64 h = 1; h < D; h *= 2) {
        PKV_PHASE({ pkv_attn_butterflies(qr, R, D, h); });
      }
      PKV_PHASE({
        for (pkv_i64 e = pkv_attn_tid(); e < R * D; e += pkv_attn_threads()) {
          const pkv_i64 d = e - pkv_div(e, D) * D;
          qr[e] = __fmul_rn(qr[e], pkv_hadamard_scale_at(D, d));
        }
      });
    }
    for (pkv_i64 t0 = k_begin; t0 < k_end; t0 += T) {
      PKV_PHASE({  // 1a. each key's rows, looked up once per key (not per element)
        for (pkv_i64 t = pkv_attn_tid(); t < T; t += pkv_attn_threads()) {
          const pkv_i64 k = t0 + t;
          const pkv_i64 pos = k < k_end ? (k < ns ? k : w_lo + k - ns) : -1;
          const pkv_i64 block = pos < 0 ? -1 : pkv_attn_block(indptr, indices, b, pos, block_size,
                                                              num_entries, num_blocks);
          kpos[t] = pos;
          ksealed[t] = block >= 0 && pkv_key_sealed<F>(key_scale, block, hk, num_kv_heads, D);
          kblock[t] = block;
          if (block >= 0) {
            const pkv_i64 off = pos - pkv_div(pos, block_size) * block_size;
            krow[t] = pkv_row_index<LAYOUT>(block, 0, off, hk, block_size, num_kv_heads);
            vrow[t] = pkv_row_index<LAYOUT>(block, 1, off, hk, block_size, num_kv_heads);
          }
        }
      });
      PKV_PHASE({  // 1b. the tile's keys and values: a warp per key, a lane per channel (coalesced)
        // Each lane first loads its PKV_ATTN_LANE_ELEMS channels of K and of V into
        // registers and only then stores them, so that its loads are in flight at once (a
        // load-then-store loop waits out one memory latency per channel). Loading several
        // keys ahead as well was measured on an H200 (decode, batch 8 x 4096): 4 keys took
        // 9q/3kv/64 fp32 from 387 to 289 us but 32q/8kv/128 from 592 to 706 us (and
        // benchmarks/kernels.py's fp16 decode from 797 to 1031 us), so one key at a time.
        const pkv_i64 nt = pkv_attn_threads(), lanes = nt < 32 ? nt : 32, teams = nt / lanes;
        const pkv_i64 tid = pkv_attn_tid(), team = tid / lanes, lane = tid - team * lanes;
        for (pkv_i64 t = team; t < T && team < teams; t += teams) {
          const pkv_i64 block = kblock[t], k_row = krow[t], v_row = vrow[t];
          const bool sealed = ksealed[t];
          float* kd = ks + t * KS;
          float* vd = vs + t * KS;
          for (pkv_i64 d0 = lane; d0 < D; d0 += PKV_ATTN_LANE_ELEMS * lanes) {
            float kx[PKV_ATTN_LANE_ELEMS], vx[PKV_ATTN_LANE_ELEMS];
PKV_UNROLL
            for (int i = 0; i < PKV_ATTN_LANE_ELEMS; ++i) {
              const pkv_i64 d = d0 + i * lanes;
              kx[i] = vx[i] = 0.0f;
              if (block >= 0 && d < D) {
                kx[i] = sealed ? pkv_key_channel_value(pkv_code_at<F>((const pkv_u8*)kv, k_row, D, d), key_scale,
                                                       key_zero, block, hk, num_kv_heads, D, d)
                               : pkv_attn_elem<F>(kv, scale, zero, k_row, D, groups, g_len, d);
                vx[i] = pkv_attn_elem<F>(kv, scale, zero, v_row, D, groups, g_len, d);
              }
            }
PKV_UNROLL
            for (int i = 0; i < PKV_ATTN_LANE_ELEMS; ++i) {
              const pkv_i64 d = d0 + i * lanes;
              if (d < D) {
                kd[d] = kx[i];
                vd[d] = vx[i];
              }
            }
          }
        }
      });
      PKV_PHASE({  // 2. logits
        for (pkv_i64 e = pkv_attn_tid(); e < R * T; e += pkv_attn_threads()) {
          const pkv_i64 r = pkv_div(e, T), t = e - r * T;
          const pkv_i64 p = pos0 + pkv_div(r, heads_per_cta);
          const pkv_i64 j = kpos[t];
          float s = neg_inf;
          if (j >= 0 && j <= p && (window <= 0 || j > p - window || j < sink_tokens)) {
            const float* qv = (ksealed[t] ? qo : qr) + r * D;
            const float* kv_t = ks + t * KS;
            float dot = 0.0f;
            for (pkv_i64 d = 0; d < D; ++d) dot = __fadd_rn(dot, __fmul_rn(qv[d], kv_t[d]));
            s = __fmul_rn(dot, sm_scale);
            if (soft_cap > 0.0f) s = __fmul_rn(soft_cap, tanhf(__fdiv_rn(s, soft_cap)));
          }
          sc[e] = s;
        }
      });
      PKV_PHASE({  // 3. online softmax
        for (pkv_i64 r = pkv_attn_tid(); r < R; r += pkv_attn_threads()) {
          float mx = mrow[r];
          // a NaN score (NaN or inf in q) wins and makes the row NaN, as the definition's
          for (pkv_i64 t = 0; t < T; ++t) {
            const float s = sc[r * T + t];
            mx = (s > mx || s != s) ? s : mx;
          }
          const float a = mx == neg_inf ? 1.0f : expf(__fsub_rn(mrow[r], mx));  // m = -inf: a = 0
          float sum = 0.0f;
          for (pkv_i64 t = 0; t < T; ++t) {
            const float s = sc[r * T + t];
            const float pr = s == neg_inf ? 0.0f : expf(__fsub_rn(s, mx));
            sc[r * T + t] = pr;
            sum = __fadd_rn(sum, pr);
          }
          lrow[r] = __fadd_rn(__fmul_rn(lrow[r], a), sum);
          mrow[r] = mx;
          alpha[r] = a;
        }
      });
      PKV_PHASE({  // 4. accumulate
        for (pkv_i64 e = pkv_attn_tid(); e < R * D; e += pkv_attn_threads()) {
          const pkv_i64 r = pkv_div(e, D), d = e - r * D;
          float x = __fmul_rn(acc[e], alpha[r]);
          for (pkv_i64 t = 0; t < T; ++t) x = __fadd_rn(x, __fmul_rn(sc[r * T + t], vs[t * KS + d]));
          acc[e] = x;
        }
      });
    }
    if (num_splits > 1) {
      PKV_PHASE({  // this split's (acc, m, l); the merge kernel normalizes and unrotates
        for (pkv_i64 e = pkv_attn_tid(); e < R * D; e += pkv_attn_threads()) {
          const pkv_i64 r = pkv_div(e, D), d = e - r * D;
          const pkv_i64 i = pkv_div(r, heads_per_cta), g = r - i * heads_per_cta;
          if (i < ntok && chunk * heads_per_cta + g < group && tok0 + i < num_q_tokens && pos0 + i >= 0) {
            const pkv_i64 row = (split * num_q_tokens + tok0 + i) * num_q_heads + head0 + g;
            part_o[row * D + d] = acc[e];
            if (d == 0) {
              part_ml[row * 2] = mrow[r];
              part_ml[row * 2 + 1] = lrow[r];
            }
          }
        }
      });
      continue;
    }
    PKV_PHASE({
      for (pkv_i64 e = pkv_attn_tid(); e < R * D; e += pkv_attn_threads()) {
        const float l = lrow[pkv_div(e, D)];
        acc[e] = l != 0.0f ? __fdiv_rn(acc[e], l) : 0.0f;  // no key seen: 0; a NaN row stays NaN
      }
    });
    if (rotated) {
      for (pkv_i64 h = 1; h < D; h *= 2) {
        PKV_PHASE({ pkv_attn_butterflies(acc, R, D, h); });
      }
    }
    PKV_PHASE({
      for (pkv_i64 e = pkv_attn_tid(); e < R * D; e += pkv_attn_threads()) {
        const pkv_i64 r = pkv_div(e, D), d = e - r * D;
        const pkv_i64 i = pkv_div(r, heads_per_cta), g = r - i * heads_per_cta;
        if (i < ntok && chunk * heads_per_cta + g < group && tok0 + i < num_q_tokens && pos0 + i >= 0) {
          float x = acc[e];
          if (rotated) x = __fmul_rn(__fmul_rn(x, pkv_hadamard_scale_at(D, d)), signs[d]);
          out[((tok0 + i) * num_q_heads + head0 + g) * D + d] = pkv_dtype<Q>::from_f32(x);
        }
      }
    });
   }
  }
}

// Merge the splits of each (token, head) row: rows on y (blockDim.y per CTA, held in
// shared memory for the unrotation), head_dim on x.
template <typename O>
__device__ __forceinline__ void pkv_attn_merge(const float* __restrict__ part_o, const float* __restrict__ part_ml,
                                               const float* __restrict__ signs, O* __restrict__ out, pkv_i64 rows,
                                               pkv_i64 head_dim, pkv_i64 num_splits) {
  PKV_COOPERATIVE();
  PKV_SHARED float buf[PKV_ROT_FLOATS];
  const pkv_i64 D = head_dim, by = blockDim.y;
  if (by * D > PKV_ROT_FLOATS) return;  // not a planned launch
  const float neg_inf = __uint_as_float(0xff800000u);
  const pkv_i64 cta = (pkv_i64)blockIdx.y * gridDim.x + blockIdx.x;
  const pkv_i64 ctas = (pkv_i64)gridDim.x * gridDim.y;
  for (pkv_i64 base = cta * by; base < rows; base += ctas * by) {
    PKV_PHASE({
      const pkv_i64 r = base + threadIdx.y;
      if (r < rows) {
        float m = neg_inf;
        for (pkv_i64 s = 0; s < num_splits; ++s) {
          const float ms = part_ml[(s * rows + r) * 2];
          m = (ms > m || ms != ms) ? ms : m;
        }
        for (pkv_i64 d = threadIdx.x; d < D; d += blockDim.x) {
          float l = 0.0f, x = 0.0f;
          for (pkv_i64 s = 0; s < num_splits; ++s) {
            const float ms = part_ml[(s * rows + r) * 2];
            if (ms == neg_inf) continue;  // no key of this row in split s
            const float c = expf(__fsub_rn(ms, m));
            l = __fadd_rn(l, __fmul_rn(part_ml[(s * rows + r) * 2 + 1], c));
            x = __fadd_rn(x, __fmul_rn(part_o[(s * rows + r) * D + d], c));
          }
          buf[threadIdx.y * D + d] = l != 0.0f ? __fdiv_rn(x, l) : 0.0f;
        }
      }
    });
    if (signs != 0) {
      for (pkv_i64 h = 1; h < D; h *= 2) {
        PKV_PHASE({
          if (base + threadIdx.y < rows) pkv_butterflies(buf + threadIdx.y * D, D, h, threadIdx.x, blockDim.x);
        });
      }
    }
    PKV_PHASE({
      const pkv_i64 r = base + threadIdx.y;
      if (r < rows) {
        for (pkv_i64 d = threadIdx.x; d < D; d += blockDim.x) {
          float x = buf[threadIdx.y * D + d];
          if (signs != 0) x = __fmul_rn(__fmul_rn(x, pkv_hadamard_scale_at(D, d)), signs[d]);
          out[r * D + d] = pkv_dtype<O>::from_f32(x);
        }
      }
    });
  }
}

#define PKV_ATTN_ENTRY(NAME, F, Q, LAYOUT, MODE)                                                                   \
  extern "C" __global__ void NAME(                                                                                 \
      const void* __restrict__ kv, const float* __restrict__ scale, const float* __restrict__ zero,               \
      const pkv_u16* __restrict__ key_scale, const pkv_u16* __restrict__ key_zero,                                \
      const float* __restrict__ signs, const Q* __restrict__ q, Q* __restrict__ out, float* __restrict__ part_o,  \
      float* __restrict__ part_ml, const int* __restrict__ indptr, const int* __restrict__ indices,               \
      const int* __restrict__ seq_lens, const int* __restrict__ q_indptr, const pkv_i64* __restrict__ tile_ends,  \
      pkv_i64 batch, pkv_i64 num_entries, pkv_i64 num_blocks, pkv_i64 block_size, pkv_i64 num_kv_heads,          \
      pkv_i64 head_dim, pkv_i64 groups, pkv_i64 num_q_tokens, pkv_i64 num_q_heads, pkv_i64 q_stride0,             \
      pkv_i64 q_stride1, pkv_i64 heads_per_cta, pkv_i64 q_tile, pkv_i64 kv_tile, pkv_i64 num_splits,              \
      pkv_i64 num_tiles, float sm_scale, float soft_cap, pkv_i64 window, pkv_i64 sink_tokens) {                   \
    pkv_attn<F, Q, LAYOUT, MODE>(kv, scale, zero, key_scale, key_zero, signs, q, out, part_o, part_ml, indptr,    \
                                 indices, seq_lens, q_indptr, tile_ends, batch, num_entries, num_blocks,           \
                                 block_size, num_kv_heads, head_dim, groups, num_q_tokens, num_q_heads, q_stride0, \
                                 q_stride1, heads_per_cta, q_tile, kv_tile, num_splits, num_tiles, sm_scale,       \
                                 soft_cap, window, sink_tokens);                                                   \
  }

#define PKV_ATTN_MODES(L, LAYOUT, FN, F, QN, Q)                                  \
  PKV_ATTN_ENTRY(pkv_attn_decode_##L##_##FN##QN, F, Q, LAYOUT, PKV_ATTN_DECODE)   \
  PKV_ATTN_ENTRY(pkv_attn_prefill_##L##_##FN##QN, F, Q, LAYOUT, PKV_ATTN_PREFILL)

#define PKV_ATTN_QUANT(L, LAYOUT, FN, F)                  \
  PKV_ATTN_MODES(L, LAYOUT, FN, F, _qf32, float)          \
  PKV_ATTN_MODES(L, LAYOUT, FN, F, _qf16, pkv_f16)        \
  PKV_ATTN_MODES(L, LAYOUT, FN, F, _qbf16, pkv_bf16)

// PKV_ATTN_KV (e.g. -DPKV_ATTN_KV=PKV_Q_INT8): only the entries that read that K/V
// storage (both layouts, both modes, every query dtype). The launcher compiles the file
// once per storage format it meets, so a first call compiles one eighth of it (NVRTC took
// about 40 s for the whole file on an H200 host); without it, every entry (the emulation
// and the compile tests).
#ifdef PKV_ATTN_KV
#define PKV_ATTN_ALL 0
#else
#define PKV_ATTN_ALL 1
#define PKV_ATTN_KV (-1)
#endif

// one storage format in both layouts
#define PKV_ATTN_MODEL_BOTH(FN, F, Q) \
  PKV_ATTN_MODES(nhd, PKV_NHD, FN, F, , Q) PKV_ATTN_MODES(hnd, PKV_HND, FN, F, , Q)
#define PKV_ATTN_QUANT_BOTH(FN, F) PKV_ATTN_QUANT(nhd, PKV_NHD, FN, F) PKV_ATTN_QUANT(hnd, PKV_HND, FN, F)

#if PKV_ATTN_ALL || PKV_ATTN_KV == PKV_F_F32
PKV_ATTN_MODEL_BOTH(f32, PKV_F_F32, float)
#endif
#if PKV_ATTN_ALL || PKV_ATTN_KV == PKV_F_F16
PKV_ATTN_MODEL_BOTH(f16, PKV_F_F16, pkv_f16)
#endif
#if PKV_ATTN_ALL || PKV_ATTN_KV == PKV_F_BF16
PKV_ATTN_MODEL_BOTH(bf16, PKV_F_BF16, pkv_bf16)
#endif
#if PKV_ATTN_ALL || PKV_ATTN_KV == PKV_Q_E4M3
PKV_ATTN_QUANT_BOTH(e4m3, PKV_Q_E4M3)
#endif
#if PKV_ATTN_ALL || PKV_ATTN_KV == PKV_Q_E5M2
PKV_ATTN_QUANT_BOTH(e5m2, PKV_Q_E5M2)
#endif
#if PKV_ATTN_ALL || PKV_ATTN_KV == PKV_Q_INT8
PKV_ATTN_QUANT_BOTH(int8, PKV_Q_INT8)
#endif
#if PKV_ATTN_ALL || PKV_ATTN_KV == PKV_Q_INT4
PKV_ATTN_QUANT_BOTH(int4, PKV_Q_INT4)
#endif
#if PKV_ATTN_ALL || PKV_ATTN_KV == PKV_Q_INT3
PKV_ATTN_QUANT_BOTH(int3, PKV_Q_INT3)
#endif

#define PKV_ATTN_MERGE(NAME, O)                                                                                \
  extern "C" __global__ void NAME(const float* __restrict__ part_o, const float* __restrict__ part_ml,         \
                                  const float* __restrict__ signs, O* __restrict__ out, pkv_i64 rows,          \
                                  pkv_i64 head_dim, pkv_i64 num_splits) {                                      \
    pkv_attn_merge<O>(part_o, part_ml, signs, out, rows, head_dim, num_splits);                                \
  }

PKV_ATTN_MERGE(pkv_attn_merge_f32, float)
PKV_ATTN_MERGE(pkv_attn_merge_f16, pkv_f16)
PKV_ATTN_MERGE(pkv_attn_merge_bf16, pkv_bf16)
