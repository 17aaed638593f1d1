// The AMX-INT8 GEMM of linear_w8 (linear_quantized.cpp; AVX-512 build, CPUs with AMX-INT8) for int8 weights with
// one scale per output channel, above the GEMV's rows: out [M, N] = x [M, K] @ W.T (+ bias), W = float(q) * scale.
// The weights are never widened: their int8 values are the tiles' B operand as they are.
//
// Arithmetic: each row of x is rounded to integers on its own step, step = max |x[m, :]| / 32767 (1 for a row of
// zeros): xi = round(x * (32767 / max |x[m, :]|)) (nearest even), |xi| <= 32767, so |xi * step - x| <= step / 2
// (plus float32 roundings of the factors: at most 2^-9 step + 2^-22 |x|); xi is split into a
// signed high byte and an unsigned low byte, xi = 256 * high + low. TDPBSSD and TDPBUSD sum high * q and low * q
// over K exactly in int32 (|sums| < 2^31 for K below 2^16). Then in float32: out = (256 * float(sum_high) +
// float(sum_low)) * (step * scale) + bias, each operation rounded once, and rounded to out's dtype once.
// Against the definition the error is at most scale * step / 2 * sum over k of |q| (x's rounding, 2^-16 of the
// row's largest value per term: below bfloat16's 2^-8 relative rounding of every value but those 256 times smaller
// than the row's largest) plus a few float32 roundings of the result.
#pragma once

#include "gemm_amx_dequantizing.h"

#if defined(CPU_CAPABILITY_AVX512)
#include <ATen/Parallel.h>
#include <ATen/cpu/Utils.h>
#include <ATen/cpu/vec/vec.h>
#include <immintrin.h>

#include <cmath>
#include <limits>
#include <vector>

namespace octavo_cpu {

constexpr int64_t kInt8Depth = 64;  // int8 values per tile row: K is padded to whole tiles
constexpr int64_t kInt8GemmMaxK = 65536;  // 255 * 128 * K, the low bytes' largest sum, stays below 2^31

// Whether AMX-INT8 runs in this process (the CPU has it and Linux granted the tile state; asked once).
inline bool amx_int8_usable() {
  static const bool usable = __builtin_cpu_supports("amx-int8") && at::cpu::init_amx();
  return usable;
}

// x's rows as 16-bit integers in two byte planes (the tiles' A operands) [Mpad][Kpad], and each row's step. Rows
// past M and columns past K hold whatever an earlier call left there: the B operand is zero past K, and the sums of
// rows past M are never stored.
struct SplitRows {
  int64_t Mpad, Kpad;
  const int8_t* high;   // xi >> 8 (arithmetic)
  const uint8_t* low;   // xi & 255
  const float* step;    // [M]
};

// xi = round(row / step) into high[0:K] and low[0:K], step = max |row| / 32767 (1 where the row is all zeros); the
// division is a multiplication by 32767 / max |row|, which moves xi by at most one where row / step lies within
// float32 rounding of a half-integer.
template <typename T>
float split_row(const T* row, int64_t K, int8_t* high, uint8_t* low) {
  __m512 largest = _mm512_setzero_ps();
  __mmask16 nan = 0;  // vmaxps drops a NaN in its first operand: NaNs are looked for on their own
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    const __m512 v = load_widened(row + k);
    largest = _mm512_max_ps(largest, _mm512_abs_ps(v));
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  }
  float amax = _mm512_reduce_max_ps(largest);
  bool any_nan = nan != 0;
  for (; k < K; ++k) {
    const float v = static_cast<float>(row[k]);
    amax = std::max(amax, std::abs(v));
    any_nan = any_nan || std::isnan(v);
  }
  // A NaN in the row makes its step NaN and an infinity makes it infinite (its xi are then 0): either way the
  // row's outputs are NaN, as a float GEMM's would be, instead of finite values from saturated integers.
  if (any_nan) amax = std::numeric_limits<float>::quiet_NaN();
  const bool finite_nonzero = amax > 0.f && std::isfinite(amax);
  const float step = amax == 0.f ? 1.f : amax / 32767.f, inverse = finite_nonzero ? 32767.f / amax : 0.f;
  const __m512 factor = _mm512_set1_ps(inverse), bound = _mm512_set1_ps(32767.f);
  k = 0;
  for (; k + 16 <= K; k += 16) {
    const __m512 scaled = _mm512_min_ps(_mm512_max_ps(_mm512_mul_ps(load_widened(row + k), factor), -bound), bound);
    const __m512i xi = _mm512_cvt_roundps_epi32(scaled, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(high + k), _mm512_cvtepi32_epi8(_mm512_srai_epi32(xi, 8)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(low + k), _mm512_cvtepi32_epi8(xi));
  }
  for (; k < K; ++k) {
    const float scaled = std::min(std::max(static_cast<float>(row[k]) * inverse, -32767.f), 32767.f);
    const int32_t xi = static_cast<int32_t>(std::nearbyint(scaled));
    high[k] = static_cast<int8_t>(xi >> 8);
    low[k] = static_cast<uint8_t>(xi & 255);
  }
  return step;
}

// x [M, K] (float32, bfloat16 or float16, contiguous) split into SplitRows. The planes are buffers of the calling
// thread kept for its next call, grown to the largest x it has split: a fresh allocation of their size would be
// mapped and faulted in at every call.
template <typename T>
SplitRows split_rows(const T* x, int64_t M, int64_t K) {
  static thread_local TileVector<int8_t> high;
  static thread_local TileVector<uint8_t> low;
  static thread_local std::vector<float> step;
  const int64_t Mpad = round_up(M, kAmxTileRows), Kpad = round_up(K, kInt8Depth);
  if (static_cast<int64_t>(high.size()) < Mpad * Kpad) {
    high.resize(Mpad * Kpad);
    low.resize(Mpad * Kpad);
  }
  if (static_cast<int64_t>(step.size()) < M) step.resize(M);
  // The workers see their own thread_local buffers by these names: they are handed the caller's by pointer.
  const SplitRows split{Mpad, Kpad, high.data(), low.data(), step.data()};
  int8_t* const high_plane = high.data();
  uint8_t* const low_plane = low.data();
  float* const steps = step.data();
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      steps[m] = split_row(x + m * K, K, high_plane + m * Kpad, low_plane + m * Kpad);
    }
  });
  return split;
}

// words [Kpad / 4][32]: the int8 rows n0 .. n0 + 31 of q [N, K] as the tiles' B operand: word (j, c) holds
// q[n0 + c, 4j .. 4j + 3] (zeros past N and K), which is row n0 + c's word j.
inline void pack_int8_block(const int8_t* q, int64_t N, int64_t K, int64_t Kpad, int64_t n0, uint32_t* words) {
  for (int64_t half = 0; half < 2; ++half) {
    for (int64_t k = 0; k < Kpad; k += kInt8Depth) {
      const int64_t left = K - k;
      const __mmask64 mask = left >= 64 ? ~__mmask64(0) : left <= 0 ? __mmask64(0) : (__mmask64(1) << left) - 1;
      __m512i in[16], out[16];
      for (int r = 0; r < 16; ++r) {
        const int64_t n = n0 + half * kAmxTileRows + r;
        in[r] = n < N ? _mm512_maskz_loadu_epi8(mask, q + n * K + k) : _mm512_setzero_si512();
      }
      transpose_16x16(in, out);
      for (int j = 0; j < 16; ++j) {
        _mm512_storeu_si512(words + (k / 4 + j) * kBf16BlockColumns + half * kAmxTileRows, out[j]);
      }
    }
  }
}

// high_sums, low_sums [16][32] (+)= the 16 rows of x's planes at `high` / `low` (ld Kpad) times `quads` rows of the
// block's words (from the same column of K on): int32, exact. The sums start from zero when `accumulate` is false.
__attribute__((target("amx-tile,amx-int8"))) inline void amx_int8_rows(const int8_t* high, const uint8_t* low,
                                                                       int64_t Kpad, const uint32_t* words,
                                                                       int64_t quads, int32_t* high_sums,
                                                                       int32_t* low_sums, bool accumulate) {
  const int64_t c_stride = kBf16BlockColumns * 4;
  if (accumulate) {
    _tile_loadd(0, high_sums, c_stride);
    _tile_loadd(1, high_sums + kAmxTileRows, c_stride);
    _tile_loadd(2, low_sums, c_stride);
    _tile_loadd(3, low_sums + kAmxTileRows, c_stride);
  } else {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
  }
  for (int64_t j = 0; j < quads; j += kAmxTileRows) {
    const uint32_t* b = words + j * kBf16BlockColumns;
    _tile_stream_loadd(4, high + 4 * j, Kpad);  // x's rows stream past the block's words, which stay in L1
    _tile_stream_loadd(5, low + 4 * j, Kpad);
    _tile_loadd(6, b, c_stride);
    _tile_loadd(7, b + kAmxTileRows, c_stride);
    _tile_dpbssd(0, 4, 6);
    _tile_dpbssd(1, 4, 7);
    _tile_dpbusd(2, 5, 6);
    _tile_dpbusd(3, 5, 7);
  }
  _tile_stored(0, high_sums, c_stride);
  _tile_stored(1, high_sums + kAmxTileRows, c_stride);
  _tile_stored(2, low_sums, c_stride);
  _tile_stored(3, low_sums + kAmxTileRows, c_stride);
}

// dst[0:columns] = T(the 32 floats of `low` then `high`): bfloat16 in registers (vcvtne2ps2bf16: nearest even, a
// value below 2^-126 in magnitude becomes zero), other types through `row` and ATen's conversion.
template <typename T>
inline void store_row(__m512 low, __m512 high, float* row, T* dst, int64_t columns) {
  _mm512_store_ps(row, low);
  _mm512_store_ps(row + kAmxTileRows, high);
  at::vec::convert(row, dst, columns);
}

inline void store_row(__m512 low, __m512 high, float*, c10::BFloat16* dst, int64_t columns) {
  store_bf16(low, high, dst, columns);
}

// out[m, n0 + c] = T((256 * high + low) * (step[m] * scale[n0 + c]) + bias[n0 + c]) for the rows m0 .. m0 + rows - 1
// and c < columns.
template <typename T>
void store_int8_sums(const int32_t* high_sums, const int32_t* low_sums, const float* step, int64_t m0, int64_t rows,
                     const Parameters& scales, const float* bias, int64_t n0, int64_t columns, T* out, int64_t N) {
  __at_align__ float scale[kBf16BlockColumns] = {}, added[kBf16BlockColumns] = {}, row[kBf16BlockColumns];
  for (int64_t c = 0; c < columns; ++c) {
    scale[c] = scales[n0 + c];
    added[c] = bias ? bias[n0 + c] : 0.f;
  }
  for (int64_t r = 0; r < rows; ++r) {
    const __m512 row_step = _mm512_set1_ps(step[m0 + r]);
    __m512 halves[2];
    for (int64_t h = 0; h < 2; ++h) {
      const int64_t at = r * kBf16BlockColumns + h * kAmxTileRows;
      const __m512 sum = _mm512_fmadd_ps(
          _mm512_cvtepi32_ps(_mm512_load_si512(high_sums + at)), _mm512_set1_ps(256.f),
          _mm512_cvtepi32_ps(_mm512_load_si512(low_sums + at)));
      const __m512 factor = _mm512_mul_ps(row_step, _mm512_load_ps(scale + h * kAmxTileRows));
      halves[h] = _mm512_fmadd_ps(sum, factor, _mm512_load_ps(added + h * kAmxTileRows));
    }
    store_row(halves[0], halves[1], row, out + (m0 + r) * N + n0, columns);
  }
}

// out [M, N] = x [M, K] @ (float(q) * scales).T (+ bias), q int8 [N, K] with one scale per row (see the top).
// Each thread takes blocks of 32 weight rows, lays a block's bytes out as the B operand in its own buffer (no
// widening), and runs every 16 rows of x's planes past it, a part of K at a time (amx_chunk_pairs: each part of the
// block stays in L1 while x's rows stream past it; the sums wait in memory between parts).
template <typename T>
void gemm_amx_int8(const int8_t* q, const Parameters& scales, int64_t N, int64_t K, const T* x, int64_t M,
                   const float* bias, T* out) {
  const SplitRows split = split_rows(x, M, K);
  const int64_t Kpad = split.Kpad, quads = Kpad / 4, tile_sums = kAmxTileRows * kBf16BlockColumns;
  const int64_t chunk = amx_chunk_pairs(quads);  // 128 bytes a row of words, as a bfloat16 block's
  const int64_t blocks = (N + kBf16BlockColumns - 1) / kBf16BlockColumns;
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    const AmxConfig config;
    amx_configure(config);
    TileVector<uint32_t> words(quads * kBf16BlockColumns);
    TileVector<int32_t> sums(2 * split.Mpad * kBf16BlockColumns);  // per 16 rows of x: high sums, low sums
    for (int64_t b = begin; b < end; ++b) {
      const int64_t n0 = b * kBf16BlockColumns, columns = std::min(kBf16BlockColumns, N - n0);
      pack_int8_block(q, N, K, Kpad, n0, words.data());
      for (int64_t first = 0; first < quads; first += chunk) {
        const int64_t count = std::min(chunk, quads - first);
        for (int64_t m0 = 0; m0 < M; m0 += kAmxTileRows) {
          int32_t* tile = sums.data() + 2 * m0 * kBf16BlockColumns;
          amx_int8_rows(split.high + m0 * Kpad + 4 * first, split.low + m0 * Kpad + 4 * first, Kpad,
                        words.data() + first * kBf16BlockColumns, count, tile, tile + tile_sums, first > 0);
        }
      }
      for (int64_t m0 = 0; m0 < M; m0 += kAmxTileRows) {
        const int32_t* tile = sums.data() + 2 * m0 * kBf16BlockColumns;
        store_int8_sums(tile, tile + tile_sums, split.step, m0, std::min(kAmxTileRows, M - m0), scales, bias,
                        n0, columns, out, N);
      }
    }
    amx_release();
  });
}

}  // namespace octavo_cpu
#endif
