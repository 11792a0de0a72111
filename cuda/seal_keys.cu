// seal_keys.cu - requantize whole blocks' keys per channel (int4 block keys,
// pagedkv/quant.py "block keys"; pagedkv.ops.reference.seal_key_blocks).
//
// Rows (y) are (sealed block, head) pairs, columns (x) the pairs of channels of a
// head: one thread owns channels 2p and 2p + 1, so it reduces both over the block's
// tokens, and then writes every byte that packs their codes (element 2p in the low
// nibble) and their scales and zero points; no byte has two writers. A block id
// outside [0, num_blocks) is skipped: the launcher cannot read device-resident ids
// without a sync, so the kernel itself never writes outside the layer.
//
// Entry points (pagedkv/kernels/sources.py lists the same names):
//   pkv_seal_keys_{nhd,hnd}_{f32,f16,bf16}
//       keys [M, bs, H, D] of the model dtype (any M/token/head strides, dense D);
//       the K plane of an int4 kv layer; key_scale/key_zero bfloat16 [NB, H, D].
#include "common.cuh"

// One channel's parameters from the minimum and maximum of its block's tokens:
// z = bf16_down(min), s = bf16_up((max - z) / 15), 1 where 0 or not finite.
struct pkv_key_channel {
  float zero, scale;

  __device__ __forceinline__ pkv_key_channel(float mn, float mx)
      : zero(pkv_bf16_directed(mn, false)),
        scale(pkv_fix_scale(pkv_bf16_directed(__fdiv_rn(__fsub_rn(mx, zero), PKV_TOP_INT4), true))) {}
};

template <typename T, int LAYOUT>
__device__ __forceinline__ void pkv_seal_keys(
    pkv_u8* __restrict__ kv, pkv_u16* __restrict__ key_scale, pkv_u16* __restrict__ key_zero,
    const T* __restrict__ keys, const pkv_i64* __restrict__ blocks, pkv_i64 num_seals,
    pkv_i64 num_blocks, pkv_i64 block_size, pkv_i64 num_heads, pkv_i64 head_dim,
    pkv_i64 keys_stride_m, pkv_i64 keys_stride_t, pkv_i64 keys_stride_h) {
  const pkv_i64 rows = num_seals * num_heads;
  const pkv_i64 pairs = head_dim / 2;  // bytes of one packed row
  for (pkv_i64 r = pkv_row_begin(); r < rows; r += pkv_row_step()) {
    const pkv_i64 i = pkv_div(r, num_heads);
    const pkv_i64 h = r - i * num_heads;
    const pkv_i64 block = blocks[i];
    if (block < 0 || block >= num_blocks) continue;
    const T* src = keys + i * keys_stride_m + h * keys_stride_h;
    for (pkv_i64 p = pkv_col_begin(); p < pairs; p += pkv_col_step()) {
      const T* x = src + 2 * p;
      float mn0, mx0, mn1, mx1;
      pkv_reduce_init<PKV_Q_INT4>(&mn0, &mx0);
      pkv_reduce_init<PKV_Q_INT4>(&mn1, &mx1);
      for (pkv_i64 t = 0; t < block_size; ++t) {
        pkv_reduce_add<PKV_Q_INT4>(&mn0, &mx0, pkv_dtype<T>::to_f32(x[t * keys_stride_t]));
        pkv_reduce_add<PKV_Q_INT4>(&mn1, &mx1, pkv_dtype<T>::to_f32(x[t * keys_stride_t + 1]));
      }
      const pkv_key_channel c0(mn0, mx0), c1(mn1, mx1);
      for (pkv_i64 t = 0; t < block_size; ++t) {
        const pkv_u32 lo = pkv_quantize<PKV_Q_INT4>(pkv_dtype<T>::to_f32(x[t * keys_stride_t]), c0.scale, c0.zero);
        const pkv_u32 hi =
            pkv_quantize<PKV_Q_INT4>(pkv_dtype<T>::to_f32(x[t * keys_stride_t + 1]), c1.scale, c1.zero);
        const pkv_i64 row = pkv_row_index<LAYOUT>(block, 0, t, h, block_size, num_heads);
        kv[row * pairs + p] = pkv_int4_pack(lo, hi);
      }
      // the parameters are bfloat16 values (or NaN), so the narrowing is exact
      const pkv_i64 at = (block * num_heads + h) * head_dim + 2 * p;
      key_scale[at] = pkv_f32_to_bf16(c0.scale);
      key_scale[at + 1] = pkv_f32_to_bf16(c1.scale);
      key_zero[at] = pkv_f32_to_bf16(c0.zero);
      key_zero[at + 1] = pkv_f32_to_bf16(c1.zero);
    }
  }
}

#define PKV_SEAL_KEYS(NAME, T, LAYOUT)                                                         \
  extern "C" __global__ void NAME(                                                             \
      pkv_u8* __restrict__ kv, pkv_u16* __restrict__ key_scale, pkv_u16* __restrict__ key_zero, \
      const T* __restrict__ keys, const pkv_i64* __restrict__ blocks, pkv_i64 num_seals,       \
      pkv_i64 num_blocks, pkv_i64 block_size, pkv_i64 num_heads, pkv_i64 head_dim,             \
      pkv_i64 keys_stride_m, pkv_i64 keys_stride_t, pkv_i64 keys_stride_h) {                   \
    pkv_seal_keys<T, LAYOUT>(kv, key_scale, key_zero, keys, blocks, num_seals, num_blocks,     \
                             block_size, num_heads, head_dim, keys_stride_m, keys_stride_t,    \
                             keys_stride_h);                                                   \
  }

#define PKV_SEAL_KEYS_LAYOUT(L, LAYOUT)                      \
  PKV_SEAL_KEYS(pkv_seal_keys_##L##_f32, float, LAYOUT)      \
  PKV_SEAL_KEYS(pkv_seal_keys_##L##_f16, pkv_f16, LAYOUT)    \
  PKV_SEAL_KEYS(pkv_seal_keys_##L##_bf16, pkv_bf16, LAYOUT)

PKV_SEAL_KEYS_LAYOUT(nhd, PKV_NHD)
PKV_SEAL_KEYS_LAYOUT(hnd, PKV_HND)
