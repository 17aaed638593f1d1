// The GEMM of the quantized linears (linear_quantized.cpp; AVX-512 build) on CPUs with AVX512_BF16 and no AMX, for
// the rows of x above the GEMV's: out [M, N] = x [M, K] @ W.T (+ bias) in float32, W dequantized inside the kernel.
//
// Arithmetic: each weight dequantized exactly as its layout defines it (float32, as the GEMV does), then rounded to
// bfloat16 (nearest even; a value below 2^-126 in magnitude becomes zero); x rounded to bfloat16 by the caller;
// vdpbf16ps multiplies them exactly and sums a pair of products at a time in float32, in K's order; the bias is
// added in float32. The result is not rounded to bfloat16.
//
// Each thread takes blocks of 32 weight rows (output columns) and dequantizes a block into its own buffer; a weight
// is dequantized once per call and nothing is stored dequantized beyond one block per thread. The block then meets
// x in the bfloat16 GEMV's dot kernel (dot_block_sums: each output sums its pairs of products in K's order, so
// both orientations give the same bits), in one of two orientations, as gemm_amx_dequantizing picks them:
// - weights packed (many rows of x): the block transposed into the packed layout of bf16_packing.h, every 8 rows
//   of x run through it (broadcast), the block staying in L1/L2 while x passes;
// - weights as rows (few rows of x): x packed once per call into that layout (tiles of 32 rows), and 8 of the
//   block's dequantized rows at a time broadcast against each tile; the 32 x 32 sums transposed as they are
//   stored. x and the sums are transposed instead of the weights.
#pragma once

#include "gemm_amx_dequantizing.h"
#include "gemv_bf16.h"

#if defined(CPU_CAPABILITY_AVX512)
#include <ATen/Parallel.h>

#include <vector>

namespace octavo_cpu {

// out [M, N] (T) = x [M, lda] (bfloat16, K padded with zeros to lda = 2 * packed_pairs(K)) @ W.T (+ bias).
template <typename W, typename T>
void gemm_dot_dequantizing(const W& w, const c10::BFloat16* x, int64_t M, const float* bias, T* out) {
  const int64_t N = w.N, K = w.K, pairs = packed_pairs(K), lda = 2 * pairs;
  // Weights as rows multiplies x in tiles of 32 rows (zeros past M), the packed orientation in tiles of 8: the
  // former only where its padding adds at most an eighth to the products.
  const bool weights_as_rows = weights_as_rows_pays(M, N, K) &&
                               8 * round_up(M, kAmxRows) <= 9 * round_up(M, kBf16GemvRows);
  const TileVector<uint32_t> x_tiles = weights_as_rows ? pack_rows_of_x(x, lda, M, pairs) : TileVector<uint32_t>();
  const auto* x_words = reinterpret_cast<const uint32_t*>(x);
  const int64_t blocks = (N + kBf16BlockColumns - 1) / kBf16BlockColumns;
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    TileVector<c10::BFloat16> rows(kBf16BlockColumns * lda, c10::BFloat16(0.f));  // K's padding stays zero
    TileVector<uint32_t> words(weights_as_rows ? 0 : pairs * kBf16BlockColumns);
    std::vector<float> scratch(K);
    __at_align__ float sums[kAmxRows * kBf16BlockColumns] = {};  // the rows past N of a last block stay zero
    const auto* row_words = reinterpret_cast<const uint32_t*>(rows.data());
    for (int64_t b = begin; b < end; ++b) {
      const int64_t n0 = b * kBf16BlockColumns, columns = std::min(kBf16BlockColumns, N - n0);
      // A last block's rows past N keep an earlier block's values: their sums are never stored.
      dequantize_block(w, n0, columns, std::min(end * kBf16BlockColumns, N), rows.data(), lda, scratch.data());
      if (weights_as_rows) {
        for (int64_t t = 0; t * kAmxRows < M; ++t) {
          const uint32_t* tile = x_tiles.data() + t * pairs * kBf16BlockColumns;
          // The tile was packed on the calling thread: nothing of it is asked for ahead (limit = its start).
          const char* no_prefetch = reinterpret_cast<const char*>(tile);
          for (int64_t c = 0; c < columns; c += kBf16GemvRows) {
            dot_block_sums_rows(std::min(kBf16GemvRows, columns - c), tile, pairs, row_words + c * pairs,
                                no_prefetch, sums + c * kBf16BlockColumns);
          }
          store_transposed_sums(sums, std::min(kAmxRows, M - t * kAmxRows), columns, bias, n0, out + t * kAmxRows * N,
                                N);
        }
        continue;
      }
      transpose_block(rows.data(), lda, pairs, words.data());
      const char* no_prefetch = reinterpret_cast<const char*>(words.data());  // the block was just written
      for (int64_t row = 0; row < M; row += kBf16GemvRows) {
        const int64_t count = std::min(kBf16GemvRows, M - row);
        dot_block_sums_rows(count, words.data(), pairs, x_words + row * pairs, no_prefetch, sums);
        store_sums(sums, count, columns, bias, n0, out + row * N, N);
      }
    }
  });
}

}  // namespace octavo_cpu
#endif
