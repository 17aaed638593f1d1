// int8 rows for the in-place decode kernel (paged_decode.h) when the queries are a bfloat16 model's: integer dot
// products on pairs of 16-bit integers (vpdpwssd on CPUs with AVX512_VNNI, vpmaddwd and vpaddd elsewhere; the
// same exact int32 sums either way) instead of widening every int8 to float.
// - keys: each query becomes q16 = round_half_even(q / sq) with sq = max|q| / 32767 (per query, so a query's
//   arithmetic never depends on the others); score_j = float(sum_d q16[d] * k_j[d]) * key_scale_j *
//   (scale * sq), the sum exact in int32 (|q16 * k| <= 32767 * 127, up to 512 dims).
// - values: per query and chunk, the weights w_j = exp(s_j - m) * value_scale_j become w16_j =
//   round_half_even(w_j / sw) with sw = max_j w_j / 32767; out[d] = float(sum_j w16_j * v_j[d]) * sw, the sum
//   exact in int32 (up to kInt8ValueRowsMax rows). Rows j and j + 1 are interleaved byte-wise once per pair for
//   all the queries.
// The rounding of q and w is an error of at most 2^-16 of the largest |q| or w: 256 times below the bfloat16
// rounding of these queries' model everywhere else (2^-8 relative), and below that of the weights in the bfloat16 cache's
// dpbf16 path. A float32 model's queries keep the exact widening path.
#pragma once

#include "paged_attention_types.h"

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace octavo_cpu {
namespace paged {

constexpr int64_t kInt8ValueRowsMax = 512;  // rows whose weighted int32 sums cannot overflow (512 * 32767 * 127)

#if defined(CPU_CAPABILITY_AVX512)
inline bool cpu_has_avx512_vnni() {
  static const bool present = __builtin_cpu_supports("avx512vnni");
  return present;
}

// acc + a[2i] * b[2i] + a[2i + 1] * b[2i + 1] in each int32 lane i (a, b: 32 int16 each), exactly. The VNNI form
// is written in assembly so that the kernels need no target attribute (GCC would not inline the intrinsic into a
// function without one, nor may a function with one run on a CPU without VNNI).
template <bool kVnni>
__attribute__((always_inline)) inline __m512i add_pair_products(__m512i acc, __m512i a, __m512i b) {
  if constexpr (kVnni) {
    asm("vpdpwssd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
    return acc;
  } else {
    return _mm512_add_epi32(acc, _mm512_madd_epi16(a, b));
  }
}

// out[0:n] = round_half_even(values[0:n] / step) as int16 (n a multiple of 16), step = max|values| / 32767 (1 when
// every value is 0); returns step.
inline float quantize_int16(const float* values, int64_t n, int16_t* out) {
  __m512 peak = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) peak = _mm512_max_ps(peak, _mm512_abs_ps(_mm512_loadu_ps(values + i)));
  const float largest = _mm512_reduce_max_ps(peak);
  const float step = largest > 0.f ? largest / 32767.f : 1.f;
  const __m512 divisor = _mm512_set1_ps(step);
  for (int64_t i = 0; i < n; i += 16) {
    const __m512i rounded = _mm512_cvt_roundps_epi32(_mm512_div_ps(_mm512_loadu_ps(values + i), divisor),
                                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), _mm512_cvtsepi32_epi16(rounded));
  }
  return step;
}

// The 16 horizontal sums of acc[0:16] as one vector, exactly in int32 (transpose_sum's tree on integers).
__attribute__((always_inline)) inline __m512i transpose_sum_epi32(const __m512i* acc) {
  __m512 vectors[16];
  for (int i = 0; i < 16; ++i) vectors[i] = _mm512_castsi512_ps(acc[i]);
  return _mm512_castps_si512(transpose_tree(vectors, [](__m512 a, __m512 b) {
    return _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(a), _mm512_castps_si512(b)));
  }));
}

// s.int16_queries / s.query_steps for the chunk's nq queries (dim a multiple of 32).
inline void prepare_int16_queries(const float* const* queries, int64_t nq, int64_t dim, Scratch& s) {
  s.int16_queries.resize(nq * dim);
  s.query_steps.resize(nq);
  for (int64_t q = 0; q < nq; ++q) s.query_steps[q] = quantize_int16(queries[q], dim, s.int16_queries.data() + q * dim);
}

// scores[q][j] = float(q16 . k_j) * key_scales[j] * (scale * steps[q]) for the NQ queries and j in [0, n), rows of
// NP * 32 int8, each key row widened to int16 once for all NQ queries; 16 keys at a time through one integer
// transpose_sum. Each scores[q] has room for round_up(n, 16) values (past n: 0). With `prefetch`, asks for the
// rows prefetch[j] as key j is scored.
template <int NP, int NQ, bool kVnni>
void score_keys_int8(const int16_t* const* queries, const float* steps, const void* const* rows,
                     const float* key_scales, int64_t n, float scale, float* const* scores, const void* const* prefetch,
                     Lookahead& ahead) {
  __m512i q[NQ][NP];
  for (int i = 0; i < NQ; ++i)
    for (int v = 0; v < NP; ++v) q[i][v] = _mm512_loadu_si512(queries[i] + v * 32);
  for (int64_t first = 0; first < n; first += 16) {
    const int64_t count = std::min<int64_t>(16, n - first);
    if (prefetch != nullptr) {
      for (int64_t j = first; j < first + count; ++j) prefetch_bytes(prefetch[j], NP * 32);
    }
    ahead.step(kLookaheadPerScoredGroup);
    __m512i acc[NQ][16];
    for (int64_t j = 0; j < 16; ++j) {
      if (j >= count) {
        for (int i = 0; i < NQ; ++i) acc[i][j] = _mm512_setzero_si512();
        continue;
      }
      const int8_t* key = static_cast<const int8_t*>(rows[first + j]);
      __m512i k[NP];
      for (int v = 0; v < NP; ++v) {
        k[v] = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(key + v * 32)));
      }
      for (int i = 0; i < NQ; ++i) {
        __m512i sum = add_pair_products<kVnni>(_mm512_setzero_si512(), q[i][0], k[0]);
        for (int v = 1; v < NP; ++v) sum = add_pair_products<kVnni>(sum, q[i][v], k[v]);
        acc[i][j] = sum;
      }
    }
    const __m512 row_scale = _mm512_loadu_ps(key_scales + first);
    for (int i = 0; i < NQ; ++i) {
      const __m512 dots = _mm512_cvtepi32_ps(transpose_sum_epi32(acc[i]));
      _mm512_storeu_ps(scores[i] + first,
                       _mm512_mul_ps(_mm512_mul_ps(dots, row_scale), _mm512_set1_ps(scale * steps[i])));
    }
  }
}

// out[q][d] = float(sum_j w16_q[j] * v_j[d]) * sw_q for the NQ queries (weights[q][0:n], quantized per query as
// the header says), rows of NP * 32 int8, j in pairs (j, j + 1) interleaved byte-wise once for all queries; an odd
// last row pairs with a zero row and weight. `quantized` is scratch for the int16 weights (n <= kInt8ValueRowsMax).
template <int NP, int NQ, bool kVnni>
void weighted_values_int8(const float* const* weights, const void* const* rows, int64_t n, float* const* out,
                          Lookahead& ahead, std::vector<int16_t>& quantized) {
  alignas(64) static constexpr int8_t kZeroRow[NP * 32] = {};
  const int64_t num_pairs = (n + 1) / 2, padded = round_up(2 * num_pairs, 16);
  quantized.resize(NQ * padded);
  float steps[NQ];
  for (int i = 0; i < NQ; ++i) {
    // weights[i] holds round_up(n, 16) values, 0 past n
    steps[i] = quantize_int16(weights[i], padded, quantized.data() + i * padded);
  }
  __m512i acc[NQ][2 * NP];
  for (int i = 0; i < NQ; ++i)
    for (int v = 0; v < 2 * NP; ++v) acc[i][v] = _mm512_setzero_si512();
  for (int64_t p = 0; p < num_pairs; ++p) {
    const int8_t* even = static_cast<const int8_t*>(rows[2 * p]);
    const int8_t* odd = 2 * p + 1 < n ? static_cast<const int8_t*>(rows[2 * p + 1]) : kZeroRow;
    ahead.step(2 * kLookaheadPerValueRow);
    __m512i value[2 * NP];  // value[2c]: dims 32c + [0, 8) and [16, 24); value[2c + 1]: [8, 16) and [24, 32)
    for (int c = 0; c < NP; ++c) {
      const __m256i e = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(even + c * 32));
      const __m256i o = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(odd + c * 32));
      value[2 * c] = _mm512_cvtepi8_epi16(_mm256_unpacklo_epi8(e, o));
      value[2 * c + 1] = _mm512_cvtepi8_epi16(_mm256_unpackhi_epi8(e, o));
    }
    for (int i = 0; i < NQ; ++i) {
      int32_t word;
      std::memcpy(&word, quantized.data() + i * padded + 2 * p, sizeof(word));
      const __m512i w = _mm512_set1_epi32(word);
      for (int v = 0; v < 2 * NP; ++v) acc[i][v] = add_pair_products<kVnni>(acc[i][v], value[v], w);
    }
  }
  for (int i = 0; i < NQ; ++i) {
    const __m512 step = _mm512_set1_ps(steps[i]);
    for (int c = 0; c < NP; ++c) {
      const __m512i a = acc[i][2 * c], b = acc[i][2 * c + 1];
      const __m512i low = _mm512_shuffle_i64x2(a, b, _MM_SHUFFLE(1, 0, 1, 0));   // dims [0, 16)
      const __m512i high = _mm512_shuffle_i64x2(a, b, _MM_SHUFFLE(3, 2, 3, 2));  // dims [16, 32)
      _mm512_storeu_ps(out[i] + c * 32, _mm512_mul_ps(_mm512_cvtepi32_ps(low), step));
      _mm512_storeu_ps(out[i] + c * 32 + 16, _mm512_mul_ps(_mm512_cvtepi32_ps(high), step));
    }
  }
}
#endif

// The path for this call: integer pairs where the build has them (VNNI where the CPU does), unless
// OCTAVO_CPU_INT8_CACHE_DOT says otherwise ("float": widen to float; "madd": integer pairs without VNNI; "vnni":
// fails on a CPU without it). Builds below AVX-512 always widen.
inline Int8Dot int8_dot_choice() {
  const char* env = std::getenv("OCTAVO_CPU_INT8_CACHE_DOT");
  const std::string choice = env == nullptr || *env == '\0' ? "auto" : env;
  TORCH_CHECK(choice == "auto" || choice == "float" || choice == "madd" || choice == "vnni",
              "OCTAVO_CPU_INT8_CACHE_DOT must be auto, float, madd or vnni, got '", choice, "'");
#if defined(CPU_CAPABILITY_AVX512)
  if (choice == "float") return Int8Dot::kFloat;
  if (choice == "madd") return Int8Dot::kMadd;
  TORCH_CHECK(choice == "auto" || cpu_has_avx512_vnni(), "OCTAVO_CPU_INT8_CACHE_DOT=vnni: this CPU has no AVX512_VNNI");
  return cpu_has_avx512_vnni() ? Int8Dot::kVnni : Int8Dot::kMadd;
#else
  return Int8Dot::kFloat;
#endif
}

}  // namespace paged
}  // namespace octavo_cpu
