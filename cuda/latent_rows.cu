// latent_rows.cu - MLA latent KV: writing rows and gathering them (latent_common.cuh has
// the row formats).
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
// Entry points (pagedkv/kernels/sources.py lists the same names):
//   pkv_latent_write_{in}_to_{fmt}       in: f32, f16, bf16
//   pkv_latent_gather_{fmt}_to_{out}     out: f32, f16, bf16
// with fmt one of f32, f16, bf16 (model rows), e4m3 (positional slice bfloat16),
// int8_r{f32,f16,bf16}, int4_r{f32,f16,bf16} (r: the positional slice's dtype).
#include "latent_common.cuh"

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
// instantiations: every (input/output type, row format) the launch plans use

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
