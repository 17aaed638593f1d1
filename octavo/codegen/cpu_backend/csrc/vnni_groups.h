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

// dst[0:count] = p[first:first + count] as float32, dst[count:padded] = 0 (padded: padded_groups(count)).
inline void widen_parameters(const Parameters& p, int64_t first, int64_t count, int64_t padded, float* dst) {
  _mm512_storeu_ps(dst + padded - 16, _mm512_setzero_ps());
  for (int64_t i = 0; i < padded - 16; i += 16) {
    const int64_t left = count - i;
    const __mmask16 mask = left >= 16 ? __mmask16(0xFFFF) : left <= 0 ? __mmask16(0) : __mmask16((1u << left) - 1);
    __m512 values;
    switch (p.type) {
      case Parameters::Type::kHalf:
        values = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, p.address(first + i)));
        break;
      case Parameters::Type::kBFloat16:
        values = _mm512_castsi512_ps(
            _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, p.address(first + i))), 16));
        break;
      default:
        values = _mm512_maskz_loadu_ps(mask, p.address(first + i));
    }
    _mm512_storeu_ps(dst + i, values);
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
