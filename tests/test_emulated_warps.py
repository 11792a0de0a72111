"""The host emulation of warp-level CUDA code (cuda/emulate_fibers.h, cuda/warp.cuh): each
thread a fiber, barriers and warp exchanges as rendezvous, cp.async deferred to its wait
with the destination poisoned, misaligned vector accesses and divergence reported; and
warp.cuh's exp2 and tanh against float64.

A small program built with g++ from the packaged headers runs each probe kernel below
through ``pkv_emu::launch_fibers`` and prints what it saw.
"""
from __future__ import annotations

import math
import shutil
import struct
import subprocess

import pytest

from pagedkv.kernels import emulation, sources

pytestmark = pytest.mark.skipif(shutil.which(emulation.CXX) is None, reason=f"needs {emulation.CXX}")

PROGRAM = r"""
#include "warp.cuh"
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>

__global__ void k_sum(float* out) {  // butterflies in every warp, then a barrier, then another warp's result
  __shared__ float s[128];
  float v[1] = {(float)threadIdx.x};
  pkv_warp_sum<1>(v, 1, 32);
  s[threadIdx.x] = v[0];
  __syncthreads();
  out[threadIdx.x] = s[(threadIdx.x + 32) % 128];
}
__global__ void k_cp(const float* src, float* out, int n) {  // before and after the wait
  __shared__ uint4 s[64];
  const int t = threadIdx.x;
  pkv_cp_async<16>(&s[t], src + 4 * t, n);
  pkv_cp_commit();
  float before, after;
  memcpy(&before, &s[t], 4);
  pkv_cp_wait<0>();
  memcpy(&after, &s[t], 4);
  out[2 * t] = before;
  out[2 * t + 1] = after;
}
__global__ void k_misaligned(const float* src) {
  __shared__ uint4 s[64];
  pkv_cp_async<16>(&s[threadIdx.x], src + 1, 16);
  pkv_cp_commit();
  pkv_cp_wait<0>();
}
__global__ void k_diverge(float* out) {  // half a warp leaves while the other half shuffles
  if (threadIdx.x % 32 < 16) return;
  float v[1] = {1.0f};
  pkv_warp_sum<1>(v, 1, 32);
  out[threadIdx.x] = v[0];
}
__global__ void k_deadlock(float* out) {  // half of each warp at a barrier, half at a shuffle
  if (threadIdx.x % 32 < 16) {
    __syncthreads();
  } else {
    float v[1] = {1.0f};
    pkv_warp_sum<1>(v, 1, 32);
    out[threadIdx.x] = v[0];
  }
}
__global__ void k_race(const float* src) {  // writes a destination whose copy is in flight
  __shared__ uint4 s[64];
  pkv_cp_async<16>(&s[threadIdx.x], src, 16);
  pkv_cp_commit();
  s[threadIdx.x].x = 7u;
  pkv_cp_wait<0>();
}

int main(int argc, char** argv) {
  const int probe = atoi(argv[1]);
  alignas(16) static float src[512], out[512];
  for (int i = 0; i < 512; ++i) src[i] = (float)i;
  unsigned dims[6] = {1, 1, 1, 128, 1, 1};
  int rc = 0;
  if (probe == 0) {
    float* o = out;
    void* argv_[] = {&o};
    rc = pkv_emu::launch_fibers(&k_sum, dims, argv_);
    for (int i = 0; i < 128; ++i) printf("%g ", out[i]);
  } else if (probe == 1 || probe == 2) {
    const float* s = src;
    float* o = out;
    int n = probe == 1 ? 16 : 0;
    dims[3] = 64;
    void* argv_[] = {&s, &o, &n};
    rc = pkv_emu::launch_fibers(&k_cp, dims, argv_);
    for (int i = 0; i < 128; ++i) printf("%g ", out[i]);
  } else if (probe == 3) {
    const float* s = src;
    void* argv_[] = {&s};
    dims[3] = 64;
    rc = pkv_emu::launch_fibers(&k_misaligned, dims, argv_);
  } else if (probe == 4 || probe == 5) {
    float* o = out;
    void* argv_[] = {&o};
    rc = probe == 4 ? pkv_emu::launch_fibers(&k_diverge, dims, argv_) : pkv_emu::launch_fibers(&k_deadlock, dims, argv_);
  } else if (probe == 6) {
    const float* s = src;
    void* argv_[] = {&s};
    dims[3] = 64;
    rc = pkv_emu::launch_fibers(&k_race, dims, argv_);
  } else if (probe == 7) {  // exp2 and tanh over a sweep: the bits, for the test to judge
    for (int i = -40000; i <= 40000; ++i) {
      const float x = (float)i * 0.00390625f;  // [-156.25, 156.25] in steps of 2^-8
      const float e = pkv_exp2(x), t = pkv_tanh(x * 0.01f);
      unsigned eb, tb;
      memcpy(&eb, &e, 4);
      memcpy(&tb, &t, 4);
      printf("%08x %08x\n", eb, tb);
    }
  }
  printf("\nrc=%d error=%s\n", rc, pkv_emu::last_error());
  return 0;
}
"""


@pytest.fixture(scope="module")
def probe(tmp_path_factory):
    d = tmp_path_factory.mktemp("warps")
    for name, data in sources.load("decode_attention.cu").headers.items():
        (d / name).write_bytes(data)
    (d / "probe.cpp").write_text(PROGRAM)
    flags = [f for f in emulation.FLAGS if f not in ("-fPIC",)]
    subprocess.run([emulation.CXX, *flags, "-Wno-unused-parameter", "probe.cpp", "-o", "probe"], cwd=d, check=True,
                   capture_output=True)

    def run(n: int) -> tuple[str, int, str]:
        text = subprocess.run([str(d / "probe"), str(n)], capture_output=True, text=True, check=True).stdout
        body, tail = text.rsplit("\nrc=", 1)
        rc, err = tail.split(" error=", 1)
        return body, int(rc), err.strip()

    return run


def test_shuffles_and_barriers_exchange_like_a_gpu(probe):
    body, rc, err = probe(0)
    assert rc == 0 and err == ""
    got = [float(x) for x in body.split()]
    sums = [sum(range(32 * w, 32 * w + 32)) for w in range(4)]  # every lane of warp w: its warp's sum
    assert got == [sums[(t // 32 + 1) % 4] for t in range(128)]


def test_cp_async_lands_at_its_wait_and_the_destination_is_poisoned_until_then(probe):
    body, rc, _ = probe(1)
    got = [float(x) for x in body.split()]
    assert rc == 0
    assert all(math.isnan(b) for b in got[0::2])  # read before the wait: 0xff bytes
    assert got[1::2] == [4.0 * t for t in range(64)]
    body, rc, _ = probe(2)  # a copy of 0 source bytes zero-fills
    assert rc == 0 and [float(x) for x in body.split()][1::2] == [0.0] * 64


@pytest.mark.parametrize("n, message", [
    (3, r"misaligned 16-byte cp.async source"),
    (4, r"warp 0: 16 lanes exited while the others wait at a warp exchange"),
    (5, r"deadlock in block \(0,0,0\): 64 threads at a barrier, 0 done"),
    (6, r"a cp.async destination .* was written before the wait that completes it"),
])
def test_broken_cuda_rules_are_reported(probe, n, message):
    import re

    _, rc, err = probe(n)
    assert rc == 1 and re.search(message, err), err


def test_exp2_and_tanh_are_accurate(probe):
    body, rc, _ = probe(7)
    assert rc == 0
    worst_e = worst_t = 0.0
    words = body.split()
    for i in range(len(words) // 2):
        eb, tb = int(words[2 * i], 16), int(words[2 * i + 1], 16)
        x = (i - 40000) * 0.00390625
        e, t = (struct.unpack("<f", struct.pack("<I", b))[0] for b in (eb, tb))
        want = 2.0 ** x
        if want >= 2.0 ** -126 and want < 3.4e38:  # normal results: within 2 ulp
            ulp = 2.0 ** (math.floor(math.log2(want)) - 23)
            worst_e = max(worst_e, abs(e - want) / ulp)
        elif want < 2.0 ** -151:
            assert e == 0.0
        elif want >= 2.0 ** 128:
            assert math.isinf(e)
        worst_t = max(worst_t, abs(t - math.tanh(x * 0.01)))  # absolute, in units of 2^-24
    assert worst_e <= 2.0, worst_e
    assert worst_t <= 4 * 2.0 ** -24, worst_t
