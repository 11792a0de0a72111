// convert_layout.cu - NHD <-> HND: swap the two middle dims of
// [planes, A, B, row] into [planes, B, A, row].
//
// Data arenas: planes = (L *) NB * 2, (A, B) = (bs, H) for NHD -> HND and
// (H, bs) for HND -> NHD, row = head_dim elements. Scale/zero arenas are the
// same transpose with a row of one float. Rows (y) walk the destination's
// (plane, b) rows, columns (x) its A * row_chunks chunks, so writes coalesce.
//
// Entry points: pkv_transpose_{v16,e4,e2,e1}.
#include "common.cuh"

template <typename C>
__device__ __forceinline__ void pkv_transpose(const C* __restrict__ src, C* __restrict__ dst,
                                              pkv_i64 planes, pkv_i64 a_len, pkv_i64 b_len,
                                              pkv_i64 row_chunks) {
  const pkv_i64 rows = planes * b_len;
  const pkv_i64 cols = a_len * row_chunks;
  for (pkv_i64 r = pkv_row_begin(); r < rows; r += pkv_row_step()) {
    const pkv_i64 plane = pkv_div(r, b_len);
    const pkv_i64 b = r - plane * b_len;
    for (pkv_i64 i = pkv_col_begin(); i < cols; i += pkv_col_step()) {
      const pkv_i64 a = pkv_div(i, row_chunks);
      const pkv_i64 c = i - a * row_chunks;
      dst[r * cols + i] = src[((plane * a_len + a) * b_len + b) * row_chunks + c];
    }
  }
}

#define PKV_TRANSPOSE(NAME, C)                                                             \
  extern "C" __global__ void NAME(const C* __restrict__ src, C* __restrict__ dst,          \
                                  pkv_i64 planes, pkv_i64 a_len, pkv_i64 b_len,            \
                                  pkv_i64 row_chunks) {                                    \
    pkv_transpose<C>(src, dst, planes, a_len, b_len, row_chunks);                          \
  }

PKV_TRANSPOSE(pkv_transpose_v16, pkv_v16)
PKV_TRANSPOSE(pkv_transpose_e4, pkv_e4)
PKV_TRANSPOSE(pkv_transpose_e2, pkv_e2)
PKV_TRANSPOSE(pkv_transpose_e1, pkv_e1)
