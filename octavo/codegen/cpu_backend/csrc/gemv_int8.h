// The w8 GEMV with scaled group sums: for each of up to 8 rows m of x and each weight row n,
//   out[m, n] = sum over groups g of  scales[n, g] * (sum over k in g of x[m, k] * float(q[n, k]))  (+ bias[n]),
// every product, partial sum and scaling rounded to float32 (the summation order is the kernel's own). The scale
// multiplies a group's sum once instead of every weight: per-row scales (one group) cost one multiplication a row,
// and the loop over the int8 bytes is widen, convert, fused multiply-add.
#pragma once

#include "vec_utils.h"

namespace octavo_cpu {

// A quantized weight's scales or offsets as the artifact stores them (float32, float16 or bfloat16, contiguous),
// each read as float32 where it is used (exact): widening a whole table into a float32 copy at every call cost the
// 4-bit weights' 18 values a row of 32 columns a tenth of a decode step.
struct Parameters {
  enum class Type : uint8_t { kFloat, kHalf, kBFloat16 };
  const void* data;
  Type type;

  float operator[](int64_t i) const {
    switch (type) {
      case Type::kHalf:
        return static_cast<float>(static_cast<const c10::Half*>(data)[i]);
      case Type::kBFloat16:
        return static_cast<float>(static_cast<const c10::BFloat16*>(data)[i]);
      default:
        return static_cast<const float*>(data)[i];
    }
  }
  const void* address(int64_t i) const {
    return static_cast<const char*>(data) + i * (type == Type::kFloat ? 4 : 2);
  }
};

// The int8 weight [N, K] and its scales [N, groups], groups of group_size columns (the last may be short).
struct Int8Matrix {
  const int8_t* q;
  Parameters scales;
  int64_t N, K, group_size, groups;
};

// Weight bytes a GEMV task reads at least: a small layer runs on one thread, not paying for the others' wake-up.
constexpr int64_t kGemvTaskBytes = 64 * 1024;
constexpr int64_t kPrefetchBytes = 4096;  // how far ahead of the rows being summed the weights are asked for

// part[r][m][c] += x[m, column:column+kLanes] * float(q[n + r, column:column+kLanes]) (rows of W from `rows`).
template <int M, int R, int C>
__attribute__((always_inline)) inline void sum_vector(const int8_t* rows, const float* x, int64_t K, int64_t column,
                                                      int c, Vec (&part)[R][M][C]) {
  Vec wide[R];
  for (int r = 0; r < R; ++r) wide[r] = load_widened(rows + r * K + column);
  for (int m = 0; m < M; ++m) {
    const Vec xv = Vec::loadu(x + m * K + column);
    for (int r = 0; r < R; ++r) part[r][m][c] = at::vec::fmadd(xv, wide[r], part[r][m][c]);
  }
}

// sum_vector over `count` vectors from column k, dealt to the C chains in turn (independent chains hide the
// latency of the fused multiply-add); every chain index is a constant, so the chains stay in registers. VG > 0:
// count is VG (a loop of fixed length).
template <int M, int R, int C, int VG>
__attribute__((always_inline)) inline void sum_vectors(const Int8Matrix& w, const float* x, int64_t n, int64_t k,
                                                       int64_t count, Vec (&part)[R][M][C]) {
  const int64_t K = w.K;
  const int8_t* rows = w.q + n * K;
  const int64_t vectors = VG > 0 ? VG : count;
  int64_t v = 0;
  for (; v + C <= vectors; v += C) {
    const int64_t column = k + v * kLanes;
    for (int c = 0; c < C; ++c) sum_vector<M, R, C>(rows, x, K, column + c * kLanes, c, part);
  }
  for (int c = 0; c + 1 < C; ++c) {
    if (v + c < vectors) sum_vector<M, R, C>(rows, x, K, k + (v + c) * kLanes, c, part);
  }
}

// The chains of one (row, x row) pair added in order (indexing elements, not passing the array: GCC keeps the
// chains in registers only while no reference to a part of the array escapes).
template <int M, int R, int C>
__attribute__((always_inline)) inline Vec chain_sum(const Vec (&part)[R][M][C], int r, int m) {
  Vec total = part[r][m][0];
  for (int c = 1; c < C; ++c) total = total + part[r][m][c];
  return total;
}

// The columns of [first, last) no vector covers: rest[r][m] += x[m, k] * float(q[n + r, k]) for k in [from, last).
template <int M, int R>
inline void sum_columns(const Int8Matrix& w, const float* x, int64_t n, int64_t from, int64_t last,
                        float (&rest)[R][M]) {
  for (int64_t k = from; k < last; ++k) {
    for (int r = 0; r < R; ++r) {
      const float value = static_cast<float>(w.q[(n + r) * w.K + k]);
      for (int m = 0; m < M; ++m) rest[r][m] += x[m * w.K + k] * value;
    }
  }
}

// Asks for the weight bytes kPrefetchBytes past those of rows [n, n + R), up to prefetch_end (the end of the
// task's rows): they are on their way while these rows are summed, whatever the row length and the rows per
// block. Measured on Zen 5: the streaming of short rows (576 bytes) is faster with it than with the hardware
// prefetcher alone.
template <int R>
__attribute__((always_inline)) inline void prefetch_ahead(const Int8Matrix& w, int64_t n,
                                                          const int8_t* prefetch_end) {
  prefetch_span(w.q + n * w.K + kPrefetchBytes, w.q + (n + R) * w.K + kPrefetchBytes, prefetch_end);
}

// Rows [n, n + R) with one scale a row: out = (sum of the row's products) * scale (+ bias).
template <int M, int R, int C>
inline void rows_per_row_scale(const Int8Matrix& w, const float* x, const float* bias, float* out, int64_t n,
                               const int8_t* prefetch_end) {
  Vec part[R][M][C];
  float rest[R][M] = {};
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m)
      for (int c = 0; c < C; ++c) part[r][m][c] = Vec(0.f);
  prefetch_ahead<R>(w, n, prefetch_end);
  const int64_t vectors = w.K / kLanes;
  sum_vectors<M, R, C, 0>(w, x, n, 0, vectors, part);
  sum_columns<M, R>(w, x, n, vectors * kLanes, w.K, rest);
  for (int r = 0; r < R; ++r) {
    const float scale = w.scales[n + r];
    for (int m = 0; m < M; ++m) {
      const float total = (hsum(chain_sum<M, R, C>(part, r, m)) + rest[r][m]) * scale;
      out[m * w.N + n + r] = bias ? total + bias[n + r] : total;
    }
  }
}

// Rows [n, n + R), group by group: acc += (the group's sum of products) * scale, one vector per (row, x row), and
// the group's columns no vector covers likewise into a float. VG > 0: every group is VG whole vectors.
template <int M, int R, int C, int VG>
inline void rows_grouped(const Int8Matrix& w, const float* x, const float* bias, float* out, int64_t n,
                         const int8_t* prefetch_end) {
  Vec acc[R][M];
  float tail[R][M] = {};
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) acc[r][m] = Vec(0.f);
  prefetch_ahead<R>(w, n, prefetch_end);
  for (int64_t g = 0; g < w.groups; ++g) {
    const int64_t first = g * w.group_size, last = std::min(first + w.group_size, w.K);
    const int64_t vectors = (last - first) / kLanes;
    Vec part[R][M][C];
    float rest[R][M] = {};
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < M; ++m)
        for (int c = 0; c < C; ++c) part[r][m][c] = Vec(0.f);
    sum_vectors<M, R, C, VG>(w, x, n, first, vectors, part);
    if (VG == 0) sum_columns<M, R>(w, x, n, first + vectors * kLanes, last, rest);
    for (int r = 0; r < R; ++r) {
      const float scale = w.scales[(n + r) * w.groups + g];
      const Vec scale_vector(scale);
      for (int m = 0; m < M; ++m) {
        acc[r][m] = at::vec::fmadd(chain_sum<M, R, C>(part, r, m), scale_vector, acc[r][m]);
        if (VG == 0) tail[r][m] += rest[r][m] * scale;
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int m = 0; m < M; ++m) {
      const float total = hsum(acc[r][m]) + tail[r][m];
      out[m * w.N + n + r] = bias ? total + bias[n + r] : total;
    }
  }
}

// Weight rows [begin, end): R at a time, the last few one at a time.
template <int M, int R, int C, int VG, bool Grouped>
void gemv_int8_range(const Int8Matrix& w, const float* x, const float* bias, float* out, int64_t begin,
                     int64_t end) {
  const int8_t* prefetch_end = w.q + end * w.K;
  int64_t n = begin;
  for (; n + R <= end; n += R) {
    if constexpr (Grouped) {
      rows_grouped<M, R, C, VG>(w, x, bias, out, n, prefetch_end);
    } else {
      rows_per_row_scale<M, R, C>(w, x, bias, out, n, prefetch_end);
    }
  }
  for (; n < end; ++n) {
    if constexpr (Grouped) {
      rows_grouped<M, 1, C, VG>(w, x, bias, out, n, prefetch_end);
    } else {
      rows_per_row_scale<M, 1, C>(w, x, bias, out, n, prefetch_end);
    }
  }
}

// The rows of W split into R-row blocks over the threads, at least kGemvTaskBytes of weights a task.
template <int M, int R, int C, int VG, bool Grouped>
void gemv_int8_parallel(const Int8Matrix& w, const float* x, const float* bias, float* out) {
  const int64_t blocks = (w.N + R - 1) / R;
  const int64_t grain = std::max<int64_t>(1, kGemvTaskBytes / std::max<int64_t>(w.K * R, 1));
  at::parallel_for(0, blocks, grain, [&](int64_t begin, int64_t end) {
    gemv_int8_range<M, R, C, VG, Grouped>(w, x, bias, out, begin * R, std::min(end * R, w.N));
  });
}

// Rows of x up to which grouped weights take scaled group sums: a multiply-add per group and row of x adds up
// with more rows, where dequantizing each weight once (one multiplication shared by the rows) costs less.
constexpr int64_t kScaledGroupRows = 2;

// Rows of x per weight-row block and chains per pair: enough independent accumulators to hide the latency of
// the fused multiply-add (8 or more), few enough to stay in registers beside the widened weights.
template <int M>
void gemv_int8_rows(const Int8Matrix& w, const float* x, const float* bias, float* out) {
  constexpr int R = M <= 2 ? 4 : 2;
  constexpr int C = M == 1 ? 2 : 1;
  if (w.groups == 1) return gemv_int8_parallel<M, R, C, 0, false>(w, x, bias, out);
  if constexpr (M <= kScaledGroupRows) {
    // Whole groups of 2, 4 or 8 vectors get loops of fixed length (32 to 128 columns with AVX-512).
    if (w.K % w.group_size == 0) {
      if (w.group_size == 2 * kLanes) return gemv_int8_parallel<M, R, 1, 2, true>(w, x, bias, out);
      if (w.group_size == 4 * kLanes) return gemv_int8_parallel<M, R, C, 4, true>(w, x, bias, out);
      if (w.group_size == 8 * kLanes) return gemv_int8_parallel<M, R, C, 8, true>(w, x, bias, out);
    }
    gemv_int8_parallel<M, R, C, 0, true>(w, x, bias, out);
  }
}

// out [rows, N] = x [rows, K] @ W.T (+ bias) by scaled group sums, for 1 to 8 rows of x; false (nothing written)
// where that does not apply: grouped weights with more than kScaledGroupRows rows.
inline bool gemv_int8(int64_t rows, const Int8Matrix& w, const float* x, const float* bias, float* out) {
  if (w.groups > 1 && rows > kScaledGroupRows) return false;
  switch (rows) {
    case 1: gemv_int8_rows<1>(w, x, bias, out); return true;
    case 2: gemv_int8_rows<2>(w, x, bias, out); return true;
    case 3: gemv_int8_rows<3>(w, x, bias, out); return true;
    case 4: gemv_int8_rows<4>(w, x, bias, out); return true;
    case 5: gemv_int8_rows<5>(w, x, bias, out); return true;
    case 6: gemv_int8_rows<6>(w, x, bias, out); return true;
    case 7: gemv_int8_rows<7>(w, x, bias, out); return true;
    case 8: gemv_int8_rows<8>(w, x, bias, out); return true;
    default: return false;
  }
}

}  // namespace octavo_cpu
