// warp.cuh - warp-level primitives that run the same on a GPU and in the host emulation.
//
// Kernels that use these are launched as fibers in the emulation (emulate_fibers.h):
// barriers, shuffles and cp.async behave there as on the hardware, and the arithmetic
// below is exact on both sides, so a GPU and the emulation agree bit for bit:
//   - pkv_fma is the correctly rounded fused multiply-add (__fmaf_rn; fmaf on the host);
//   - pkv_exp2 is a fixed polynomial evaluated with those FMAs (no hardware ex2.approx,
//     no libm), and pkv_tanh is built on it;
//   - shuffle reductions are butterflies with a fixed order (a + b == b + a in IEEE).
// Vector loads and stores check their alignment in the emulation.
#pragma once

#include "common.cuh"

#ifdef PAGEDKV_EMULATE
#define __shared__ static thread_local
#define __launch_bounds__(...)
inline void __syncthreads() { pkv_emu::syncthreads(); }
inline float __fmaf_rn(float a, float b, float c) { return __builtin_fmaf(a, b, c); }
inline unsigned int __byte_perm(unsigned int x, unsigned int y, unsigned int s) {
  const unsigned long long v = ((unsigned long long)y << 32) | x;
  unsigned int r = 0;
  for (int i = 0; i < 4; ++i) r |= (unsigned int)((v >> (8 * ((s >> (4 * i)) & 7))) & 0xff) << (8 * i);
  return r;
}
#endif

#define PKV_FULL_MASK 0xffffffffu
#ifdef PAGEDKV_EMULATE
#define PKV_UNROLL_NONE
#else
#define PKV_UNROLL_NONE _Pragma("unroll 1")
#endif

__device__ __forceinline__ float pkv_fma(float a, float b, float c) { return __fmaf_rn(a, b, c); }

// ---- warp exchanges --------------------------------------------------------------------
// N floats at once: one rendezvous in the emulation, N shuffles on a GPU.

template <int N>
__device__ __forceinline__ void pkv_shfl_xor_n(float (&v)[N], float (&out)[N], int lane_mask) {
#ifdef PAGEDKV_EMULATE
  pkv_emu::exchange(1, PKV_FULL_MASK, lane_mask, (const unsigned*)v, (unsigned*)out, N);
#else
PKV_UNROLL
  for (int i = 0; i < N; ++i) out[i] = __shfl_xor_sync(PKV_FULL_MASK, v[i], lane_mask);
#endif
}

// v[i] <- the sum of v[i] over the lanes that differ from this one only in the bits
// of [lo, hi) (powers of two), as butterflies from lo up: every lane of a group ends
// with the same bits.
template <int N>
__device__ __forceinline__ void pkv_warp_sum(float (&v)[N], int lo, int hi) {
  for (int m = lo; m < hi; m *= 2) {
    float o[N];
    pkv_shfl_xor_n<N>(v, o, m);
PKV_UNROLL
    for (int i = 0; i < N; ++i) v[i] = __fadd_rn(v[i], o[i]);
  }
}

// the same with max (NaN-propagating, as the reduction order must not matter)
template <int N>
__device__ __forceinline__ void pkv_warp_max(float (&v)[N], int lo, int hi) {
  for (int m = lo; m < hi; m *= 2) {
    float o[N];
    pkv_shfl_xor_n<N>(v, o, m);
PKV_UNROLL
    for (int i = 0; i < N; ++i) v[i] = pkv_max_nan(v[i], o[i]);
  }
}

// every lane of the warp meets here (and sees the others' shared-memory writes)
__device__ __forceinline__ void pkv_syncwarp() {
#ifdef PAGEDKV_EMULATE
  pkv_emu::exchange(4, PKV_FULL_MASK, 0, nullptr, nullptr, 0);
#else
  __syncwarp(PKV_FULL_MASK);
#endif
}

// ---- cp.async ----------------------------------------------------------------------------
// dst in shared memory, src in global memory; `n` of the `SIZE` bytes are read, the rest
// zero-filled (n = 0: zeros, src is not read but must be a valid address).

template <int SIZE>
__device__ __forceinline__ void pkv_cp_async(void* dst, const void* src, unsigned n) {
#ifdef PAGEDKV_EMULATE
  pkv_emu::cp_async(dst, src, SIZE, n);
#else
  unsigned s;
  asm volatile("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(s) : "l"(dst));
  if (SIZE == 16)
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(s), "l"(src), "r"(n) : "memory");
  else
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;" ::"r"(s), "l"(src), "n"(SIZE), "r"(n) : "memory");
#endif
}

__device__ __forceinline__ void pkv_cp_commit() {
#ifdef PAGEDKV_EMULATE
  pkv_emu::cp_commit();
#else
  asm volatile("cp.async.commit_group;" ::: "memory");
#endif
}

// wait until at most N of this thread's committed groups are pending
template <int N>
__device__ __forceinline__ void pkv_cp_wait() {
#ifdef PAGEDKV_EMULATE
  pkv_emu::cp_wait(N);
#else
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
#endif
}

// ---- vector loads and stores (alignment checked in the emulation) ------------------------

__device__ __forceinline__ uint4 pkv_ld16(const void* p) {
#ifdef PAGEDKV_EMULATE
  pkv_emu::check_aligned(p, 16, "load");
#endif
  return *(const uint4*)p;
}
__device__ __forceinline__ uint2 pkv_ld8(const void* p) {
#ifdef PAGEDKV_EMULATE
  pkv_emu::check_aligned(p, 8, "load");
#endif
  return *(const uint2*)p;
}
__device__ __forceinline__ void pkv_st16(void* p, uint4 v) {
#ifdef PAGEDKV_EMULATE
  pkv_emu::check_aligned(p, 16, "store");
#endif
  *(uint4*)p = v;
}

// ---- exp2 and tanh ----------------------------------------------------------------------

// 2^x, from 2^x = 2^n * 2^f with n = rint(x), |f| <= 1/2: 2^f by its degree-7 Taylor
// polynomial (truncation below 3e-9 relative) in FMAs, 2^n put into the exponent bits
// (two steps where the result is subnormal). About 2 ulp; -inf -> 0, NaN -> NaN.
__device__ __forceinline__ float pkv_exp2(float x) {
  if (!(x > -151.0f)) return x != x ? x : 0.0f;
  if (x >= 128.0f) return __uint_as_float(0x7f800000u);
  const float big = __fadd_rn(x, 12582912.0f);  // 1.5 * 2^23: rounds x to an integer
  const int n = (int)(__float_as_uint(big) - 0x4b400000u);
  const float f = __fsub_rn(x, __fsub_rn(big, 12582912.0f));
  float p = 1.5252733804059841e-05f;  // ln2^7 / 7!
  p = pkv_fma(p, f, 1.5403530393381609e-04f);
  p = pkv_fma(p, f, 1.3333558146428443e-03f);
  p = pkv_fma(p, f, 9.6181291076284772e-03f);
  p = pkv_fma(p, f, 5.5504108664821580e-02f);
  p = pkv_fma(p, f, 2.4022650695910071e-01f);
  p = pkv_fma(p, f, 6.9314718055994531e-01f);
  p = pkv_fma(p, f, 1.0f);
  if (n >= -126 && n <= 127) return __fmul_rn(p, __uint_as_float((unsigned)(n + 127) << 23));
  const int h = n / 2;  // subnormal results and n = 128: both halves stay normal powers of two
  return __fmul_rn(__fmul_rn(p, __uint_as_float((unsigned)(h + 127) << 23)),
                   __uint_as_float((unsigned)(n - h + 127) << 23));
}

// tanh(y) = sign(y) (1 - e) / (1 + e), e = 2^(-2 |y| log2(e)): a few ulp absolute
__device__ __forceinline__ float pkv_tanh(float y) {
  const float e = pkv_exp2(__fmul_rn(pkv_fabs(y), -2.8853900817779268f));
  const float t = __fdiv_rn(__fsub_rn(1.0f, e), __fadd_rn(1.0f, e));
  return __uint_as_float(__float_as_uint(t) | (__float_as_uint(y) & 0x80000000u));
}
