// The w4 GEMV of a bfloat16 model (bf16_gemm) for groups of a multiple of 32 columns, on CPUs with AVX512_VNNI:
// up to 8 rows of x, out [M, N] = x @ W.T (+ bias) with W[n, k] = q[n, k] * scale[n, g] + offset[n, g], in integers.
//
// Each row of x is rounded to 16-bit integers on its own step, as the AMX-INT8 GEMM rounds it (split_rows:
// xi = 256 * high + low, |xi * step - x| <= step / 2 plus float32 roundings). Then
//   out[m, n] = step * (sum over g of scale[n, g] * S(n, g) + sum over g of offset[n, g] * X(g)) + bias[n],
// where S(n, g) = sum over the group's k of q * xi and X(g) = sum over the group's k of xi are exact integers.
// vpdpbusd forms S a 32-column block at a time (four int32 lanes, eight columns each): the 4-bit q is a valid
// operand both as unsigned and as signed bytes, so the signed high bytes meet q as the unsigned operand and the
// unsigned low bytes meet it as the signed one, with no correction. A block's exact sum (|256 * high sum + low sum|
// < 2^22) is widened to float32 and multiplied by its group's scale into float32 accumulators; the offsets meet
// X(g) once per weight row. Against the definition the error is x's rounding, 2^-16 of its row's largest value per
// term, and float32 roundings of the sums.
//
// Per 64 weight bytes (128 columns), for each row of x: four vpdpbusd, a shift, a widening and a multiply-add,
// against about 24 table-lookup and multiply-add instructions of the float32 GEMV, which held it to ~13 GB/s.
// The nibbles stay where they are: x's columns are reordered instead, every 128 of them even columns first (the
// low nibbles of 64 bytes), then odd ones (the high nibbles).
#pragma once

#include "gemm_amx_int8.h"
#include "gemv_int8.h"
#include "gemv_int8_vnni.h"
#include "vnni_groups.h"

#if defined(CPU_CAPABILITY_AVX512)
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace octavo_cpu {

constexpr int64_t kNibbleChunk = 128;  // columns of one 64-byte load of 4-bit weights

// The 4-bit weight [N, K / 2 bytes] (column 2j in byte j's low nibble, 2j + 1 in its high one), its scales and
// offsets [N, groups].
struct Int4Matrix {
  const uint8_t* q;
  Parameters scales, offsets;
  int64_t N, K, group_size, groups;
};

// x prepared for the kernel: the planes of split_rows over x's columns reordered chunk by chunk (slot j < 64 of a
// chunk is its column 2j, slot 64 + j its column 2j + 1, zeros past K), each row's integer sum over every group
// (float32, zeros up to padded_groups), and each chunk's groups (a lane sums 8 of its columns).
struct NibbleRows {
  SplitRows planes;
  const float* group_sums;  // [M][padded_groups]
  ChunkGroups groups;
  int64_t padded_groups;
};

// The row's columns in the kernel's order into slots (width = whole chunks, zeros past K): per 128-column chunk, its
// even columns then its odd ones. 16-bit x (bfloat16, float16) 64 columns at a time by two-source permutes; float32
// x one pair at a time.
template <typename T>
void reorder_row(const T* row, int64_t K, T* slots) {
  int64_t k = 0;
  if constexpr (sizeof(T) == 2) {
    alignas(64) static constexpr int16_t kEven[32] = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30,
                                                      32, 34, 36, 38, 40, 42, 44, 46, 48, 50, 52, 54, 56, 58, 60, 62};
    alignas(64) static constexpr int16_t kOdd[32] = {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31,
                                                     33, 35, 37, 39, 41, 43, 45, 47, 49, 51, 53, 55, 57, 59, 61, 63};
    const __m512i even_index = _mm512_load_si512(kEven), odd_index = _mm512_load_si512(kOdd);
    const auto part = [&](int64_t first) {  // 32 columns from `first`, zeros past K
      const int64_t left = std::clamp<int64_t>(K - first, 0, 32);
      return _mm512_maskz_loadu_epi16(left >= 32 ? ~__mmask32(0) : (__mmask32(1) << left) - 1, row + first);
    };
    for (; k < K; k += 64) {  // columns k .. k + 63: slots (k / 128) * 128 + (k % 128) / 2 + [0, 32) and + 64
      const __m512i a = part(k), b = part(k + 32);
      T* at = slots + k / kNibbleChunk * kNibbleChunk + k % kNibbleChunk / 2;
      _mm512_storeu_si512(at, _mm512_permutex2var_epi16(a, even_index, b));
      _mm512_storeu_si512(at + 64, _mm512_permutex2var_epi16(a, odd_index, b));
    }
    return;
  }
  for (; k + 1 < K; k += 2) {
    const int64_t slot = k / kNibbleChunk * kNibbleChunk + k % kNibbleChunk / 2;
    slots[slot] = row[k];
    slots[slot + 64] = row[k + 1];
  }
}

// The exact integer sum of xi = 256 * high + low over the 32 slots of a 32-column block (16 slots at `at` and 16 at
// at + 64): the bytes summed by vpsadbw, the signed high bytes offset by 128 to sum them as unsigned.
inline int64_t block_sum(const int8_t* high, const uint8_t* low) {
  const __m128i bias = _mm_set1_epi8(static_cast<char>(0x80)), zero = _mm_setzero_si128();
  const auto bytes_sum = [&](__m128i first, __m128i second) {
    const __m128i sums = _mm_add_epi64(_mm_sad_epu8(first, zero), _mm_sad_epu8(second, zero));
    return _mm_cvtsi128_si64(sums) + _mm_extract_epi64(sums, 1);
  };
  const auto load = [](const void* at) { return _mm_loadu_si128(static_cast<const __m128i*>(at)); };
  const int64_t high_sum = bytes_sum(_mm_xor_si128(load(high), bias), _mm_xor_si128(load(high + 64), bias)) - 32 * 128;
  const int64_t low_sum = bytes_sum(load(low), load(low + 64));
  return 256 * high_sum + low_sum;
}

template <typename T>
NibbleRows nibble_rows(const Int4Matrix& w, const T* x, int64_t M) {
  static thread_local std::vector<T> reordered;
  static thread_local std::vector<float> sums;
  const int64_t K = w.K, chunks = (K + kNibbleChunk - 1) / kNibbleChunk, width = chunks * kNibbleChunk;
  const int64_t G = padded_groups(w.groups);
  reordered.assign(M * width, T(0.f));
  for (int64_t m = 0; m < M; ++m) reorder_row(x + m * K, K, reordered.data() + m * width);
  const SplitRows planes = split_rows(reordered.data(), M, width);
  // A 32-column block b is slots 16j .. 16j + 15 and 64 + 16j .. 64 + 16j + 15 of chunk b / 4 (j = b % 4).
  sums.assign(M * G, 0.f);
  const int64_t blocks = (K + 31) / 32, blocks_per_group = w.group_size / 32;
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t g = 0; g < w.groups; ++g) {
      int64_t group_sum = 0;  // exact: at most group_size * 32767
      for (int64_t b = g * blocks_per_group; b < std::min((g + 1) * blocks_per_group, blocks); ++b) {
        const int64_t at = m * planes.Kpad + b / 4 * kNibbleChunk + b % 4 * 16;
        group_sum += block_sum(planes.high + at, planes.low + at);
      }
      sums[m * G + g] = static_cast<float>(group_sum);
    }
  }
  return NibbleRows{planes, sums.data(), chunk_groups<kNibbleChunk, 8>(K, w.group_size, w.groups), G};
}

// Adds scale * (the block sums of chunk c) for weight rows [n, n + R) and the M rows of x into acc. First asks for
// each row's weight bytes kPrefetchBytes past this chunk's (the rows lie end to end: that is the stream
// kPrefetchBytes ahead), one line a row, up to prefetch_end: spread over the chunks, not all of a block's at once.
// Masked: the row's last, partial chunk (zeros past its bytes); the others load whole (see gemv_int4_vnni_block).
template <int M, int R, bool Masked>
__attribute__((target("avx512vnni"), always_inline)) inline void nibble_chunk(
    const Int4Matrix& w, const NibbleRows& x, int64_t n, int64_t c, const float* scales, int64_t scale_stride,
    const uint8_t* prefetch_end, __m512 (&acc)[M][R]) {
  const int64_t row_bytes = w.K / 2, left = row_bytes - c * 64;
  for (int r = 0; r < R; ++r) {
    const uint8_t* ahead = w.q + (n + r) * row_bytes + c * 64 + kPrefetchBytes;
    if (ahead < prefetch_end) __builtin_prefetch(ahead);
  }
  const __mmask64 mask = left >= 64 ? ~__mmask64(0) : (__mmask64(1) << left) - 1;
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  const __m512i lane_group = _mm512_loadu_si512(x.groups.lane_group + c * 16);
  __m512i even[R], odd[R];
  __m512 scale[R];
  for (int r = 0; r < R; ++r) {
    const uint8_t* at = w.q + (n + r) * row_bytes + c * 64;
    const __m512i bytes = Masked ? _mm512_maskz_loadu_epi8(mask, at) : _mm512_loadu_si512(at);
    even[r] = _mm512_and_si512(bytes, nibble);
    odd[r] = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), nibble);
    scale[r] = _mm512_permutexvar_ps(lane_group, _mm512_loadu_ps(scales + r * scale_stride + x.groups.first_group[c]));
  }
  for (int m = 0; m < M; ++m) {
    const int64_t at = m * x.planes.Kpad + c * kNibbleChunk;
    const __m512i high_even = _mm512_loadu_si512(x.planes.high + at);
    const __m512i high_odd = _mm512_loadu_si512(x.planes.high + at + 64);
    const __m512i low_even = _mm512_loadu_si512(x.planes.low + at);
    const __m512i low_odd = _mm512_loadu_si512(x.planes.low + at + 64);
    for (int r = 0; r < R; ++r) {
      __m512i sum = _mm512_dpbusd_epi32(_mm512_setzero_si512(), even[r], high_even);
      sum = _mm512_slli_epi32(_mm512_dpbusd_epi32(sum, odd[r], high_odd), 8);
      sum = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(sum, low_even, even[r]), low_odd, odd[r]);
      acc[m][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), scale[r], acc[m][r]);
    }
  }
}

// out[m, n + r] for the weight rows [n, n + R) and the M rows of x, the task's rows ending at `end`. The block asks
// for the scales and offsets of the rows whose weights are being fetched (as many rows ahead as kPrefetchBytes).
template <typename T, int M, int R>
__attribute__((target("avx512vnni"))) inline void gemv_int4_vnni_block(const Int4Matrix& w, const NibbleRows& x,
                                                                       const float* bias, T* out, int64_t n,
                                                                       int64_t end) {
  const int64_t row_bytes = w.K / 2, G = x.padded_groups;
  const int64_t ahead = n + std::max<int64_t>(1, kPrefetchBytes / row_bytes);
  for (const Parameters* p : {&w.scales, &w.offsets}) {
    prefetch_span(p->address(ahead * w.groups), p->address((ahead + R) * w.groups), p->address(end * w.groups));
  }
  // The block's rows' scales and offsets, each widened in one pass (row r's at r * groups).
  const int64_t span = R * w.groups, room = padded_groups(span);
  static thread_local std::vector<float> parameters;
  if (static_cast<int64_t>(parameters.size()) < 2 * room) parameters.resize(2 * room);
  float* const scales = parameters.data();
  float* const offsets = scales + room;
  widen_parameter_rows(w.scales, n * w.groups, span, scales);
  widen_parameter_rows(w.offsets, n * w.groups, span, offsets);
  __m512 acc[M][R];
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = _mm512_setzero_ps();
  // GCC 12 keeps the accumulators in registers only while the loop has no masked load: with one, it stored all of
  // them to memory at every chunk. So only the last, partial chunk is masked, after the loop.
  const int64_t whole = row_bytes / 64;
  for (int64_t c = 0; c < whole; ++c) {
    nibble_chunk<M, R, false>(w, x, n, c, scales, w.groups, w.q + end * row_bytes, acc);
  }
  if (whole < x.groups.chunks) nibble_chunk<M, R, true>(w, x, n, whole, scales, w.groups, w.q + end * row_bytes, acc);
  // The offsets' terms join the same accumulators, 16 groups at a time; past the row's last group the offsets are
  // taken as zeros (as the sums of x there are), not the next row's.
  for (int64_t g = 0; g < w.groups; g += 16) {
    const int64_t left = w.groups - g;
    const __mmask16 mask = left >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1);
    for (int m = 0; m < M; ++m) {
      const __m512 sums = _mm512_loadu_ps(x.group_sums + m * G + g);
      for (int r = 0; r < R; ++r) {
        acc[m][r] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mask, offsets + r * w.groups + g), sums, acc[m][r]);
      }
    }
  }
  for (int m = 0; m < M; ++m) {
    float totals[R];
    reduce_add_rows<R>(acc[m], totals);
    for (int r = 0; r < R; ++r) {
      out[m * w.N + n + r] = static_cast<T>(std::fma(totals[r], x.planes.step[m], bias ? bias[n + r] : 0.f));
    }
  }
}

template <typename T, int M>
void gemv_int4_vnni_rows(const Int4Matrix& w, const NibbleRows& x, const float* bias, T* out) {
  // Two weight rows a block above two rows of x, not one: a block's own work (its parameters widened, one 16-lane
  // reduction per row of x and weight row) took about a third of the time at 8 rows with one weight row a block
  // (5 to 8 rows of x: 20-30% less time with two, at most 2 * 8 accumulators beside 4 nibble vectors).
  constexpr int R = M <= 2 ? 4 : 2;
  const int64_t blocks = (w.N + R - 1) / R;
  const int64_t grain = std::max<int64_t>(1, kGemvTaskBytes / std::max<int64_t>(w.K / 2 * R, 1));
  at::parallel_for(0, blocks, grain, [&](int64_t begin, int64_t end) {
    const int64_t first = begin * R, last = std::min(end * R, w.N);
    int64_t n = first;
    for (; n + R <= last; n += R) gemv_int4_vnni_block<T, M, R>(w, x, bias, out, n, last);
    for (; n < last; ++n) gemv_int4_vnni_block<T, M, 1>(w, x, bias, out, n, last);
  });
}

// Whether the integer w4 GEMV takes this weight: groups of whole 32-column blocks, each group's integer sum of x
// within int32 (and K within split_rows' range), on a CPU with AVX512_VNNI.
inline bool int4_vnni_shape_fits(int64_t K, int64_t group_size) {
  return group_size % 32 == 0 && K < kInt8GemmMaxK && cpu_has_avx512_vnni();
}

// out [M, N] (T, x's dtype) = x [M, K] @ W.T (+ bias) for 1 to 8 rows of x (int4_vnni_shape_fits).
template <typename T>
void gemv_int4_vnni(const Int4Matrix& w, const T* x, int64_t M, const float* bias, T* out) {
  const NibbleRows rows = nibble_rows(w, x, M);
  with_row_count(M, "linear_w4", [&](auto m) { gemv_int4_vnni_rows<T, decltype(m)::value>(w, rows, bias, out); });
}

}  // namespace octavo_cpu
#endif
