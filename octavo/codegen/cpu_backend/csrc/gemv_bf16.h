// The GEMV of octavo_cpu::linear_bf16 on the packed weight (bf16_packing.h): out [M, N] = x [M, K] @ W.T (+ bias)
// for 1 to kBf16GemvRows rows of x. It reads every word once, a block (32 output columns) at a time, and keeps the
// rows of x in cache: out[m, n] = bf16(sum over k of x[m, k] * W[n, k] (+ bias[n])), each product exact in float32
// (two bfloat16 numbers), the sum in float32 in the kernel's order, the bias added in float32, the result rounded
// to bfloat16 (nearest even) once.
// - AVX512_BF16 (a runtime check in the AVX-512 build): vdpbf16ps on the words with x's pairs broadcast (pairs of
//   products first); the instruction flushes denormal inputs and results to zero.
// - any other vector build: each word split into its two floats (shift / mask), two FMAs with x widened.
// - the portable build: the same arithmetic a column at a time.
#pragma once

#include "bf16_packing.h"
#include "vec_utils.h"

#include <c10/util/bit_cast.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace octavo_cpu {

constexpr int64_t kBf16GemvRows = 8;
constexpr int64_t kBf16TaskBytes = 64 * 1024;  // weight bytes a GEMV task reads at least
constexpr int64_t kBf16PrefetchBytes = 2048;   // how far ahead of the words being summed they are asked for

// The bfloat16 of `value`, rounded to nearest even (c10's conversion; NaN stays NaN).
inline uint16_t bf16_bits(float value) { return c10::BFloat16(value).x; }

// out[m, first + c] = bf16(sums[m][c] + bias[first + c]) for c < columns (columns of the block inside N).
inline void store_block_rows(const float* sums, int64_t rows, int64_t columns, const float* bias, int64_t first,
                             uint16_t* out, int64_t N) {
  for (int64_t m = 0; m < rows; ++m) {
    for (int64_t c = 0; c < columns; ++c) {
      const float total = bias ? sums[m * kBf16BlockColumns + c] + bias[first + c] : sums[m * kBf16BlockColumns + c];
      out[m * N + first + c] = bf16_bits(total);
    }
  }
}

// Column vectors of a block a GEMV sums at once for M rows: a power of two dividing V, M * VC accumulators
// within about half the vector registers (the rest hold weights and x).
constexpr int gemv_vectors(int V, int M) {
  const int budget = kLanes == 8 ? 12 : 24;
  int count = V;
  while (count > 1 && count * M > budget) count /= 2;
  return count;
}

#if defined(CPU_CAPABILITY_AVX512)
// sums[m * 32 + c] = sum over p of the block's word (p, c) . x's pair p of row m, for M rows of x given as pairs
// (x_words[m * pairs + p] = x[m, 2p], x[m, 2p + 1]) and one block's words ([pairs][32]): vdpbf16ps with x's pairs
// broadcast. The words `kBf16PrefetchBytes` ahead are asked for while summing, up to `prefetch_end`; with
// kReadOnce (the GEMV, whose every weight is summed in one pass and never read again in the call) as lines read once.
template <int M, bool kReadOnce = false>
__attribute__((target("avx512bf16"))) inline void dot_block_sums(const uint32_t* words, int64_t pairs,
                                                                  const uint32_t* x_words, const char* prefetch_end,
                                                                  float* sums) {
  constexpr int V = kBf16BlockColumns / 16;
  constexpr int VC = gemv_vectors(V, M);
  for (int v0 = 0; v0 < V; v0 += VC) {
    __m512 acc[M][VC];
    for (int m = 0; m < M; ++m)
      for (int v = 0; v < VC; ++v) acc[m][v] = _mm512_setzero_ps();
    for (int64_t p = 0; p < pairs; ++p) {
      const uint32_t* row = words + p * kBf16BlockColumns + v0 * 16;
      if (v0 == 0) {
        const char* here = reinterpret_cast<const char*>(row);
        prefetch_span<kReadOnce>(here + kBf16PrefetchBytes, here + kBf16PrefetchBytes + kBf16BlockColumns * 4,
                                 prefetch_end);
      }
      __m512bh weights[VC];
      for (int v = 0; v < VC; ++v) weights[v] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(row + v * 16));
      for (int m = 0; m < M; ++m) {
        const __m512bh xv = reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(x_words[m * pairs + p])));
        for (int v = 0; v < VC; ++v) acc[m][v] = _mm512_dpbf16_ps(acc[m][v], xv, weights[v]);
      }
    }
    for (int m = 0; m < M; ++m)
      for (int v = 0; v < VC; ++v) _mm512_storeu_ps(sums + m * kBf16BlockColumns + (v0 + v) * 16, acc[m][v]);
  }
}

// out[m, first + c] = bf16(sums[m * 32 + c] + bias[first + c]) for c < columns: the bias added in float32, one
// rounding to nearest even (vcvtneps2bf16, which makes a result below 2^-126 in magnitude zero).
__attribute__((target("avx512bf16"))) inline void store_block_bf16(const float* sums, int64_t rows, int64_t columns,
                                                                    const float* bias, int64_t first, uint16_t* out,
                                                                    int64_t N) {
  for (int64_t m = 0; m < rows; ++m) {
    for (int64_t offset = 0; offset < columns; offset += 16) {
      const int64_t count = std::min<int64_t>(columns - offset, 16);
      const __mmask16 mask = static_cast<__mmask16>((1u << count) - 1);
      __m512 total = _mm512_loadu_ps(sums + m * kBf16BlockColumns + offset);
      if (bias) total = _mm512_add_ps(total, _mm512_maskz_loadu_ps(mask, bias + first + offset));
      const __m256i rounded = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(total));
      _mm256_mask_storeu_epi16(out + m * N + first + offset, mask, rounded);
    }
  }
}

// Blocks [begin, end) of the GEMV for M rows of x given as pairs; kReadOnce as read_once_prefetch_pays() says.
template <int M, bool kReadOnce>
__attribute__((target("avx512bf16"))) void gemv_bf16_blocks_dot(const PackedBf16& w, const uint32_t* x_words,
                                                                 const float* bias, uint16_t* out, int64_t begin,
                                                                 int64_t end) {
  // One pass over each block's words (all its column vectors at once), so each weight line is read once.
  static_assert(gemv_vectors(kBf16BlockColumns / 16, M) == kBf16BlockColumns / 16, "the GEMV sums a block in one pass");
  const char* prefetch_end = reinterpret_cast<const char*>(w.block(end));
  __at_align__ float sums[M * kBf16BlockColumns];
  for (int64_t b = begin; b < end; ++b) {
    dot_block_sums<M, kReadOnce>(w.block(b), w.pairs, x_words, prefetch_end, sums);
    const int64_t first = b * kBf16BlockColumns;
    store_block_bf16(sums, M, std::min<int64_t>(kBf16BlockColumns, w.N - first), bias, first, out, w.N);
  }
}
#endif

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
// The two floats of each 32-bit word of `raw`: even = the low bfloat16, odd = the high one.
__attribute__((always_inline)) inline void split_words(const void* raw_words, Vec& even, Vec& odd) {
#if defined(CPU_CAPABILITY_AVX512)
  const __m512i raw = _mm512_loadu_si512(raw_words);
  even = Vec(_mm512_castsi512_ps(_mm512_slli_epi32(raw, 16)));
  odd = Vec(_mm512_castsi512_ps(_mm512_and_si512(raw, _mm512_set1_epi32(static_cast<int>(0xffff0000u)))));
#else
  const __m256i raw = _mm256_loadu_si256(static_cast<const __m256i*>(raw_words));
  even = Vec(_mm256_castsi256_ps(_mm256_slli_epi32(raw, 16)));
  odd = Vec(_mm256_castsi256_ps(_mm256_and_si256(raw, _mm256_set1_epi32(static_cast<int>(0xffff0000u)))));
#endif
}

// Blocks [begin, end) for M rows of x widened to float (x_wide[m * 2 * pairs + k], zero past K): per word, one
// FMA for its even k and one for its odd k. VC column vectors of a block at a time, so that the accumulators of
// M rows stay in registers (AVX2 has 16).
template <int M>
void gemv_bf16_blocks_widening(const PackedBf16& w, const float* x_wide, const float* bias, uint16_t* out,
                               int64_t begin, int64_t end) {
  constexpr int V = kBf16BlockColumns / kLanes;
  constexpr int VC = gemv_vectors(V, M);
  const int64_t pairs = w.pairs, stride = 2 * pairs;
  const char* prefetch_end = reinterpret_cast<const char*>(w.block(end));
  for (int64_t b = begin; b < end; ++b) {
    const uint32_t* words = w.block(b);
    __at_align__ float sums[M * kBf16BlockColumns];
    for (int v0 = 0; v0 < V; v0 += VC) {
      Vec acc[M][VC];
      for (int m = 0; m < M; ++m)
        for (int v = 0; v < VC; ++v) acc[m][v] = Vec(0.f);
      for (int64_t p = 0; p < pairs; ++p) {
        const uint32_t* row = words + p * kBf16BlockColumns + v0 * kLanes;
        if (v0 == 0) {
          const char* here = reinterpret_cast<const char*>(row);
          prefetch_span(here + kBf16PrefetchBytes, here + kBf16PrefetchBytes + kBf16BlockColumns * 4, prefetch_end);
        }
        Vec even[VC], odd[VC];
        for (int v = 0; v < VC; ++v) split_words(row + v * kLanes, even[v], odd[v]);
        for (int m = 0; m < M; ++m) {
          const Vec x_even(x_wide[m * stride + 2 * p]), x_odd(x_wide[m * stride + 2 * p + 1]);
          for (int v = 0; v < VC; ++v) {
            acc[m][v] = at::vec::fmadd(odd[v], x_odd, at::vec::fmadd(even[v], x_even, acc[m][v]));
          }
        }
      }
      for (int m = 0; m < M; ++m)
        for (int v = 0; v < VC; ++v) acc[m][v].store(sums + m * kBf16BlockColumns + (v0 + v) * kLanes);
    }
    const int64_t first = b * kBf16BlockColumns;
    store_block_rows(sums, M, std::min<int64_t>(kBf16BlockColumns, w.N - first), bias, first, out, w.N);
  }
}
#else
// The portable build: the widening arithmetic of the vector builds, a column at a time.
template <int M>
void gemv_bf16_blocks_widening(const PackedBf16& w, const float* x_wide, const float* bias, uint16_t* out,
                               int64_t begin, int64_t end) {
  const int64_t pairs = w.pairs, stride = 2 * pairs;
  for (int64_t b = begin; b < end; ++b) {
    const uint32_t* words = w.block(b);
    float sums[M * kBf16BlockColumns] = {};
    for (int64_t p = 0; p < pairs; ++p) {
      for (int64_t c = 0; c < kBf16BlockColumns; ++c) {
        const uint32_t word = words[p * kBf16BlockColumns + c];
        const float even = c10::bit_cast<float>(word << 16), odd = c10::bit_cast<float>(word & 0xffff0000u);
        for (int m = 0; m < M; ++m) {
          float& sum = sums[m * kBf16BlockColumns + c];
          sum = std::fma(even, x_wide[m * stride + 2 * p], sum);
          sum = std::fma(odd, x_wide[m * stride + 2 * p + 1], sum);
        }
      }
    }
    const int64_t first = b * kBf16BlockColumns;
    store_block_rows(sums, M, std::min<int64_t>(kBf16BlockColumns, w.N - first), bias, first, out, w.N);
  }
}
#endif

// The blocks split over the threads, at least kBf16TaskBytes of words a task.
template <typename Body>
void for_block_ranges(const PackedBf16& w, const Body& body) {
  const int64_t block_bytes = w.pairs * kBf16BlockColumns * 4;
  const int64_t grain = std::max<int64_t>(1, kBf16TaskBytes / std::max<int64_t>(block_bytes, 1));
  at::parallel_for(0, w.blocks, grain, body);
}

template <int M>
void gemv_bf16_rows(const PackedBf16& w, const uint32_t* x_words, const float* x_wide, const float* bias,
                    uint16_t* out) {
#if defined(CPU_CAPABILITY_AVX512)
  if (x_words != nullptr) {
    const bool read_once = read_once_prefetch_pays();
    return for_block_ranges(w, [&](int64_t begin, int64_t end) {
      if (read_once) return gemv_bf16_blocks_dot<M, true>(w, x_words, bias, out, begin, end);
      gemv_bf16_blocks_dot<M, false>(w, x_words, bias, out, begin, end);
    });
  }
#endif
  for_block_ranges(w, [&](int64_t begin, int64_t end) {
    gemv_bf16_blocks_widening<M>(w, x_wide, bias, out, begin, end);
  });
}

// out [rows, N] (bfloat16 bits) = x @ W.T (+ bias) for 1 to kBf16GemvRows rows. x_words: x as pairs when the
// dpbf16 path runs (else nullptr); x_wide: x widened to float, zero-padded to 2 * pairs columns, otherwise.
inline void gemv_bf16(int64_t rows, const PackedBf16& w, const uint32_t* x_words, const float* x_wide,
                      const float* bias, uint16_t* out) {
  with_row_count(rows, "linear_bf16's GEMV", [&](auto m) {
    gemv_bf16_rows<decltype(m)::value>(w, x_words, x_wide, bias, out);
  });
}

#if defined(CPU_CAPABILITY_AVX512)
// dot_block_sums for 1 to kBf16GemvRows rows of x.
inline void dot_block_sums_rows(int64_t rows, const uint32_t* words, int64_t pairs, const uint32_t* x_words,
                                const char* prefetch_end, float* sums) {
  with_row_count(rows, "dot_block_sums", [&](auto m) {
    dot_block_sums<decltype(m)::value>(words, pairs, x_words, prefetch_end, sums);
  });
}

// out [M, N] = x @ W.T (+ bias) for any M on CPUs with AVX512_BF16 but no AMX: the GEMV's dot kernel over tiles of
// kBf16GemvRows rows of x (x_words: x as pairs, [M, pairs]), each thread taking whole blocks (the block stays in
// cache while every tile of x runs through it).
inline void gemm_bf16_dot(const PackedBf16& w, const uint32_t* x_words, int64_t M, const float* bias, uint16_t* out) {
  at::parallel_for(0, w.blocks, 1, [&](int64_t begin, int64_t end) {
    __at_align__ float sums[kBf16GemvRows * kBf16BlockColumns];
    for (int64_t b = begin; b < end; ++b) {
      const int64_t first = b * kBf16BlockColumns, columns = std::min<int64_t>(kBf16BlockColumns, w.N - first);
      const char* prefetch_end = reinterpret_cast<const char*>(w.block(b + 1));
      for (int64_t row = 0; row < M; row += kBf16GemvRows) {
        const int64_t rows = std::min(kBf16GemvRows, M - row);
        dot_block_sums_rows(rows, w.block(b), w.pairs, x_words + row * w.pairs, prefetch_end, sums);
        store_block_bf16(sums, rows, columns, bias, first, out + row * w.N, w.N);
      }
    }
  });
}
#endif

}  // namespace octavo_cpu
