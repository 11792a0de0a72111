// decode_attention.cu - paged decode attention at the memory limit: one query token per
// CTA row of work, the K/V rows streamed once through a cp.async ring.
//
// Semantics are paged_attention.cu's (its header states them: the keys a query sees,
// window and sinks, soft cap, rotation, every storage format, a bad table entry read
// as zeros); only the float32 arithmetic differs in order and rounding (FMA, exp2), and
// within the same stated error bound (tests/test_decode_attention.py).
//
// One variant per compile (pagedkv/kernels/decode_plans.py passes the defines):
//   PKV_DEC_F (storage format), PKV_DEC_D (head_dim), PKV_DEC_G (query heads per CTA,
//   dividing the GQA group), PKV_DEC_NGL (scale groups per lane: 1, 2 or 4),
//   PKV_DEC_LAYOUT (PKV_NHD / PKV_HND), PKV_DEC_NAME (the entry point's name).
// Entry points: PKV_DEC_NAME, and pkv_decode_merge_{f32,f16,bf16} for that head_dim.
//
// A CTA (4 warps) serves one work item (query token t, KV head, G of its query heads)
// and one split of the keys t sees. Its threads:
//   - load the G query rows once into registers, a lane holding E consecutive channels
//     of each (pkv_dec_lane_elems), rotated there with shuffles when the arena is;
//   - stage the split's block ids in shared memory once (PKV_DEC_PAGES at a time);
//   - per warp, stream tiles of KPW * KT keys (KPW keys side by side, D / E lanes each,
//     KT keys per lane) through a 3- or 4-deep cp.async ring in shared memory,
//     where every lane reads back only the bytes it copied: no barrier in the loop;
//   - score each key with FMAs against the codes (the scale and zero point of each
//     group are applied once per group: s * sum(q c) + z * sum(q)), reduce over the
//     key's lanes with shuffles, and keep the online softmax (in log2 units, pkv_exp2)
//     and the output accumulators in registers;
//   - at the end merge the key slots of a warp with shuffles and the 4 warps through
//     shared memory (the one barrier), and write the split's unnormalized output, max
//     and sum to the workspace, [splits, rows, D + 2] floats.
// pkv_decode_merge_* combines the splits of each row, normalizes, unrotates (warp
// shuffles) and converts to the output dtype.
#include "decode_attention.cuh"

template <int F, int D, int G, int NGL, int LAYOUT>
__device__ __forceinline__ void pkv_decode(
    const pkv_u8* __restrict__ kv, const float* __restrict__ scale, const float* __restrict__ zero,
    const float* __restrict__ signs, const void* __restrict__ q, int q_kind, float* __restrict__ part,
    const int* __restrict__ indptr, const int* __restrict__ indices, const int* __restrict__ seq_lens,
    const int* __restrict__ q_indptr, pkv_i64 batch, pkv_i64 num_entries, pkv_i64 num_blocks,
    pkv_i64 block_size, pkv_i64 num_kv_heads, pkv_i64 groups, pkv_i64 num_q_tokens, pkv_i64 num_q_heads,
    pkv_i64 q_stride0, pkv_i64 q_stride1, pkv_i64 num_splits, float sm_scale, float soft_cap, pkv_i64 window,
    pkv_i64 sink_tokens, pkv_i64 bs_mul, pkv_i64 bs_shift) {
  constexpr int BITS = pkv_dec_bits<F>();
  constexpr int E = pkv_dec_lane_elems<F, G>();
  constexpr int VB = F == PKV_Q_INT3 ? 12 : E * BITS / 8;  // bytes of a lane's vector
  constexpr int LPK = D / E, KPW = 32 / LPK;                // lanes per key, keys per warp
  constexpr int KT = NGL == 1 && G * E <= 16 ? 2 : 1;       // keys per lane per stage (registers)
  constexpr int STAGES = KT == 2 || NGL == 4 ? 3 : 4;       // ring depth (shared memory: under 48 KiB)
  constexpr int EPG = E / NGL;                              // channels per scale group of a lane
  constexpr bool QUANT = pkv_dec_quant<F>(), ZERO = pkv_dec_has_zero<F>();
  constexpr int NP = QUANT ? 2 * NGL : 1;                   // param floats per ring slot
  constexpr pkv_i64 RB = F == PKV_Q_INT3 ? D / 8 * 3 : (pkv_i64)D * BITS / 8;
  constexpr int SLOTS = PKV_DEC_WARPS * STAGES * KT * 2 * 32;
  // a warp's part of the ring, in 16-byte slots: its stages, or its state at the end if larger
  constexpr int WREG = STAGES * KT * 2 * 32 > (G * (D + 2) + 3) / 4 ? STAGES * KT * 2 * 32
                                                                            : (G * (D + 2) + 3) / 4;
  static_assert(D % E == 0 && LPK <= 32 && (LPK & (LPK - 1)) == 0, "a key's lanes: a power of two <= 32");
  static_assert(E % NGL == 0 && G * E <= PKV_DEC_QREGS, "lane geometry");
  __shared__ uint4 ring[PKV_DEC_WARPS * WREG];  // [warp][stage][key][K/V][lane] 16-byte slots
  __shared__ float ring_par[QUANT ? SLOTS * NP : 1];  // the same slots' scale/zero per group
  __shared__ int pages[PKV_DEC_PAGES];     // staged block ids (-1: reads as zeros)

  if (blockDim.x != PKV_DEC_THREADS || blockDim.y != 1 || blockDim.z != 1) return;  // not a planned launch
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, slot = lane / LPK, sub = lane % LPK;
  const pkv_i64 group = num_q_heads / num_kv_heads, chunks = group / G;
  const pkv_i64 works = num_q_tokens * num_kv_heads * chunks, rows = num_q_tokens * num_q_heads;
  const pkv_i64 g_len = pkv_div(D, groups);
  const float neg_inf = __uint_as_float(0xff800000u);
  // logits in log2 units: s * log2(e), folded into the scale (or the soft cap)
  const float log2e = 1.4426950408889634f;
  const float s2 = __fmul_rn(sm_scale, log2e), cap2 = __fmul_rn(soft_cap, log2e);
  float* wstate = reinterpret_cast<float*>(ring + warp * WREG);  // the warp's ring part

  for (pkv_i64 w = blockIdx.y; w < works; w += gridDim.y) {
    for (pkv_i64 split = blockIdx.x; split < num_splits; split += gridDim.x) {
      const pkv_i64 t = pkv_div(w, num_kv_heads * chunks);
      const pkv_i64 hk = pkv_div(w - t * num_kv_heads * chunks, chunks);
      const pkv_i64 chunk = w - (t * num_kv_heads + hk) * chunks;
      const pkv_i64 head0 = hk * group + chunk * G;
      // the token's sequence b and position p; span 0 when the tables cannot place it
      pkv_i64 b = 0, p = -1, len = 0;
      if (batch > 0 && q_indptr[0] <= t) {
        pkv_i64 lo = 0, hi = batch;  // the last b with q_indptr[b] <= t
        while (lo < hi) {
          const pkv_i64 mid = lo + (hi - lo + 1) / 2;
          if ((pkv_i64)q_indptr[mid] <= t) lo = mid; else hi = mid - 1;
        }
        b = lo;
        if (b < batch && t < q_indptr[b + 1]) {
          len = seq_lens[b];
          p = len - ((pkv_i64)q_indptr[b + 1] - q_indptr[b]) + (t - q_indptr[b]);
        }
      }
      const pkv_i64 hi = p < 0 ? 0 : (p + 1 < len ? p + 1 : len);
      pkv_i64 ns = 0, w_lo = 0;
      if (window > 0) {
        ns = sink_tokens < hi ? sink_tokens : hi;
        w_lo = p - window + 1 > ns ? p - window + 1 : ns;
      }
      const pkv_i64 span = p < 0 ? 0 : ns + (hi > w_lo ? hi - w_lo : 0);
      const pkv_i64 per = (span + num_splits - 1) / num_splits;
      const pkv_i64 k_begin = split * per < span ? split * per : span;
      const pkv_i64 k_end = k_begin + per < span ? k_begin + per : span;

      // the query rows, rotated when the arena is: q[g][e] is channel sub * E + e of head head0 + g
      float qv[G * E];
PKV_UNROLL
      for (int g = 0; g < G; ++g) {
PKV_UNROLL
        for (int e = 0; e < E; ++e) {
          float x = 0.0f;
          if (p >= 0 && t < num_q_tokens) {
            const pkv_i64 i = t * q_stride0 + (head0 + g) * q_stride1 + sub * E + e;
            if (q_kind == PKV_QK_F32) x = ((const float*)q)[i];
            else if (q_kind == PKV_QK_F16) x = pkv_dec_f16(((const pkv_u16*)q)[i]);
            else x = __uint_as_float((pkv_u32)((const pkv_u16*)q)[i] << 16);
          }
          qv[g * E + e] = signs ? __fmul_rn(x, signs[sub * E + e]) : x;
        }
      }
      if (signs) {  // rotate(q) = H(signs * q): butterflies in registers, then across lanes
PKV_UNROLL
        for (int h = 1; h < E; h *= 2) {
PKV_UNROLL
          for (int g = 0; g < G; ++g)
PKV_UNROLL
            for (int e = 0; e < E; ++e)
              if (!(e & h)) {
                const float a = qv[g * E + e], c = qv[g * E + e + h];
                qv[g * E + e] = __fadd_rn(a, c);
                qv[g * E + e + h] = __fsub_rn(a, c);
              }
        }
        for (int h = 1; h < LPK; h *= 2) {
          float o[G * E];
          pkv_shfl_xor_n<G * E>(qv, o, h);
          const bool upper = (sub & h) != 0;
PKV_UNROLL
          for (int i = 0; i < G * E; ++i) qv[i] = upper ? __fsub_rn(o[i], qv[i]) : __fadd_rn(qv[i], o[i]);
        }
        const float hs = pkv_hadamard_scale(pkv_top_bit(D));
PKV_UNROLL
        for (int i = 0; i < G * E; ++i) qv[i] = __fmul_rn(qv[i], hs);
      }
      // sum of q over each of the lane's scale groups (the zero point's factor)
      float qsum[G * NGL];
PKV_UNROLL
      for (int g = 0; g < G; ++g)
PKV_UNROLL
        for (int j = 0; j < NGL; ++j) {
          float s = 0.0f;
PKV_UNROLL
          for (int e = 0; e < EPG; ++e) s = __fadd_rn(s, qv[g * E + j * EPG + e]);
          qsum[g * NGL + j] = s;
        }

      float m[G], l[G], acc[G * E], zacc[G * NGL];
PKV_UNROLL
      for (int g = 0; g < G; ++g) {
        m[g] = neg_inf;
        l[g] = 0.0f;
PKV_UNROLL
        for (int j = 0; j < NGL; ++j) zacc[g * NGL + j] = 0.0f;
      }
PKV_UNROLL
      for (int i = 0; i < G * E; ++i) acc[i] = 0.0f;

      // the scale group of the lane's first channel (NGL > 1: g_len == EPG)
      const pkv_i64 grp0 = NGL > 1 ? (pkv_i64)sub * NGL : pkv_div((pkv_i64)sub * E, g_len);
      const pkv_i64 ck = (PKV_DEC_PAGES - 4) * block_size;  // keys per staged chunk
      for (pkv_i64 c0 = k_begin; c0 < k_end; c0 += ck) {
        const pkv_i64 c1 = c0 + ck < k_end ? c0 + ck : k_end;
        // the chunk's entries: the sinks' [ea0, ea1), then the window's [eb0, eb1)
        pkv_i64 ea0 = 0, ea1 = 0, eb0 = 0, eb1 = 0;
        if (c0 < ns) {
          ea0 = pkv_div(c0, block_size);
          ea1 = pkv_div((c1 < ns ? c1 : ns) - 1, block_size) + 1;
        }
        if (c1 > ns) {
          eb0 = pkv_div(w_lo + (c0 > ns ? c0 : ns) - ns, block_size);
          eb1 = pkv_div(w_lo + c1 - 1 - ns, block_size) + 1;
        }
        const pkv_i64 na = ea1 - ea0;
        if (c0 != k_begin) __syncthreads();  // every warp is done with the previous chunk's ids
        for (pkv_i64 i = tid; i < na + eb1 - eb0; i += PKV_DEC_THREADS) {
          const pkv_i64 e = i < na ? ea0 + i : eb0 + i - na;
          const pkv_i64 entry = (pkv_i64)indptr[b] + e;
          int blk = -1;
          if (entry >= indptr[b] && entry < indptr[b + 1] && entry >= 0 && entry < num_entries) {
            blk = indices[entry];
            if (blk < 0 || blk >= num_blocks) blk = -1;
          }
          pages[i] = blk;
        }
        __syncthreads();

        const pkv_i64 kps = KPW * KT;  // keys per warp tile
        const pkv_i64 tiles = (c1 - c0 + kps - 1) / kps;
        const int nst = tiles > warp ? (int)((tiles - warp + PKV_DEC_WARPS - 1) / PKV_DEC_WARPS) : 0;
        pkv_u32 parity = 0;  // int3: which half of each staged 4-byte word is the bfloat16 parameter

        auto issue = [&](int it) {
          const int st = (int)(it % STAGES);
          const pkv_i64 base = c0 + (warp + it * PKV_DEC_WARPS) * kps;
PKV_UNROLL
          for (int i = 0; i < KT; ++i) {
            const pkv_i64 key = base + i * KPW + slot;
            pkv_i64 blk = -1, off = 0;
            if (key < c1) {
              const pkv_i64 pos = key < ns ? key : w_lo + key - ns;
              const pkv_i64 e = pkv_fastdiv(pos, block_size, bs_mul, bs_shift);
              blk = pages[key < ns ? e - ea0 : na + e - eb0];
              off = pos - e * block_size;
            }
PKV_UNROLL
            for (int kvp = 0; kvp < 2; ++kvp) {
              const int si = (((warp * STAGES + st) * KT + i) * 2 + kvp) * 32 + lane;  // params
              const int ri = warp * WREG + ((st * KT + i) * 2 + kvp) * 32 + lane;            // data
              const pkv_i64 row = blk < 0 ? 0 : pkv_row_index<LAYOUT>(blk, kvp, off, hk, block_size, num_kv_heads);
              const pkv_u8* src = kv + row * RB + sub * VB;
              const unsigned n = blk < 0 ? 0u : 4u;
              if constexpr (VB == 12) {
                pkv_cp_async<4>((char*)&ring[ri], src, n);
                pkv_cp_async<4>((char*)&ring[ri] + 4, src + 4, n);
                pkv_cp_async<4>((char*)&ring[ri] + 8, src + 8, n);
              } else {
                pkv_cp_async<VB>(&ring[ri], src, n * (VB / 4));
              }
              if constexpr (QUANT) {
PKV_UNROLL
                for (int j = 0; j < NGL; ++j) {
                  const pkv_i64 pi = row * groups + grp0 + j;
                  float* dst = &ring_par[si * NP + 2 * j];
                  if (F == PKV_Q_INT3) {  // bfloat16 parameters: the aligned word holding each
                    const char* sp = (const char*)scale + pi * 2;
                    const char* zp = (const char*)zero + pi * 2;
                    pkv_cp_async<4>(dst, (const void*)((size_t)sp & ~(size_t)3), n);
                    pkv_cp_async<4>(dst + 1, (const void*)((size_t)zp & ~(size_t)3), n);
                    const pkv_u32 bit = ((st * KT + i) * 2 + kvp) * NGL + j;  // < 32: STAGES * KT * 2 * NGL <= 32
                    parity = (parity & ~(1u << bit)) | ((pkv_u32)(((size_t)sp >> 1) & 1) << bit);
                  } else {
                    pkv_cp_async<4>(dst, scale + pi, n);
                    if (ZERO) pkv_cp_async<4>(dst + 1, zero + pi, n);
                  }
                }
              }
            }
          }
        };
        auto param = [&](int si, int j, int which, pkv_u32 bit) -> float {
          const float x = ring_par[si * NP + 2 * j + which];
          if (F != PKV_Q_INT3) return x;
          const pkv_u32 u = __float_as_uint(x);
          return __uint_as_float(((parity >> bit) & 1) ? (u & 0xffff0000u) : (u << 16));
        };

PKV_UNROLL_NONE
        for (int s = 0; s < STAGES - 1; ++s) {
          if (s < nst) issue(s);
          pkv_cp_commit();
        }
PKV_UNROLL_NONE
        for (int it = 0; it < nst; ++it) {
          if (it + STAGES - 1 < nst) issue(it + STAGES - 1);
          pkv_cp_commit();
          pkv_cp_wait<STAGES - 1>();  // this stage's copies (the newer ones may still fly)
          const int st = (int)(it % STAGES);
          const pkv_i64 base = c0 + (warp + it * PKV_DEC_WARPS) * kps;
          // 1. the keys' partial dot products over this lane's channels
          float dots[KT * G];
PKV_UNROLL
          for (int i = 0; i < KT; ++i) {
            const int si = (((warp * STAGES + st) * KT + i) * 2 + 0) * 32 + lane;
            const int ri = warp * WREG + ((st * KT + i) * 2 + 0) * 32 + lane;
            pkv_u32 wk[4];
            if (VB == 16 || VB == 12) {
              const uint4 v = pkv_ld16(&ring[ri]);
              wk[0] = v.x, wk[1] = v.y, wk[2] = v.z, wk[3] = v.w;
            } else if (VB == 8) {
              const uint2 v = pkv_ld8(&ring[ri]);
              wk[0] = v.x, wk[1] = v.y, wk[2] = wk[3] = 0u;
            } else {
              wk[0] = *(const pkv_u32*)&ring[ri], wk[1] = wk[2] = wk[3] = 0u;
            }
            float kx[E];
PKV_UNROLL
            for (int e = 0; e < E; ++e) kx[e] = pkv_dec_elem<F>(wk, e);
PKV_UNROLL
            for (int g = 0; g < G; ++g) {
              float part_dot = 0.0f;
PKV_UNROLL
              for (int j = 0; j < NGL; ++j) {
                float d = 0.0f;
PKV_UNROLL
                for (int e = 0; e < EPG; ++e) d = pkv_fma(qv[g * E + j * EPG + e], kx[j * EPG + e], d);
                if (QUANT) {
                  const pkv_u32 bit = ((st * KT + i) * 2 + 0) * NGL + j;
                  const float ks = param(si, j, 0, bit);
                  d = ZERO ? pkv_fma(ks, d, __fmul_rn(param(si, j, 1, bit), qsum[g * NGL + j])) : __fmul_rn(ks, d);
                }
                part_dot = __fadd_rn(part_dot, d);
              }
              dots[i * G + g] = part_dot;
            }
          }
          // 2. over the key's lanes (every lane of the key gets the same sum)
          pkv_warp_sum<KT * G>(dots, 1, LPK);
          // 3. logits (log2 units) and the online softmax
          float pr[KT * G];
PKV_UNROLL
          for (int i = 0; i < KT; ++i) {
            const bool valid = base + i * KPW + slot < c1;
PKV_UNROLL
            for (int g = 0; g < G; ++g) {
              float s = neg_inf;
              if (valid) {
                s = soft_cap > 0.0f
                        ? __fmul_rn(cap2, pkv_tanh(__fdiv_rn(__fmul_rn(dots[i * G + g], sm_scale), soft_cap)))
                        : __fmul_rn(dots[i * G + g], s2);
              }
              pr[i * G + g] = s;
            }
          }
PKV_UNROLL
          for (int g = 0; g < G; ++g) {
            float mx = m[g];
PKV_UNROLL
            for (int i = 0; i < KT; ++i) mx = pkv_max_nan(mx, pr[i * G + g]);
            const bool none = mx == neg_inf;  // nothing seen yet: leave the state as it is
            const float alpha = none ? 1.0f : pkv_exp2(__fsub_rn(m[g], mx));
            float sum = 0.0f;
PKV_UNROLL
            for (int i = 0; i < KT; ++i) {
              const float pi = none ? 0.0f : pkv_exp2(__fsub_rn(pr[i * G + g], mx));
              pr[i * G + g] = pi;
              sum = __fadd_rn(sum, pi);
            }
            l[g] = pkv_fma(l[g], alpha, sum);
            m[g] = none ? m[g] : mx;
PKV_UNROLL
            for (int e = 0; e < E; ++e) acc[g * E + e] = __fmul_rn(acc[g * E + e], alpha);
PKV_UNROLL
            for (int j = 0; j < NGL; ++j) zacc[g * NGL + j] = __fmul_rn(zacc[g * NGL + j], alpha);
          }
          // 4. the values: acc += (p * scale) * code per group, zacc += p * zero
PKV_UNROLL
          for (int i = 0; i < KT; ++i) {
            const int si = (((warp * STAGES + st) * KT + i) * 2 + 1) * 32 + lane;
            const int ri = warp * WREG + ((st * KT + i) * 2 + 1) * 32 + lane;
            pkv_u32 wv[4];
            if (VB == 16 || VB == 12) {
              const uint4 v = pkv_ld16(&ring[ri]);
              wv[0] = v.x, wv[1] = v.y, wv[2] = v.z, wv[3] = v.w;
            } else if (VB == 8) {
              const uint2 v = pkv_ld8(&ring[ri]);
              wv[0] = v.x, wv[1] = v.y, wv[2] = wv[3] = 0u;
            } else {
              wv[0] = *(const pkv_u32*)&ring[ri], wv[1] = wv[2] = wv[3] = 0u;
            }
            float vx[E];
PKV_UNROLL
            for (int e = 0; e < E; ++e) vx[e] = pkv_dec_elem<F>(wv, e);
PKV_UNROLL
            for (int j = 0; j < NGL; ++j) {
              const pkv_u32 bit = ((st * KT + i) * 2 + 1) * NGL + j;
              const float vs = QUANT ? param(si, j, 0, bit) : 1.0f;
              const float vz = ZERO ? param(si, j, 1, bit) : 0.0f;
PKV_UNROLL
              for (int g = 0; g < G; ++g) {
                const float pw = pr[i * G + g];
                const float ps = QUANT ? __fmul_rn(pw, vs) : pw;
PKV_UNROLL
                for (int e = 0; e < EPG; ++e)
                  acc[g * E + j * EPG + e] = pkv_fma(ps, vx[j * EPG + e], acc[g * E + j * EPG + e]);
                if (ZERO) zacc[g * NGL + j] = pkv_fma(pw, vz, zacc[g * NGL + j]);
              }
            }
          }
        }
        pkv_cp_wait<0>();
      }

      // epilogue: the zero points' share, then the warp's key slots merged with shuffles
PKV_UNROLL
      for (int g = 0; g < G; ++g)
PKV_UNROLL
        for (int e = 0; e < E; ++e) acc[g * E + e] = __fadd_rn(acc[g * E + e], zacc[g * NGL + e / EPG]);
      float mm[G];
PKV_UNROLL
      for (int g = 0; g < G; ++g) mm[g] = m[g];
      pkv_warp_max<G>(mm, LPK, 32);
      float st[G * E + G];
PKV_UNROLL
      for (int g = 0; g < G; ++g) {
        const float f = m[g] == neg_inf ? 0.0f : pkv_exp2(__fsub_rn(m[g], mm[g]));
PKV_UNROLL
        for (int e = 0; e < E; ++e) st[g * E + e] = __fmul_rn(acc[g * E + e], f);
        st[G * E + g] = __fmul_rn(l[g], f);
      }
      pkv_warp_sum<G * E + G>(st, LPK, 32);
      pkv_syncwarp();  // every lane is done reading the ring (with one key per warp, no shuffle above says so)
      if (slot == 0) {  // the warp's state, [G][D + 2], in its own part of the ring (its copies are done)
PKV_UNROLL
        for (int g = 0; g < G; ++g) {
PKV_UNROLL
          for (int e = 0; e < E; ++e) wstate[g * (D + 2) + sub * E + e] = st[g * E + e];
          if (sub == 0) {
            wstate[g * (D + 2) + D] = mm[g];
            wstate[g * (D + 2) + D + 1] = st[G * E + g];
          }
        }
      }
      __syncthreads();
      // the 4 warps, in order, into this split's partial rows
      const float* ws0 = reinterpret_cast<const float*>(ring);
      const pkv_i64 wstride = WREG * 4;
      for (int idx = tid; idx < G * D; idx += PKV_DEC_THREADS) {
        const int g = idx / D, d = idx - g * D;
        float mx = neg_inf;
        for (int k = 0; k < PKV_DEC_WARPS; ++k) mx = pkv_max_nan(mx, ws0[k * wstride + g * (D + 2) + D]);
        float o = 0.0f, lsum = 0.0f;
        for (int k = 0; k < PKV_DEC_WARPS; ++k) {
          const float* s = ws0 + k * wstride + g * (D + 2);
          const float f = s[D] == neg_inf ? 0.0f : pkv_exp2(__fsub_rn(s[D], mx));
          o = pkv_fma(s[d], f, o);
          lsum = pkv_fma(s[D + 1], f, lsum);
        }
        if (t < num_q_tokens) {
          float* out = part + ((split * rows) + t * num_q_heads + head0 + g) * (D + 2);
          out[d] = o;
          if (d == 0) {
            out[D] = mx;
            out[D + 1] = lsum;
          }
        }
      }
      const bool more = split + gridDim.x < num_splits || w + gridDim.y < works;
      if (more) __syncthreads();  // the next item's copies go where this one's state was read
    }
  }
}

// Combine the splits of each (token, head) row (a warp per row, D / 32 channels a lane):
// M = max m_s, o = sum acc_s 2^(m_s - M) / sum l_s 2^(m_s - M), unrotated (butterflies
// across the lanes), in the output dtype.
template <int D, typename O>
__device__ __forceinline__ void pkv_decode_merge(const float* __restrict__ part, const float* __restrict__ signs,
                                                 O* __restrict__ out, pkv_i64 rows, pkv_i64 num_splits) {
  constexpr int EPL = D / 32;
  static_assert(D % 32 == 0, "a whole number of channels per lane");
  if (blockDim.x % 32 || blockDim.y != 1 || blockDim.z != 1) return;  // whole warps only
  const int lane = threadIdx.x % 32;
  const float neg_inf = __uint_as_float(0xff800000u);
  const pkv_i64 cta = (pkv_i64)blockIdx.y * gridDim.x + blockIdx.x;
  const pkv_i64 warps = (pkv_i64)gridDim.x * gridDim.y * (blockDim.x / 32);
  for (pkv_i64 r = cta * (blockDim.x / 32) + threadIdx.x / 32; r < rows; r += warps) {
    float mx = neg_inf;
    for (pkv_i64 s = 0; s < num_splits; ++s) mx = pkv_max_nan(mx, part[(s * rows + r) * (D + 2) + D]);
    float x[EPL], lsum = 0.0f;
PKV_UNROLL
    for (int e = 0; e < EPL; ++e) x[e] = 0.0f;
    for (pkv_i64 s = 0; s < num_splits; ++s) {
      const float* ps = part + (s * rows + r) * (D + 2);
      const float f = ps[D] == neg_inf ? 0.0f : pkv_exp2(__fsub_rn(ps[D], mx));
      lsum = pkv_fma(ps[D + 1], f, lsum);
PKV_UNROLL
      for (int e = 0; e < EPL; ++e) x[e] = pkv_fma(ps[lane * EPL + e], f, x[e]);
    }
PKV_UNROLL
    for (int e = 0; e < EPL; ++e) x[e] = lsum != 0.0f ? __fdiv_rn(x[e], lsum) : 0.0f;  // a NaN row stays NaN
    if (signs) {  // unrotate(y) = signs * H(y)
PKV_UNROLL
      for (int h = 1; h < EPL; h *= 2)
PKV_UNROLL
        for (int e = 0; e < EPL; ++e)
          if (!(e & h)) {
            const float a = x[e], c = x[e + h];
            x[e] = __fadd_rn(a, c);
            x[e + h] = __fsub_rn(a, c);
          }
      for (int h = 1; h < 32; h *= 2) {
        float o[EPL];
        pkv_shfl_xor_n<EPL>(x, o, h);
        const bool upper = (lane & h) != 0;
PKV_UNROLL
        for (int e = 0; e < EPL; ++e) x[e] = upper ? __fsub_rn(o[e], x[e]) : __fadd_rn(x[e], o[e]);
      }
      const float hs = pkv_hadamard_scale(pkv_top_bit(D));
PKV_UNROLL
      for (int e = 0; e < EPL; ++e) x[e] = __fmul_rn(__fmul_rn(x[e], hs), signs[lane * EPL + e]);
    }
PKV_UNROLL
    for (int e = 0; e < EPL; ++e) out[r * D + lane * EPL + e] = pkv_dtype<O>::from_f32(x[e]);
  }
}

#if defined(PKV_DEC_F) && defined(PKV_DEC_NAME)
extern "C" __global__ void __launch_bounds__(PKV_DEC_THREADS, PKV_DEC_MIN_CTAS) PKV_DEC_NAME(
    const pkv_u8* __restrict__ kv, const float* __restrict__ scale, const float* __restrict__ zero,
    const float* __restrict__ signs, const void* __restrict__ q, int q_kind, float* __restrict__ part,
    const int* __restrict__ indptr, const int* __restrict__ indices, const int* __restrict__ seq_lens,
    const int* __restrict__ q_indptr, pkv_i64 batch, pkv_i64 num_entries, pkv_i64 num_blocks,
    pkv_i64 block_size, pkv_i64 num_kv_heads, pkv_i64 groups, pkv_i64 num_q_tokens, pkv_i64 num_q_heads,
    pkv_i64 q_stride0, pkv_i64 q_stride1, pkv_i64 num_splits, float sm_scale, float soft_cap, pkv_i64 window,
    pkv_i64 sink_tokens, pkv_i64 bs_mul, pkv_i64 bs_shift) {
  pkv_decode<PKV_DEC_F, PKV_DEC_D, PKV_DEC_G, PKV_DEC_NGL, PKV_DEC_LAYOUT>(
      kv, scale, zero, signs, q, q_kind, part, indptr, indices, seq_lens, q_indptr, batch, num_entries, num_blocks,
      block_size, num_kv_heads, groups, num_q_tokens, num_q_heads, q_stride0, q_stride1, num_splits, sm_scale,
      soft_cap, window, sink_tokens, bs_mul, bs_shift);
}
#endif

#ifdef PKV_DEC_D
#define PKV_DEC_MERGE(NAME, O)                                                                           \
  extern "C" __global__ void NAME(const float* __restrict__ part, const float* __restrict__ signs,       \
                                  O* __restrict__ out, pkv_i64 rows, pkv_i64 num_splits) {               \
    pkv_decode_merge<PKV_DEC_D, O>(part, signs, out, rows, num_splits);                                  \
  }
PKV_DEC_MERGE(pkv_decode_merge_f32, float)
PKV_DEC_MERGE(pkv_decode_merge_f16, pkv_f16)
PKV_DEC_MERGE(pkv_decode_merge_bf16, pkv_bf16)
#endif
