// The GEMM of the quantized linears (linear_quantized.cpp; AVX-512 build) on CPUs with AVX512_BF16 and no AMX, for
// the rows of x above the GEMV's: out [M, N] = x [M, K] @ W.T (+ bias) in float32, W dequantized inside the kernel.
//
// Arithmetic: each weight dequantized exactly as its layout defines it (float32, as the GEMV does), then rounded to
// bfloat16 (nearest even; a value below 2^-126 in magnitude becomes zero); x rounded to bfloat16 by the caller;
// vdpbf16ps multiplies them exactly and sums a pair of products at a time in float32, in K's order; the bias is
// added in float32. The result is not rounded to bfloat16.
//
// Each thread takes blocks of 32 weight rows (output columns), dequantizes a block into its own buffer, transposes
// it into the packed layout of bf16_packing.h (which linear_bf16's kernels multiply by) and runs every 8 rows of x
// through it with the bfloat16 GEMV's dot kernel: a weight is dequantized once per call, the block stays in L1/L2
// while x's rows pass, and nothing is stored dequantized beyond one block per thread.
#pragma once

#include "gemm_amx_dequantizing.h"
#include "gemv_bf16.h"

#if defined(CPU_CAPABILITY_AVX512)
#include <ATen/Parallel.h>

#include <vector>

namespace octavo_cpu {

// out [M, N] (T) = x @ W.T (+ bias) for x as bfloat16 pairs (x_words [M, packed_pairs(K)], K padded with zeros).
template <typename W, typename T>
void gemm_dot_dequantizing(const W& w, const uint32_t* x_words, int64_t M, const float* bias, T* out) {
  const int64_t N = w.N, K = w.K, pairs = packed_pairs(K), lda = 2 * pairs;
  const int64_t blocks = (N + kBf16BlockColumns - 1) / kBf16BlockColumns;
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    TileVector<c10::BFloat16> rows(kBf16BlockColumns * lda, c10::BFloat16(0.f));  // K's padding stays zero
    TileVector<uint32_t> words(pairs * kBf16BlockColumns);
    std::vector<float> scratch(K);
    __at_align__ float sums[kBf16GemvRows * kBf16BlockColumns];
    // The block was just written: nothing of it is asked for ahead.
    const char* no_prefetch = reinterpret_cast<const char*>(words.data());
    for (int64_t b = begin; b < end; ++b) {
      const int64_t n0 = b * kBf16BlockColumns, columns = std::min(kBf16BlockColumns, N - n0);
      // A last block's rows past N keep an earlier block's values: their sums are never stored.
      dequantize_block(w, n0, columns, std::min(end * kBf16BlockColumns, N), rows.data(), lda, scratch.data());
      transpose_block(rows.data(), lda, pairs, words.data());
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
