// The w8 GEMV of a bfloat16 or float16 model (bf16_gemm) for 4 to 8 rows of x on CPUs with AVX512_BF16 (AVX-512
// build; linear_quantized.cpp runs it where the integer GEMV of AMX-INT8 CPUs does not), int8 weights with one
// scale per row or per group of a multiple of 32 columns: out [M, N] = x @ W.T (+ bias), W[n, k] = float(q[n, k]) *
// scale[n, k / group_size].
//
// Arithmetic (the vdpbf16ps GEMM's, gemm_dot_dequantizing.h): each weight dequantized as the layout defines it in
// float32 and rounded to bfloat16 (nearest even; vcvtne2ps2bf16, which also makes a value below 2^-126 in magnitude
// zero); x rounded to bfloat16 (a bfloat16 x as it is); vdpbf16ps multiplies them exactly and adds a pair of
// products at a time into one of 16 float32 lanes (lane j takes columns 2j and 2j + 1 of every 32, in K's order);
// the lanes are added at the end, the bias added in float32 and the result rounded to x's dtype once.
//
// Why: the float32 GEMV spends one multiply-add per 16 weights and row of x, and from 4 rows of x on those bound it
// (SmolLM2 w8 at 8 rows: a little over the bfloat16 model's time, reading half its bytes). Here 32 weights are
// dequantized once for all the rows (two widenings, two multiplications, one rounding) and each row of x takes one
// vdpbf16ps per 32 weights.
#pragma once

#include "gemv_int8.h"
#include "vec_utils.h"
#include "vnni_groups.h"

#if defined(CPU_CAPABILITY_AVX512)
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <vector>

namespace octavo_cpu {

constexpr int64_t kDotGemvMinRows = 4;  // at 3 rows this kernel took 1.05x the float32 GEMV's time

// Whether this weight takes the kernel: one scale per row, or groups of whole 32-column blocks.
inline bool int8_dot_shape_fits(int64_t groups, int64_t group_size) { return groups == 1 || group_size % 32 == 0; }

// Adds columns [k, k + 32) of weight rows [n, n + R) times the M rows of x into acc: each row's 32 weights
// dequantized with its scale and rounded to bfloat16 once, then one vdpbf16ps per row of x. Masked (K's last
// columns only): loads under `mask`, zeros past K for both operands.
template <int M, int R, bool Masked>
__attribute__((target("avx512bf16"), always_inline)) inline void dot_chunk(const Int8Matrix& w,
                                                                           const c10::BFloat16* x, int64_t n,
                                                                           int64_t k, __mmask32 mask,
                                                                           const __m512 (&scale)[R],
                                                                           __m512 (&acc)[M][R]) {
  __m512bh weights[R];
  for (int r = 0; r < R; ++r) {
    const int8_t* at = w.q + (n + r) * w.K + k;
    const __m256i q = Masked ? _mm256_maskz_loadu_epi8(mask, at) : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(at));
    const __m512 low = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(q)));
    const __m512 high = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(q, 1)));
    weights[r] = _mm512_cvtne2ps_pbh(_mm512_mul_ps(high, scale[r]), _mm512_mul_ps(low, scale[r]));
  }
  for (int m = 0; m < M; ++m) {
    const c10::BFloat16* at = x + m * w.K + k;
    const __m512i row = Masked ? _mm512_maskz_loadu_epi16(mask, at) : _mm512_loadu_si512(at);
    for (int r = 0; r < R; ++r) acc[m][r] = _mm512_dpbf16_ps(acc[m][r], weights[r], (__m512bh)row);
  }
}

// out[m, n + r] for the weight rows [n, n + R) and the M rows of x (bfloat16, [M, K]), group by group (a group is
// whole 32-column chunks but at K's end; one scale per row is one group). Each 64 weight bytes of a row first ask
// for the bytes kPrefetchBytes past them, up to prefetch_end (as the other GEMVs).
// GCC 12 keeps the accumulators in registers only while the loop has no masked load: with one, it stored all of
// them to memory at every chunk (a store per vdpbf16ps). So only K's last chunk is masked, after the loops.
template <typename T, int M, int R>
__attribute__((target("avx512bf16"))) inline void int8_dot_block(const Int8Matrix& w, const c10::BFloat16* x,
                                                                  const float* bias, T* out, int64_t n,
                                                                  const int8_t* prefetch_end) {
  const int64_t K = w.K;
  // The block's scales widened once (row r's groups at r * groups), the thread's buffer looked up once (each use
  // of a thread_local is a call).
  const int64_t span = R * w.groups;
  static thread_local std::vector<float> buffer;
  if (static_cast<int64_t>(buffer.size()) < padded_groups(span)) buffer.resize(padded_groups(span));
  float* const scales = buffer.data();
  widen_parameter_rows(w.scales, n * w.groups, span, scales);
  __m512 acc[M][R], scale[R];
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = _mm512_setzero_ps();
  int64_t k = 0;
  for (int64_t g = 0; g < w.groups; ++g) {
    for (int r = 0; r < R; ++r) scale[r] = _mm512_set1_ps(scales[r * w.groups + g]);
    const int64_t whole_end = std::min(K, (g + 1) * w.group_size) / 32 * 32;
    for (; k < whole_end; k += 32) {
      if (k % 64 == 0) {
        for (int r = 0; r < R; ++r) {
          const int8_t* ahead = w.q + (n + r) * K + k + kPrefetchBytes;
          if (ahead < prefetch_end) __builtin_prefetch(ahead);
        }
      }
      dot_chunk<M, R, false>(w, x, n, k, 0, scale, acc);
    }
  }
  // scale holds the last group's.
  if (k < K) dot_chunk<M, R, true>(w, x, n, k, (__mmask32(1) << (K - k)) - 1, scale, acc);
  for (int m = 0; m < M; ++m) {
    for (int r = 0; r < R; ++r) {
      out[m * w.N + n + r] = static_cast<T>(_mm512_reduce_add_ps(acc[m][r]) + (bias ? bias[n + r] : 0.f));
    }
  }
}

template <typename T, int M>
void int8_dot_rows(const Int8Matrix& w, const c10::BFloat16* x, const float* bias, T* out) {
  // 4 * M or 2 * M accumulators (12 to 16) beside R dequantized vectors.
  constexpr int R = M <= 4 ? 4 : 2;
  const int64_t blocks = (w.N + R - 1) / R;
  const int64_t grain = std::max<int64_t>(1, kGemvTaskBytes / std::max<int64_t>(w.K * R, 1));
  at::parallel_for(0, blocks, grain, [&](int64_t begin, int64_t end) {
    const int64_t first = begin * R, last = std::min(end * R, w.N);
    const int8_t* prefetch_end = w.q + last * w.K;
    int64_t n = first;
    for (; n + R <= last; n += R) int8_dot_block<T, M, R>(w, x, bias, out, n, prefetch_end);
    for (; n < last; ++n) int8_dot_block<T, M, 1>(w, x, bias, out, n, prefetch_end);
  });
}

// out [M, N] (T, x's dtype) = x [M, K] (bfloat16) @ W.T (+ bias) for kDotGemvMinRows to 8 rows of x
// (int8_dot_shape_fits, a CPU with AVX512_BF16).
template <typename T>
void gemv_int8_dot(const Int8Matrix& w, const c10::BFloat16* x, int64_t M, const float* bias, T* out) {
  with_row_count(M, "linear_w8", [&](auto m) { int8_dot_rows<T, decltype(m)::value>(w, x, bias, out); });
}

}  // namespace octavo_cpu
#endif
