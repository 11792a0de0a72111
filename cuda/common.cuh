// common.cuh - shared helpers of the pagedkv kernels.
//
// Everything here is plain CUDA C++ that NVRTC compiles without any system or
// toolkit header, and that g++ compiles through emulate.h (PAGEDKV_EMULATE). The
// number conversions are written out in integer arithmetic instead of using
// cuda_fp16.h / cuda_fp8.h: those headers do not build with a host compiler from
// the pip wheels, and one implementation on both sides means the host emulation
// tests the very code the GPU runs. tests/test_kernels_emulated.py proves each
// conversion against torch's casts over every input that matters.
#pragma once

#ifdef PAGEDKV_EMULATE
#include "emulate.h"
#endif

typedef long long pkv_i64;
typedef unsigned int pkv_u32;
typedef unsigned short pkv_u16;
typedef unsigned char pkv_u8;

// ---------------------------------------------------------------------------
// 64-bit grid-stride indices. Every kernel is a 2-D loop nest: "rows" (tokens,
// table entries, block pairs, planes) stride over y, "columns" (chunks inside a
// row) over x. Counters and offsets are 64-bit so no product overflows.

__device__ __forceinline__ pkv_i64 pkv_row_begin() {
  return (pkv_i64)blockIdx.y * blockDim.y + threadIdx.y;
}
__device__ __forceinline__ pkv_i64 pkv_row_step() { return (pkv_i64)gridDim.y * blockDim.y; }
__device__ __forceinline__ pkv_i64 pkv_col_begin() {
  return (pkv_i64)blockIdx.x * blockDim.x + threadIdx.x;
}
__device__ __forceinline__ pkv_i64 pkv_col_step() { return (pkv_i64)gridDim.x * blockDim.x; }

// a / b for a >= 0, b > 0. A 64-bit division costs several times a 32-bit one on
// the GPU, and the operands almost always fit in 32 bits.
__device__ __forceinline__ pkv_i64 pkv_div(pkv_i64 a, pkv_i64 b) {
  if (((a | b) >> 31) == 0) return (pkv_i64)((pkv_u32)a / (pkv_u32)b);
  return a / b;
}

// ---------------------------------------------------------------------------
// Layouts. A (token, head) "row" of a per-layer view: NHD [NB, 2, bs, H, .],
// HND [NB, 2, H, bs, .]. The index is in rows; multiply by the row length (head
// dim, or 1 for the scale/zero views) for an element offset.

#define PKV_NHD 0
#define PKV_HND 1

template <int LAYOUT>
__device__ __forceinline__ pkv_i64 pkv_row_index(pkv_i64 block, pkv_i64 kv, pkv_i64 offset,
                                                 pkv_i64 head, pkv_i64 block_size,
                                                 pkv_i64 num_heads) {
  if (LAYOUT == PKV_NHD) return ((block * 2 + kv) * block_size + offset) * num_heads + head;
  return ((block * 2 + kv) * num_heads + head) * block_size + offset;
}

// ---------------------------------------------------------------------------
// Copy units ("chunks"): a 16-byte vector when sizes and pointers allow it (the
// launcher checks), else one element of 4, 2 or 1 bytes.

typedef uint4 pkv_v16;
typedef pkv_u32 pkv_e4;
typedef pkv_u16 pkv_e2;
typedef pkv_u8 pkv_e1;

template <typename C>
__device__ __forceinline__ C pkv_zero_chunk() {
  return C(0);
}
template <>
__device__ __forceinline__ pkv_v16 pkv_zero_chunk<pkv_v16>() {
  return make_uint4(0u, 0u, 0u, 0u);
}

// ---------------------------------------------------------------------------
// float bits

__device__ __forceinline__ bool pkv_isnan(float x) {
  return (__float_as_uint(x) & 0x7fffffffu) > 0x7f800000u;
}
__device__ __forceinline__ bool pkv_isfinite(float x) {
  return (__float_as_uint(x) & 0x7f800000u) != 0x7f800000u;
}
__device__ __forceinline__ float pkv_fabs(float x) {
  return __uint_as_float(__float_as_uint(x) & 0x7fffffffu);
}
// max/min that propagate NaN like torch.amax/amin (fmaxf/fminf would drop it).
__device__ __forceinline__ float pkv_max_nan(float acc, float x) {
  return (x > acc || pkv_isnan(x)) ? x : acc;
}
__device__ __forceinline__ float pkv_min_nan(float acc, float x) {
  return (x < acc || pkv_isnan(x)) ? x : acc;
}

// ---------------------------------------------------------------------------
// Model dtypes: float32, float16 and bfloat16 (the 16-bit ones as raw bits).

struct pkv_f16 {
  pkv_u16 bits;
};
struct pkv_bf16 {
  pkv_u16 bits;
};

__device__ __forceinline__ float pkv_f16_to_f32(pkv_u16 h) {
  const pkv_u32 sign = (pkv_u32)(h & 0x8000u) << 16;
  const pkv_u32 exp = (h >> 10) & 0x1fu;
  const pkv_u32 mant = h & 0x3ffu;
  if (exp == 0) {  // zero or subnormal: mant * 2^-24, exact in float32
    const float v = (float)mant * 5.9604644775390625e-8f;
    return __uint_as_float(__float_as_uint(v) | sign);
  }
  if (exp == 31) {  // inf, or NaN made quiet (as torch and the hardware do)
    return __uint_as_float(sign | 0x7f800000u | (mant << 13) | (mant ? 0x400000u : 0u));
  }
  return __uint_as_float(sign | ((exp + 112u) << 23) | (mant << 13));
}

// Round to nearest even. A NaN stays a quiet NaN with its sign and top payload
// bits (x86 F16C's rule, which torch's CPU cast follows); NaN payloads are not part
// of pagedkv's contract (torch's own CPU and CUDA casts differ there).
__device__ __forceinline__ pkv_u16 pkv_f32_to_f16(float f) {
  const pkv_u32 u = __float_as_uint(f);
  const pkv_u32 sign = (u >> 16) & 0x8000u;
  const pkv_u32 a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return (pkv_u16)(sign | 0x7e00u | ((a >> 13) & 0x3ffu));
  if (a >= 0x47800000u) return (pkv_u16)(sign | 0x7c00u);  // >= 65536: inf
  if (a >= 0x38800000u) {  // normal result (>= 2^-14); a carry may round up to inf
    const pkv_u32 r = (a + 0xfffu + ((a >> 13) & 1u)) >> 13;
    return (pkv_u16)(sign | (r - (112u << 10)));
  }
  // subnormal result: rint(|f| * 2^24) in [0, 1024]; 1024 encodes 2^-14 exactly.
  const float scaled = __uint_as_float(a) * 16777216.0f;
  return (pkv_u16)(sign | (pkv_u32)rintf(scaled));
}

__device__ __forceinline__ float pkv_bf16_to_f32(pkv_u16 b) {
  return __uint_as_float((pkv_u32)b << 16);
}

// Round to nearest even. A NaN is truncated and made quiet (sign and top payload
// bits kept); see pkv_f32_to_f16 on NaN payloads.
__device__ __forceinline__ pkv_u16 pkv_f32_to_bf16(float f) {
  const pkv_u32 u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (pkv_u16)((u >> 16) | 0x0040u);
  return (pkv_u16)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

template <typename T>
struct pkv_dtype;
template <>
struct pkv_dtype<float> {
  __device__ __forceinline__ static float to_f32(float x) { return x; }
  __device__ __forceinline__ static float from_f32(float x) { return x; }
};
template <>
struct pkv_dtype<pkv_f16> {
  __device__ __forceinline__ static float to_f32(pkv_f16 x) { return pkv_f16_to_f32(x.bits); }
  __device__ __forceinline__ static pkv_f16 from_f32(float x) {
    pkv_f16 r;
    r.bits = pkv_f32_to_f16(x);
    return r;
  }
};
template <>
struct pkv_dtype<pkv_bf16> {
  __device__ __forceinline__ static float to_f32(pkv_bf16 x) { return pkv_bf16_to_f32(x.bits); }
  __device__ __forceinline__ static pkv_bf16 from_f32(float x) {
    pkv_bf16 r;
    r.bits = pkv_f32_to_bf16(x);
    return r;
  }
};

// ---------------------------------------------------------------------------
// fp8 (OCP e4m3fn and e5m2) conversions.
//
// float -> fp8 saturates: it equals torch's cast of clamp(x, -FMAX, FMAX), and
// cuda_fp8.h's __nv_cvt_float_to_fp8(x, __NV_SATFINITE, ...): round to nearest
// even, |x| beyond FMAX (inf included) -> +-FMAX, NaN -> 0x7f with x's sign.

#define PKV_Q_E4M3 0
#define PKV_Q_E5M2 1
#define PKV_Q_INT8 2
#define PKV_Q_INT4 3
#define PKV_Q_INT3 4

__device__ __forceinline__ pkv_u8 pkv_f32_to_e4m3(float f) {
  const pkv_u32 u = __float_as_uint(f);
  const pkv_u32 sign = (u >> 24) & 0x80u;
  const pkv_u32 a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return (pkv_u8)(sign | 0x7fu);
  if (a >= 0x43e00000u) return (pkv_u8)(sign | 0x7eu);  // >= 448
  if (a >= 0x3c800000u) {  // normal result (>= 2^-6); rounding stays <= 448
    const pkv_u32 r = (a + 0x7ffffu + ((a >> 20) & 1u)) >> 20;
    return (pkv_u8)(sign | (r - (120u << 3)));
  }
  // subnormal result: rint(|f| * 2^9) in [0, 8]; 8 encodes 2^-6 exactly.
  const float scaled = __uint_as_float(a) * 512.0f;
  return (pkv_u8)(sign | (pkv_u32)rintf(scaled));
}

__device__ __forceinline__ pkv_u8 pkv_f32_to_e5m2(float f) {
  const pkv_u32 u = __float_as_uint(f);
  const pkv_u32 sign = (u >> 24) & 0x80u;
  const pkv_u32 a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return (pkv_u8)(sign | 0x7fu);
  if (a >= 0x47600000u) return (pkv_u8)(sign | 0x7bu);  // >= 57344
  if (a >= 0x38800000u) {  // normal result (>= 2^-14); rounding stays <= 57344
    const pkv_u32 r = (a + 0xfffffu + ((a >> 21) & 1u)) >> 21;
    return (pkv_u8)(sign | (r - (112u << 2)));
  }
  // subnormal result: rint(|f| * 2^16) in [0, 4]; 4 encodes 2^-14 exactly.
  const float scaled = __uint_as_float(a) * 65536.0f;
  return (pkv_u8)(sign | (pkv_u32)rintf(scaled));
}

__device__ __forceinline__ float pkv_e4m3_to_f32(pkv_u8 q) {
  const pkv_u32 sign = (pkv_u32)(q & 0x80u) << 24;
  const pkv_u32 exp = (q >> 3) & 0xfu;
  const pkv_u32 mant = q & 0x7u;
  if (exp == 15 && mant == 7) return __uint_as_float(sign | 0x7ff00000u);  // the only NaN (quiet)
  if (exp == 0) {  // subnormal: mant * 2^-9
    const float v = (float)mant * 0.001953125f;
    return __uint_as_float(__float_as_uint(v) | sign);
  }
  return __uint_as_float(sign | ((exp + 120u) << 23) | (mant << 20));
}

// e5m2 is the upper byte of an IEEE half.
__device__ __forceinline__ float pkv_e5m2_to_f32(pkv_u8 q) {
  return pkv_f16_to_f32((pkv_u16)((pkv_u32)q << 8));
}

template <int Q>
__device__ __forceinline__ float pkv_fp8_max() {
  return Q == PKV_Q_E4M3 ? 448.0f : 57344.0f;
}
template <int Q>
__device__ __forceinline__ pkv_u8 pkv_f32_to_fp8(float f) {
  return Q == PKV_Q_E4M3 ? pkv_f32_to_e4m3(f) : pkv_f32_to_e5m2(f);
}
template <int Q>
__device__ __forceinline__ float pkv_fp8_to_f32(pkv_u8 q) {
  return Q == PKV_Q_E4M3 ? pkv_e4m3_to_f32(q) : pkv_e5m2_to_f32(q);
}

// ---------------------------------------------------------------------------
// Cooperative kernels: the threads of a CTA share work between barriers. Such a
// kernel opens with PKV_COOPERATIVE() and writes each stretch between two barriers
// as PKV_PHASE({ ... }); every barrier is the end of a phase. Control flow outside
// the phases must be the same for every thread of the CTA (it may read blockIdx,
// blockDim, gridDim and the arguments, never threadIdx), a phase body must not
// return, and values pass from one phase to the next only through PKV_SHARED
// arrays. On the GPU a phase is its body then __syncthreads(). In the host
// emulation (emulate.h) only thread 0 of each CTA runs the kernel, and each phase
// steps every thread of the CTA through its body before the next phase starts:
// the barrier's semantics, run sequentially.

#ifdef PAGEDKV_EMULATE
#define PKV_COOPERATIVE()                                  \
  if (threadIdx.x != 0 || threadIdx.y != 0 || threadIdx.z != 0) return
#define PKV_PHASE(...) pkv_emu::each_thread([&]() __VA_ARGS__)
#define PKV_SHARED
#else
#define PKV_COOPERATIVE() ((void)0)
#define PKV_PHASE(...) \
  do __VA_ARGS__ while (0); \
  __syncthreads()
#define PKV_SHARED __shared__
#endif

#define PKV_MAX_THREADS 1024  // per CTA: the size of per-thread shared arrays

// ---------------------------------------------------------------------------
// Quantization: the arithmetic of pagedkv/quant.py, one rounding per step
// (explicit _rn operations: no FMA). A group is the run of elements that shares
// one scale: a whole (token, head) row, or one int4 group of it.

__device__ __forceinline__ float pkv_fix_scale(float s) {
  return (s == 0.0f || !pkv_isfinite(s)) ? 1.0f : s;
}

// int3's parameters are bfloat16 rounded outward (pagedkv/quant.py): f rounded to a
// bfloat16 value toward +inf (up) or -inf, returned as float32. The magnitude is
// truncated when that moves toward the wanted infinity, else rounded away from zero
// (overflowing to infinity past bfloat16's range); the sign stays; NaN -> 0x7fc0.
__device__ __forceinline__ float pkv_bf16_directed(float f, bool up) {
  const pkv_u32 u = __float_as_uint(f), a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return __uint_as_float(0x7fc00000u);
  const bool neg = (u >> 31) != 0u;
  const pkv_u32 mag = neg != up ? ((a + 0xffffu) & 0xffff0000u) : (a & 0xffff0000u);
  return __uint_as_float((u & 0x80000000u) | mag);
}

// Scale and zero-point arenas: float32, except int3's bfloat16 (the kernels take
// them as float pointers; int3's are read and written as 16-bit values).
template <int Q>
__device__ __forceinline__ float pkv_param_load(const float* __restrict__ p, pkv_i64 i) {
  if (Q == PKV_Q_INT3) return pkv_bf16_to_f32(((const pkv_u16*)p)[i]);
  return p[i];
}
template <int Q>
__device__ __forceinline__ void pkv_param_store(float* __restrict__ p, pkv_i64 i, float v) {
  if (Q == PKV_Q_INT3)
    ((pkv_u16*)p)[i] = pkv_f32_to_bf16(v);  // exact: int3's parameters are bfloat16 values
  else
    p[i] = v;
}

// The group's zero point from its minimum a (int3: rounded toward -inf to bfloat16).
template <int Q>
__device__ __forceinline__ float pkv_group_zero(float a) {
  return Q == PKV_Q_INT3 ? pkv_bf16_directed(a, false) : a;
}

// The partial reduction of a group: fp8 keeps amax in a, the asymmetric formats
// min in a and max in b; both start from values every element replaces.
template <int Q>
__device__ __forceinline__ void pkv_reduce_init(float* a, float* b) {
  *a = Q == PKV_Q_E4M3 || Q == PKV_Q_E5M2 ? 0.0f : __uint_as_float(0x7f800000u);
  *b = __uint_as_float(0xff800000u);
}
template <int Q>
__device__ __forceinline__ void pkv_reduce_add(float* a, float* b, float x) {
  if (Q == PKV_Q_E4M3 || Q == PKV_Q_E5M2) {
    *a = pkv_max_nan(*a, pkv_fabs(x));
  } else {
    *a = pkv_min_nan(*a, x);
    *b = pkv_max_nan(*b, x);
  }
}
template <int Q>
__device__ __forceinline__ void pkv_reduce_merge(float* a, float* b, float a2, float b2) {
  if (Q == PKV_Q_E4M3 || Q == PKV_Q_E5M2) {
    *a = pkv_max_nan(*a, a2);
  } else {
    *a = pkv_min_nan(*a, a2);
    *b = pkv_max_nan(*b, b2);
  }
}

// The group's scale from (a, b): fp8 a = amax; else a = its zero point
// (pkv_group_zero of the minimum) and b = its maximum.
template <int Q>
__device__ __forceinline__ float pkv_group_scale(float a, float b) {
  if (Q == PKV_Q_E4M3 || Q == PKV_Q_E5M2) return pkv_fix_scale(__fdiv_rn(a, pkv_fp8_max<Q>()));
  if (Q == PKV_Q_INT3) return pkv_fix_scale(pkv_bf16_directed(__fdiv_rn(__fsub_rn(b, a), 7.0f), true));
  return pkv_fix_scale(__fdiv_rn(__fsub_rn(b, a), Q == PKV_Q_INT8 ? 255.0f : 15.0f));
}

// One element's code: the fp8 byte, the int8 byte, or the int4/int3 code (0..15/0..7).
template <int Q>
__device__ __forceinline__ pkv_u32 pkv_quantize(float x, float scale, float zero) {
  if (Q == PKV_Q_E4M3 || Q == PKV_Q_E5M2) {
    // A NaN keeps its own sign bit (a GPU division would return the canonical
    // NaN), so the code matches torch on the CPU: 0x7f or 0xff.
    return pkv_f32_to_fp8<Q>(pkv_isnan(x) ? x : __fdiv_rn(x, scale));
  }
  const float top = Q == PKV_Q_INT8 ? 255.0f : (Q == PKV_Q_INT3 ? 7.0f : 15.0f);
  float v = __fdiv_rn(__fsub_rn(x, zero), scale);
  if (pkv_isnan(v)) v = 0.0f;  // the defined result for NaN input: code 0
  v = rintf(v);
  v = v < 0.0f ? 0.0f : (v > top ? top : v);
  return Q == PKV_Q_INT8 ? (pkv_u32)(pkv_u8)(signed char)((int)v - 128) : (pkv_u32)v;
}

// Bytes of one quantized (token, head) row: int4 two codes per byte, int3 eight
// codes per three bytes (head_dim a multiple of 8), else one code per byte.
template <int Q>
__device__ __forceinline__ pkv_i64 pkv_row_bytes(pkv_i64 head_dim) {
  return Q == PKV_Q_INT4 ? head_dim / 2 : (Q == PKV_Q_INT3 ? head_dim / 8 * 3 : head_dim);
}

// code -> value: fp8 q * s; int8 (q + 128) * s + zero; int4/int3 c * s + zero
template <int Q>
__device__ __forceinline__ float pkv_dequantize(pkv_u32 q, float scale, float zero) {
  if (Q == PKV_Q_INT8) {
    const float c = (float)((int)(signed char)(pkv_u8)q + 128);
    return __fadd_rn(__fmul_rn(c, scale), zero);
  }
  if (Q == PKV_Q_INT4 || Q == PKV_Q_INT3) return __fadd_rn(__fmul_rn((float)q, scale), zero);
  return __fmul_rn(pkv_fp8_to_f32<Q>((pkv_u8)q), scale);
}

// ---------------------------------------------------------------------------
// Rotation (pagedkv/rotation.py, bit for bit): rotate(x) = H(signs * x) on write,
// unrotate(y) = signs * H(y) on read. H is block-diagonal over the binary
// decomposition of head_dim (largest block first); on a block of n = 2^b it is the
// butterfly stages h = 1, 2, 4, ... then one multiply by float32(1 / sqrt(n)). Every
// block of size >= 2h starts at a multiple of 2h, so stage h runs over the prefix
// head_dim & ~(2h - 1) of the row as if it were one block. A CTA row holds its
// (token, head) row in shared memory, one barrier phase per stage; PKV_ROT_FLOATS
// bounds blockDim.y * head_dim (the launch plans keep to it).

#define PKV_ROT_FLOATS 4096

// index of the highest set bit of x > 0
__device__ __forceinline__ int pkv_top_bit(pkv_i64 x) { return 63 - __clzll(x); }

// float32(1 / sqrt(2^b)): 2^(-b/2) exactly for even b, else that power of two times
// float32(1 / sqrt(2)) (scaling by a power of two keeps the rounding)
__device__ __forceinline__ float pkv_hadamard_scale(int b) {
  const float pow2 = __uint_as_float((pkv_u32)(127 - (b >> 1)) << 23);
  return (b & 1) ? __fmul_rn(pow2, __uint_as_float(0x3f3504f3u)) : pow2;
}

// the scale of element j's block: the highest bit where j (< d) and d differ
__device__ __forceinline__ float pkv_hadamard_scale_at(pkv_i64 d, pkv_i64 j) {
  return pkv_hadamard_scale(pkv_top_bit(d ^ j));
}

// stage h (a power of two) of the butterflies over y[0, d): pairs [first, ...) by step
__device__ __forceinline__ void pkv_butterflies(float* y, pkv_i64 d, pkv_i64 h, pkv_i64 first,
                                                pkv_i64 step) {
  const pkv_i64 pairs = (d & ~(2 * h - 1)) / 2;
  for (pkv_i64 p = first; p < pairs; p += step) {
    const pkv_i64 i = ((p & ~(h - 1)) << 1) | (p & (h - 1));
    const float a = y[i], b = y[i + h];
    y[i] = __fadd_rn(a, b);
    y[i + h] = __fsub_rn(a, b);
  }
}

// ---------------------------------------------------------------------------
// Reading rows (gather_kv.cu and paged_attention.cu).

// The code of element d of a quantized row (int4: its nibble of byte d / 2; int3:
// bits 3 (d % 8) of the 24-bit little-endian pack d / 8).
template <int Q>
__device__ __forceinline__ pkv_u32 pkv_code_at(const pkv_u8* __restrict__ kv, pkv_i64 row,
                                               pkv_i64 head_dim, pkv_i64 d) {
  if (Q == PKV_Q_INT4) return (kv[row * (head_dim / 2) + d / 2] >> ((pkv_u32)(d & 1) * 4)) & 15u;
  if (Q == PKV_Q_INT3) {
    const pkv_u8* p = kv + row * pkv_row_bytes<Q>(head_dim) + d / 8 * 3;
    const pkv_u32 bits = (pkv_u32)p[0] | ((pkv_u32)p[1] << 8) | ((pkv_u32)p[2] << 16);
    return (bits >> (3 * (pkv_u32)(d & 7))) & 7u;
  }
  return kv[row * head_dim + d];
}

// Block keys: whether (block, head) holds per-channel int4 keys, and one of their
// values. key_scale/key_zero are bfloat16 bits, [num_blocks, H, D] row-major.
template <int Q>
__device__ __forceinline__ bool pkv_key_sealed(const pkv_u16* __restrict__ key_scale, pkv_i64 block,
                                               pkv_i64 head, pkv_i64 num_heads, pkv_i64 head_dim) {
  if (Q != PKV_Q_INT4 || key_scale == 0) return false;
  return pkv_bf16_to_f32(key_scale[(block * num_heads + head) * head_dim]) != 0.0f;
}
__device__ __forceinline__ float pkv_key_channel_value(pkv_u32 code, const pkv_u16* __restrict__ key_scale,
                                                 const pkv_u16* __restrict__ key_zero, pkv_i64 block,
                                                 pkv_i64 head, pkv_i64 num_heads, pkv_i64 head_dim,
                                                 pkv_i64 d) {
  const pkv_i64 i = (block * num_heads + head) * head_dim + d;
  return __fadd_rn(__fmul_rn((float)code, pkv_bf16_to_f32(key_scale[i])), pkv_bf16_to_f32(key_zero[i]));
}
