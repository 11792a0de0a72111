// gather_kv.cu - read the K/V of a batch of sequences into contiguous
// [num_tokens, H, D] tensors, in token order (sequence 0's tokens first).
//
// Rows (y) are block-table entries, columns (x) the chunks of the up to
// block_size tokens one entry holds, so a table lookup is amortised over a whole
// block. The output position of sequence b starts at seq_ends[b] - seq_lens[b]
// (seq_ends: the launcher's inclusive int64 prefix sum of seq_lens). Entries past
// ceil(seq_lens[b] / block_size) are padding and are never read. The launcher
// cannot read device-resident tables without a sync, so the kernel guards
// itself: a block id outside [0, num_blocks) yields zeros, and nothing is written
// outside [0, total_tokens).
//
// Entry points (pagedkv/kernels/sources.py lists the same names):
//   pkv_gather_{csr,pad}_{nhd,hnd}_{v16,e4,e2}                     plain copy
//   pkv_gather_{csr,pad}_{nhd,hnd}_{e4m3,e5m2,int8,int4,int3}_to_{f32,f16,bf16}
//                                                     dequantizing, one element per thread
//   pkv_gather_{csr,pad}_{nhd,hnd}_{e4m3,e5m2,int8,int4,int3}_to_{f32,f16,bf16}_rot
//       dequantizing and unrotating (common.cuh, "Rotation"), cooperatively: rows
//       are (token, K/V, head) output rows; the CTA row that owns one finds its
//       token's block (a binary search of seq_ends), dequantizes the row into
//       shared memory, runs the butterfly stages there (a barrier phase each), and
//       stores the scaled, sign-multiplied row converted to the output type.
// Every dequantizing entry point also takes key_scale/key_zero: null, or (int4 only)
// the bfloat16 [num_blocks, H, D] per-channel parameters of block keys
// (pagedkv/quant.py, "block keys"). A K row whose key_scale[block, head, 0] is
// nonzero (a float compare: -0.0 is zero, NaN is not) is code * s + z per channel
// and is never unrotated; every other row takes its per-token parameters.
//   pkv_gather_{csr,pad}_{nhd,hnd}_{e4m3,e5m2,int8,int4,int3}_to_{f32,f16,bf16}_v16
//       the dequantizing gather at one thread per 16 output bytes (4 or 8 elements: the
//       launcher takes it when head_dim is a multiple of that and the outputs are 16-byte
//       aligned): a chunk's parameters are looked up once per scale group it meets, its
//       block-key test once, and it is stored as one 16-byte vector.
// csr: indptr [B + 1] + indices [nnz]; pad: block_table [B, width], row-major.
#include "warp.cuh"

#define PKV_TABLE_CSR 0
#define PKV_TABLE_PAD 1

// Map table entry j to (sequence, logical block in it, physical block id).
template <int TABLE>
__device__ __forceinline__ bool pkv_locate(pkv_i64 j, const int* __restrict__ table,
                                           const int* __restrict__ indptr, pkv_i64 batch,
                                           pkv_i64 width, pkv_i64* seq, pkv_i64* logical,
                                           pkv_i64* block) {
  if (TABLE == PKV_TABLE_PAD) {
    *seq = pkv_div(j, width);
    *logical = j - *seq * width;
  } else {
    // The last sequence whose range starts at or before j; j must lie inside it.
    if (batch <= 0 || indptr[0] > j) return false;
    pkv_i64 lo = 0, hi = batch - 1;
    while (lo < hi) {
      const pkv_i64 mid = lo + (hi - lo + 1) / 2;
      if (indptr[mid] <= j) lo = mid; else hi = mid - 1;
    }
    if (j >= indptr[lo + 1]) return false;
    *seq = lo;
    *logical = j - indptr[lo];
  }
  *block = table[j];
  return true;
}

// The tokens one table entry contributes: [out_begin, out_begin + count) of the
// output, read from offsets [0, count) of the entry's block.
struct pkv_entry {
  pkv_i64 block;
  pkv_i64 out_begin;
  pkv_i64 count;
  bool valid_block;
};

template <int TABLE>
__device__ __forceinline__ bool pkv_entry_at(pkv_i64 j, const int* __restrict__ table,
                                             const int* __restrict__ indptr,
                                             const int* __restrict__ seq_lens,
                                             const pkv_i64* __restrict__ seq_ends,
                                             pkv_i64 batch, pkv_i64 width, pkv_i64 num_blocks,
                                             pkv_i64 block_size, pkv_entry* e) {
  pkv_i64 seq, logical;
  if (!pkv_locate<TABLE>(j, table, indptr, batch, width, &seq, &logical, &e->block)) return false;
  const pkv_i64 len = seq_lens[seq];
  const pkv_i64 first = logical * block_size;
  if (first >= len) return false;  // padding entry (or a non-positive length)
  e->count = len - first < block_size ? len - first : block_size;
  e->out_begin = seq_ends[seq] - len + first;
  e->valid_block = e->block >= 0 && e->block < num_blocks;
  return true;
}

template <typename C, int LAYOUT, int TABLE>
__device__ __forceinline__ void pkv_gather_copy(
    const C* __restrict__ kv, C* __restrict__ out_key, C* __restrict__ out_value,
    const int* __restrict__ table, const int* __restrict__ indptr,
    const int* __restrict__ seq_lens, const pkv_i64* __restrict__ seq_ends, pkv_i64 batch,
    pkv_i64 num_entries, pkv_i64 width, pkv_i64 total_tokens, pkv_i64 num_blocks,
    pkv_i64 block_size, pkv_i64 num_heads, pkv_i64 head_chunks) {
  const pkv_i64 row_chunks = num_heads * head_chunks;
  const pkv_i64 out_chunks = total_tokens * row_chunks;
  for (pkv_i64 j = pkv_row_begin(); j < num_entries; j += pkv_row_step()) {
    pkv_entry e;
    if (!pkv_entry_at<TABLE>(j, table, indptr, seq_lens, seq_ends, batch, width, num_blocks,
                             block_size, &e))
      continue;
    const pkv_i64 n = e.count * row_chunks;
    for (pkv_i64 i = pkv_col_begin(); i < n; i += pkv_col_step()) {
      const pkv_i64 dst = e.out_begin * row_chunks + i;
      if (dst < 0 || dst >= out_chunks) continue;
      C k = pkv_zero_chunk<C>(), v = pkv_zero_chunk<C>();
      if (e.valid_block) {
        pkv_i64 k_src, v_src;
        if (LAYOUT == PKV_NHD) {  // the block's [count, H, Dc] run is contiguous
          k_src = (e.block * 2 + 0) * block_size * row_chunks + i;
          v_src = (e.block * 2 + 1) * block_size * row_chunks + i;
        } else {
          const pkv_i64 offset = pkv_div(i, row_chunks);
          const pkv_i64 r = i - offset * row_chunks;
          const pkv_i64 h = pkv_div(r, head_chunks);
          const pkv_i64 c = r - h * head_chunks;
          k_src = pkv_row_index<LAYOUT>(e.block, 0, offset, h, block_size, num_heads) * head_chunks + c;
          v_src = pkv_row_index<LAYOUT>(e.block, 1, offset, h, block_size, num_heads) * head_chunks + c;
        }
        k = kv[k_src];
        v = kv[v_src];
      }
      out_key[dst] = k;
      out_value[dst] = v;
    }
  }
}

// pkv_code_at, pkv_key_sealed and pkv_key_channel_value: common.cuh ("Reading rows").

template <int Q, typename O, int LAYOUT, int TABLE>
__device__ __forceinline__ void pkv_gather_dequant(
    const pkv_u8* __restrict__ kv, const float* __restrict__ scale,
    const float* __restrict__ zero, O* __restrict__ out_key, O* __restrict__ out_value,
    const int* __restrict__ table, const int* __restrict__ indptr,
    const int* __restrict__ seq_lens, const pkv_i64* __restrict__ seq_ends, pkv_i64 batch,
    pkv_i64 num_entries, pkv_i64 width, pkv_i64 total_tokens, pkv_i64 num_blocks,
    pkv_i64 block_size, pkv_i64 num_heads, pkv_i64 head_dim, pkv_i64 groups,
    const pkv_u16* __restrict__ key_scale, const pkv_u16* __restrict__ key_zero) {
  const pkv_i64 row_elems = num_heads * head_dim;
  const pkv_i64 out_elems = total_tokens * row_elems;
  const pkv_i64 g_len = pkv_div(head_dim, groups);
  for (pkv_i64 j = pkv_row_begin(); j < num_entries; j += pkv_row_step()) {
    pkv_entry e;
    if (!pkv_entry_at<TABLE>(j, table, indptr, seq_lens, seq_ends, batch, width, num_blocks,
                             block_size, &e))
      continue;
    const pkv_i64 n = e.count * row_elems;
    for (pkv_i64 i = pkv_col_begin(); i < n; i += pkv_col_step()) {
      const pkv_i64 dst = e.out_begin * row_elems + i;
      if (dst < 0 || dst >= out_elems) continue;
      float k = 0.0f, v = 0.0f;
      if (e.valid_block) {
        const pkv_i64 row = pkv_div(i, head_dim);  // offset * H + head
        const pkv_i64 d = i - row * head_dim;
        const pkv_i64 offset = pkv_div(row, num_heads);
        const pkv_i64 h = row - offset * num_heads;
        const pkv_i64 k_row = pkv_row_index<LAYOUT>(e.block, 0, offset, h, block_size, num_heads);
        const pkv_i64 v_row = pkv_row_index<LAYOUT>(e.block, 1, offset, h, block_size, num_heads);
        const pkv_i64 g = groups == 1 ? 0 : pkv_div(d, g_len);
        const bool has_zero = Q == PKV_Q_INT8 || Q == PKV_Q_INT4 || Q == PKV_Q_INT3;
        const float k_zero = has_zero ? pkv_param_load<Q>(zero, k_row * groups + g) : 0.0f;
        const float v_zero = has_zero ? pkv_param_load<Q>(zero, v_row * groups + g) : 0.0f;
        const pkv_u32 k_code = pkv_code_at<Q>(kv, k_row, head_dim, d);
        if (pkv_key_sealed<Q>(key_scale, e.block, h, num_heads, head_dim))
          k = pkv_key_channel_value(k_code, key_scale, key_zero, e.block, h, num_heads, head_dim, d);
        else
          k = pkv_dequantize<Q>(k_code, pkv_param_load<Q>(scale, k_row * groups + g), k_zero);
        v = pkv_dequantize<Q>(pkv_code_at<Q>(kv, v_row, head_dim, d), pkv_param_load<Q>(scale, v_row * groups + g),
                              v_zero);
      }
      out_key[dst] = pkv_dtype<O>::from_f32(k);
      out_value[dst] = pkv_dtype<O>::from_f32(v);
    }
  }
}

template <int Q, typename O, int LAYOUT, int TABLE>
__device__ __forceinline__ void pkv_gather_dequant_v16(
    const pkv_u8* __restrict__ kv, const float* __restrict__ scale,
    const float* __restrict__ zero, O* __restrict__ out_key, O* __restrict__ out_value,
    const int* __restrict__ table, const int* __restrict__ indptr,
    const int* __restrict__ seq_lens, const pkv_i64* __restrict__ seq_ends, pkv_i64 batch,
    pkv_i64 num_entries, pkv_i64 width, pkv_i64 total_tokens, pkv_i64 num_blocks,
    pkv_i64 block_size, pkv_i64 num_heads, pkv_i64 head_dim, pkv_i64 groups,
    const pkv_u16* __restrict__ key_scale, const pkv_u16* __restrict__ key_zero) {
  constexpr int CE = 16 / (int)sizeof(O);  // elements per 16-byte chunk
  const pkv_i64 head_chunks = head_dim / CE, row_chunks = num_heads * head_chunks;
  const pkv_i64 out_chunks = total_tokens * row_chunks;
  const pkv_i64 g_len = pkv_div(head_dim, groups);
  const bool has_zero = Q == PKV_Q_INT8 || Q == PKV_Q_INT4 || Q == PKV_Q_INT3;
  for (pkv_i64 j = pkv_row_begin(); j < num_entries; j += pkv_row_step()) {
    pkv_entry e;
    if (!pkv_entry_at<TABLE>(j, table, indptr, seq_lens, seq_ends, batch, width, num_blocks,
                             block_size, &e))
      continue;
    const pkv_i64 n = e.count * row_chunks;
    for (pkv_i64 i = pkv_col_begin(); i < n; i += pkv_col_step()) {
      const pkv_i64 dst = e.out_begin * row_chunks + i;
      if (dst < 0 || dst >= out_chunks) continue;
      float k[CE], v[CE];
      for (int c = 0; c < CE; ++c) k[c] = v[c] = 0.0f;
      if (e.valid_block) {
        const pkv_i64 row = pkv_div(i, head_chunks);  // offset * H + head
        const pkv_i64 d0 = (i - row * head_chunks) * CE;
        const pkv_i64 offset = pkv_div(row, num_heads);
        const pkv_i64 h = row - offset * num_heads;
        const pkv_i64 k_row = pkv_row_index<LAYOUT>(e.block, 0, offset, h, block_size, num_heads);
        const pkv_i64 v_row = pkv_row_index<LAYOUT>(e.block, 1, offset, h, block_size, num_heads);
        const bool sealed = pkv_key_sealed<Q>(key_scale, e.block, h, num_heads, head_dim);
        pkv_i64 g = -1;
        float ks = 0.0f, kz = 0.0f, vs = 0.0f, vz = 0.0f;
        for (int c = 0; c < CE; ++c) {
          const pkv_i64 d = d0 + c;
          const pkv_i64 gd = groups == 1 ? 0 : pkv_div(d, g_len);
          if (gd != g) {  // once per scale group the chunk meets
            g = gd;
            ks = pkv_param_load<Q>(scale, k_row * groups + g);
            vs = pkv_param_load<Q>(scale, v_row * groups + g);
            kz = has_zero ? pkv_param_load<Q>(zero, k_row * groups + g) : 0.0f;
            vz = has_zero ? pkv_param_load<Q>(zero, v_row * groups + g) : 0.0f;
          }
          const pkv_u32 k_code = pkv_code_at<Q>(kv, k_row, head_dim, d);
          k[c] = sealed ? pkv_key_channel_value(k_code, key_scale, key_zero, e.block, h, num_heads, head_dim, d)
                        : pkv_dequantize<Q>(k_code, ks, kz);
          v[c] = pkv_dequantize<Q>(pkv_code_at<Q>(kv, v_row, head_dim, d), vs, vz);
        }
      }
      pkv_u32 wk[4] = {0u, 0u, 0u, 0u}, wv[4] = {0u, 0u, 0u, 0u};
      for (int c = 0; c < CE; ++c) {
        if constexpr (sizeof(O) == 4) {
          wk[c] = __float_as_uint(k[c]);
          wv[c] = __float_as_uint(v[c]);
        } else {
          wk[c / 2] |= (pkv_u32)pkv_dtype<O>::from_f32(k[c]).bits << (16 * (c & 1));
          wv[c / 2] |= (pkv_u32)pkv_dtype<O>::from_f32(v[c]).bits << (16 * (c & 1));
        }
      }
      pkv_st16(out_key + dst * CE, make_uint4(wk[0], wk[1], wk[2], wk[3]));
      pkv_st16(out_value + dst * CE, make_uint4(wv[0], wv[1], wv[2], wv[3]));
    }
  }
}

// Where output token t lives: its block and its offset in that block; -1 when the
// tables name no valid block for it (the row reads as zeros, as in the plain
// gather), -2 when t lies past every sequence (the row is not written).
template <int TABLE>
__device__ __forceinline__ pkv_i64 pkv_token_block(pkv_i64 t, const int* __restrict__ table,
                                                   const int* __restrict__ indptr,
                                                   const int* __restrict__ seq_lens,
                                                   const pkv_i64* __restrict__ seq_ends,
                                                   pkv_i64 batch, pkv_i64 num_entries,
                                                   pkv_i64 width, pkv_i64 num_blocks,
                                                   pkv_i64 block_size, pkv_i64* offset) {
  *offset = 0;
  if (batch <= 0) return -2;
  pkv_i64 lo = 0, hi = batch - 1;  // the first sequence whose end is past t
  while (lo < hi) {
    const pkv_i64 mid = lo + (hi - lo) / 2;
    if (seq_ends[mid] > t) hi = mid; else lo = mid + 1;
  }
  const pkv_i64 j = t - (seq_ends[lo] - seq_lens[lo]);  // the token's index in its sequence
  if (j < 0 || j >= seq_lens[lo]) return -2;
  const pkv_i64 logical = pkv_div(j, block_size);
  pkv_i64 entry;
  if (TABLE == PKV_TABLE_PAD) {
    if (logical >= width) return -1;
    entry = lo * width + logical;
  } else {
    entry = (pkv_i64)indptr[lo] + logical;
    if (entry < indptr[lo] || entry >= indptr[lo + 1]) return -1;
  }
  if (entry < 0 || entry >= num_entries) return -1;
  const pkv_i64 block = table[entry];
  if (block < 0 || block >= num_blocks) return -1;
  *offset = j - logical * block_size;
  return block;
}

template <int Q, typename O, int LAYOUT, int TABLE>
__device__ __forceinline__ void pkv_gather_dequant_rot(
    const pkv_u8* __restrict__ kv, const float* __restrict__ scale,
    const float* __restrict__ zero, O* __restrict__ out_key, O* __restrict__ out_value,
    const int* __restrict__ table, const int* __restrict__ indptr,
    const int* __restrict__ seq_lens, const pkv_i64* __restrict__ seq_ends, pkv_i64 batch,
    pkv_i64 num_entries, pkv_i64 width, pkv_i64 total_tokens, pkv_i64 num_blocks,
    pkv_i64 block_size, pkv_i64 num_heads, pkv_i64 head_dim, pkv_i64 groups,
    const float* __restrict__ signs, const pkv_u16* __restrict__ key_scale,
    const pkv_u16* __restrict__ key_zero) {
  PKV_COOPERATIVE();
  PKV_SHARED float rot[PKV_ROT_FLOATS];  // per CTA row: its row
  PKV_SHARED bool found[PKV_MAX_THREADS];  // per CTA row: whether its token is in a sequence
  // per CTA row: a block key row, final after the first phase; every thread still runs
  // every phase (the barriers), the butterflies and the unrotation just pass it by
  PKV_SHARED bool sealed[PKV_MAX_THREADS];
  const pkv_i64 bx = blockDim.x, by = blockDim.y;
  if (by * head_dim > PKV_ROT_FLOATS) return;  // not a planned launch: write nothing
  const pkv_i64 rows = total_tokens * 2 * num_heads;
  const pkv_i64 cta = (pkv_i64)blockIdx.y * gridDim.x + blockIdx.x;
  const pkv_i64 ctas = (pkv_i64)gridDim.x * gridDim.y;
  const pkv_i64 g_len = pkv_div(head_dim, groups);
  const bool has_zero = Q == PKV_Q_INT8 || Q == PKV_Q_INT4 || Q == PKV_Q_INT3;
  for (pkv_i64 base = cta * by; base < rows; base += ctas * by) {
    PKV_PHASE({
      const pkv_i64 r = base + threadIdx.y;
      if (r < rows) {
        const pkv_i64 t = pkv_div(r, 2 * num_heads);
        const pkv_i64 kvh = r - t * 2 * num_heads;
        const pkv_i64 kvp = kvh >= num_heads ? 1 : 0;
        pkv_i64 offset;
        const pkv_i64 block = pkv_token_block<TABLE>(t, table, indptr, seq_lens, seq_ends, batch,
                                                     num_entries, width, num_blocks, block_size,
                                                     &offset);
        const pkv_i64 head = kvh - kvp * num_heads;
        const bool is_key_block = kvp == 0 && block >= 0 &&
                                  pkv_key_sealed<Q>(key_scale, block, head, num_heads, head_dim);
        found[threadIdx.y] = block != -2;
        sealed[threadIdx.y] = is_key_block;
        const pkv_i64 row = block < 0 ? 0 : pkv_row_index<LAYOUT>(block, kvp, offset, head, block_size, num_heads);
        for (pkv_i64 d = threadIdx.x; d < head_dim; d += bx) {
          float x = 0.0f;
          if (is_key_block) {
            x = pkv_key_channel_value(pkv_code_at<Q>(kv, row, head_dim, d), key_scale, key_zero, block, head, num_heads,
                                head_dim, d);
          } else if (block >= 0) {
            const pkv_i64 g = groups == 1 ? 0 : pkv_div(d, g_len);
            x = pkv_dequantize<Q>(pkv_code_at<Q>(kv, row, head_dim, d), pkv_param_load<Q>(scale, row * groups + g),
                                  has_zero ? pkv_param_load<Q>(zero, row * groups + g) : 0.0f);
          }
          rot[threadIdx.y * head_dim + d] = x;
        }
      }
    });
    for (pkv_i64 h = 1; h < head_dim; h *= 2) {
      PKV_PHASE({
        if (base + threadIdx.y < rows && !sealed[threadIdx.y])
          pkv_butterflies(rot + threadIdx.y * head_dim, head_dim, h, threadIdx.x, bx);
      });
    }
    PKV_PHASE({
      const pkv_i64 r = base + threadIdx.y;
      if (r < rows && found[threadIdx.y]) {
        const pkv_i64 t = pkv_div(r, 2 * num_heads);
        const pkv_i64 kvh = r - t * 2 * num_heads;
        const pkv_i64 kvp = kvh >= num_heads ? 1 : 0;
        O* out = (kvp ? out_value : out_key) + (t * num_heads + kvh - kvp * num_heads) * head_dim;
        const bool as_is = sealed[threadIdx.y];
        for (pkv_i64 d = threadIdx.x; d < head_dim; d += bx) {
          const float x = rot[threadIdx.y * head_dim + d];
          out[d] = pkv_dtype<O>::from_f32(
              as_is ? x : __fmul_rn(__fmul_rn(x, pkv_hadamard_scale_at(head_dim, d)), signs[d]));
        }
      }
    });
  }
}

#define PKV_GATHER_TABLE_PARAMS                                                              \
  const int* __restrict__ table, const int* __restrict__ indptr,                             \
      const int* __restrict__ seq_lens, const pkv_i64* __restrict__ seq_ends, pkv_i64 batch, \
      pkv_i64 num_entries, pkv_i64 width, pkv_i64 total_tokens, pkv_i64 num_blocks,          \
      pkv_i64 block_size, pkv_i64 num_heads
#define PKV_GATHER_TABLE_ARGS                                                              \
  table, indptr, seq_lens, seq_ends, batch, num_entries, width, total_tokens, num_blocks, \
      block_size, num_heads

#define PKV_GATHER_COPY(NAME, C, LAYOUT, TABLE)                                              \
  extern "C" __global__ void NAME(const C* __restrict__ kv, C* __restrict__ out_key,         \
                                  C* __restrict__ out_value, PKV_GATHER_TABLE_PARAMS,        \
                                  pkv_i64 head_chunks) {                                     \
    pkv_gather_copy<C, LAYOUT, TABLE>(kv, out_key, out_value, PKV_GATHER_TABLE_ARGS,         \
                                      head_chunks);                                          \
  }

#define PKV_GATHER_DEQUANT(NAME, Q, O, LAYOUT, TABLE)                                        \
  extern "C" __global__ void NAME(const pkv_u8* __restrict__ kv,                             \
                                  const float* __restrict__ scale,                           \
                                  const float* __restrict__ zero, O* __restrict__ out_key,   \
                                  O* __restrict__ out_value, PKV_GATHER_TABLE_PARAMS,        \
                                  pkv_i64 head_dim, pkv_i64 groups,                          \
                                  const pkv_u16* __restrict__ key_scale,                     \
                                  const pkv_u16* __restrict__ key_zero) {                    \
    pkv_gather_dequant<Q, O, LAYOUT, TABLE>(kv, scale, zero, out_key, out_value,             \
                                            PKV_GATHER_TABLE_ARGS, head_dim, groups,         \
                                            key_scale, key_zero);                            \
  }                                                                                          \
  extern "C" __global__ void NAME##_v16(const pkv_u8* __restrict__ kv,                       \
                                        const float* __restrict__ scale,                     \
                                        const float* __restrict__ zero,                      \
                                        O* __restrict__ out_key, O* __restrict__ out_value,  \
                                        PKV_GATHER_TABLE_PARAMS, pkv_i64 head_dim,           \
                                        pkv_i64 groups, const pkv_u16* __restrict__ key_scale, \
                                        const pkv_u16* __restrict__ key_zero) {              \
    pkv_gather_dequant_v16<Q, O, LAYOUT, TABLE>(kv, scale, zero, out_key, out_value,         \
                                                PKV_GATHER_TABLE_ARGS, head_dim, groups,     \
                                                key_scale, key_zero);                        \
  }                                                                                          \
  extern "C" __global__ void NAME##_rot(const pkv_u8* __restrict__ kv,                       \
                                        const float* __restrict__ scale,                     \
                                        const float* __restrict__ zero,                      \
                                        O* __restrict__ out_key, O* __restrict__ out_value,  \
                                        PKV_GATHER_TABLE_PARAMS, pkv_i64 head_dim,           \
                                        pkv_i64 groups, const float* __restrict__ signs,     \
                                        const pkv_u16* __restrict__ key_scale,               \
                                        const pkv_u16* __restrict__ key_zero) {              \
    pkv_gather_dequant_rot<Q, O, LAYOUT, TABLE>(kv, scale, zero, out_key, out_value,         \
                                                PKV_GATHER_TABLE_ARGS, head_dim, groups,     \
                                                signs, key_scale, key_zero);                 \
  }

#define PKV_GATHER_COPY_ALL(T, TABLE, L, LAYOUT)                               \
  PKV_GATHER_COPY(pkv_gather_##T##_##L##_v16, pkv_v16, LAYOUT, TABLE)         \
  PKV_GATHER_COPY(pkv_gather_##T##_##L##_e4, pkv_e4, LAYOUT, TABLE)           \
  PKV_GATHER_COPY(pkv_gather_##T##_##L##_e2, pkv_e2, LAYOUT, TABLE)

#define PKV_GATHER_DEQUANT_Q(T, TABLE, L, LAYOUT, QN, Q)                                    \
  PKV_GATHER_DEQUANT(pkv_gather_##T##_##L##_##QN##_to_f32, Q, float, LAYOUT, TABLE)        \
  PKV_GATHER_DEQUANT(pkv_gather_##T##_##L##_##QN##_to_f16, Q, pkv_f16, LAYOUT, TABLE)      \
  PKV_GATHER_DEQUANT(pkv_gather_##T##_##L##_##QN##_to_bf16, Q, pkv_bf16, LAYOUT, TABLE)

#define PKV_GATHER_ALL(T, TABLE, L, LAYOUT)                       \
  PKV_GATHER_COPY_ALL(T, TABLE, L, LAYOUT)                        \
  PKV_GATHER_DEQUANT_Q(T, TABLE, L, LAYOUT, e4m3, PKV_Q_E4M3)     \
  PKV_GATHER_DEQUANT_Q(T, TABLE, L, LAYOUT, e5m2, PKV_Q_E5M2)     \
  PKV_GATHER_DEQUANT_Q(T, TABLE, L, LAYOUT, int8, PKV_Q_INT8)     \
  PKV_GATHER_DEQUANT_Q(T, TABLE, L, LAYOUT, int4, PKV_Q_INT4)     \
  PKV_GATHER_DEQUANT_Q(T, TABLE, L, LAYOUT, int3, PKV_Q_INT3)

PKV_GATHER_ALL(csr, PKV_TABLE_CSR, nhd, PKV_NHD)
PKV_GATHER_ALL(csr, PKV_TABLE_CSR, hnd, PKV_HND)
PKV_GATHER_ALL(pad, PKV_TABLE_PAD, nhd, PKV_NHD)
PKV_GATHER_ALL(pad, PKV_TABLE_PAD, hnd, PKV_HND)
