// bfloat16 rows for the in-place decode kernel (paged_decode.h), read as pairs of values without the
// per-element widening shuffle:
// - values: one raw load holds 2 * kLanes bfloat16; as 32-bit lanes, the even element is the low half (shift
//   left by 16 = its float) and the odd element the high half (mask the low half off = its float). The
//   weighted sum accumulates even and odd dims in separate vectors and interleaves them once at the end:
//   each dim's sequence of FMAs is the one of the widening path, so the result is the same bits.
// - keys, on CPUs with AVX512_BF16 and a query whose values are all bfloat16 numbers (a bf16 model's query,
//   widened to float on the way in): q . k by _mm512_dpbf16_ps on the stored pairs directly. A product of
//   two bfloat16 is exact in float, so the only rounding is that of each addition (as with the widening
//   path's FMAs, in another order: pairs of dims first, then the transpose-add tree), and denormal inputs
//   and results are flushed to zero (the instruction's DAZ/FTZ; |q . k| that small cannot move a softmax).
//   A query that is not all bfloat16 numbers takes the widening path.
#pragma once

#include "paged_attention_types.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace octavo_cpu {
namespace paged {

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
constexpr bool kHasBf16Pairs = true;

// The floats of the 2 * kLanes bfloat16 at src: even[i] = src[2i], odd[i] = src[2i + 1].
__attribute__((always_inline)) inline void load_bf16_pairs(const c10::BFloat16* src, Vec& even, Vec& odd) {
#if defined(CPU_CAPABILITY_AVX512)
  const __m512i raw = _mm512_loadu_si512(src);
  even = Vec(_mm512_castsi512_ps(_mm512_slli_epi32(raw, 16)));
  odd = Vec(_mm512_castsi512_ps(_mm512_and_si512(raw, _mm512_set1_epi32(static_cast<int>(0xffff0000u)))));
#else
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
  even = Vec(_mm256_castsi256_ps(_mm256_slli_epi32(raw, 16)));
  odd = Vec(_mm256_castsi256_ps(_mm256_and_si256(raw, _mm256_set1_epi32(static_cast<int>(0xffff0000u)))));
#endif
}

// out[2i] = even[i], out[2i + 1] = odd[i] for i < kLanes.
__attribute__((always_inline)) inline void store_interleaved(const Vec& even, const Vec& odd, float* out) {
#if defined(CPU_CAPABILITY_AVX512)
  const __m512i low = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
  const __m512i high = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
  _mm512_storeu_ps(out, _mm512_permutex2var_ps(even, low, odd));
  _mm512_storeu_ps(out + kLanes, _mm512_permutex2var_ps(even, high, odd));
#else
  const __m256 low = _mm256_unpacklo_ps(even, odd), high = _mm256_unpackhi_ps(even, odd);
  _mm256_storeu_ps(out, _mm256_permute2f128_ps(low, high, 0x20));
  _mm256_storeu_ps(out + kLanes, _mm256_permute2f128_ps(low, high, 0x31));
#endif
}

// weighted_values for bfloat16 rows of NP * 2 * kLanes values: out[q][d] = sum_j weights[q][j] * v_j[d], j in
// [0, n) in order, one FMA per (j, d) from 0: the same bits as widening each row.
template <int NP, int NQ>
void weighted_values_bf16(const float* const* weights, const void* const* rows, int64_t n, float* const* out,
                          Lookahead& ahead) {
  Vec even[NQ][NP], odd[NQ][NP];
  for (int q = 0; q < NQ; ++q)
    for (int v = 0; v < NP; ++v) even[q][v] = odd[q][v] = Vec(0.f);
  for (int64_t j = 0; j < n; ++j) {
    const c10::BFloat16* row = static_cast<const c10::BFloat16*>(rows[j]);
    ahead.step(kLookaheadPerValueRow);
    Vec e[NP], o[NP];
    for (int v = 0; v < NP; ++v) load_bf16_pairs(row + v * 2 * kLanes, e[v], o[v]);
    for (int q = 0; q < NQ; ++q) {
      const Vec w(weights[q][j]);
      for (int v = 0; v < NP; ++v) {
        even[q][v] = at::vec::fmadd(w, e[v], even[q][v]);
        odd[q][v] = at::vec::fmadd(w, o[v], odd[q][v]);
      }
    }
  }
  for (int q = 0; q < NQ; ++q)
    for (int v = 0; v < NP; ++v) store_interleaved(even[q][v], odd[q][v], out[q] + v * 2 * kLanes);
}
#else
constexpr bool kHasBf16Pairs = false;
#endif

#if defined(CPU_CAPABILITY_AVX512)
constexpr bool kHasDotBf16 = true;

// The bfloat16 bits of query[0:dim] into out[0:dim]; true when every value is a bfloat16 number (the low 16
// bits of each float are zero), so the truncation is exact.
inline bool query_as_bf16(const float* query, int64_t dim, uint16_t* out) {
  __m512i low_bits = _mm512_setzero_si512();
  for (int64_t i = 0; i < dim; i += kLanes) {
    const __m512i bits = _mm512_loadu_si512(query + i);
    low_bits = _mm512_or_si512(low_bits, _mm512_and_si512(bits, _mm512_set1_epi32(0xffff)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), _mm512_cvtepi32_epi16(_mm512_srli_epi32(bits, 16)));
  }
  return _mm512_test_epi32_mask(low_bits, low_bits) == 0;
}

// scores[j] = scale * (q . k_j) for j in [0, n), q and the rows NP * 32 bfloat16, by dpbf16 on stored pairs:
// each key's 32-product vectors summed lane-wise, then kLanes keys at a time through one transpose_sum.
// scores has room for round_up(n, kLanes) values (past n: 0). With `prefetch`, asks for the rows
// prefetch[j] (row_bytes each) as key j is scored.
template <int NP>
__attribute__((target("avx512bf16"))) void score_keys_dot_bf16(const uint16_t* query, const void* const* rows,
                                                                int64_t n, float scale, float* scores,
                                                                const void* const* prefetch, int64_t row_bytes,
                                                                Lookahead& ahead) {
  __m512bh q[NP];
  for (int v = 0; v < NP; ++v) q[v] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(query + v * 32));
  for (int64_t first = 0; first < n; first += kLanes) {
    const int64_t count = std::min(kLanes, n - first);
    if (prefetch != nullptr) {
      for (int64_t j = first; j < first + count; ++j) prefetch_bytes(prefetch[j], row_bytes);
    }
    ahead.step(kLookaheadPerScoredGroup);
    Vec acc[kLanes];
    for (int64_t j = 0; j < kLanes; ++j) {
      if (j >= count) {
        acc[j] = Vec(0.f);
        continue;
      }
      const uint16_t* key = static_cast<const uint16_t*>(rows[first + j]);
      __m512 sum = _mm512_dpbf16_ps(_mm512_setzero_ps(), q[0], reinterpret_cast<__m512bh>(_mm512_loadu_si512(key)));
      for (int v = 1; v < NP; ++v) {
        sum = _mm512_dpbf16_ps(sum, q[v], reinterpret_cast<__m512bh>(_mm512_loadu_si512(key + v * 32)));
      }
      acc[j] = Vec(sum);
    }
    (transpose_sum(acc) * Vec(scale)).store(scores + first);
  }
}

// weighted_values for bfloat16 rows of NP * 32 values by dpbf16 on pairs of keys (the weights of a bf16 model's
// queries, on CPUs with AVX512_BF16): out[q][d] = sum over pairs (j, j + 1) of bf16(w_q[j]) v_j[d] +
// bf16(w_q[j + 1]) v_{j+1}[d], the weights rounded to bfloat16 (nearest even: a relative error of at most 2^-8
// each, as the bf16 prefill kernel rounds them), each product exact in float32, sums in float32 in pair order; an
// odd last key pairs with a zero row and weight. Each pair's rows are interleaved once (VNNI words) for all NQ
// queries. `pairs` is scratch for the weights as bf16 pairs.
template <int NP, int NQ>
__attribute__((target("avx512bf16"))) void weighted_values_dot_bf16(const float* const* weights,
                                                                     const void* const* rows, int64_t n,
                                                                     float* const* out, Lookahead& ahead,
                                                                     std::vector<uint32_t>& pairs) {
  alignas(64) static constexpr uint16_t kZeroRow[NP * 32] = {};
  const int64_t num_pairs = (n + 1) / 2, stride = round_up(num_pairs, kLanes);
  pairs.resize(NQ * stride);
  for (int q = 0; q < NQ; ++q) {
    for (int64_t j = 0; j < 2 * stride; j += 2 * kLanes) {
      const auto part = [&](int64_t first) {
        const int64_t count = std::clamp<int64_t>(n - first, 0, kLanes);
        return _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << count) - 1), weights[q] + first);
      };
      const __m512bh words = _mm512_cvtne2ps_pbh(part(j + kLanes), part(j));
      _mm512_storeu_si512(pairs.data() + q * stride + j / 2, reinterpret_cast<__m512i>(words));
    }
  }
  __m512 acc[NQ][2 * NP];
  for (int q = 0; q < NQ; ++q)
    for (int v = 0; v < 2 * NP; ++v) acc[q][v] = _mm512_setzero_ps();
  for (int64_t i = 0; i < num_pairs; ++i) {
    const uint16_t* even = static_cast<const uint16_t*>(rows[2 * i]);
    const uint16_t* odd = 2 * i + 1 < n ? static_cast<const uint16_t*>(rows[2 * i + 1]) : kZeroRow;
    ahead.step(2 * kLookaheadPerValueRow);
    __m512bh value[2 * NP];
    for (int c = 0; c < NP; ++c) {
      __m512i low, high;
      interleave_bf16_rows(even + c * 32, odd + c * 32, low, high);
      value[2 * c] = reinterpret_cast<__m512bh>(low);
      value[2 * c + 1] = reinterpret_cast<__m512bh>(high);
    }
    for (int q = 0; q < NQ; ++q) {
      const __m512bh w = reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int32_t>(pairs[q * stride + i])));
      for (int v = 0; v < 2 * NP; ++v) acc[q][v] = _mm512_dpbf16_ps(acc[q][v], w, value[v]);
    }
  }
  for (int q = 0; q < NQ; ++q)
    for (int v = 0; v < 2 * NP; ++v) _mm512_storeu_ps(out[q] + v * kLanes, acc[q][v]);
}
#else
constexpr bool kHasDotBf16 = false;
#endif

// s.dot_queries[q] = the bfloat16 bits of queries[q] (in s.bf16_queries) where the dpbf16 path applies to it (an
// AVX-512 build on a CPU with AVX512_BF16, rows of whole 32-value pairs of vectors, a query of bfloat16
// numbers), else nullptr; empty when no query of the chunk takes it.
template <int NV>
void prepare_dot_queries(const float* const* queries, int64_t nq, int64_t dim, Scratch& s) {
  s.dot_queries.clear();
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (NV % 2 == 0) {
    if (!cpu_has_avx512_bf16()) return;
    s.bf16_queries.resize(nq * dim);
    bool any = false;
    for (int64_t q = 0; q < nq; ++q) {
      uint16_t* bits = s.bf16_queries.data() + q * dim;
      const bool exact = query_as_bf16(queries[q], dim, bits);
      s.dot_queries.push_back(exact ? bits : nullptr);
      any = any || exact;
    }
    if (!any) s.dot_queries.clear();
  }
#endif
}

}  // namespace paged
}  // namespace octavo_cpu
