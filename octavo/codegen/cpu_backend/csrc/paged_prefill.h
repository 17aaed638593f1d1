// The prefill kernels of octavo_cpu::paged_attention: causal attention of a run of query positions of one
// sequence over its paged context, for the query heads of one kv head (one work item of the schedule).
//
// Two implementations of the same flash attention (key tiles, online softmax in float32 per row, row =
// position x query head of the group):
// - prefill_tile_widened: any cache type and ISA level; K and V rows widened to float tiles, float32 FMAs.
// - prefill_tile_bf16 (AVX-512 builds, run only on CPUs with AVX512_BF16, bf16 cache and bf16 queries):
//   q . k in bf16 dot products (vdpbf16ps: exact products of bf16 numbers, float32 sums), scores kept
//   transposed [key][row] so that the softmax runs across 16 rows per vector; the softmax weights are rounded
//   to bf16 (the only rounding the float path does not do) and multiplied with V in bf16 dot products over
//   pairs of keys, the row sums taken from the unrounded float32 weights.
#pragma once

#include "paged_attention_types.h"
#include "paged_prefill_bf16.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

namespace octavo_cpu {
namespace paged {

// Context position `position` of kv head `head` as floats in dst[0:dim] (dequantized); dst[dim:] untouched.
template <typename CT>
inline void read_row(const Pool& pool, const int32_t* blocks, int64_t block_size, int64_t position, int64_t head,
                     int64_t dim, int64_t padded, float* dst) {
  const int64_t block = blocks[position / block_size], offset = position % block_size;
  const CT* src = static_cast<const CT*>(pool.data) + block * pool.block_stride + offset * pool.token_stride +
                  head * pool.head_stride;
  widen(src, dim, dst);
  if constexpr (kQuantized<CT>) {
    scale_row(pool.scales[block * pool.scale_block_stride + offset * pool.scale_token_stride +
                          head * pool.scale_head_stride],
              dst, padded);
  }
}

// scores[r][j] = scale * q_r . k_j for NR rows against one transposed key tile [dim][kKeyTile], the NR x
// kKeyTile / kLanes accumulators in registers (each key vector loaded serves NR rows).
template <int NR>
inline void tile_score_rows(const float* const* queries, const float* key_tile, int64_t dim, float scale,
                            float* scores) {
  constexpr int64_t kVectors = kKeyTile / kLanes;
  Vec acc[NR][kVectors];
  for (auto& row : acc)
    for (auto& a : row) a = Vec(0.f);
  for (int64_t d = 0; d < dim; ++d) {
    Vec keys[kVectors];
    for (int64_t v = 0; v < kVectors; ++v) keys[v] = Vec::loadu(key_tile + d * kKeyTile + v * kLanes);
    for (int b = 0; b < NR; ++b) {
      const Vec qd(queries[b][d]);
      for (int64_t v = 0; v < kVectors; ++v) acc[b][v] = at::vec::fmadd(qd, keys[v], acc[b][v]);
    }
  }
  for (int b = 0; b < NR; ++b)
    for (int64_t v = 0; v < kVectors; ++v) (acc[b][v] * Vec(scale)).store(scores + b * kKeyTile + v * kLanes);
}

// Scores of rows [0, rows) against one transposed key tile: blocks of rows that keep ~16 accumulators busy
// (enough independent FMAs to cover their latency), the rest one row at a time.
inline void tile_scores(const float* const* queries, int64_t rows, const float* key_tile, int64_t dim, float scale,
                        float* scores) {
  constexpr int kRowBlock = static_cast<int>(std::max<int64_t>(1, 16 / (kKeyTile / kLanes)));
  int64_t r = 0;
  for (; r + kRowBlock <= rows; r += kRowBlock) {
    tile_score_rows<kRowBlock>(queries + r, key_tile, dim, scale, scores + r * kKeyTile);
  }
  for (; r < rows; ++r) tile_score_rows<1>(queries + r, key_tile, dim, scale, scores + r * kKeyTile);
}

// tile_accumulate for NR rows and NV column vectors from column `column`, in registers over the whole tile.
template <int NR, int NV>
inline void accumulate_tile_block(const float* weights, const float* factors, const float* value_tile, int64_t n,
                                  int64_t length, int64_t column, float* out) {
  Vec acc[NR][NV];
  for (int b = 0; b < NR; ++b)
    for (int v = 0; v < NV; ++v) acc[b][v] = Vec::loadu(out + b * length + column + v * kLanes) * Vec(factors[b]);
  for (int64_t j = 0; j < n; ++j) {
    Vec value[NV];
    for (int v = 0; v < NV; ++v) value[v] = Vec::loadu(value_tile + j * length + column + v * kLanes);
    for (int b = 0; b < NR; ++b) {
      const Vec w(weights[b * kKeyTile + j]);
      for (int v = 0; v < NV; ++v) acc[b][v] = at::vec::fmadd(w, value[v], acc[b][v]);
    }
  }
  for (int b = 0; b < NR; ++b)
    for (int v = 0; v < NV; ++v) acc[b][v].store(out + b * length + column + v * kLanes);
}

template <int NV>
inline void accumulate_tile_columns(const float* weights, const float* factors, int64_t rows, const float* value_tile,
                                    int64_t n, int64_t length, int64_t column, float* out) {
  constexpr int kRowBlock = 4;
  int64_t r = 0;
  for (; r + kRowBlock <= rows; r += kRowBlock) {
    accumulate_tile_block<kRowBlock, NV>(weights + r * kKeyTile, factors + r, value_tile, n, length, column,
                                         out + r * length);
  }
  for (; r < rows; ++r) {
    accumulate_tile_block<1, NV>(weights + r * kKeyTile, factors + r, value_tile, n, length, column, out + r * length);
  }
}

// out_r = out_r * factors[r] + sum_j weights[r][j] * value_tile[j] for rows [0, rows), j in [0, n) in order:
// 4 rows x 4 column vectors of accumulators sharing each value vector loaded (1 column vector at the end).
inline void tile_accumulate(const float* weights, const float* factors, int64_t rows, const float* value_tile,
                            int64_t n, int64_t length, float* out) {
  int64_t column = 0;
  for (; column + 4 * kLanes <= length; column += 4 * kLanes) {
    accumulate_tile_columns<4>(weights, factors, rows, value_tile, n, length, column, out);
  }
  for (; column < length; column += kLanes) {
    accumulate_tile_columns<1>(weights, factors, rows, value_tile, n, length, column, out);
  }
}

// prefill_tile with every K and V row widened (and dequantized) into float tiles of kKeyTile keys, the
// products in float32 FMAs: any cache type, any ISA level.
template <typename CT>
void prefill_tile_widened(const Problem& p, const int32_t* blocks, int64_t head, int64_t token, int64_t first,
                          int64_t count, Scratch& s) {
  const int64_t rows = count * p.group, pvd = p.padded_value_dim;
  s.key_tile.assign(p.padded_dim * kKeyTile, 0.f);  // transposed: [dim][key]
  s.value_tile.assign(kKeyTile * pvd, 0.f);
  s.key_row.assign(p.padded_dim, 0.f);
  s.scores.assign(rows * kKeyTile, 0.f);
  s.row_max.assign(rows, kNegInf);
  s.row_sum.assign(rows, 0.f);
  s.factors.assign(rows, 1.f);
  s.accumulators.assign(rows * pvd, 0.f);
  s.queries.resize(rows);
  for (int64_t r = 0; r < rows; ++r) {
    s.queries[r] = p.query + ((token + r / p.group) * p.num_heads + head * p.group + r % p.group) * p.padded_dim;
  }
  const int64_t last = first + count - 1;
  const int64_t start = p.window > 0 ? std::max<int64_t>(0, first - p.window + 1) : 0;
  for (int64_t tile = start; tile <= last; tile += kKeyTile) {
    const int64_t n = std::min(kKeyTile, last + 1 - tile);
    for (int64_t j = 0; j < n; ++j) {
      read_row<CT>(p.keys, blocks, p.block_size, tile + j, head, p.head_dim, p.padded_dim, s.key_row.data());
      for (int64_t d = 0; d < p.head_dim; ++d) s.key_tile[d * kKeyTile + j] = s.key_row[d];
      read_row<CT>(p.values, blocks, p.block_size, tile + j, head, p.value_dim, pvd, s.value_tile.data() + j * pvd);
    }
    tile_scores(s.queries.data(), rows, s.key_tile.data(), p.head_dim, p.scale, s.scores.data());
    for (int64_t r = 0; r < rows; ++r) {
      float* scores = s.scores.data() + r * kKeyTile;
      soft_cap_row(scores, kKeyTile, p.soft_cap);  // before the mask: masked scores stay -inf
      const int64_t position = first + r / p.group;
      const int64_t lowest = p.window > 0 ? position - p.window + 1 : 0;
      for (int64_t j = 0; j < kKeyTile; ++j) {
        if (j >= n || tile + j > position || tile + j < lowest) scores[j] = kNegInf;
      }
      const float tile_max = row_max(scores, kKeyTile);
      if (tile_max == kNegInf) {  // nothing visible in this tile: weights 0, state unchanged
        std::fill(scores, scores + kKeyTile, 0.f);
        s.factors[r] = 1.f;
        continue;
      }
      const float new_max = std::max(s.row_max[r], tile_max);
      s.factors[r] = std::exp(s.row_max[r] - new_max);
      s.row_sum[r] = s.row_sum[r] * s.factors[r] + exp_shift_sum(scores, kKeyTile, new_max);
      s.row_max[r] = new_max;
    }
    tile_accumulate(s.scores.data(), s.factors.data(), rows, s.value_tile.data(), n, pvd, s.accumulators.data());
  }
  for (int64_t r = 0; r < rows; ++r) {
    float* out = p.output + ((token + r / p.group) * p.num_heads + head * p.group + r % p.group) * pvd;
    const Vec sum(s.row_sum[r]);
    const float* o = s.accumulators.data() + r * pvd;
    for (int64_t i = 0; i < pvd; i += kLanes) (Vec::loadu(o + i) / sum).store(out + i);
  }
}

// Causal attention of positions [first, first + count) of one sequence (its tokens start at query row
// `token`) over its context, for the `group` query heads of kv head `head`.
template <typename CT>
void prefill_tile(const Problem& p, const int32_t* blocks, int64_t head, int64_t token, int64_t first, int64_t count,
                  Scratch& s) {
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (std::is_same_v<CT, c10::BFloat16>) {
    if (bf16_prefill_applies(p)) return prefill_tile_bf16(p, blocks, head, token, first, count);
  }
#endif
  prefill_tile_widened<CT>(p, blocks, head, token, first, count, s);
}

}  // namespace paged
}  // namespace octavo_cpu
