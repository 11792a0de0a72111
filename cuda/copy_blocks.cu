// copy_blocks.cu - copy whole blocks between two all-layer arenas, across all
// layers, in one launch per arena (data, scale or zero).
//
// The same kernels serve copy_blocks (src and dst are the same arena) and
// swap_blocks (a device arena and a pinned host arena, which the GPU reads or
// writes in place through unified addressing): one launch moves any number of
// blocks of every layer with no per-copy host call, and no staging buffer.
//
// An arena is [num_layers, num_blocks, <block>] with a block of block_chunks
// chunks. Rows (y) are (layer, pair) items, columns (x) the chunks of one block.
// A pair with a block id out of range is skipped (the launcher validates host
// pairs; device pairs are not read on the host).
//
// Entry points: pkv_copy_blocks_{v16,e4,e2,e1}_{i32,i64} (chunk, pair dtype).
#include "common.cuh"

template <typename C, typename I>
__device__ __forceinline__ void pkv_copy_blocks(const C* __restrict__ src, C* __restrict__ dst,
                                                const I* __restrict__ pairs, pkv_i64 num_pairs,
                                                pkv_i64 num_layers, pkv_i64 block_chunks,
                                                pkv_i64 src_blocks, pkv_i64 dst_blocks) {
  const pkv_i64 rows = num_pairs * num_layers;
  for (pkv_i64 r = pkv_row_begin(); r < rows; r += pkv_row_step()) {
    const pkv_i64 layer = pkv_div(r, num_pairs);
    const pkv_i64 p = r - layer * num_pairs;
    const pkv_i64 s = pairs[2 * p];
    const pkv_i64 d = pairs[2 * p + 1];
    if (s < 0 || s >= src_blocks || d < 0 || d >= dst_blocks) continue;
    const C* from = src + (layer * src_blocks + s) * block_chunks;
    C* to = dst + (layer * dst_blocks + d) * block_chunks;
    for (pkv_i64 i = pkv_col_begin(); i < block_chunks; i += pkv_col_step()) to[i] = from[i];
  }
}

#define PKV_COPY_BLOCKS(NAME, C, I)                                                          \
  extern "C" __global__ void NAME(const C* __restrict__ src, C* __restrict__ dst,            \
                                  const I* __restrict__ pairs, pkv_i64 num_pairs,            \
                                  pkv_i64 num_layers, pkv_i64 block_chunks,                  \
                                  pkv_i64 src_blocks, pkv_i64 dst_blocks) {                  \
    pkv_copy_blocks<C, I>(src, dst, pairs, num_pairs, num_layers, block_chunks, src_blocks,  \
                          dst_blocks);                                                       \
  }

#define PKV_COPY_BLOCKS_CHUNK(CN, C)                          \
  PKV_COPY_BLOCKS(pkv_copy_blocks_##CN##_i32, C, int)         \
  PKV_COPY_BLOCKS(pkv_copy_blocks_##CN##_i64, C, pkv_i64)

PKV_COPY_BLOCKS_CHUNK(v16, pkv_v16)
PKV_COPY_BLOCKS_CHUNK(e4, pkv_e4)
PKV_COPY_BLOCKS_CHUNK(e2, pkv_e2)
PKV_COPY_BLOCKS_CHUNK(e1, pkv_e1)
