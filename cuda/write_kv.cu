// write_kv.cu - store one layer's new K/V tokens into their slots
// (reshape-and-cache).
//
// Rows (y) are tokens, columns (x) the chunks of one token's [H, D] row; a
// negative slot is padding and is skipped. A slot >= num_slots is skipped too:
// the launcher cannot read device-resident slots without a sync, so the kernel
// itself never writes outside the layer.
//
// Entry points (pagedkv/kernels/sources.py lists the same names):
//   pkv_write_kv_{nhd,hnd}_{v16,e4,e2}
//       plain copy in 16-byte vectors, or per 4-/2-byte element (any model dtype:
//       the bytes are moved, never converted);
//   pkv_write_kv_{nhd,hnd}_{f32,f16,bf16}_to_{e4m3,e5m2,int8}
//       quantizing: one thread per (token, head) row computes the row's scale
//       (and zero point), then writes the codes.
#include "common.cuh"

template <typename C, int LAYOUT>
__device__ __forceinline__ void pkv_write_kv_copy(
    C* __restrict__ kv, const C* __restrict__ key, const C* __restrict__ value,
    const pkv_i64* __restrict__ slot_mapping, pkv_i64 num_tokens, pkv_i64 num_slots,
    pkv_i64 block_size, pkv_i64 num_heads, pkv_i64 head_chunks, pkv_i64 key_stride_t,
    pkv_i64 key_stride_h, pkv_i64 value_stride_t, pkv_i64 value_stride_h) {
  const pkv_i64 row_chunks = num_heads * head_chunks;
  for (pkv_i64 t = pkv_row_begin(); t < num_tokens; t += pkv_row_step()) {
    const pkv_i64 slot = slot_mapping[t];
    if (slot < 0 || slot >= num_slots) continue;
    const pkv_i64 block = pkv_div(slot, block_size);
    const pkv_i64 offset = slot - block * block_size;
    for (pkv_i64 i = pkv_col_begin(); i < row_chunks; i += pkv_col_step()) {
      const pkv_i64 h = pkv_div(i, head_chunks);
      const pkv_i64 c = i - h * head_chunks;
      const pkv_i64 k_row = pkv_row_index<LAYOUT>(block, 0, offset, h, block_size, num_heads);
      const pkv_i64 v_row = pkv_row_index<LAYOUT>(block, 1, offset, h, block_size, num_heads);
      kv[k_row * head_chunks + c] = key[t * key_stride_t + h * key_stride_h + c];
      kv[v_row * head_chunks + c] = value[t * value_stride_t + h * value_stride_h + c];
    }
  }
}

template <typename T, int Q, int LAYOUT>
__device__ __forceinline__ void pkv_write_kv_quant(
    pkv_u8* __restrict__ kv, float* __restrict__ scale, float* __restrict__ zero,
    const T* __restrict__ key, const T* __restrict__ value,
    const pkv_i64* __restrict__ slot_mapping, pkv_i64 num_tokens, pkv_i64 num_slots,
    pkv_i64 block_size, pkv_i64 num_heads, pkv_i64 head_dim, pkv_i64 key_stride_t,
    pkv_i64 key_stride_h, pkv_i64 value_stride_t, pkv_i64 value_stride_h) {
  for (pkv_i64 t = pkv_row_begin(); t < num_tokens; t += pkv_row_step()) {
    const pkv_i64 slot = slot_mapping[t];
    if (slot < 0 || slot >= num_slots) continue;
    const pkv_i64 block = pkv_div(slot, block_size);
    const pkv_i64 offset = slot - block * block_size;
    for (pkv_i64 h = pkv_col_begin(); h < num_heads; h += pkv_col_step()) {
      for (pkv_i64 kv_index = 0; kv_index < 2; ++kv_index) {
        const T* src = kv_index == 0 ? key + t * key_stride_t + h * key_stride_h
                                     : value + t * value_stride_t + h * value_stride_h;
        const pkv_i64 row =
            pkv_row_index<LAYOUT>(block, kv_index, offset, h, block_size, num_heads);
        // zero is null for fp8 (unused there); no arithmetic on a null pointer.
        pkv_quantize_row<T, Q>(src, head_dim, kv + row * head_dim, scale + row,
                               Q == PKV_Q_INT8 ? zero + row : zero);
      }
    }
  }
}

#define PKV_WRITE_KV_COPY(NAME, C, LAYOUT)                                                    \
  extern "C" __global__ void NAME(                                                            \
      C* __restrict__ kv, const C* __restrict__ key, const C* __restrict__ value,             \
      const pkv_i64* __restrict__ slot_mapping, pkv_i64 num_tokens, pkv_i64 num_slots,        \
      pkv_i64 block_size, pkv_i64 num_heads, pkv_i64 head_chunks, pkv_i64 key_stride_t,       \
      pkv_i64 key_stride_h, pkv_i64 value_stride_t, pkv_i64 value_stride_h) {                 \
    pkv_write_kv_copy<C, LAYOUT>(kv, key, value, slot_mapping, num_tokens, num_slots,         \
                                 block_size, num_heads, head_chunks, key_stride_t,            \
                                 key_stride_h, value_stride_t, value_stride_h);               \
  }

#define PKV_WRITE_KV_QUANT(NAME, T, Q, LAYOUT)                                                \
  extern "C" __global__ void NAME(                                                            \
      pkv_u8* __restrict__ kv, float* __restrict__ scale, float* __restrict__ zero,           \
      const T* __restrict__ key, const T* __restrict__ value,                                 \
      const pkv_i64* __restrict__ slot_mapping, pkv_i64 num_tokens, pkv_i64 num_slots,        \
      pkv_i64 block_size, pkv_i64 num_heads, pkv_i64 head_dim, pkv_i64 key_stride_t,          \
      pkv_i64 key_stride_h, pkv_i64 value_stride_t, pkv_i64 value_stride_h) {                 \
    pkv_write_kv_quant<T, Q, LAYOUT>(kv, scale, zero, key, value, slot_mapping, num_tokens,   \
                                     num_slots, block_size, num_heads, head_dim,              \
                                     key_stride_t, key_stride_h, value_stride_t,              \
                                     value_stride_h);                                         \
  }

#define PKV_WRITE_KV_COPY_LAYOUT(L, LAYOUT)               \
  PKV_WRITE_KV_COPY(pkv_write_kv_##L##_v16, pkv_v16, LAYOUT) \
  PKV_WRITE_KV_COPY(pkv_write_kv_##L##_e4, pkv_e4, LAYOUT)   \
  PKV_WRITE_KV_COPY(pkv_write_kv_##L##_e2, pkv_e2, LAYOUT)

#define PKV_WRITE_KV_QUANT_DTYPE(L, LAYOUT, TN, T)                                   \
  PKV_WRITE_KV_QUANT(pkv_write_kv_##L##_##TN##_to_e4m3, T, PKV_Q_E4M3, LAYOUT)       \
  PKV_WRITE_KV_QUANT(pkv_write_kv_##L##_##TN##_to_e5m2, T, PKV_Q_E5M2, LAYOUT)       \
  PKV_WRITE_KV_QUANT(pkv_write_kv_##L##_##TN##_to_int8, T, PKV_Q_INT8, LAYOUT)

#define PKV_WRITE_KV_QUANT_LAYOUT(L, LAYOUT)           \
  PKV_WRITE_KV_QUANT_DTYPE(L, LAYOUT, f32, float)      \
  PKV_WRITE_KV_QUANT_DTYPE(L, LAYOUT, f16, pkv_f16)    \
  PKV_WRITE_KV_QUANT_DTYPE(L, LAYOUT, bf16, pkv_bf16)

PKV_WRITE_KV_COPY_LAYOUT(nhd, PKV_NHD)
PKV_WRITE_KV_COPY_LAYOUT(hnd, PKV_HND)
PKV_WRITE_KV_QUANT_LAYOUT(nhd, PKV_NHD)
PKV_WRITE_KV_QUANT_LAYOUT(hnd, PKV_HND)
