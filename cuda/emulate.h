// emulate.h - build the pagedkv .cu kernels with a host C++ compiler.
//
// Most kernels are plain CUDA C++: grid-stride loops, no warp intrinsics, and
// barriers only through common.cuh's PKV_PHASE; the warp-level ones (warp.cuh) run as
// fibers, see emulate_fibers.h. This header maps the few CUDA
// names they use onto host C++ so that g++ compiles the unchanged sources into a
// shared library that pagedkv.kernels.emulation drives through ctypes.
// pkv_emu::launch() runs a kernel over its whole grid, one (block, thread) at a
// time; that is exact for the barrier-free kernels because every output element is
// written by exactly one thread. A cooperative kernel lets only thread 0 of each
// block through, which then steps all the block's threads through one phase after
// another (each_thread), so everything a thread wrote before a barrier is there
// for every thread after it.
//
// Build with -ffp-contract=off (and no -ffast-math) so each float operation
// rounds once, as __fdiv_rn/__fmul_rn/__fadd_rn do on the device.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstring>
#include <utility>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline __attribute__((always_inline))
#define __restrict__ __restrict

struct pkv_emu_dim3 {
  unsigned int x, y, z;
};

// One set per host thread, so independent emulated launches may run in parallel.
inline thread_local pkv_emu_dim3 threadIdx;
inline thread_local pkv_emu_dim3 blockIdx;
inline thread_local pkv_emu_dim3 blockDim;
inline thread_local pkv_emu_dim3 gridDim;

// The CUDA vector types the kernels use, with the device alignment.
struct alignas(16) uint4 {
  unsigned int x, y, z, w;
};
struct alignas(16) float4 {
  float x, y, z, w;
};
struct alignas(8) uint2 {
  unsigned int x, y;
};

inline uint4 make_uint4(unsigned int x, unsigned int y, unsigned int z, unsigned int w) {
  return uint4{x, y, z, w};
}

inline unsigned int __float_as_uint(float f) {
  unsigned int u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

inline float __uint_as_float(unsigned int u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// Round-to-nearest-even single operations; with -ffp-contract=off plain operators
// are exactly that on x86-64 (SSE arithmetic, default rounding mode).
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }

inline int __clzll(long long x) { return x ? __builtin_clzll((unsigned long long)x) : 64; }

namespace pkv_emu {

template <typename... A, std::size_t... I>
inline void call(void (*kernel)(A...), void** argv, std::index_sequence<I...>) {
  // argv[i] points at the i-th argument, exactly as cuLaunchKernel's kernelParams.
  kernel(*static_cast<A*>(argv[I])...);
}

// Run f once as each thread of the current block (x fastest), then continue as
// thread 0: one barrier phase of a cooperative kernel.
template <typename F>
inline void each_thread(F&& f) {
  for (unsigned int tz = 0; tz < blockDim.z; ++tz)
    for (unsigned int ty = 0; ty < blockDim.y; ++ty)
      for (unsigned int tx = 0; tx < blockDim.x; ++tx) {
        threadIdx = pkv_emu_dim3{tx, ty, tz};
        f();
      }
  threadIdx = pkv_emu_dim3{0, 0, 0};
}

inline thread_local bool failed = false;  // (emulate_fibers.h: an error in the launch)

// dims = {grid.x, grid.y, grid.z, block.x, block.y, block.z}; returns 0, or 1 after an
// error (a misaligned vector access: pkv_emu::last_error()).
template <typename... A>
inline int launch(void (*kernel)(A...), const unsigned int* dims, void** argv) {
  failed = false;
  gridDim = pkv_emu_dim3{dims[0], dims[1], dims[2]};
  blockDim = pkv_emu_dim3{dims[3], dims[4], dims[5]};
  for (unsigned int bz = 0; bz < gridDim.z; ++bz)
    for (unsigned int by = 0; by < gridDim.y; ++by)
      for (unsigned int bx = 0; bx < gridDim.x; ++bx)
        for (unsigned int tz = 0; tz < blockDim.z; ++tz)
          for (unsigned int ty = 0; ty < blockDim.y; ++ty)
            for (unsigned int tx = 0; tx < blockDim.x; ++tx) {
              blockIdx = pkv_emu_dim3{bx, by, bz};
              threadIdx = pkv_emu_dim3{tx, ty, tz};
              call(kernel, argv, std::index_sequence_for<A...>{});
            }
  return failed ? 1 : 0;
}

}  // namespace pkv_emu

#include "emulate_fibers.h"
