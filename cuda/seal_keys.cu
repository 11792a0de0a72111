// seal_keys.cu - requantize whole blocks' keys per channel (int4 block keys,
// pagedkv/quant.py "block keys"; pagedkv.ops.reference.seal_key_blocks).
//
// Rows (y) are (sealed block, head) pairs, columns (x) units of channels of a head: one
// thread owns a pair of channels (or eight, for wider keys), so it reduces them over the
// block's tokens, and then writes every byte that packs their codes (element 2p in the low
// nibble; wider keys: their high bits in the K rows' per-token parameter bytes) and their
// scales and zero points; no byte has two writers. A block id
// outside [0, num_blocks) is skipped: the launcher cannot read device-resident ids
// without a sync, so the kernel itself never writes outside the layer.
//
// Entry points (pagedkv/kernels/sources.py lists the same names):
//   pkv_seal_keys_{nhd,hnd}_{f32,f16,bf16}
//       keys [M, bs, H, D] of the model dtype (any M/token/head strides, dense D);
//       the K plane of an int4 kv layer; key_scale/key_zero bfloat16 [NB, H, D];
//       scale/zero: the layer's float32 per-token parameter views ([rows, groups]) and
//       key_extra the keys' high bits (0: 4-bit keys; then they are not touched).
#include "common.cuh"

// One channel's parameters from the minimum and maximum of its block's tokens:
// z = bf16_down(min), s = bf16_up((max - z) / top), 1 where 0 or not finite; top is
// 2^(4 + key_extra) - 1 (15 for 4-bit keys).
struct pkv_key_channel {
  float zero, scale;

  __device__ __forceinline__ pkv_key_channel() : zero(0.0f), scale(1.0f) {}
  __device__ __forceinline__ pkv_key_channel(float mn, float mx, float top)
      : zero(pkv_bf16_directed(mn, false)),
        scale(pkv_fix_scale(pkv_bf16_directed(__fdiv_rn(__fsub_rn(mx, zero), top), true))) {}
};

// Columns are units of channels: pairs for 4-bit keys (one code byte), eights for wider
// keys (four code bytes and key_extra whole bytes of high bits), so that no byte has two
// writers. The thread of unit 0 also clears the parameter bytes past the high bits.
#define PKV_SEAL_UNIT 8

template <typename T, int LAYOUT>
__device__ __forceinline__ void pkv_seal_keys(
    pkv_u8* __restrict__ kv, pkv_u16* __restrict__ key_scale, pkv_u16* __restrict__ key_zero,
    const T* __restrict__ keys, const pkv_i64* __restrict__ blocks, pkv_i64 num_seals,
    pkv_i64 num_blocks, pkv_i64 block_size, pkv_i64 num_heads, pkv_i64 head_dim,
    pkv_i64 keys_stride_m, pkv_i64 keys_stride_t, pkv_i64 keys_stride_h,
    float* __restrict__ scale, float* __restrict__ zero, pkv_i64 groups, pkv_i64 key_extra) {
  const pkv_i64 rows = num_seals * num_heads;
  const pkv_i64 pairs = head_dim / 2;  // bytes of one packed row
  const pkv_i64 unit = key_extra > 0 ? PKV_SEAL_UNIT : 2;
  const pkv_i64 units = (head_dim + unit - 1) / unit;
  const float top = (float)((1u << (4 + (key_extra > 0 ? key_extra : 0))) - 1u);
  const pkv_i64 need = (head_dim * key_extra + 7) / 8, half = groups * 4;
  for (pkv_i64 r = pkv_row_begin(); r < rows; r += pkv_row_step()) {
    const pkv_i64 i = pkv_div(r, num_heads);
    const pkv_i64 h = r - i * num_heads;
    const pkv_i64 block = blocks[i];
    if (block < 0 || block >= num_blocks) continue;
    const T* src = keys + i * keys_stride_m + h * keys_stride_h;
    for (pkv_i64 u = pkv_col_begin(); u < units; u += pkv_col_step()) {
      const pkv_i64 d0 = u * unit;
      const pkv_i64 n = head_dim - d0 < unit ? head_dim - d0 : unit;  // even: head_dim is
      pkv_key_channel c[PKV_SEAL_UNIT];
      for (pkv_i64 j = 0; j < n; ++j) {
        float mn, mx;
        pkv_reduce_init<PKV_Q_INT4>(&mn, &mx);
        for (pkv_i64 t = 0; t < block_size; ++t)
          pkv_reduce_add<PKV_Q_INT4>(&mn, &mx, pkv_dtype<T>::to_f32(src[t * keys_stride_t + d0 + j]));
        c[j] = pkv_key_channel(mn, mx, top);
      }
      for (pkv_i64 t = 0; t < block_size; ++t) {
        const pkv_i64 row = pkv_row_index<LAYOUT>(block, 0, t, h, block_size, num_heads);
        pkv_u32 high = 0;  // the unit's high bits, channel j's at bit j * key_extra
        for (pkv_i64 j = 0; j < n; j += 2) {
          const pkv_u32 lo = pkv_int_code(__fdiv_rn(__fsub_rn(pkv_dtype<T>::to_f32(src[t * keys_stride_t + d0 + j]),
                                                               c[j].zero), c[j].scale), top);
          const pkv_u32 hi = pkv_int_code(
              __fdiv_rn(__fsub_rn(pkv_dtype<T>::to_f32(src[t * keys_stride_t + d0 + j + 1]), c[j + 1].zero),
                        c[j + 1].scale), top);
          kv[row * pairs + (d0 + j) / 2] = pkv_int4_pack(lo & 15u, hi & 15u);
          if (key_extra > 0) high |= ((lo >> 4) << (j * key_extra)) | ((hi >> 4) << ((j + 1) * key_extra));
        }
        if (key_extra > 0) {
          pkv_u8* ps = (pkv_u8*)(scale + row * groups);
          pkv_u8* pz = (pkv_u8*)(zero + row * groups);
          const pkv_i64 first = d0 * key_extra / 8, bytes = (n * key_extra + 7) / 8;
          for (pkv_i64 k = 0; k < bytes; ++k) {
            const pkv_i64 at = first + k;
            (at < half ? ps[at] : pz[at - half]) = (pkv_u8)(high >> (8 * k));
          }
          if (u == 0)
            for (pkv_i64 at = need; at < 2 * half; ++at) (at < half ? ps[at] : pz[at - half]) = 0;
        }
      }
      // the parameters are bfloat16 values (or NaN), so the narrowing is exact
      for (pkv_i64 j = 0; j < n; ++j) {
        const pkv_i64 at = (block * num_heads + h) * head_dim + d0 + j;
        key_scale[at] = pkv_f32_to_bf16(c[j].scale);
        key_zero[at] = pkv_f32_to_bf16(c[j].zero);
      }
    }
  }
}

#define PKV_SEAL_KEYS(NAME, T, LAYOUT)                                                         \
  extern "C" __global__ void NAME(                                                             \
      pkv_u8* __restrict__ kv, pkv_u16* __restrict__ key_scale, pkv_u16* __restrict__ key_zero, \
      const T* __restrict__ keys, const pkv_i64* __restrict__ blocks, pkv_i64 num_seals,       \
      pkv_i64 num_blocks, pkv_i64 block_size, pkv_i64 num_heads, pkv_i64 head_dim,             \
      pkv_i64 keys_stride_m, pkv_i64 keys_stride_t, pkv_i64 keys_stride_h,                     \
      float* __restrict__ scale, float* __restrict__ zero, pkv_i64 groups, pkv_i64 key_extra) { \
    pkv_seal_keys<T, LAYOUT>(kv, key_scale, key_zero, keys, blocks, num_seals, num_blocks,     \
                             block_size, num_heads, head_dim, keys_stride_m, keys_stride_t,    \
                             keys_stride_h, scale, zero, groups, key_extra);                   \
  }

#define PKV_SEAL_KEYS_LAYOUT(L, LAYOUT)                      \
  PKV_SEAL_KEYS(pkv_seal_keys_##L##_f32, float, LAYOUT)      \
  PKV_SEAL_KEYS(pkv_seal_keys_##L##_f16, pkv_f16, LAYOUT)    \
  PKV_SEAL_KEYS(pkv_seal_keys_##L##_bf16, pkv_bf16, LAYOUT)

PKV_SEAL_KEYS_LAYOUT(nhd, PKV_NHD)
PKV_SEAL_KEYS_LAYOUT(hnd, PKV_HND)
