// What the integer GEMVs (gemv_int4_vnni.h, gemv_int8_vnni.h) share for grouped weights: a row's scales (or
// offsets) widened to float32 in a padded buffer and the group each int32 lane of a 64-byte chunk of weights sums,
// so that one permute gives a chunk's lanes their groups' scales.
//
// Groups must be whole 32-column blocks (group_size a multiple of 32): a lane then never sums two groups.
#pragma once

#include "gemm_amx_bf16.h"
#include "gemv_int8.h"

#if defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>

#include <algorithm>
#include <type_traits>
#include <vector>

namespace octavo_cpu {

// Groups rounded up to whole vectors, and one vector more: a chunk's scales are loaded as a vector from its first
// group, which may lie in the last vector.
inline int64_t padded_groups(int64_t groups) { return round_up(groups, 16) + 16; }

// dst[0:count] = p[first:first + count] as float32, then zeros up to padded_groups(count) (dst has room for that
// many), the type asked once: one row's groups, or the parameters of consecutive weight rows side by side (row r's
// groups at r * groups) widened in one pass for a block of rows. A chunk's scales are loaded as a vector from its
// first group, which reads at most 15 values past its row: the next row's, or the zeros.
inline void widen_parameter_rows(const Parameters& p, int64_t first, int64_t count, float* dst) {
  const auto widen = [&](auto load) {
    for (int64_t i = 0; i < count; i += 16) {
      const int64_t left = count - i;
      const __mmask16 mask = left >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1);
      _mm512_storeu_ps(dst + i, load(mask, p.address(first + i)));
    }
  };
  switch (p.type) {
    case Parameters::Type::kHalf:
      widen([](__mmask16 mask, const void* at) { return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, at)); });
      break;
    case Parameters::Type::kBFloat16:
      widen([](__mmask16 mask, const void* at) {
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, at)), 16));
      });
      break;
    default:
      widen([](__mmask16 mask, const void* at) { return _mm512_maskz_loadu_ps(mask, at); });
  }
  _mm512_storeu_ps(dst + round_up(count, 16), _mm512_setzero_ps());
}

// The sum of each vector's 16 lanes in _mm512_reduce_add_ps's order (lane i with lane i + 8, then i with i + 4, then
// i with i + 2, then the last two), four vectors at once: the same bits as four calls, in about a third of the
// instructions. sums[k] is v[k]'s.
inline void reduce_add_4(const __m512 (&v)[4], float (&sums)[4]) {
  const __m512 halves01 = _mm512_add_ps(_mm512_shuffle_f32x4(v[0], v[1], 0x44), _mm512_shuffle_f32x4(v[0], v[1], 0xEE));
  const __m512 halves23 = _mm512_add_ps(_mm512_shuffle_f32x4(v[2], v[3], 0x44), _mm512_shuffle_f32x4(v[2], v[3], 0xEE));
  // 128-bit lane k: vector k's four partial sums (lanes i + (i + 8) + (i + 4) + (i + 12) for i < 4).
  const __m512 quarters = _mm512_add_ps(_mm512_shuffle_f32x4(halves01, halves23, 0x88),
                                        _mm512_shuffle_f32x4(halves01, halves23, 0xDD));
  const __m512 pairs = _mm512_add_ps(quarters, _mm512_permute_ps(quarters, 0x4E));
  const __m512 totals = _mm512_add_ps(pairs, _mm512_permute_ps(pairs, 0xB1));
  _mm_storeu_ps(sums, _mm512_castps512_ps128(_mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0,
                                                                                      0, 0, 0, 0, 0, 0), totals)));
}

// out_sums[r] = the lane sum of acc[r] for R vectors (reduce_add_4 for four, _mm512_reduce_add_ps otherwise: the
// same bits either way).
template <int R>
inline void reduce_add_rows(const __m512 (&acc)[R], float (&sums)[R]) {
  if constexpr (R == 4) {
    reduce_add_4(acc, sums);
  } else {
    for (int r = 0; r < R; ++r) sums[r] = _mm512_reduce_add_ps(acc[r]);
  }
}

// For each chunk of `Columns` columns: its first group, and for each of the 16 lanes (lane i sums the chunk's
// columns i * LaneColumns .. (i + 1) * LaneColumns - 1, in the kernel's column order) its group relative to the
// first (at most 3 for groups of 32 or more columns). A lane past K sums zeros; it is given the row's last group.
struct ChunkGroups {
  const int32_t* first_group;  // [chunks]
  const int32_t* lane_group;   // [chunks][16]
  int64_t chunks;
};

// Depends on K and the group size only: kept for the calling thread's next call of the same shape.
template <int64_t Columns, int64_t LaneColumns>
ChunkGroups chunk_groups(int64_t K, int64_t group_size, int64_t groups) {
  static_assert(16 * LaneColumns == Columns, "16 lanes cover a chunk");
  static thread_local std::vector<int32_t> first, lanes;
  static thread_local int64_t cached_k = -1, cached_group_size = -1;
  const int64_t chunks = (K + Columns - 1) / Columns;
  if (cached_k != K || cached_group_size != group_size) {
    first.resize(chunks);
    lanes.resize(chunks * 16);
    for (int64_t c = 0; c < chunks; ++c) {
      first[c] = static_cast<int32_t>(c * Columns / group_size);
      for (int64_t lane = 0; lane < 16; ++lane) {
        const int64_t group = std::min((c * Columns + lane * LaneColumns) / group_size, groups - 1);
        lanes[c * 16 + lane] = static_cast<int32_t>(group - first[c]);
      }
    }
    cached_k = K;
    cached_group_size = group_size;
  }
  return ChunkGroups{first.data(), lanes.data(), chunks};
}

}  // namespace octavo_cpu
#endif
