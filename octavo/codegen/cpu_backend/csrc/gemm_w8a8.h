// The arithmetic and kernels of octavo_cpu::linear_w8a8 (linear_w8a8.cpp): int8 weights with one scale per output
// row times x rounded to int8 at run time, in groups of kW8a8Group = 64 consecutive columns of a row, each group on a
// step of its own (dynamic, symmetric), its products summed exactly in int32. Every path computes the same bits:
//
//   amax[m, g]  = max over the group's k of |x[m, k]|          (x widened to float32 exactly)
//   step[m, g]  = amax[m, g] / 127                             (float32, rounded once)
//   xq[m, k]    = nearest-even(x[m, k] * (127 / amax[m, g]))   (the factor and the product each rounded to float32
//                                                               once; |xq| <= 127; 0 where amax is 0)
//   dot[m,n,g]  = sum over the group's k of xq[m, k] * q[n, k] (exact; |dot| <= 64 * 127 * 127 < 2^24, so float(dot)
//                                                               is exact too)
//   acc[m, n]   = fma(float(dot), step, acc) over the groups in K's order, from acc = 0 (float32)
//   out[m, n]   = fma(acc, scale[n], bias[n])                  (float32; no bias: + 0), then rounded to x's dtype once
//                                                               (nearest even).
//
// Against the float definition x @ (float(q) * scale).T the approximation is x's rounding,
// |x - xq * step| <= step / 2 = amax[m, g] / 254 per element, plus the float32 roundings of the groups' sum.
// Groups of 64 instead of one step per row: on SmolLM2 (float32 activations, 1024 tokens) one step per row cost
// +3.0% perplexity over w8 on the evaluation text and +2.5% on prose, groups of 64 +0.1% and -0.2% (128: 0.0% and
// +1.0%), for about a fifth more instructions than one step per row.
//
// Weight layout (pack_w8a8): blocks of 16 output rows; block b holds, for every 4 columns k4, the 4 bytes of each
// of its 16 rows: packed[b][k4][i][j] = q[16 b + i][4 k4 + j] + 128 (uint8: vpdpbusd takes its unsigned operand
// from the weights); rows past N and columns past K (padded to whole groups) hold 128 (a zero weight). One 64-byte load is then 4 columns
// of 16 rows, each int32 lane of vpdpbusd an output row: no sums across lanes. The +128 adds 128 * sum(xq[m]) to
// every sum of row m, taken back out exactly before the conversion.
#pragma once

#include "vec_utils.h"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

namespace octavo_cpu {

constexpr int64_t kW8a8BlockRows = 16;   // output rows a block interleaves (the int32 lanes of a vector)
constexpr int64_t kW8a8Group = 64;       // columns of x that share a step (16 steps of 4 columns)
constexpr int64_t kW8a8TileRows = 4;     // rows of x a register tile takes
constexpr int64_t kW8a8TileBlocks = 4;   // weight blocks a register tile takes (4 x 4 accumulators: GCC
                                         // kept 20 or more of them in memory, 5 x 4 measured 1.3x slower)

constexpr int64_t kW8a8GroupSteps = kW8a8Group / 4;

inline int64_t w8a8_groups(int64_t K) { return (K + kW8a8Group - 1) / kW8a8Group; }
// 4-column steps of a row, K padded to whole groups (zeros): every group takes the same unrolled loop.
inline int64_t w8a8_steps(int64_t K) { return w8a8_groups(K) * kW8a8GroupSteps; }
inline int64_t w8a8_blocks(int64_t N) { return (N + kW8a8BlockRows - 1) / kW8a8BlockRows; }

// x rounded to int8 as the header defines: xq [M, 4 * steps] (zeros past K); for each row and group the sum of
// its xq and its step ([M, groups]).
struct QuantizedRows {
  std::vector<int8_t> q;
  std::vector<int32_t> sums;
  std::vector<float> steps;
  int64_t stride;
  int64_t groups;
};

// xq[0:K] of one group, float32 values already widened; returns its step and writes the sum of xq to *sum.
inline float quantize_group_int8(const float* x, int64_t K, int8_t* xq, int32_t* sum) {
  float amax = 0.f;
  for (int64_t k = 0; k < K; ++k) amax = std::max(amax, std::fabs(x[k]));
  const float factor = amax > 0.f ? 127.f / amax : 0.f;
  int32_t total = 0;
  for (int64_t k = 0; k < K; ++k) {
    const float scaled = x[k] * factor;
    const float rounded = std::min(127.f, std::max(-127.f, std::nearbyint(scaled)));
    xq[k] = static_cast<int8_t>(rounded);
    total += xq[k];
  }
  *sum = total;
  return amax / 127.f;
}

#if defined(CPU_CAPABILITY_AVX512)
// 16 values of x from `x` (count of them, zeros past it) widened to float32 exactly.
template <typename T>
__attribute__((target("avx512f,avx512bw"), always_inline)) inline __m512 load_widened(const T* x, __mmask16 mask) {
  if constexpr (std::is_same_v<T, float>) {
    return _mm512_maskz_loadu_ps(mask, x);
  } else if constexpr (std::is_same_v<T, c10::Half>) {
    return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, x));
  } else {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, x)), 16));
  }
}

// quantize_group_int8 from x's own dtype, 16 values at a time: the same bits (max is exact; the products and the
// conversion round to nearest even as the scalar code does under the default rounding mode).
template <typename T>
__attribute__((target("avx512f,avx512bw"))) float quantize_group_int8_avx512(const T* x, int64_t K, int8_t* xq,
                                                                            int32_t* sum) {
  const __m512 sign = _mm512_set1_ps(-0.f);
  __m512 largest = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 16) {
    const __mmask16 mask = K - k >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (K - k)) - 1);
    largest = _mm512_max_ps(largest, _mm512_andnot_ps(sign, load_widened(x + k, mask)));
  }
  const float amax = _mm512_reduce_max_ps(largest);
  const __m512 factor = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
  const __m512i low = _mm512_set1_epi32(-127), high = _mm512_set1_epi32(127);
  __m512i total = _mm512_setzero_si512();
  for (int64_t k = 0; k < K; k += 16) {
    const __mmask16 mask = K - k >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (K - k)) - 1);
    const __m512i rounded = _mm512_cvtps_epi32(_mm512_mul_ps(load_widened(x + k, mask), factor));
    const __m512i clamped = _mm512_min_epi32(_mm512_max_epi32(rounded, low), high);
    total = _mm512_add_epi32(total, clamped);
    _mm_mask_storeu_epi8(xq + k, mask, _mm512_cvtepi32_epi8(clamped));
  }
  *sum = _mm512_reduce_add_epi32(total);
  return amax / 127.f;
}
#endif

template <typename T>
void quantize_rows_int8(const T* x, int64_t M, int64_t K, QuantizedRows& rows) {
  rows.stride = 4 * w8a8_steps(K);
  rows.groups = w8a8_groups(K);
  rows.q.assign(M * rows.stride, 0);
  rows.sums.assign(M * rows.groups, 0);
  rows.steps.assign(M * rows.groups, 0.f);
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
#if !defined(CPU_CAPABILITY_AVX512)
    std::vector<float> widened(kW8a8Group);
#endif
    for (int64_t m = begin; m < end; ++m) {
      for (int64_t g = 0; g < rows.groups; ++g) {
        const int64_t first = g * kW8a8Group, count = std::min(kW8a8Group, K - first), at = m * rows.groups + g;
        int8_t* xq = rows.q.data() + m * rows.stride + first;
#if defined(CPU_CAPABILITY_AVX512)
        rows.steps[at] = quantize_group_int8_avx512(x + m * K + first, count, xq, &rows.sums[at]);
#else
        for (int64_t k = 0; k < count; ++k) widened[k] = static_cast<float>(x[m * K + first + k]);
        rows.steps[at] = quantize_group_int8(widened.data(), count, xq, &rows.sums[at]);
#endif
      }
    }
  });
}

// The definition as plain loops over the packed layout: AVX-512 CPUs without AVX512_VNNI, and the default build.
template <typename T>
void gemm_w8a8_portable(const uint8_t* packed, int64_t N, int64_t K, const QuantizedRows& x, int64_t M,
                        const float* scales, const float* bias, T* out) {
  const int64_t steps = w8a8_steps(K);
  at::parallel_for(0, w8a8_blocks(N), 1, [&](int64_t begin, int64_t end) {
    int32_t dots[kW8a8BlockRows];
    float acc[kW8a8BlockRows];
    for (int64_t b = begin; b < end; ++b) {
      const uint8_t* block = packed + b * steps * 4 * kW8a8BlockRows;
      const int64_t rows = std::min(kW8a8BlockRows, N - b * kW8a8BlockRows);
      for (int64_t m = 0; m < M; ++m) {
        const int8_t* xq = x.q.data() + m * x.stride;
        std::fill(acc, acc + kW8a8BlockRows, 0.f);
        for (int64_t g = 0; g < x.groups; ++g) {
          std::fill(dots, dots + kW8a8BlockRows, -128 * x.sums[m * x.groups + g]);  // the +128 of the weights
          for (int64_t s = g * kW8a8GroupSteps; s < (g + 1) * kW8a8GroupSteps; ++s) {
            for (int64_t i = 0; i < kW8a8BlockRows; ++i) {
              const uint8_t* w = block + (s * kW8a8BlockRows + i) * 4;
              for (int64_t j = 0; j < 4; ++j) dots[i] += static_cast<int32_t>(w[j]) * xq[4 * s + j];
            }
          }
          const float step = x.steps[m * x.groups + g];
          for (int64_t i = 0; i < kW8a8BlockRows; ++i) acc[i] = std::fma(static_cast<float>(dots[i]), step, acc[i]);
        }
        for (int64_t i = 0; i < rows; ++i) {
          const int64_t n = b * kW8a8BlockRows + i;
          out[m * N + n] = static_cast<T>(std::fma(acc[i], scales[n], bias ? bias[n] : 0.f));
        }
      }
    }
  });
}

#if defined(CPU_CAPABILITY_AVX512)
// Whether this CPU executes AVX512_VNNI (asked once).
inline bool w8a8_vnni_usable() {
  static const bool present = __builtin_cpu_supports("avx512vnni");
  return present;
}

// Stores 16 float32 results (`count` of them) as T.
template <typename T>
__attribute__((target("avx512f"), always_inline)) inline void store_w8a8_results(__m512 values, int64_t count, T* dst) {
  const __mmask16 mask = count >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << count) - 1);
  if constexpr (std::is_same_v<T, float>) {
    _mm512_mask_storeu_ps(dst, mask, values);
  } else {
    alignas(64) float buffer[16];
    _mm512_store_ps(buffer, values);
    for (int64_t i = 0; i < count; ++i) dst[i] = static_cast<T>(buffer[i]);
  }
}

// acc += the sums of 4 products of unsigned bytes of `weights` and signed bytes of `x`, per int32 lane (vpdpbusd),
// in place: with the intrinsic GCC copied accumulators between registers on each step (GEMMs at 0.77-0.88x the
// bfloat16 GEMM's time on a Zen 5 instead of 0.56-0.80x, scripts/measure_w8a8.py).
__attribute__((target("avx512vnni"), always_inline)) inline void add_dot_bytes(__m512i& acc, __m512i weights,
                                                                               __m512i x) {
  asm("vpdpbusd %[x], %[weights], %[acc]" : [acc] "+v"(acc) : [weights] "v"(weights), [x] "v"(x));
}

// Rows [m0, m0 + MT) of x against the weight blocks [b0, b0 + NB): for each group, MT x NB vectors of 16 int32
// sums (one vpdpbusd per 4 columns of 16 rows and row of x, its 4 bytes broadcast), started from the group's
// -128 * sum(xq) and added into float32 partial sums kept in L1; then the header's last step.
template <typename T, int MT, int NB>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) void w8a8_tile(const uint8_t* packed, int64_t N, int64_t K,
                                                                      const QuantizedRows& x, int64_t m0, int64_t b0,
                                                                      const float* scales, const float* bias,
                                                                      T* out) {
  const int64_t block_bytes = w8a8_steps(K) * 4 * kW8a8BlockRows;
  const uint8_t* blocks = packed + b0 * block_bytes;
  const int8_t* rows = x.q.data() + m0 * x.stride;
  const int64_t stride = x.stride, groups = x.groups;
  alignas(64) float partial[MT][NB][16];
  // Every loop over the tile fully unrolled: an accumulator indexed at run time anywhere would keep the array in
  // memory, and GCC then stores each accumulator on every step.
  for (int64_t g = 0; g < groups; ++g) {
    __m512i acc[MT][NB];
#pragma GCC unroll 8
    for (int m = 0; m < MT; ++m) {
      const __m512i start = _mm512_set1_epi32(-128 * x.sums[(m0 + m) * groups + g]);
#pragma GCC unroll 4
      for (int b = 0; b < NB; ++b) acc[m][b] = start;
    }
#pragma GCC unroll 16
    for (int64_t s = g * kW8a8GroupSteps; s < (g + 1) * kW8a8GroupSteps; ++s) {
      __m512i w[NB];
#pragma GCC unroll 4
      for (int b = 0; b < NB; ++b) w[b] = _mm512_loadu_si512(blocks + b * block_bytes + s * 64);
#pragma GCC unroll 8
      for (int m = 0; m < MT; ++m) {
        int32_t word;
        std::memcpy(&word, rows + m * stride + 4 * s, sizeof(word));
        const __m512i xv = _mm512_set1_epi32(word);
#pragma GCC unroll 4
        for (int b = 0; b < NB; ++b) add_dot_bytes(acc[m][b], w[b], xv);
      }
    }
#pragma GCC unroll 8
    for (int m = 0; m < MT; ++m) {
      const __m512 step = _mm512_set1_ps(x.steps[(m0 + m) * groups + g]);
#pragma GCC unroll 4
      for (int b = 0; b < NB; ++b) {
        const __m512 sum = g == 0 ? _mm512_setzero_ps() : _mm512_load_ps(partial[m][b]);
        _mm512_store_ps(partial[m][b], _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[m][b]), step, sum));
      }
    }
  }
#pragma GCC unroll 4
  for (int b = 0; b < NB; ++b) {
    const int64_t n0 = (b0 + b) * kW8a8BlockRows, count = std::min(kW8a8BlockRows, N - n0);
    const __mmask16 mask = count >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << count) - 1);
    const __m512 scale = _mm512_maskz_loadu_ps(mask, scales + n0);
    const __m512 shift = bias ? _mm512_maskz_loadu_ps(mask, bias + n0) : _mm512_setzero_ps();
#pragma GCC unroll 8
    for (int m = 0; m < MT; ++m) {
      const __m512 value = _mm512_fmadd_ps(_mm512_load_ps(partial[m][b]), scale, shift);
      store_w8a8_results(value, count, out + (m0 + m) * N + n0);
    }
  }
}

template <typename T, int MT>
void w8a8_tile_blocks(int64_t blocks, const uint8_t* packed, int64_t N, int64_t K, const QuantizedRows& x,
                      int64_t m0, int64_t b0, const float* scales, const float* bias, T* out) {
  switch (blocks) {
    case 1: return w8a8_tile<T, MT, 1>(packed, N, K, x, m0, b0, scales, bias, out);
    case 2: return w8a8_tile<T, MT, 2>(packed, N, K, x, m0, b0, scales, bias, out);
    case 3: return w8a8_tile<T, MT, 3>(packed, N, K, x, m0, b0, scales, bias, out);
    default: return w8a8_tile<T, MT, 4>(packed, N, K, x, m0, b0, scales, bias, out);
  }
}

// Each thread takes a range of weight blocks, kW8a8TileBlocks at a time, and runs every row of x through them in
// tiles of kW8a8TileRows (the blocks stay in L1/L2 while x passes; at one row the weights stream once).
template <typename T>
void gemm_w8a8_vnni(const uint8_t* packed, int64_t N, int64_t K, const QuantizedRows& x, int64_t M,
                    const float* scales, const float* bias, T* out) {
  at::parallel_for(0, w8a8_blocks(N), 1, [&](int64_t begin, int64_t end) {
    for (int64_t b0 = begin; b0 < end; b0 += kW8a8TileBlocks) {
      const int64_t blocks = std::min(kW8a8TileBlocks, end - b0);
      for (int64_t m0 = 0; m0 < M; m0 += kW8a8TileRows) {
        switch (std::min(kW8a8TileRows, M - m0)) {
          case 1: w8a8_tile_blocks<T, 1>(blocks, packed, N, K, x, m0, b0, scales, bias, out); break;
          case 2: w8a8_tile_blocks<T, 2>(blocks, packed, N, K, x, m0, b0, scales, bias, out); break;
          case 3: w8a8_tile_blocks<T, 3>(blocks, packed, N, K, x, m0, b0, scales, bias, out); break;
          default: w8a8_tile_blocks<T, 4>(blocks, packed, N, K, x, m0, b0, scales, bias, out); break;
        }
      }
    }
  });
}
#endif

#if defined(CPU_CAPABILITY_AVX2)
// The AVX2 build (CPUs without AVX-512): vpmaddubsw multiplies unsigned by signed bytes into 16-bit pair sums,
// which would saturate on the packed weights (up to 255) times x (up to 127). So each weight byte goes back to q
// (xor 128) and in as |q|, x's bytes taking q's sign (vpsignb): |q| * (+-x) = q * x, a pair's sum at most
// 2 * 127 * 127 < 2^15, exact; vpmaddwd adds pairs into int32 lanes. The sums are then q * xq without the +128,
// so a group's accumulators start at 0. A 16-row block's step is two 32-byte halves (rows 0-7, 8-15); tiles of
// kW8a8Avx2TileRows rows of x against one block fit AVX2's 16 registers.
constexpr int64_t kW8a8Avx2TileRows = 3;

template <typename T, int MT>
void w8a8_tile_avx2(const uint8_t* packed, int64_t N, int64_t K, const QuantizedRows& x, int64_t m0, int64_t b,
                    const float* scales, const float* bias, T* out) {
  const uint8_t* block = packed + b * w8a8_steps(K) * 4 * kW8a8BlockRows;
  const int8_t* rows = x.q.data() + m0 * x.stride;
  const int64_t stride = x.stride, groups = x.groups;
  const __m256i top_bit = _mm256_set1_epi8(static_cast<char>(0x80)), ones = _mm256_set1_epi16(1);
  __m256 partial[MT][2];
  for (int64_t g = 0; g < groups; ++g) {
    __m256i acc[MT][2];
#pragma GCC unroll 4
    for (int m = 0; m < MT; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_si256();
#pragma GCC unroll 16
    for (int64_t s = g * kW8a8GroupSteps; s < (g + 1) * kW8a8GroupSteps; ++s) {
      __m256i q[2], magnitude[2];
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {
        q[h] = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + s * 64 + h * 32)),
                                top_bit);
        magnitude[h] = _mm256_abs_epi8(q[h]);
      }
#pragma GCC unroll 4
      for (int m = 0; m < MT; ++m) {
        int32_t word;
        std::memcpy(&word, rows + m * stride + 4 * s, sizeof(word));
        const __m256i xv = _mm256_set1_epi32(word);
#pragma GCC unroll 2
        for (int h = 0; h < 2; ++h) {
          const __m256i pairs = _mm256_maddubs_epi16(magnitude[h], _mm256_sign_epi8(xv, q[h]));
          acc[m][h] = _mm256_add_epi32(acc[m][h], _mm256_madd_epi16(pairs, ones));
        }
      }
    }
#pragma GCC unroll 4
    for (int m = 0; m < MT; ++m) {
      const __m256 step = _mm256_set1_ps(x.steps[(m0 + m) * groups + g]);
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {
        const __m256 sum = g == 0 ? _mm256_setzero_ps() : partial[m][h];
        partial[m][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[m][h]), step, sum);
      }
    }
  }
  const int64_t n0 = b * kW8a8BlockRows, count = std::min(kW8a8BlockRows, N - n0);
  for (int m = 0; m < MT; ++m) {
    alignas(32) float sums[kW8a8BlockRows];
    _mm256_store_ps(sums, partial[m][0]);
    _mm256_store_ps(sums + 8, partial[m][1]);
    for (int64_t i = 0; i < count; ++i) {
      const float value = std::fma(sums[i], scales[n0 + i], bias ? bias[n0 + i] : 0.f);
      out[(m0 + m) * N + n0 + i] = static_cast<T>(value);
    }
  }
}

template <typename T>
void gemm_w8a8_avx2(const uint8_t* packed, int64_t N, int64_t K, const QuantizedRows& x, int64_t M,
                    const float* scales, const float* bias, T* out) {
  at::parallel_for(0, w8a8_blocks(N), 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      for (int64_t m0 = 0; m0 < M; m0 += kW8a8Avx2TileRows) {
        switch (std::min(kW8a8Avx2TileRows, M - m0)) {
          case 1: w8a8_tile_avx2<T, 1>(packed, N, K, x, m0, b, scales, bias, out); break;
          case 2: w8a8_tile_avx2<T, 2>(packed, N, K, x, m0, b, scales, bias, out); break;
          default: w8a8_tile_avx2<T, 3>(packed, N, K, x, m0, b, scales, bias, out); break;
        }
      }
    }
  });
}
#endif

}  // namespace octavo_cpu
