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
//   pkv_write_kv_{nhd,hnd}_{f32,f16,bf16}_to_{e4m3,e5m2,int8,int4,int3}
//       quantizing, cooperatively: the blockDim.x threads of a CTA row share one
//       (token, K/V, head) row, reduce each scale group of it through shared
//       memory (a tree of barrier phases), then write its codes (int4: two per
//       byte; int3: eight per three bytes, a thread per eight) and its scale and
//       zero point (int3: bfloat16). blockDim.y rows per CTA; the CTAs of the
//       whole grid stride over the rows.
//   pkv_write_kv_{nhd,hnd}_{f32,f16,bf16}_to_{e4m3,e5m2,int8,int4,int3}_rot
//       the same after rotating each row (common.cuh, "Rotation"): the CTA row
//       first widens its row times the signs into shared memory, runs the
//       butterfly stages there (a barrier phase each) and scales it, then reduces
//       and quantizes the rotated values.
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

// Row r of a quantizing write is (token, K/V, head) = (r / 2H, r / H % 2, r % H).
template <typename T, int LAYOUT>
struct pkv_quant_row {
  bool active;  // a real row with a slot inside the layer
  const T* src;
  pkv_i64 row;  // its (token, head) row in the layer

  __device__ __forceinline__ pkv_quant_row(pkv_i64 r, pkv_i64 rows, const T* __restrict__ key,
                                           const T* __restrict__ value,
                                           const pkv_i64* __restrict__ slot_mapping,
                                           pkv_i64 num_slots, pkv_i64 block_size,
                                           pkv_i64 num_heads, pkv_i64 key_stride_t,
                                           pkv_i64 key_stride_h, pkv_i64 value_stride_t,
                                           pkv_i64 value_stride_h)
      : active(false), src(key), row(0) {
    if (r >= rows) return;
    const pkv_i64 t = pkv_div(r, 2 * num_heads);
    const pkv_i64 kvh = r - t * 2 * num_heads;
    const pkv_i64 kv = kvh >= num_heads ? 1 : 0;
    const pkv_i64 h = kvh - kv * num_heads;
    const pkv_i64 slot = slot_mapping[t];
    if (slot < 0 || slot >= num_slots) return;
    const pkv_i64 block = pkv_div(slot, block_size);
    active = true;
    src = kv ? value + t * value_stride_t + h * value_stride_h : key + t * key_stride_t + h * key_stride_h;
    row = pkv_row_index<LAYOUT>(block, kv, slot - block * block_size, h, block_size, num_heads);
  }
};

template <typename T, int Q, int LAYOUT, bool ROT>
__device__ __forceinline__ void pkv_write_kv_quant(
    pkv_u8* __restrict__ kv, float* __restrict__ scale, float* __restrict__ zero,
    const T* __restrict__ key, const T* __restrict__ value,
    const pkv_i64* __restrict__ slot_mapping, pkv_i64 num_tokens, pkv_i64 num_slots,
    pkv_i64 block_size, pkv_i64 num_heads, pkv_i64 head_dim, pkv_i64 groups,
    pkv_i64 key_stride_t, pkv_i64 key_stride_h, pkv_i64 value_stride_t, pkv_i64 value_stride_h,
    const float* __restrict__ signs) {
  PKV_COOPERATIVE();
  PKV_SHARED float red_a[PKV_MAX_THREADS];  // per thread: its partial reduction
  PKV_SHARED float red_b[PKV_MAX_THREADS];
  PKV_SHARED float rot[ROT ? PKV_ROT_FLOATS : 1];  // per CTA row: its rotated row
  const pkv_i64 bx = blockDim.x, by = blockDim.y;
  if (ROT && by * head_dim > PKV_ROT_FLOATS) return;  // not a planned launch: write nothing
  const pkv_i64 rows = num_tokens * 2 * num_heads;
  const pkv_i64 cta = (pkv_i64)blockIdx.y * gridDim.x + blockIdx.x;
  const pkv_i64 ctas = (pkv_i64)gridDim.x * gridDim.y;
  const pkv_i64 g_len = pkv_div(head_dim, groups);
  const pkv_i64 row_bytes = pkv_row_bytes<Q>(head_dim);
#define PKV_ROW() \
  pkv_quant_row<T, LAYOUT> w(base + threadIdx.y, rows, key, value, slot_mapping, num_slots, \
                             block_size, num_heads, key_stride_t, key_stride_h,            \
                             value_stride_t, value_stride_h)
// element d of the row being quantized (ROT: the rotated row in shared memory)
#define PKV_X(d) (ROT ? rot[threadIdx.y * head_dim + (d)] : pkv_dtype<T>::to_f32(w.src[d]))
  for (pkv_i64 base = cta * by; base < rows; base += ctas * by) {
    if (ROT) {
      PKV_PHASE({
        PKV_ROW();
        if (w.active)
          for (pkv_i64 d = threadIdx.x; d < head_dim; d += bx)
            rot[threadIdx.y * head_dim + d] = __fmul_rn(pkv_dtype<T>::to_f32(w.src[d]), signs[d]);
      });
      for (pkv_i64 h = 1; h < head_dim; h *= 2) {
        PKV_PHASE({
          PKV_ROW();
          if (w.active) pkv_butterflies(rot + threadIdx.y * head_dim, head_dim, h, threadIdx.x, bx);
        });
      }
      PKV_PHASE({
        PKV_ROW();
        if (w.active)
          for (pkv_i64 d = threadIdx.x; d < head_dim; d += bx)
            rot[threadIdx.y * head_dim + d] =
                __fmul_rn(rot[threadIdx.y * head_dim + d], pkv_hadamard_scale_at(head_dim, d));
      });
    }
    for (pkv_i64 g = 0; g < groups; ++g) {
      const pkv_i64 lo = g * g_len, hi = lo + g_len;  // the group's elements
      PKV_PHASE({
        PKV_ROW();
        float a, b;
        pkv_reduce_init<Q>(&a, &b);
        if (w.active)
          for (pkv_i64 d = lo + threadIdx.x; d < hi; d += bx)
            pkv_reduce_add<Q>(&a, &b, PKV_X(d));
        red_a[threadIdx.y * bx + threadIdx.x] = a;
        red_b[threadIdx.y * bx + threadIdx.x] = b;
      });
      for (pkv_i64 step = 1; step < bx; step *= 2) {
        PKV_PHASE({
          const pkv_i64 i = threadIdx.y * bx + threadIdx.x;
          if (threadIdx.x % (2 * step) == 0 && threadIdx.x + step < bx)
            pkv_reduce_merge<Q>(&red_a[i], &red_b[i], red_a[i + step], red_b[i + step]);
        });
      }
      PKV_PHASE({
        PKV_ROW();
        if (w.active) {
          const float mn = pkv_group_zero<Q>(red_a[threadIdx.y * bx]);
          const float s = pkv_group_scale<Q>(mn, red_b[threadIdx.y * bx]);
          pkv_u8* q = kv + w.row * row_bytes;
          if (Q == PKV_Q_INT3) {
            // a group is whole packs of 8 codes: 24 bits, little-endian in 3 bytes
            for (pkv_i64 p = lo / 8 + threadIdx.x; p < hi / 8; p += bx) {
              pkv_u32 bits = 0;
              for (int i = 0; i < 8; ++i) bits |= pkv_quantize<Q>(PKV_X(8 * p + i), s, mn) << (3 * i);
              pkv_int3_store(q + 3 * p, bits);
            }
          } else if (Q == PKV_Q_INT4) {
            // bytes holding the group's codes; one that also holds a neighbouring
            // group's code keeps that nibble (that group's phase runs apart)
            for (pkv_i64 i = lo / 2 + threadIdx.x; i < (hi + 1) / 2; i += bx) {
              pkv_u32 byte = 0, keep = 0;
              for (pkv_i64 e = 2 * i; e < 2 * i + 2; ++e) {
                const pkv_u32 shift = (pkv_u32)(e & 1) * 4;
                if (e >= lo && e < hi)
                  byte |= pkv_quantize<Q>(PKV_X(e), s, mn) << shift;
                else
                  keep |= 15u << shift;
              }
              q[i] = (pkv_u8)(byte | (q[i] & keep));
            }
          } else {
            for (pkv_i64 d = lo + threadIdx.x; d < hi; d += bx)
              q[d] = (pkv_u8)pkv_quantize<Q>(PKV_X(d), s, mn);
          }
          if (threadIdx.x == 0) {
            pkv_param_store<Q>(scale, w.row * groups + g, s);
            if (Q != PKV_Q_E4M3 && Q != PKV_Q_E5M2) pkv_param_store<Q>(zero, w.row * groups + g, mn);
          }
        }
      });
    }
  }
#undef PKV_X
#undef PKV_ROW
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

#define PKV_WRITE_KV_QUANT_PARAMS(T)                                                          \
  pkv_u8 *__restrict__ kv, float *__restrict__ scale, float *__restrict__ zero,                \
      const T *__restrict__ key, const T *__restrict__ value,                                  \
      const pkv_i64 *__restrict__ slot_mapping, pkv_i64 num_tokens, pkv_i64 num_slots,         \
      pkv_i64 block_size, pkv_i64 num_heads, pkv_i64 head_dim, pkv_i64 groups,                 \
      pkv_i64 key_stride_t, pkv_i64 key_stride_h, pkv_i64 value_stride_t, pkv_i64 value_stride_h
#define PKV_WRITE_KV_QUANT_ARGS                                                                \
  kv, scale, zero, key, value, slot_mapping, num_tokens, num_slots, block_size, num_heads,     \
      head_dim, groups, key_stride_t, key_stride_h, value_stride_t, value_stride_h

#define PKV_WRITE_KV_QUANT(NAME, T, Q, LAYOUT)                                                \
  extern "C" __global__ void NAME(PKV_WRITE_KV_QUANT_PARAMS(T)) {                                \
    pkv_write_kv_quant<T, Q, LAYOUT, false>(PKV_WRITE_KV_QUANT_ARGS, nullptr);                \
  }                                                                                           \
  extern "C" __global__ void NAME##_rot(PKV_WRITE_KV_QUANT_PARAMS(T),                            \
                                        const float* __restrict__ signs) {                    \
    pkv_write_kv_quant<T, Q, LAYOUT, true>(PKV_WRITE_KV_QUANT_ARGS, signs);                   \
  }

#define PKV_WRITE_KV_COPY_LAYOUT(L, LAYOUT)               \
  PKV_WRITE_KV_COPY(pkv_write_kv_##L##_v16, pkv_v16, LAYOUT) \
  PKV_WRITE_KV_COPY(pkv_write_kv_##L##_e4, pkv_e4, LAYOUT)   \
  PKV_WRITE_KV_COPY(pkv_write_kv_##L##_e2, pkv_e2, LAYOUT)

#define PKV_WRITE_KV_QUANT_DTYPE(L, LAYOUT, TN, T)                                   \
  PKV_WRITE_KV_QUANT(pkv_write_kv_##L##_##TN##_to_e4m3, T, PKV_Q_E4M3, LAYOUT)       \
  PKV_WRITE_KV_QUANT(pkv_write_kv_##L##_##TN##_to_e5m2, T, PKV_Q_E5M2, LAYOUT)       \
  PKV_WRITE_KV_QUANT(pkv_write_kv_##L##_##TN##_to_int8, T, PKV_Q_INT8, LAYOUT)       \
  PKV_WRITE_KV_QUANT(pkv_write_kv_##L##_##TN##_to_int4, T, PKV_Q_INT4, LAYOUT)       \
  PKV_WRITE_KV_QUANT(pkv_write_kv_##L##_##TN##_to_int3, T, PKV_Q_INT3, LAYOUT)

#define PKV_WRITE_KV_QUANT_LAYOUT(L, LAYOUT)           \
  PKV_WRITE_KV_QUANT_DTYPE(L, LAYOUT, f32, float)      \
  PKV_WRITE_KV_QUANT_DTYPE(L, LAYOUT, f16, pkv_f16)    \
  PKV_WRITE_KV_QUANT_DTYPE(L, LAYOUT, bf16, pkv_bf16)

PKV_WRITE_KV_COPY_LAYOUT(nhd, PKV_NHD)
PKV_WRITE_KV_COPY_LAYOUT(hnd, PKV_HND)
PKV_WRITE_KV_QUANT_LAYOUT(nhd, PKV_NHD)
PKV_WRITE_KV_QUANT_LAYOUT(hnd, PKV_HND)
