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

// The scalar number conversions and quantization steps (float16/bfloat16, fp8,
// directed bfloat16 rounding, the integer codes and their packing) and the pkv_i64..
// pkv_u8 types: one definition shared with the CPU ops (pagedkv/ops/quant_rows.h).
#include "quant_scalar.h"

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
#define PKV_UNROLL
#else
#define PKV_COOPERATIVE() ((void)0)
#define PKV_PHASE(...) \
  do __VA_ARGS__ while (0); \
  __syncthreads()
#define PKV_SHARED __shared__
// a _Pragma, unlike #pragma, may stand inside a PKV_PHASE body (a macro argument)
#define PKV_UNROLL _Pragma("unroll")
#endif

#define PKV_MAX_THREADS 1024  // per CTA: the size of per-thread shared arrays

// ---------------------------------------------------------------------------
// Quantization: the arithmetic of pagedkv/quant.py, one rounding per step
// (explicit _rn operations: no FMA). A group is the run of elements that shares
// one scale: a whole (token, head) row, or one int4 group of it.

// int3's parameters: f rounded to a bfloat16 value toward +inf (up) or -inf, as
// float32 (pagedkv/format/quant.py; quant_scalar.h's pkv_f32_to_bf16_directed).
__device__ __forceinline__ float pkv_bf16_directed(float f, bool up) {
  return pkv_bf16_to_f32(pkv_f32_to_bf16_directed(f, up ? 1u : 0u));
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
  if (Q == PKV_Q_INT3) return pkv_fix_scale(pkv_bf16_directed(__fdiv_rn(__fsub_rn(b, a), PKV_TOP_INT3), true));
  return pkv_fix_scale(__fdiv_rn(__fsub_rn(b, a), Q == PKV_Q_INT8 ? PKV_TOP_INT8 : PKV_TOP_INT4));
}

// One element's code: the fp8 byte, the int8 byte, or the int4/int3 code (0..15/0..7).
template <int Q>
__device__ __forceinline__ pkv_u32 pkv_quantize(float x, float scale, float zero) {
  if (Q == PKV_Q_E4M3 || Q == PKV_Q_E5M2) {
    // A NaN keeps its own sign bit (a GPU division would return the canonical
    // NaN), so the code matches torch on the CPU: 0x7f or 0xff.
    return pkv_f32_to_fp8<Q>(pkv_isnan(x) ? x : __fdiv_rn(x, scale));
  }
  const float top = Q == PKV_Q_INT8 ? PKV_TOP_INT8 : (Q == PKV_Q_INT3 ? PKV_TOP_INT3 : PKV_TOP_INT4);
  // NaN -> code 0 (the defined result for NaN input), clamped, rounded half to even
  const pkv_u32 c = pkv_int_code(__fdiv_rn(__fsub_rn(x, zero), scale), top);
  return Q == PKV_Q_INT8 ? (pkv_u32)(pkv_u8)(c - 128u) : c;
}

// Bytes of one quantized (token, head) row: int4 two codes per byte, int3 eight
// codes per three bytes (head_dim a multiple of 8), else one code per byte.
template <int Q>
__device__ __forceinline__ pkv_i64 pkv_row_bytes(pkv_i64 head_dim) {
  return pkv_row_bytes_of(Q, head_dim);
}

// code -> value: fp8 q * s; int8 (q + 128) * s + zero; int4/int3 c * s + zero
template <int Q>
__device__ __forceinline__ float pkv_dequantize(pkv_u32 q, float scale, float zero) {
  if (Q == PKV_Q_INT8) return pkv_affine(pkv_int8_value((pkv_u8)q), scale, zero);
  if (Q == PKV_Q_INT4 || Q == PKV_Q_INT3) return pkv_affine((float)q, scale, zero);
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
  if (Q == PKV_Q_INT4) return pkv_int4_code(kv[row * (head_dim / 2) + d / 2], d);
  if (Q == PKV_Q_INT3) return pkv_int3_code(pkv_int3_load(kv + row * pkv_row_bytes<Q>(head_dim) + d / 8 * 3), d);
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
  return pkv_affine((float)code, pkv_bf16_to_f32(key_scale[i]), pkv_bf16_to_f32(key_zero[i]));
}
