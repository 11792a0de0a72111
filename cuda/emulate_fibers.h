// emulate_fibers.h - run warp-level CUDA code on the CPU, bit for bit (emulate.h includes it).
//
// pkv_emu::launch_fibers() runs every thread of a CTA as a fiber (its own stack) on
// the calling host thread, one CTA after another. A fiber runs until it reaches a
// rendezvous, then the scheduler runs the next one:
//   - __syncthreads(): every live thread of the CTA must arrive;
//   - a warp exchange (shuffles, ballots, __syncwarp): every live lane of the warp must
//     arrive at the same kind of exchange with the same width, then every lane gets
//     the value of the lane it named, exactly as the hardware's register exchange;
// a thread that exits while others of its warp wait at an exchange, or a CTA whose
// threads wait at different rendezvous, is an error (divergence: on a GPU, a hang or
// undefined behaviour). cp.async copies are deferred to the wait that completes them,
// with the destination poisoned (0xff bytes: NaN floats) meanwhile, so a kernel that
// reads before it waits reads NaN; a destination written before its wait, and a
// misaligned vector access, are errors. The first error of a launch is kept, the
// launch finishes its current fibers' work where it can, and returns 1;
// pkv_emu::last_error() says what happened.
//
// Fibers switch with a few instructions of inline assembly on x86-64 (a glibc
// swapcontext costs a system call per switch, 30x slower); elsewhere, and under
// AddressSanitizer (which must be told about stack switches), through ucontext.
#pragma once

#include <sys/mman.h>
#include <ucontext.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

#if defined(__SANITIZE_ADDRESS__)
#define PKV_EMU_ASAN 1
#include <sanitizer/common_interface_defs.h>
#endif
#if defined(__x86_64__) && !defined(PKV_EMU_ASAN)
#define PKV_EMU_ASM_SWITCH 1
#endif

namespace pkv_emu {

inline thread_local char error_text[512];

// Record the first error of a launch (printf-style).
template <typename... A>
inline void fail(const char* fmt, A... args) {
  if (failed) return;
  failed = true;
  std::snprintf(error_text, sizeof error_text, fmt, args...);
}
inline const char* last_error() { return failed ? error_text : ""; }

inline void check_aligned(const void* p, unsigned bytes, const char* what) {
  if (reinterpret_cast<std::uintptr_t>(p) % bytes)
    fail("misaligned %u-byte %s at %p (thread %u,%u,%u of block %u,%u,%u)", bytes, what, p, threadIdx.x,
         threadIdx.y, threadIdx.z, blockIdx.x, blockIdx.y, blockIdx.z);
}

#if PKV_EMU_ASM_SWITCH
// Save the callee-saved state on this stack, store the stack pointer in *save and
// resume the fiber whose stack pointer is `next` (a stack made by fiber_stack or a
// previous switch). The clobbers make the compiler keep nothing in registers across
// it; rbp is saved by hand; 128 bytes are skipped first to keep the red zone intact.
inline void switch_to(void** save, void* next) {
  asm volatile(
      "leaq -128(%%rsp), %%rsp\n\t"
      "leaq 1f(%%rip), %%rax\n\t"
      "pushq %%rax\n\t"
      "pushq %%rbp\n\t"
      "movq %%rsp, (%%rdi)\n\t"
      "movq %%rsi, %%rsp\n\t"
      "popq %%rbp\n\t"
      "ret\n\t"
      "1:\n\t"
      "leaq 128(%%rsp), %%rsp\n\t"
      : "+D"(save), "+S"(next)
      :
      : "rax", "rbx", "rcx", "rdx", "r8", "r9", "r10", "r11", "r12", "r13", "r14", "r15", "memory",
        "cc", "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11",
        "xmm12", "xmm13", "xmm14", "xmm15");
}
#endif

enum FiberState { READY, AT_BARRIER, AT_WARP, DONE };

// A pending cp.async: copy n of size bytes from src (the rest zero-filled) at the wait.
struct Copy {
  unsigned char* dst;
  const unsigned char* src;
  unsigned size, n;
};

// One warp exchange in flight: what each lane offers and where its result goes.
struct Exchange {
  int kind = 0;    // 1 shuffle-xor, 2 shuffle-index, 3 ballot, 4 syncwarp
  int width = 0;   // 32-bit words per lane
  int arg[32];     // per lane: the xor mask, the source lane, or the predicate
  const unsigned* in[32];
  unsigned* out[32];
};

struct Fiber {
  void* sp = nullptr;  // saved stack pointer (asm switch)
  ucontext_t ctx;      // (ucontext switch)
  FiberState state = READY;
  pkv_emu_dim3 tid{0, 0, 0};
  std::vector<Copy> open;                 // cp.async issued since the last commit
  std::vector<std::vector<Copy>> groups;  // committed, oldest first
#if PKV_EMU_ASAN
  void* fake = nullptr;  // AddressSanitizer's fake stack while switched out
#endif
};

struct Cta {
  std::vector<Fiber> fibers;
  std::vector<Exchange> warps;
  void (*body)(void*) = nullptr;
  void* body_arg = nullptr;
  unsigned current = 0;
  void* sched_sp = nullptr;
  ucontext_t sched_ctx;
  unsigned char* stacks = nullptr;
  std::size_t stack_bytes = 0, stacks_len = 0;
#if PKV_EMU_ASAN
  void* sched_fake = nullptr;
  const void* sched_bottom = nullptr;  // the scheduler's stack, learnt by the first fiber
  std::size_t sched_size = 0;
#endif
};

inline thread_local Cta* cta = nullptr;  // the CTA being run on this host thread

inline void complete(Copy& c) {
  for (unsigned i = 0; i < c.size; ++i)
    if (c.dst[i] != 0xff) {
      fail("a cp.async destination %p was written before the wait that completes it", (void*)c.dst);
      break;
    }
  if (c.n) std::memcpy(c.dst, c.src, c.n);
  if (c.size > c.n) std::memset(c.dst + c.n, 0, c.size - c.n);
}

// Back to the scheduler (from a fiber).
inline void yield_fiber() {
  Fiber& f = cta->fibers[cta->current];
#if PKV_EMU_ASM_SWITCH
  switch_to(&f.sp, cta->sched_sp);
#else
#if PKV_EMU_ASAN  // a finished fiber leaves for good: its fake stack can go
  __sanitizer_start_switch_fiber(f.state == DONE ? nullptr : &f.fake, cta->sched_bottom, cta->sched_size);
#endif
  swapcontext(&f.ctx, &cta->sched_ctx);
#if PKV_EMU_ASAN
  __sanitizer_finish_switch_fiber(cta->fibers[cta->current].fake, nullptr, nullptr);
#endif
#endif
  threadIdx = f.tid;
}

inline void fiber_main() {
  Fiber& f = cta->fibers[cta->current];
  threadIdx = f.tid;
  cta->body(cta->body_arg);
  Fiber& g = cta->fibers[cta->current];
  for (auto& grp : g.groups)  // copies never waited for still land (as on a GPU)
    for (auto& c : grp) complete(c);
  for (auto& c : g.open) complete(c);
  g.groups.clear();
  g.open.clear();
  g.state = DONE;
  yield_fiber();
  __builtin_trap();  // a finished fiber is never resumed
}

#if PKV_EMU_ASM_SWITCH
[[noreturn]] inline void fiber_entry() {
  fiber_main();
  __builtin_unreachable();
}
#else
inline void fiber_entry_uc() {
#if PKV_EMU_ASAN
  __sanitizer_finish_switch_fiber(nullptr, &cta->sched_bottom, &cta->sched_size);
#endif
  fiber_main();
}
#endif

// ---- what the kernels call (warp.cuh maps the CUDA names here) ----------------------

inline void syncthreads() {
  cta->fibers[cta->current].state = AT_BARRIER;
  yield_fiber();
}

// Offer `width` words at `in`; get the named lane's words in `out` (in and out may alias).
inline void exchange(int kind, unsigned mask, int arg, const unsigned* in, unsigned* out, int width) {
  const unsigned t = cta->current, w = t / 32, lane = t % 32;
  const unsigned n = (unsigned)cta->fibers.size();
  const unsigned lanes = n - w * 32 < 32 ? n - w * 32 : 32;
  const unsigned full = lanes == 32 ? 0xffffffffu : ((1u << lanes) - 1u);
  if (mask != full) fail("warp exchange with mask %#x: the emulation takes whole warps (%#x)", mask, full);
  Exchange& x = cta->warps[w];
  bool first = true;
  for (unsigned l = 0; l < lanes; ++l)
    if (cta->fibers[w * 32 + l].state == AT_WARP) first = false;
  if (first) {
    x.kind = kind;
    x.width = width;
  } else if (x.kind != kind || x.width != width) {
    fail("warp %u: lanes met at different exchanges (kind %d width %d vs kind %d width %d)", w, x.kind, x.width,
         kind, width);
  }
  x.arg[lane] = arg;
  x.in[lane] = in;
  x.out[lane] = out;
  cta->fibers[t].state = AT_WARP;
  yield_fiber();
}

inline void cp_async(void* dst, const void* src, unsigned size, unsigned n) {
  check_aligned(dst, size, "cp.async destination");
  check_aligned(src, size, "cp.async source");
  std::memset(dst, 0xff, size);
  cta->fibers[cta->current].open.push_back(Copy{(unsigned char*)dst, (const unsigned char*)src, size, n});
}
inline void cp_commit() {
  Fiber& f = cta->fibers[cta->current];
  f.groups.push_back(std::move(f.open));
  f.open.clear();
}
// cp.async.wait_group n: complete all but the n most recent committed groups.
inline void cp_wait(unsigned n) {
  Fiber& f = cta->fibers[cta->current];
  while (f.groups.size() > n) {
    for (auto& c : f.groups.front()) complete(c);
    f.groups.erase(f.groups.begin());
  }
}

// ---- the scheduler -------------------------------------------------------------------

inline void resolve_warp(Cta& c, unsigned w, unsigned lanes) {
  Exchange& x = c.warps[w];
  unsigned tmp[32][128];
  if (x.width > 128) {
    fail("warp exchange of %d words: at most 128", x.width);
    x.width = 128;
  }
  unsigned ballot = 0;
  for (unsigned l = 0; l < lanes; ++l)
    if (x.arg[l]) ballot |= 1u << l;
  for (unsigned l = 0; l < lanes; ++l) {
    unsigned src = l;
    if (x.kind == 1) src = l ^ (unsigned)x.arg[l];
    if (x.kind == 2) src = (unsigned)x.arg[l] % 32;
    if (src >= lanes) src = l;  // outside the warp: the lane keeps its own value (as the hardware)
    if (x.kind == 3)
      for (int k = 0; k < x.width; ++k) tmp[l][k] = ballot;
    else if (x.kind != 4)
      std::memcpy(tmp[l], x.in[src], sizeof(unsigned) * x.width);
  }
  for (unsigned l = 0; l < lanes; ++l) {
    if (x.kind != 4) std::memcpy(x.out[l], tmp[l], sizeof(unsigned) * x.width);
    c.fibers[w * 32 + l].state = READY;
  }
}

inline void run_fiber(Cta& c, unsigned i) {
  c.current = i;
  Fiber& f = c.fibers[i];
#if PKV_EMU_ASM_SWITCH
  switch_to(&c.sched_sp, f.sp);
#else
#if PKV_EMU_ASAN
  __sanitizer_start_switch_fiber(&c.sched_fake, c.stacks + (std::size_t)i * c.stack_bytes, c.stack_bytes);
#endif
  swapcontext(&c.sched_ctx, &f.ctx);
#if PKV_EMU_ASAN
  __sanitizer_finish_switch_fiber(c.sched_fake, nullptr, nullptr);
#endif
#endif
}

inline void start_fiber(Cta& c, unsigned i) {
  Fiber& f = c.fibers[i];
  unsigned char* base = c.stacks + (std::size_t)i * c.stack_bytes;
#if PKV_EMU_ASM_SWITCH
  // [rbp = 0][return address = fiber_entry] near the top, placed so that fiber_entry
  // starts with rsp = 8 mod 16, as after a call
  auto* top = reinterpret_cast<void**>(base + c.stack_bytes - 72);
  top[0] = nullptr;
  top[1] = reinterpret_cast<void*>(&fiber_entry);
  top[2] = nullptr;
  f.sp = top;
#else
  getcontext(&f.ctx);
  f.ctx.uc_stack.ss_sp = base;
  f.ctx.uc_stack.ss_size = c.stack_bytes;
  f.ctx.uc_link = nullptr;
  makecontext(&f.ctx, fiber_entry_uc, 0);
#endif
}

// Run body(arg) as every thread of the current CTA (blockIdx, blockDim set); false on error.
inline void run_cta(void (*body)(void*), void* arg) {
  static thread_local Cta c;
  const unsigned n = blockDim.x * blockDim.y * blockDim.z;
  const std::size_t stack_bytes = std::size_t(1) << 18;
  if (c.stacks_len < n * stack_bytes) {
    if (c.stacks) munmap(c.stacks, c.stacks_len);
    c.stacks_len = n * stack_bytes;
    void* p = mmap(nullptr, c.stacks_len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) {
      c.stacks = nullptr;
      c.stacks_len = 0;
      fail("cannot map %u fiber stacks", n);
      return;
    }
    c.stacks = static_cast<unsigned char*>(p);
  }
  c.stack_bytes = stack_bytes;
  c.body = body;
  c.body_arg = arg;
  c.fibers.assign(n, Fiber{});
  c.warps.assign((n + 31) / 32, Exchange{});
  for (unsigned i = 0; i < n; ++i) {
    c.fibers[i].tid = pkv_emu_dim3{i % blockDim.x, (i / blockDim.x) % blockDim.y, i / (blockDim.x * blockDim.y)};
    start_fiber(c, i);
  }
  Cta* outer = cta;
  cta = &c;
  for (;;) {
    bool ran = false;
    for (unsigned i = 0; i < n; ++i)
      if (c.fibers[i].state == READY) {
        run_fiber(c, i);
        ran = true;
      }
    unsigned done = 0, barrier = 0;
    for (auto& f : c.fibers) {
      done += f.state == DONE;
      barrier += f.state == AT_BARRIER;
    }
    if (done == n) break;
    bool resolved = false;
    for (unsigned w = 0; w * 32 < n; ++w) {
      const unsigned lanes = n - w * 32 < 32 ? n - w * 32 : 32;
      unsigned waiting = 0, gone = 0;
      for (unsigned l = 0; l < lanes; ++l) {
        waiting += c.fibers[w * 32 + l].state == AT_WARP;
        gone += c.fibers[w * 32 + l].state == DONE;
      }
      if (waiting && waiting + gone == lanes) {
        if (gone) {  // the exchange can never complete: abandon the CTA
          fail("warp %u: %u lanes exited while the others wait at a warp exchange", w, gone);
          break;
        }
        resolve_warp(c, w, lanes);
        resolved = true;
      }
    }
    if (failed) break;
    if (!resolved && barrier && barrier + done == n) {
      for (auto& f : c.fibers)
        if (f.state == AT_BARRIER) f.state = READY;
      resolved = true;
    }
    if (!ran && !resolved) {
      fail("deadlock in block (%u,%u,%u): %u threads at a barrier, %u done, the rest at warp exchanges", blockIdx.x,
           blockIdx.y, blockIdx.z, barrier, done);
      break;  // the stuck fibers are abandoned with their stacks
    }
  }
  cta = outer;
  threadIdx = pkv_emu_dim3{0, 0, 0};
}

template <typename... A, std::size_t... I>
inline void call_packed(void (*kernel)(A...), void** argv, std::index_sequence<I...>) {
  kernel(*static_cast<A*>(argv[I])...);
}

template <typename... A>
struct Packed {
  void (*kernel)(A...);
  void** argv;
  static void run(void* p) {
    auto* self = static_cast<Packed*>(p);
    call_packed(self->kernel, self->argv, std::index_sequence_for<A...>{});
  }
};

// dims = {grid.x, grid.y, grid.z, block.x, block.y, block.z}; returns 0, or 1 on an error.
template <typename... A>
inline int launch_fibers(void (*kernel)(A...), const unsigned int* dims, void** argv) {
  failed = false;
  gridDim = pkv_emu_dim3{dims[0], dims[1], dims[2]};
  blockDim = pkv_emu_dim3{dims[3], dims[4], dims[5]};
  Packed<A...> packed{kernel, argv};
  for (unsigned bz = 0; bz < gridDim.z && !failed; ++bz)
    for (unsigned by = 0; by < gridDim.y && !failed; ++by)
      for (unsigned bx = 0; bx < gridDim.x && !failed; ++bx) {
        blockIdx = pkv_emu_dim3{bx, by, bz};
        run_cta(&Packed<A...>::run, &packed);
      }
  return failed ? 1 : 0;
}

}  // namespace pkv_emu
