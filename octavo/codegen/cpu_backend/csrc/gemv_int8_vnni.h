// The w8 GEMV of a bfloat16 model (bf16_gemm) with AVX512_VNNI (linear_quantized.cpp runs it on CPUs with AMX-INT8,
// where it measured faster than the float32 GEMV), for int8 weights with one scale per row
// (below) or per group of a multiple of 32 columns (at the end): up to 8 rows of x, out [M, N] =
// x @ (float(q) * scale).T (+ bias); per row in the arithmetic of gemm_amx_int8.h.
//
// Each row of x is rounded to 16-bit integers on its own step (the GEMM's split_rows: xi = 256 * high + low,
// |xi * step - x| <= step / 2 plus float32 roundings), and for each weight row the exact int32 sums of high * q
// and low * q are formed by vpdpbusd (unsigned byte times signed byte, four products a lane). The low bytes are
// unsigned and q is signed: low * q goes in as it is. For high * q (both signed) the weight is made unsigned,
// q + 128 (its top bit flipped), against the signed high byte, and 128 * (sum of high) is taken back out: that
// correction is x's alone, one number per row of x and call (per 4-column lane for grouped weights), where making
// high unsigned instead needed the sum of q of every weight row, a third vpdpbusd per 64 bytes. Both sums are
// exact, the same integers as the AMX GEMM's. Then, as the AMX GEMM does, out = (256 * float(high sum) +
// float(low sum)) * (step * scale) + bias, each operation rounded to float32 once, and the result rounded to x's
// dtype once. Against the definition the error is that of the AMX GEMM (gemm_amx_int8.h): x's rounding, 2^-16 of
// its row's largest value per term, and a few float32 roundings.
//
// Per 64 weight bytes and row of W: one load, one xor and two vpdpbusd against about twelve widening and
// multiply-add instructions of the float32 GEMV. The loop loads without masks but for the last, partial 64 bytes,
// and each block of rows asks for the weight bytes kPrefetchBytes ahead once, as the float32 GEMV does, instead of
// a compare and a prefetch per row and step. On a Zen 5 the three together took 0.7x the time of the kernel before
// them; the flip alone, or the unmasked loop alone, had not changed it.
#pragma once

#include "gemm_amx_int8.h"
#include "gemv_int8.h"
#include "vnni_groups.h"

#if defined(CPU_CAPABILITY_AVX512)
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cmath>

namespace octavo_cpu {

// Whether this CPU executes AVX512_VNNI (asked once).
inline bool cpu_has_avx512_vnni() {
  static const bool present = __builtin_cpu_supports("avx512vnni");
  return present;
}

// The 64 bytes of R weight rows from `first` (rows `stride` bytes apart) as they are (q, signed) and with their top
// bits flipped (q + 128, unsigned). Masked: the bytes outside `mask` are zeros in both.
template <int R, bool Masked>
__attribute__((always_inline)) inline void load_weight_bytes(const int8_t* first, int64_t stride, __mmask64 mask,
                                                             __m512i (&q)[R], __m512i (&unsigned_q)[R]) {
  const __m512i top_bit = _mm512_set1_epi8(static_cast<char>(0x80));
  const __m512i flip = Masked ? _mm512_maskz_mov_epi8(mask, top_bit) : top_bit;
  for (int r = 0; r < R; ++r) {
    const int8_t* row = first + r * stride;
    q[r] = Masked ? _mm512_maskz_loadu_epi8(mask, row) : _mm512_loadu_si512(row);
    unsigned_q[r] = _mm512_xor_si512(q[r], flip);
  }
}

// One 64-byte step of rows [n, n + R) of q from column k against the M rows of x's planes: high[r][m] += the lane
// sums of (q + 128) * high, low[r][m] += those of low * q. Masked: the step ends at K (the bytes past it are loaded
// as zeros, q + 128 is zero there too, so the stale columns of x's planes add nothing).
template <int M, int R, bool Masked>
__attribute__((target("avx512vnni"), always_inline)) inline void vnni_step(const int8_t* q, int64_t K,
                                                                         const SplitRows& x, int64_t n, int64_t k,
                                                                         __mmask64 mask, __m512i (&high)[R][M],
                                                                         __m512i (&low)[R][M]) {
  __m512i w[R], unsigned_w[R];
  load_weight_bytes<R, Masked>(q + n * K + k, K, mask, w, unsigned_w);
  for (int m = 0; m < M; ++m) {
    const __m512i h = _mm512_loadu_si512(x.high + m * x.Kpad + k);
    const __m512i l = _mm512_loadu_si512(x.low + m * x.Kpad + k);
    for (int r = 0; r < R; ++r) {
      high[r][m] = _mm512_dpbusd_epi32(high[r][m], unsigned_w[r], h);
      low[r][m] = _mm512_dpbusd_epi32(low[r][m], l, w[r]);
    }
  }
}

// out[m, n + r] for the weight rows [n, n + R) and the M rows of x; high_sums[m] = the sum of row m's high bytes
// over K. First asks for the weight bytes kPrefetchBytes past the block's, up to prefetch_end.
template <typename T, int M, int R>
__attribute__((target("avx512vnni"))) inline void gemv_int8_vnni_block(const Int8Matrix& w, const SplitRows& x,
                                                                       const int32_t* high_sums, const float* bias,
                                                                       T* out, int64_t n, const int8_t* prefetch_end) {
  const int64_t K = w.K;
  prefetch_ahead<R>(w, n, prefetch_end);
  __m512i high[R][M], low[R][M];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) high[r][m] = low[r][m] = _mm512_setzero_si512();
  int64_t k = 0;
  for (; k + 64 <= K; k += 64) vnni_step<M, R, false>(w.q, K, x, n, k, 0, high, low);
  if (k < K) vnni_step<M, R, true>(w.q, K, x, n, k, (__mmask64(1) << (K - k)) - 1, high, low);
  for (int r = 0; r < R; ++r) {
    const float scale = w.scales[n + r];
    for (int m = 0; m < M; ++m) {
      const int32_t high_sum = _mm512_reduce_add_epi32(high[r][m]) - 128 * high_sums[m];
      const int32_t low_sum = _mm512_reduce_add_epi32(low[r][m]);
      const float sum = std::fma(static_cast<float>(high_sum), 256.f, static_cast<float>(low_sum));
      out[m * w.N + n + r] = static_cast<T>(std::fma(sum, x.step[m] * scale, bias ? bias[n + r] : 0.f));
    }
  }
}

// Weight rows [begin, end), R at a time, the last few one at a time.
template <typename T, int M, int R>
void gemv_int8_vnni_range(const Int8Matrix& w, const SplitRows& x, const int32_t* high_sums, const float* bias,
                          T* out, int64_t begin, int64_t end) {
  const int8_t* prefetch_end = w.q + end * w.K;
  int64_t n = begin;
  for (; n + R <= end; n += R) gemv_int8_vnni_block<T, M, R>(w, x, high_sums, bias, out, n, prefetch_end);
  for (; n < end; ++n) gemv_int8_vnni_block<T, M, 1>(w, x, high_sums, bias, out, n, prefetch_end);
}

// The sum of high[0:K] (|sum| <= 128 K, exact).
__attribute__((target("avx512vnni"))) inline int32_t high_byte_sum(const int8_t* high, int64_t K) {
  const __m512i ones = _mm512_set1_epi8(1);
  __m512i total = _mm512_setzero_si512();
  int64_t k = 0;
  for (; k + 64 <= K; k += 64) total = _mm512_dpbusd_epi32(total, ones, _mm512_loadu_si512(high + k));
  if (k < K) {
    total = _mm512_dpbusd_epi32(total, ones, _mm512_maskz_loadu_epi8((__mmask64(1) << (K - k)) - 1, high + k));
  }
  return _mm512_reduce_add_epi32(total);
}

// Two weight rows a block up to 3 rows of x, then one: SmolLM2's 120 w8 linears at one row of x took 4.6-4.7 ms
// with two, 6.4 ms with four (the compiled one-row graph 7.0 against 9.0 ms), on a Zen 5; at 4 rows 5.5 ms with
// one against 5.9 with two. (The grouped kernel below measured the other way: the Q8_0 lm_head at one row 0.81 ms
// with four rows a block, 0.95 with two.)
template <typename T, int M>
void gemv_int8_vnni_rows(const Int8Matrix& w, const SplitRows& x, const float* bias, T* out) {
  constexpr int R = M <= 3 ? 2 : 1;
  const int64_t blocks = (w.N + R - 1) / R;
  const int64_t grain = std::max<int64_t>(1, kGemvTaskBytes / std::max<int64_t>(w.K * R, 1));
  int32_t high_sums[M];
  for (int m = 0; m < M; ++m) high_sums[m] = high_byte_sum(x.high + m * x.Kpad, w.K);
  at::parallel_for(0, blocks, grain, [&](int64_t begin, int64_t end) {
    gemv_int8_vnni_range<T, M, R>(w, x, high_sums, bias, out, begin * R, std::min(end * R, w.N));
  });
}

// ---- weights in groups of a multiple of 32 columns (one scale per group) --------------------------------------
// The same integer sums, a 64-column chunk at a time (lane i sums columns 4i .. 4i + 3 of the chunk: a 32-column
// block is 8 lanes), each lane's exact sum of q * xi (|sum| <= 4 * 128 * 32767 < 2^24, so widened exactly) times
// its group's scale into float32 accumulators, then out = step * (their sum) + bias, rounded to x's dtype.

// Adds scale * (the lane sums of chunk c) for the weight rows [n, n + R) and the M rows of x into acc. The high
// sums as in vnni_step, with 128 * (the lane's sum of high) taken back out; Masked: the chunk ends at K, and x's
// high plane is loaded masked too (past K it is stale, and that correction is x's alone).
template <int M, int R, bool Masked>
__attribute__((target("avx512vnni"), always_inline)) inline void grouped_int8_chunk(
    const Int8Matrix& w, const SplitRows& x, const ChunkGroups& groups, int64_t n, int64_t c, __mmask64 mask,
    const float* scales, int64_t scale_stride, __m512 (&acc)[M][R]) {
  const __m512i top_bit = _mm512_set1_epi8(static_cast<char>(0x80));
  const __m512i lane_group = _mm512_loadu_si512(groups.lane_group + c * 16);
  __m512i q[R], unsigned_q[R];
  load_weight_bytes<R, Masked>(w.q + n * w.K + c * 64, w.K, mask, q, unsigned_q);
  __m512 scale[R];
  for (int r = 0; r < R; ++r) {
    scale[r] = _mm512_permutexvar_ps(lane_group, _mm512_loadu_ps(scales + r * scale_stride + groups.first_group[c]));
  }
  for (int m = 0; m < M; ++m) {
    const int8_t* hp = x.high + m * x.Kpad + c * 64;
    const __m512i high = Masked ? _mm512_maskz_loadu_epi8(mask, hp) : _mm512_loadu_si512(hp);
    const __m512i low = _mm512_loadu_si512(x.low + m * x.Kpad + c * 64);
    const __m512i high_128 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), top_bit, high);  // 128 * lane sum of high
    for (int r = 0; r < R; ++r) {
      const __m512i flipped_sum = _mm512_dpbusd_epi32(_mm512_setzero_si512(), unsigned_q[r], high);
      const __m512i high_sum = _mm512_sub_epi32(flipped_sum, high_128);
      const __m512i sum = _mm512_dpbusd_epi32(_mm512_slli_epi32(high_sum, 8), low, q[r]);
      acc[m][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), scale[r], acc[m][r]);
    }
  }
}

// out[m, n + r] for the weight rows [n, n + R) and the M rows of x, the task's rows ending at `end`; the block asks
// for the scales of the rows whose weights are being fetched.
template <typename T, int M, int R>
__attribute__((target("avx512vnni"))) inline void grouped_int8_block(const Int8Matrix& w, const SplitRows& x,
                                                                     const ChunkGroups& groups, const float* bias,
                                                                     T* out, int64_t n, int64_t end) {
  const int64_t ahead = n + std::max<int64_t>(1, kPrefetchBytes / w.K);
  prefetch_span(w.scales.address(ahead * w.groups), w.scales.address((ahead + R) * w.groups),
                w.scales.address(end * w.groups));
  // The block's rows' scales widened in one pass (row r's at r * groups).
  const int64_t span = R * w.groups, room = padded_groups(span);
  static thread_local std::vector<float> parameters;
  if (static_cast<int64_t>(parameters.size()) < room) parameters.resize(room);
  float* const scales = parameters.data();
  widen_parameter_rows(w.scales, n * w.groups, span, scales);
  __m512 acc[M][R];
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = _mm512_setzero_ps();
  prefetch_ahead<R>(w, n, w.q + end * w.K);
  const int64_t full = w.K / 64;
  for (int64_t c = 0; c < full; ++c) grouped_int8_chunk<M, R, false>(w, x, groups, n, c, 0, scales, w.groups, acc);
  if (full < groups.chunks) {
    grouped_int8_chunk<M, R, true>(w, x, groups, n, full, (__mmask64(1) << (w.K - full * 64)) - 1, scales, w.groups,
                                   acc);
  }
  for (int m = 0; m < M; ++m) {
    float totals[R];
    reduce_add_rows<R>(acc[m], totals);
    for (int r = 0; r < R; ++r) {
      out[m * w.N + n + r] = static_cast<T>(std::fma(totals[r], x.step[m], bias ? bias[n + r] : 0.f));
    }
  }
}

template <typename T, int M>
void grouped_int8_rows(const Int8Matrix& w, const SplitRows& x, const float* bias, T* out) {
  constexpr int R = M <= 2 ? 4 : M <= 4 ? 2 : 1;
  const ChunkGroups groups = chunk_groups<64, 4>(w.K, w.group_size, w.groups);
  const int64_t blocks = (w.N + R - 1) / R;
  const int64_t grain = std::max<int64_t>(1, kGemvTaskBytes / std::max<int64_t>(w.K * R, 1));
  at::parallel_for(0, blocks, grain, [&](int64_t begin, int64_t end) {
    const int64_t first = begin * R, last = std::min(end * R, w.N);
    int64_t n = first;
    for (; n + R <= last; n += R) grouped_int8_block<T, M, R>(w, x, groups, bias, out, n, last);
    for (; n < last; ++n) grouped_int8_block<T, M, 1>(w, x, groups, bias, out, n, last);
  });
}

// Whether the integer w8 GEMV takes these weights: one scale per row, or groups of whole 32-column blocks; K below
// kInt8GemmMaxK; a CPU with AVX512_VNNI.
inline bool int8_vnni_shape_fits(int64_t K, int64_t group_size, int64_t groups) {
  return (groups == 1 || group_size % 32 == 0) && K < kInt8GemmMaxK && cpu_has_avx512_vnni();
}

// out [M, N] (T, x's dtype) = x [M, K] @ W.T (+ bias) for 1 to 8 rows of x and int8 weights that
// int8_vnni_shape_fits.
template <typename T>
void gemv_int8_vnni(const Int8Matrix& w, const T* x, int64_t M, const float* bias, T* out) {
  const SplitRows rows = split_rows(x, M, w.K);
  with_row_count(M, "linear_w8", [&](auto m) {
    constexpr int kRows = decltype(m)::value;
    if (w.groups == 1) return gemv_int8_vnni_rows<T, kRows>(w, rows, bias, out);
    grouped_int8_rows<T, kRows>(w, rows, bias, out);
  });
}

}  // namespace octavo_cpu
#endif
