// decode_attention.cuh - the compile-time geometry of the decode kernel and its lane
// decoders (pagedkv/kernels/decode_plans.py mirrors pkv_dec_lane_elems and the limits).
#pragma once

#include "warp.cuh"

// K/V storage formats beyond the PKV_Q_* codes (as paged_attention.cu numbers them)
#ifndef PKV_F_F32
#define PKV_F_F32 10
#define PKV_F_F16 11
#define PKV_F_BF16 12
#endif

#define PKV_DEC_THREADS 128
#define PKV_DEC_WARPS 4
#define PKV_DEC_PAGES 512   // block-table entries a CTA stages in shared memory at once
#define PKV_DEC_QREGS 32    // at most G * E query floats per thread (and as many accumulators)
#define PKV_DEC_MIN_CTAS 3  // CTAs per SM the register cap keeps room for (168 registers)

#define PKV_QK_F32 0  // the query dtype codes of the q_kind argument
#define PKV_QK_F16 1
#define PKV_QK_BF16 2

template <int F>
__device__ constexpr int pkv_dec_bits() {
  return F == PKV_F_F32 ? 32 : (F == PKV_F_F16 || F == PKV_F_BF16) ? 16 : F == PKV_Q_INT4 ? 4 : F == PKV_Q_INT3 ? 3 : 8;
}

// E, the channels of a row one lane holds: a 16-byte vector where G * E query floats
// fit PKV_DEC_QREGS, else halved down to 4 bytes; int3 always 32 codes (12 bytes, whole
// 3-byte packs). The lanes of a key: D / E.
template <int F, int G>
__device__ constexpr int pkv_dec_lane_elems() {
  if (F == PKV_Q_INT3) return 32;
  int e = 128 / pkv_dec_bits<F>();
  while (e * G > PKV_DEC_QREGS && e * pkv_dec_bits<F>() > 32) e /= 2;
  return e;
}

template <int F>
__device__ constexpr bool pkv_dec_quant() { return F < PKV_F_F32; }
template <int F>
__device__ constexpr bool pkv_dec_has_zero() { return F == PKV_Q_INT8 || F == PKV_Q_INT4 || F == PKV_Q_INT3; }

// n / d for 0 <= n < 2^31 without a division (none in the main loop): the launcher's
// (mul, shift) = (ceil(2^p / d), p - 32) with p = 31 + ceil(log2 d); shift -1 means d = 1
// (decode_plans.fastdiv, as CUTLASS's FastDivmod).
__device__ __forceinline__ pkv_i64 pkv_fastdiv(pkv_i64 n, pkv_i64 d, pkv_i64 mul, pkv_i64 shift) {
  (void)d;
  if (shift < 0) return n;
  const unsigned long long hi = ((unsigned long long)(pkv_u32)n * (unsigned long long)(pkv_u32)mul) >> 32;
  return (pkv_i64)(hi >> shift);
}

// ---- lane decoders: E stored values -> floats, without int->float conversions ---------
// The asymmetric formats give their codes (c, as exact floats through the 2^23 magic
// number: the scale and zero are applied per group outside the dot products); fp8 gives
// its values before the scale; the model dtypes their values.

__device__ __forceinline__ float pkv_dec_code(pkv_u32 c) {  // 0 <= c < 2^23, exact
  return __fsub_rn(__uint_as_float(0x4b000000u | c), 8388608.0f);
}

// a float16 (low 16 bits of h) exactly: subnormals through a power-of-two multiply
__device__ __forceinline__ float pkv_dec_f16(pkv_u32 h) {
  const pkv_u32 sign = (h & 0x8000u) << 16, m = h & 0x7fffu;
  if (m >= 0x7c00u)  // inf, or NaN made quiet (as pkv_f16_to_f32)
    return __uint_as_float(sign | 0x7f800000u | ((m & 0x3ffu) << 13) | ((m & 0x3ffu) ? 0x400000u : 0u));
  return __uint_as_float(sign | __float_as_uint(__fmul_rn(__uint_as_float(m << 13), 5.192296858534828e+33f)));
}

// fp8 byte b: e4m3 (bias 7) or e5m2 (bias 15) by moving its bits into a float32 and
// one exact multiply by 2^120 / 2^112; the NaN (and e5m2 inf) codes as pkv_*_to_f32
template <int Q>
__device__ __forceinline__ float pkv_dec_fp8(pkv_u32 b) {
  const pkv_u32 sign = (b & 0x80u) << 24, m = b & 0x7fu;
  if (Q == PKV_Q_E4M3) {
    if (m == 0x7fu) return __uint_as_float(sign | 0x7ff00000u);
    return __uint_as_float(sign | __float_as_uint(__fmul_rn(__uint_as_float(m << 20), 1.329227995784916e+36f)));
  }
  if (m >= 0x7cu) return __uint_as_float(sign | 0x7f800000u | ((m & 3u) << 21) | (m > 0x7cu ? 0x400000u : 0u));
  return __uint_as_float(sign | __float_as_uint(__fmul_rn(__uint_as_float(m << 21), 5.192296858534828e+33f)));
}

// Element e of the lane's vector w (its 32-bit words) as a float (see above).
template <int F>
__device__ __forceinline__ float pkv_dec_elem(const pkv_u32* w, int e) {
  if (F == PKV_F_F32) return __uint_as_float(w[e]);
  if (F == PKV_F_F16) return pkv_dec_f16(w[e / 2] >> (16 * (e & 1)));
  if (F == PKV_F_BF16) return __uint_as_float((w[e / 2] >> (16 * (e & 1))) << 16);
  if (F == PKV_Q_E4M3 || F == PKV_Q_E5M2) return pkv_dec_fp8<F>((w[e / 4] >> (8 * (e & 3))) & 0xffu);
  if (F == PKV_Q_INT8) return pkv_dec_code(((w[e / 4] >> (8 * (e & 3))) & 0xffu) ^ 0x80u);  // code = byte + 128
  if (F == PKV_Q_INT4) return pkv_dec_code((w[e / 8] >> (4 * (e & 7))) & 15u);
  // int3: code e at bit 3e of the little-endian 96-bit vector (packs of 8 codes in 3 bytes)
  const int bit = 3 * e, k = bit / 32, s = bit % 32;
  pkv_u32 c = w[k] >> s;
  if (s > 29) c |= w[k + 1] << (32 - s);
  return pkv_dec_code(c & 7u);
}
