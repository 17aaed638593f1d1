// The decode chunk kernel that reads K and V rows in place from the paged pool: rows widened in registers
// (float, bfloat16, float16, int8 with per-row scales), kLanes keys scored at once through one transpose-add
// tree, each row read once for a group of queries; the chunk's K rows are asked for as it starts and its V rows
// while K is scored, and the scoring and weighting loops ask for the next item's lines a few at a time
// (Scratch::ahead). bfloat16 rows take the paired loads of paged_decode_bf16.h (values always; keys by dpbf16
// where the CPU and the query allow); int8 rows under a bfloat16 model's queries the int16 pairs of
// paged_decode_int8.h (AVX-512 builds, rows of whole 32-value parts).
#pragma once

#include "paged_attention_types.h"
#include "paged_decode_bf16.h"
#include "paged_decode_int8.h"

#include <algorithm>
#include <type_traits>
#include <vector>

namespace octavo_cpu {
namespace paged {

// Scales of positions [begin, begin + n) of kv head `head` (a quantized pool), zero-padded to whole vectors; block
// by block, as row_pointers (no division per row).
inline void row_scales(const Pool& pool, const int32_t* blocks, int64_t block_size, int64_t begin, int64_t n,
                       int64_t head, std::vector<float>& scales) {
  scales.assign(round_up(n, kLanes), 0.f);
  const float* base = pool.scales + head * pool.scale_head_stride;
  int64_t block = begin / block_size, offset = begin % block_size;
  const float* start = base + blocks[block] * pool.scale_block_stride;
  for (int64_t j = 0; j < n; ++j) {
    if (offset == block_size) {
      offset = 0;
      start = base + blocks[++block] * pool.scale_block_stride;
    }
    scales[j] = start[offset++ * pool.scale_token_stride];
  }
}

template <typename CT, int NV>
inline void prefetch_row(const void* row) {
  prefetch_bytes(row, NV * kLanes * static_cast<int64_t>(sizeof(CT)));
}

// scores[q][j] = scale * (queries[q] . k_j) for the NQ queries and j in [0, n), rows of NV vectors of CT
// widened in registers once for all NQ queries. kLanes keys at a time: each (query, key)'s products are
// summed lane-wise into one vector, then one transpose_sum per query turns its kLanes vectors into kLanes
// scores. Each scores[q] has room for round_up(n, kLanes) values (past n: 0). A query's arithmetic is the
// same whatever NQ and the other queries are; the lanes a key's terms land in depend only on its offset
// from the first key. With `prefetch`, asks for the rows prefetch[j] as key j is scored. Quantized rows:
// the dot product with the stored integers times the row's scale (key_scales[j]) times `scale`.
template <typename CT, int NV, int NQ>
void score_keys(const float* const* queries, const void* const* rows, const float* key_scales, int64_t n, float scale,
                float* const* scores, const void* const* prefetch, Lookahead& ahead) {
  for (int64_t first = 0; first < n; first += kLanes) {
    const int64_t count = std::min(kLanes, n - first);
    if (prefetch != nullptr) {
      for (int64_t j = first; j < first + count; ++j) prefetch_row<CT, NV>(prefetch[j]);
    }
    ahead.step(kLookaheadPerScoredGroup);
    Vec acc[NQ][kLanes];
    for (int64_t j = 0; j < kLanes; ++j) {
      if (j >= count) {
        for (int q = 0; q < NQ; ++q) acc[q][j] = Vec(0.f);
        continue;
      }
      const CT* key = static_cast<const CT*>(rows[first + j]);
      Vec k[NV];
      for (int v = 0; v < NV; ++v) k[v] = load_widened(key + v * kLanes);
      for (int q = 0; q < NQ; ++q) {
        Vec sum = Vec::loadu(queries[q]) * k[0];
        for (int v = 1; v < NV; ++v) sum = at::vec::fmadd(Vec::loadu(queries[q] + v * kLanes), k[v], sum);
        acc[q][j] = sum;
      }
    }
    if constexpr (kQuantized<CT>) {
      const Vec row_scale = Vec::loadu(key_scales + first);
      for (int q = 0; q < NQ; ++q) (transpose_sum(acc[q]) * row_scale * Vec(scale)).store(scores[q] + first);
    } else {
      for (int q = 0; q < NQ; ++q) (transpose_sum(acc[q]) * Vec(scale)).store(scores[q] + first);
    }
  }
}

// out[q][0:NV * kLanes] = sum_j weights[q][j] * v_j for the NQ queries, j in [0, n) in order, rows of CT
// widened in registers once for all NQ queries.
template <typename CT, int NV, int NQ>
void weighted_values(const float* const* weights, const void* const* rows, int64_t n, float* const* out,
                     Lookahead& ahead) {
  if constexpr (std::is_same_v<CT, c10::BFloat16> && kHasBf16Pairs && NV % 2 == 0) {
    return weighted_values_bf16<NV / 2, NQ>(weights, rows, n, out, ahead);
  }
  Vec acc[NQ][NV];
  for (int q = 0; q < NQ; ++q)
    for (int v = 0; v < NV; ++v) acc[q][v] = Vec(0.f);
  for (int64_t j = 0; j < n; ++j) {
    const CT* row = static_cast<const CT*>(rows[j]);
    ahead.step(kLookaheadPerValueRow);
    Vec value[NV];
    for (int v = 0; v < NV; ++v) value[v] = load_widened(row + v * kLanes);
    for (int q = 0; q < NQ; ++q) {
      const Vec w(weights[q][j]);
      for (int v = 0; v < NV; ++v) acc[q][v] = at::vec::fmadd(w, value[v], acc[q][v]);
    }
  }
  for (int q = 0; q < NQ; ++q)
    for (int v = 0; v < NV; ++v) acc[q][v].store(out[q] + v * kLanes);
}

// Scores of NQ queries (the chunk's queries offset, offset + 1, ...) over its keys (see score_keys). bfloat16
// rows on a CPU with AVX512_BF16: a query whose bfloat16 form s.dot_queries holds is scored by dpbf16
// (score_keys_dot_bf16), the others by widening; either way a query's arithmetic depends only on itself.
template <typename CT, int NV, int NQ>
void score_group(const Problem& p, int64_t n, const float* const* queries, float* const* scores,
                 const void* const* prefetch, Scratch& s, int64_t offset) {
#if defined(CPU_CAPABILITY_AVX512)  // the integer pairs exist in AVX-512 builds only
  if constexpr (std::is_same_v<CT, int8_t> && NV % 2 == 0) {
    if (p.int8_dot != Int8Dot::kFloat) {
      const int16_t* int16_queries[NQ];
      for (int q = 0; q < NQ; ++q) int16_queries[q] = s.int16_queries.data() + (offset + q) * p.head_dim;
      const float* steps = s.query_steps.data() + offset;
      const auto kernel = p.int8_dot == Int8Dot::kVnni ? &score_keys_int8<NV / 2, NQ, true>
                                                        : &score_keys_int8<NV / 2, NQ, false>;
      return kernel(int16_queries, steps, s.key_sources.data(), s.key_scales.data(), n, p.scale, scores, prefetch,
                    s.ahead);
    }
  }
#endif
  if constexpr (std::is_same_v<CT, c10::BFloat16> && kHasDotBf16 && NV % 2 == 0) {
    if (!s.dot_queries.empty()) {
      const uint16_t* const* dot = s.dot_queries.data() + offset;
      for (int q = 0; q < NQ; ++q) {
        const void* const* ahead = q == 0 ? prefetch : nullptr;
        if (dot[q] != nullptr) {
          score_keys_dot_bf16<NV / 2>(dot[q], s.key_sources.data(), n, p.scale, scores[q], ahead,
                                      NV * kLanes * static_cast<int64_t>(sizeof(CT)), s.ahead);
        } else {
          score_keys<CT, NV, 1>(queries + q, s.key_sources.data(), nullptr, n, p.scale, scores + q, ahead, s.ahead);
        }
      }
      return;
    }
  }
  score_keys<CT, NV, NQ>(queries, s.key_sources.data(), s.key_scales.data(), n, p.scale, scores, prefetch, s.ahead);
}

// Partials (see chunk_partials) of NQ queries over the chunk whose rows s.key_sources / s.value_sources hold.
template <typename CT, int NV, int NQ>
void query_group_partials(const Problem& p, int64_t n, const float* const* queries, float* const* records,
                          bool pull_values, Scratch& s, int64_t offset) {
  const int64_t pvd = p.padded_value_dim, stride = round_up(n, kLanes);
  float* scores[NQ];
  for (int q = 0; q < NQ; ++q) scores[q] = s.scores.data() + q * stride;
  score_group<CT, NV, NQ>(p, n, queries, scores, pull_values ? s.value_sources.data() : nullptr, s, offset);
  for (int q = 0; q < NQ; ++q) {
    soft_cap_row(scores[q], n, p.soft_cap);
    const float m = row_max(scores[q], n);
    records[q][pvd] = m;
    records[q][pvd + 1] = exp_shift_sum(scores[q], n, m);
    if constexpr (kQuantized<CT>) {  // weights exp(s_j - m) times the scale of value row j
      for (int64_t j = 0; j < stride; j += kLanes) {
        (Vec::loadu(scores[q] + j) * Vec::loadu(s.value_scales.data() + j)).store(scores[q] + j);
      }
    }
  }
#if defined(CPU_CAPABILITY_AVX512)  // the integer pairs exist in AVX-512 builds only
  if constexpr (std::is_same_v<CT, int8_t> && NV % 2 == 0) {
    if (p.int8_dot != Int8Dot::kFloat && n <= kInt8ValueRowsMax) {
      const auto kernel = p.int8_dot == Int8Dot::kVnni ? &weighted_values_int8<NV / 2, NQ, true>
                                                        : &weighted_values_int8<NV / 2, NQ, false>;
      return kernel(scores, s.value_sources.data(), n, records, s.ahead, s.int16_weights);
    }
  }
#endif
#if defined(CPU_CAPABILITY_AVX512)  // the dpbf16 weighting and the CPU check exist in AVX-512 builds only
  if constexpr (std::is_same_v<CT, c10::BFloat16> && NV % 2 == 0) {
    if (p.bf16_queries && cpu_has_avx512_bf16()) {  // a bf16 model's queries: its weights are rounded to bf16
      return weighted_values_dot_bf16<NV / 2, NQ>(scores, s.value_sources.data(), n, records, s.ahead, s.weight_pairs);
    }
  }
#endif
  weighted_values<CT, NV, NQ>(scores, s.value_sources.data(), n, records, s.ahead);
}

// chunk_partials reading K and V straight from the pool (rows of NV whole vectors: float, 16-bit or int8), the
// queries in groups of up to kGroup so that each row widened serves several queries (kGroup * NV vector
// accumulators stay in registers).
template <typename CT, int NV>
void chunk_partials_direct(const Problem& p, const int32_t* blocks, int64_t head, int64_t begin, int64_t end,
                           const float* const* queries, float* const* records, int64_t nq, Scratch& s) {
  constexpr int kGroup = std::max(1, std::min(4, 16 / NV));
  const int64_t n = end - begin;
  row_pointers<CT>(p.keys, blocks, p.block_size, begin, n, head, s.key_sources);
  row_pointers<CT>(p.values, blocks, p.block_size, begin, n, head, s.value_sources);
  if constexpr (kQuantized<CT>) {
    row_scales(p.keys, blocks, p.block_size, begin, n, head, s.key_scales);
    row_scales(p.values, blocks, p.block_size, begin, n, head, s.value_scales);
  }
  if constexpr (std::is_same_v<CT, c10::BFloat16>) prepare_dot_queries<NV>(queries, nq, p.head_dim, s);
#if defined(CPU_CAPABILITY_AVX512)  // the integer pairs exist in AVX-512 builds only
  if constexpr (std::is_same_v<CT, int8_t> && NV % 2 == 0) {
    if (p.int8_dot != Int8Dot::kFloat) prepare_int16_queries(queries, nq, p.head_dim, s);
  }
#endif
  // Every K row of the chunk is requested at once (their loads then overlap); V rows while K is scored.
  for (int64_t j = 0; j < n; ++j) prefetch_row<CT, NV>(s.key_sources[j]);
  s.scores.resize(kGroup * round_up(n, kLanes));
  for (int64_t q = 0; q < nq; q += kGroup) {
    const bool first = q == 0;  // the first group pulls K and V from memory, the others find them in L1
    switch (std::min<int64_t>(kGroup, nq - q)) {
      case 1: query_group_partials<CT, NV, 1>(p, n, queries + q, records + q, first, s, q); break;
      case 2: if constexpr (kGroup >= 2) query_group_partials<CT, NV, 2>(p, n, queries + q, records + q, first, s, q); break;
      case 3: if constexpr (kGroup >= 3) query_group_partials<CT, NV, 3>(p, n, queries + q, records + q, first, s, q); break;
      default: if constexpr (kGroup >= 4) query_group_partials<CT, NV, 4>(p, n, queries + q, records + q, first, s, q); break;
    }
  }
}

template <typename CT>
using ChunkKernel = void (*)(const Problem&, const int32_t*, int64_t, int64_t, int64_t, const float* const*,
                             float* const*, int64_t, Scratch&);

// The direct kernel for this problem, or nullptr where rows must be widened into a tile first: float8
// caches (no instruction widens them: a table lookup per element), rows that are not whole vectors (a vector load would run into the next row),
// key and value rows of different lengths, and the portable build (no transpose_sum).
template <typename CT>
ChunkKernel<CT> direct_kernel(const Problem& p) {
  if constexpr (std::is_same_v<CT, c10::Float8_e4m3fn> || !kHasTransposeSum) {
    return nullptr;
  } else {
    if (p.head_dim != p.padded_dim || p.value_dim != p.padded_value_dim || p.head_dim != p.value_dim) return nullptr;
    switch (p.padded_dim / kLanes) {
      case 1: return &chunk_partials_direct<CT, 1>;
      case 2: return &chunk_partials_direct<CT, 2>;
      case 4: return &chunk_partials_direct<CT, 4>;
      case 6: return &chunk_partials_direct<CT, 6>;
      case 8: return &chunk_partials_direct<CT, 8>;
      case 16: return &chunk_partials_direct<CT, 16>;
      default: return nullptr;
    }
  }
}

}  // namespace paged
}  // namespace octavo_cpu
