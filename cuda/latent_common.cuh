// latent_common.cuh - what the MLA latent kernels share (latent_rows.cu, latent_attention.cu):
// the row formats, reading one element of a stored row, and finding a position's row.
//
// A layer's arena is [num_blocks, block_size, row] with one row per token: a model
// dtype row of R + P elements (c_kv then k_pe), or a quantized row of row_bytes bytes:
// R codes (int4: R / 2 bytes, two codes per byte, low nibble first), one float32 scale
// per group of G codes (fp8: G = 128), one float32 zero point per group (int8, int4),
// then P positional values (fp8: bfloat16; int8/int4: the model dtype). Slot s is row
// s of the arena viewed as [num_blocks * block_size, row] (pagedkv/store/latent.py
// defines the rows and their arithmetic).
#pragma once

#include "common.cuh"

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

