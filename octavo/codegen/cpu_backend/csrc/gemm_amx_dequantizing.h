// The AMX GEMM of the quantized linears (linear_quantized.cpp; AVX-512 build, CPUs with AMX-BF16) for the rows of x
// above the GEMV's: out [M, N] = x [M, K] @ W.T (+ bias) in float32, W dequantized inside the kernel.
//
// Arithmetic: each weight dequantized exactly as its layout defines it (float32, as the GEMV does), then rounded to
// bfloat16 (nearest even; vcvtne2ps2bf16, which the whole vectors take, also makes a value below 2^-126 in
// magnitude zero); x rounded to bfloat16 by the caller;
// TDPBF16PS multiplies them exactly and sums in float32 in the tiles' order; the bias is added in float32. The
// result is not rounded to bfloat16.
//
// Each thread takes blocks of 32 weight rows (output columns) and dequantizes a block's rows to bfloat16 in its own
// buffer; a weight is dequantized once per call and never stored dequantized beyond one block per thread. The
// block then meets x's rows on the tiles in one of two orientations (gemm_amx_dequantizing picks by the shape):
// the block's rows as the A operand as they lie, x packed once per call as the B operand (few rows of x), or the
// block transposed into the packed layout as the B operand, x's rows as the A operand (many rows).
#pragma once

#include "gemm_amx_bf16.h"
#include "gemv_dequantizing.h"
#include "vnni_groups.h"

#if defined(CPU_CAPABILITY_AVX512)
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <immintrin.h>

#include <vector>

namespace octavo_cpu {

constexpr int64_t kAmxTileRows = 16;

// The 16 x 16 words at rows[0..15] transposed: out[c] holds word c of every row, row r in lane r.
inline void transpose_16x16(const __m512i (&rows)[16], __m512i (&out)[16]) {
  __m512i pairs[16], quads[16];
  for (int i = 0; i < 8; ++i) {  // within each 128-bit lane L: words 4L, 4L + 1 (lo) and 4L + 2, 4L + 3 (hi)
    pairs[2 * i] = _mm512_unpacklo_epi32(rows[2 * i], rows[2 * i + 1]);
    pairs[2 * i + 1] = _mm512_unpackhi_epi32(rows[2 * i], rows[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // quads[4 i + j], lane L: word 4L + j of rows 4i .. 4i + 3
    quads[4 * i] = _mm512_unpacklo_epi64(pairs[4 * i], pairs[4 * i + 2]);
    quads[4 * i + 1] = _mm512_unpackhi_epi64(pairs[4 * i], pairs[4 * i + 2]);
    quads[4 * i + 2] = _mm512_unpacklo_epi64(pairs[4 * i + 1], pairs[4 * i + 3]);
    quads[4 * i + 3] = _mm512_unpackhi_epi64(pairs[4 * i + 1], pairs[4 * i + 3]);
  }
  for (int j = 0; j < 4; ++j) {  // lane L of quads[j], quads[4 + j], quads[8 + j], quads[12 + j] -> out[4L + j]
    const __m512i even_ab = _mm512_shuffle_i32x4(quads[j], quads[4 + j], 0x88);
    const __m512i odd_ab = _mm512_shuffle_i32x4(quads[j], quads[4 + j], 0xDD);
    const __m512i even_cd = _mm512_shuffle_i32x4(quads[8 + j], quads[12 + j], 0x88);
    const __m512i odd_cd = _mm512_shuffle_i32x4(quads[8 + j], quads[12 + j], 0xDD);
    out[j] = _mm512_shuffle_i32x4(even_ab, even_cd, 0x88);
    out[8 + j] = _mm512_shuffle_i32x4(even_ab, even_cd, 0xDD);
    out[4 + j] = _mm512_shuffle_i32x4(odd_ab, odd_cd, 0x88);
    out[12 + j] = _mm512_shuffle_i32x4(odd_ab, odd_cd, 0xDD);
  }
}

// The first `count` (at most 32) of the floats of `low` then `high` rounded to bfloat16 (nearest even; below 2^-126
// in magnitude: zero) into dst.
__attribute__((target("avx512bf16"))) inline void store_bf16(__m512 low, __m512 high, c10::BFloat16* dst,
                                                             int64_t count = 32) {
  const __mmask32 mask = count >= 32 ? ~__mmask32(0) : (__mmask32(1) << count) - 1;
  _mm512_mask_storeu_epi16(dst, mask, (__m512i)_mm512_cvtne2ps_pbh(high, low));
}

// dst[0:K] = W[n, :] dequantized as the layout defines it (float32), rounded to bfloat16: whole pairs of vectors
// in registers (store_bf16), the rest of each group through `scratch` (K floats; ATen's rounding, nearest even).
template <typename W>
inline void dequantize_row_bf16(const W& w, int64_t n, c10::BFloat16* dst, float* scratch) {
  for_each_group(w, n, [&](const RowGroup& g) {
    int64_t k = g.vector_begin;
    for (; k + 2 * kLanes <= g.vector_end; k += 2 * kLanes) {
      store_bf16(w.values(n, k, g.sv, g.ov), w.values(n, k + kLanes, g.sv, g.ov), dst + k);
    }
    // The rest: at most one column before the vectors (a w4 group's odd start), one vector and the last columns.
    for (int64_t j = g.first; j < g.vector_begin; ++j) scratch[j - g.first] = w.value(n, j, g.s, g.o);
    at::vec::convert(scratch, dst + g.first, g.vector_begin - g.first);
    for (int64_t j = k; j < g.vector_end; j += kLanes) w.values(n, j, g.sv, g.ov).store(scratch + (j - k));
    for (int64_t j = g.vector_end; j < g.last; ++j) scratch[j - k] = w.value(n, j, g.s, g.o);
    at::vec::convert(scratch, dst + k, g.last - k);
  });
}

// The w4 row when its groups are whole 32-column chunks (every group starts on a byte): per group, its 16 possible
// values q * scale + offset (float32, as the layout defines them) rounded to bfloat16 once into a table, and every
// 32 columns looked up at once by their nibbles (vpermw); the same bfloat16 values as the general path, without
// widening each weight to float32.
__attribute__((target("avx512bf16"))) inline void dequantize_row_bf16_lookup(const Int4Weight& w, int64_t n,
                                                                            c10::BFloat16* dst) {
  // The row's scales and offsets widened once (one type switch a row, not one a group).
  static thread_local std::vector<float> parameters;
  const int64_t padded = padded_groups(w.groups);
  if (static_cast<int64_t>(parameters.size()) < 2 * padded) parameters.resize(2 * padded);
  float* const scales = parameters.data();
  float* const offsets = scales + padded;
  widen_parameter_rows(w.scales, n * w.groups, w.groups, scales);
  widen_parameter_rows(w.offsets, n * w.groups, w.groups, offsets);
  const __m512 levels = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  // Word j of the index holds byte j / 2 twice (that byte in both its halves): its bits 0-3 are then column j's
  // nibble once even words are left as they are and odd ones shifted right by 4. vpermw reads bits 0-4, and bit 4
  // (the other nibble's lowest bit) picks between two copies of the same 16 values. The 16 bytes go to every
  // 128-bit lane and a byte shuffle within each lane spreads them: lane L's 8 words take bytes 4L .. 4L + 3.
  alignas(64) static constexpr int8_t kSpread[64] = {
      0,  0,  0,  0,  1,  1,  1,  1,  2,  2,  2,  2,  3,  3,  3,  3,  4,  4,  4,  4,  5,  5,
      5,  5,  6,  6,  6,  6,  7,  7,  7,  7,  8,  8,  8,  8,  9,  9,  9,  9,  10, 10, 10, 10,
      11, 11, 11, 11, 12, 12, 12, 12, 13, 13, 13, 13, 14, 14, 14, 14, 15, 15, 15, 15};
  const __m512i spread = _mm512_load_si512(kSpread), odd_shift = _mm512_set1_epi32(4 << 16);
  const uint8_t* row = w.row(n);
  const auto lookup = [&](__m128i bytes, __m512i table) {
    const __m512i doubled = _mm512_shuffle_epi8(_mm512_broadcast_i32x4(bytes), spread);
    return _mm512_permutexvar_epi16(_mm512_srlv_epi16(doubled, odd_shift), table);
  };
  for (int64_t g = 0; g < w.groups; ++g) {
    const __m512 values = _mm512_add_ps(_mm512_mul_ps(levels, _mm512_set1_ps(scales[g])), _mm512_set1_ps(offsets[g]));
    const __m512i table = (__m512i)_mm512_cvtne2ps_pbh(values, values);
    const int64_t last = std::min((g + 1) * w.group_size, w.K);
    int64_t k = g * w.group_size;
    for (; k + 32 <= last; k += 32) {
      _mm512_storeu_si512(dst + k, lookup(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + k / 2)), table));
    }
    if (k < last) {
      const int64_t count = last - k;
      const __m128i bytes = _mm_maskz_loadu_epi8((__mmask16)((1u << (count / 2)) - 1), row + k / 2);
      _mm512_mask_storeu_epi16(dst + k, (__mmask32)((uint64_t{1} << count) - 1), lookup(bytes, table));
    }
  }
}

// The w8 row when its groups are whole 32-column chunks: the row's scales widened once, every 32 columns widened,
// scaled and rounded to bfloat16 in registers (the same values as dequantize_row_bf16, without its per-group
// bookkeeping).
__attribute__((target("avx512bf16"))) inline void dequantize_row_bf16_chunks(const Int8Weight& w, int64_t n,
                                                                            c10::BFloat16* dst) {
  static thread_local std::vector<float> parameters;
  const int64_t padded = padded_groups(w.groups);
  if (static_cast<int64_t>(parameters.size()) < padded) parameters.resize(padded);
  float* const scales = parameters.data();
  widen_parameter_rows(w.scales, n * w.groups, w.groups, scales);
  const int8_t* row = w.q + n * w.K;
  const auto widen = [](__m128i bytes, __m512 scale) {
    return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes)), scale);
  };
  for (int64_t g = 0; g < w.groups; ++g) {
    const __m512 scale = _mm512_set1_ps(scales[g]);
    const int64_t last = std::min((g + 1) * w.group_size, w.K);
    int64_t k = g * w.group_size;
    for (; k + 32 <= last; k += 32) {
      const __m128i* source = reinterpret_cast<const __m128i*>(row + k);
      store_bf16(widen(_mm_loadu_si128(source), scale), widen(_mm_loadu_si128(source + 1), scale), dst + k);
    }
    if (k < last) {
      const int64_t count = last - k;
      const __m256i bytes = _mm256_maskz_loadu_epi8((__mmask32)((uint64_t{1} << count) - 1), row + k);
      store_bf16(widen(_mm256_castsi256_si128(bytes), scale), widen(_mm256_extracti128_si256(bytes, 1), scale),
                 dst + k, count);
    }
  }
}

// Row n of W in bfloat16 into dst: the whole-chunk loops where a w4 or w8 row's groups are whole 32-column chunks,
// the general dequantize_row_bf16 otherwise (fp8, other group sizes). The same values either way.
template <typename W>
inline void dequantize_block_row(const W& w, int64_t n, c10::BFloat16* dst, float* scratch) {
  dequantize_row_bf16(w, n, dst, scratch);
}

inline void dequantize_block_row(const Int4Weight& w, int64_t n, c10::BFloat16* dst, float* scratch) {
  if (w.group_size % 32 != 0) return dequantize_row_bf16(w, n, dst, scratch);
  dequantize_row_bf16_lookup(w, n, dst);
}

inline void dequantize_block_row(const Int8Weight& w, int64_t n, c10::BFloat16* dst, float* scratch) {
  if (w.group_size % 32 != 0) return dequantize_row_bf16(w, n, dst, scratch);
  dequantize_row_bf16_chunks(w, n, dst);
}

// words [pairs][32] = the block's 32 bfloat16 rows (ld `lda`, K padded with zeros) in the packed layout: word (p, c)
// holds row c's values 2p (low half) and 2p + 1 (high half), which on a little-endian CPU is row c's word p.
inline void transpose_block(const c10::BFloat16* rows, int64_t lda, int64_t pairs, uint32_t* words) {
  for (int64_t half = 0; half < 2; ++half) {
    const auto* source = reinterpret_cast<const uint32_t*>(rows + half * kAmxTileRows * lda);
    for (int64_t p = 0; p < pairs; p += kAmxTileRows) {
      __m512i in[16], out[16];
      for (int r = 0; r < 16; ++r) in[r] = _mm512_loadu_si512(source + r * (lda / 2) + p);
      transpose_16x16(in, out);
      for (int j = 0; j < 16; ++j) {
        _mm512_storeu_si512(words + (p + j) * kBf16BlockColumns + half * kAmxTileRows, out[j]);
      }
    }
  }
}

// x [M, lda] as the B operand: per tile of 32 rows of x, words [pairs][32] (the packed layout, x's rows in the place
// of the weights'), rows past M zero; tile t at t * pairs * 32. On the calling thread: a few rows of x take less
// time to transpose than the threads take to start.
inline TileVector<uint32_t> pack_rows_of_x(const c10::BFloat16* x, int64_t lda, int64_t M, int64_t pairs) {
  const int64_t tiles = (M + kAmxRows - 1) / kAmxRows;
  TileVector<uint32_t> words(tiles * pairs * kBf16BlockColumns);
  const TileVector<c10::BFloat16> last_tile = amx_last_tile(x, lda, M);
  for (int64_t t = 0; t < tiles; ++t) {
    const c10::BFloat16* rows = t * kAmxRows + kAmxRows > M ? last_tile.data() : x + t * kAmxRows * lda;
    transpose_block(rows, lda, pairs, words.data() + t * pairs * kBf16BlockColumns);
  }
  return words;
}

// out[r, n0 + c] = T(sums[c * 32 + r] + bias[n0 + c]) for r < rows, c < columns: store_sums of the transposed sums.
template <typename T>
inline void store_transposed_sums(const float* sums, int64_t rows, int64_t columns, const float* bias, int64_t n0,
                                  T* out, int64_t N) {
  __at_align__ float flipped[kAmxRows * kBf16BlockColumns];
  for (int64_t i = 0; i < 2; ++i) {
    for (int64_t j = 0; j < 2; ++j) {
      __m512i in[16], out_words[16];
      for (int r = 0; r < 16; ++r) in[r] = _mm512_loadu_si512(sums + (16 * i + r) * kBf16BlockColumns + 16 * j);
      transpose_16x16(in, out_words);
      for (int c = 0; c < 16; ++c) {
        _mm512_storeu_si512(flipped + (16 * j + c) * kBf16BlockColumns + 16 * i, out_words[c]);
      }
    }
  }
  store_sums(flipped, rows, columns, bias, n0, out, N);
}

// Rows n0 .. n0 + columns of W dequantized to bfloat16 into rows (ld `lda`), the next block's weight rows asked for
// meanwhile: they arrive while this block's tiles run (the rows are read once per call, from memory). `last_row`:
// the end of the thread's rows (nothing past it is asked for).
template <typename W>
inline void dequantize_block(const W& w, int64_t n0, int64_t columns, int64_t last_row, c10::BFloat16* rows,
                             int64_t lda, float* scratch) {
  const uint8_t* prefetch_end = w.row(last_row);
  for (int64_t i = 0; i < columns; ++i) {
    const uint8_t* next = w.row(n0 + kBf16BlockColumns + i);
    prefetch_span(next, next + w.row_bytes(), prefetch_end);
    dequantize_block_row(w, n0 + i, rows + i * lda, scratch);
  }
}

// out [M, N] (float32) = x [M, lda] (bfloat16, K padded with zeros to lda = 2 * packed_pairs(K)) @ W.T (+ bias).
// The block's rows meet x in one of two orientations, the same sums bit for bit (each sums the same bfloat16
// products in K's order); they differ in what is transposed:
// - weights as rows: the dequantized rows are the A operand as they lie (row-major, 32 rows of K) and x, packed once
//   per call, the B operand; the tiles give out's block transposed (32 weight rows x 32 rows of x), transposed back
//   as it is stored: x and the sums are transposed (M x K plus M x N values per call);
// - weights packed: the rows are transposed into the packed layout of bf16_packing.h (the B operand) and every 32
//   rows of x run through it as gemm_amx_bf16 does (the block's slice in L1, x's tiles streamed past it): the
//   weights are transposed (N x K).
// Weights as rows is taken when its transposes are less than half the other's. SmolLM2's w4 layers in groups of 32
// (AMX Xeon, two threads), weights as rows against packed: 0.79x the time at 16 rows of x, 0.85-0.94x at 64,
// 0.94-0.97x at 128; at 256 and 512 rows no faster (the sums' transposes outweigh the weights').
// Whether the weights-as-rows orientation transposes less than the packed one: x and the sums (M x K plus M x N
// values per call) less than half the weights (N x K).
inline bool weights_as_rows_pays(int64_t M, int64_t N, int64_t K) { return 2 * M * (N + K) <= N * K; }

template <typename W, typename T>
void gemm_amx_dequantizing(const W& w, const c10::BFloat16* x, int64_t lda, int64_t M, const float* bias, T* out) {
  const int64_t N = w.N, K = w.K, pairs = packed_pairs(K);
  const bool weights_as_rows = weights_as_rows_pays(M, N, K);
  const int64_t tiles = (M + kAmxRows - 1) / kAmxRows;
  const TileVector<uint32_t> x_words = weights_as_rows ? pack_rows_of_x(x, lda, M, pairs) : TileVector<uint32_t>();
  const TileVector<c10::BFloat16> last_tile = weights_as_rows ? TileVector<c10::BFloat16>()
                                                              : amx_last_tile(x, lda, M);
  const int64_t blocks = (N + kBf16BlockColumns - 1) / kBf16BlockColumns;
  const int64_t chunk = amx_chunk_pairs(pairs);
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    const AmxConfig config;
    amx_configure(config);
    TileVector<c10::BFloat16> rows(kBf16BlockColumns * lda, c10::BFloat16(0.f));  // K's padding stays zero
    TileVector<uint32_t> words(weights_as_rows ? 0 : pairs * kBf16BlockColumns);
    std::vector<float> scratch(K);
    TileVector<float> sums(tiles * kAmxRows * kBf16BlockColumns);
    for (int64_t b = begin; b < end; ++b) {
      const int64_t n0 = b * kBf16BlockColumns, columns = std::min(kBf16BlockColumns, N - n0);
      // A last block's rows past N keep an earlier block's values: their sums are never stored.
      dequantize_block(w, n0, columns, std::min(end * kBf16BlockColumns, N), rows.data(), lda, scratch.data());
      if (!weights_as_rows) transpose_block(rows.data(), lda, pairs, words.data());
      for (int64_t first = 0; first < pairs; first += chunk) {
        const int64_t count = std::min(chunk, pairs - first);
        for (int64_t t = 0; t < tiles; ++t) {
          float* tile_sums = sums.data() + t * kAmxRows * kBf16BlockColumns;
          if (weights_as_rows) {
            amx_block<true>(rows.data() + 2 * first, lda, x_words.data() + (t * pairs + first) * kBf16BlockColumns,
                            count, tile_sums, first > 0);
          } else {
            const c10::BFloat16* a = t * kAmxRows + kAmxRows > M ? last_tile.data() : x + t * kAmxRows * lda;
            amx_block(a + 2 * first, lda, words.data() + first * kBf16BlockColumns, count, tile_sums, first > 0);
          }
        }
      }
      for (int64_t t = 0; t < tiles; ++t) {
        const float* tile_sums = sums.data() + t * kAmxRows * kBf16BlockColumns;
        const int64_t tile_rows = std::min(kAmxRows, M - t * kAmxRows);
        if (weights_as_rows) {
          store_transposed_sums(tile_sums, tile_rows, columns, bias, n0, out + t * kAmxRows * N, N);
        } else {
          store_sums(tile_sums, tile_rows, columns, bias, n0, out + t * kAmxRows * N, N);
        }
      }
    }
    amx_release();
  });
}

}  // namespace octavo_cpu
#endif
