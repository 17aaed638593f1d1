// The streaming GEMV of the quantized linears (linear_quantized.cpp) for up to kGemvRows rows of x: every weight
// read once, dequantized in registers exactly as its layout defines it (w8: float(q) * scale; w4: float(q) *
// scale, then + offset; fp8: float(q) * scale), out = sum over k of x * weight (+ bias), float32 throughout in the
// kernel's own order.
// The w8 weights take gemv_int8.h's scaled group sums where those apply.
#pragma once

#include "gemv_int8.h"
#include "vec_utils.h"

#include <algorithm>
#include <cstring>
#include <vector>

namespace octavo_cpu {

constexpr int64_t kGemvRows = 8;

// The kLanes 4-bit values of kLanes / 2 bytes (low nibble first) widened to float, in registers.
inline Vec load_nibbles(const uint8_t* src) {
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#if defined(CPU_CAPABILITY_AVX512)
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(src));
#else
  int32_t word;
  std::memcpy(&word, src, sizeof(word));
  const __m128i bytes = _mm_cvtsi32_si128(word);
#endif
  const __m128i mask = _mm_set1_epi8(0x0F);
  // Interleaving the low and the high nibbles of each byte puts the columns in order.
  const __m128i columns =
      _mm_unpacklo_epi8(_mm_and_si128(bytes, mask), _mm_and_si128(_mm_srli_epi16(bytes, 4), mask));
#if defined(CPU_CAPABILITY_AVX512)
  return Vec(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(columns)));
#else
  return Vec(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(columns)));
#endif
#else
  __at_align__ float values[kLanes];
  for (int64_t i = 0; i < kLanes; ++i) values[i] = static_cast<float>((src[i / 2] >> (4 * (i % 2))) & 0x0F);
  return Vec::loadu(values);
#endif
}

// w8: W[n, k] = float(q[n, k]) * scales[n, k / group_size].
struct Int8Weight {
  static constexpr bool kNeedsEvenStart = false;
  static constexpr bool kSplitsColumns = false;
  const int8_t* q;
  Parameters scales;
  int64_t N, K, group_size, groups;

  float scale(int64_t n, int64_t g) const { return scales[n * groups + g]; }
  float offset(int64_t, int64_t) const { return 0.f; }
  Vec values(int64_t n, int64_t k, const Vec& s, const Vec&) const { return load_widened(q + n * K + k) * s; }
  float value(int64_t n, int64_t k, float s, float) const { return static_cast<float>(q[n * K + k]) * s; }
  int64_t row_bytes() const { return K; }
  const uint8_t* row(int64_t n) const { return reinterpret_cast<const uint8_t*>(q) + n * K; }
  void prefetch_parameters(int64_t i) const { __builtin_prefetch(scales.address(i)); }
};

// w4: W[n, k] = float(nibble k of row n) * scales[n, g] + offsets[n, g], g = k / group_size.
struct Int4Weight {
  static constexpr bool kNeedsEvenStart = true;  // a vector starts at the low nibble of a byte
#if defined(CPU_CAPABILITY_AVX512)
  // Whole groups look their values up (see accumulate_whole_group) in 32-column chunks ordered even columns
  // first, then odd ones: x is reordered the same way.
  static constexpr bool kSplitsColumns = true;
#else
  static constexpr bool kSplitsColumns = false;
#endif
  const uint8_t* q;
  Parameters scales;
  Parameters offsets;
  int64_t N, K, group_size, groups;

  float scale(int64_t n, int64_t g) const { return scales[n * groups + g]; }
  float offset(int64_t n, int64_t g) const { return offsets[n * groups + g]; }
  Vec values(int64_t n, int64_t k, const Vec& s, const Vec& o) const {
    return load_nibbles(q + n * (K / 2) + k / 2) * s + o;
  }
  float value(int64_t n, int64_t k, float s, float o) const {
    const uint8_t byte = q[n * (K / 2) + k / 2];
    return static_cast<float>((k & 1) ? byte >> 4 : byte & 0x0F) * s + o;
  }
  int64_t row_bytes() const { return K / 2; }
  const uint8_t* row(int64_t n) const { return q + n * (K / 2); }
  void prefetch_parameters(int64_t i) const {
    __builtin_prefetch(scales.address(i));
    __builtin_prefetch(offsets.address(i));
  }
};

// fp8: W[n, k] = float(q[n, k]) * scales[n]: float8_e4m3fn values, one scale per output channel (one group of K
// columns), widened in registers by load_widened.
struct Fp8Weight {
  static constexpr bool kNeedsEvenStart = false;
  static constexpr bool kSplitsColumns = false;
  const c10::Float8_e4m3fn* q;
  Parameters scales;
  int64_t N, K, group_size, groups;

  float scale(int64_t n, int64_t) const { return scales[n]; }
  float offset(int64_t, int64_t) const { return 0.f; }
  Vec values(int64_t n, int64_t k, const Vec& s, const Vec&) const { return load_widened(q + n * K + k) * s; }
  float value(int64_t n, int64_t k, float s, float) const { return static_cast<float>(q[n * K + k]) * s; }
  int64_t row_bytes() const { return K; }
  const uint8_t* row(int64_t n) const { return reinterpret_cast<const uint8_t*>(q) + n * K; }
  void prefetch_parameters(int64_t i) const { __builtin_prefetch(scales.address(i)); }
};

// Columns [begin, end) of one group: the first column whose vectors can start there, and the end of the vectors.
template <typename W>
inline void vector_span(int64_t begin, int64_t end, int64_t& vector_begin, int64_t& vector_end) {
  vector_begin = (W::kNeedsEvenStart && (begin & 1)) ? std::min(begin + 1, end) : begin;
  vector_end = vector_begin + (end - vector_begin) / kLanes * kLanes;
}

// One group of a weight row as the dequantizing loops walk it: its columns [first, last), the vectors' span
// (vector_span), and its scale and offset as floats and broadcast.
struct RowGroup {
  int64_t first, last, vector_begin, vector_end;
  float s, o;
  Vec sv, ov;
};

// Calls body(RowGroup) for every group of row n of W, in column order.
template <typename W, typename Body>
inline void for_each_group(const W& w, int64_t n, const Body& body) {
  for (int64_t g = 0; g < w.groups; ++g) {
    const float s = w.scale(n, g), o = w.offset(n, g);
    RowGroup group{g * w.group_size, std::min((g + 1) * w.group_size, w.K), 0, 0, s, o, Vec(s), Vec(o)};
    vector_span<W>(group.first, group.last, group.vector_begin, group.vector_end);
    body(group);
  }
}

// Accumulates rows [n, n + R) of W against the M rows of x over columns [first, last) of one group (any bounds):
// whole vectors into acc, the columns no vector covers (an odd start of a w4 group, the end) into tail.
template <int M, int R, typename W>
inline void accumulate_group(const W& w, const float* x, int64_t n, int64_t g, int64_t first, int64_t last,
                             Vec (&acc)[R][M], float (&tail)[R][M]) {
  const int64_t K = w.K;
  float s[R], o[R];
  Vec sv[R], ov[R];
  for (int r = 0; r < R; ++r) {
    s[r] = w.scale(n + r, g);
    o[r] = w.offset(n + r, g);
    sv[r] = Vec(s[r]);
    ov[r] = Vec(o[r]);
  }
  int64_t vector_begin, vector_end;
  vector_span<W>(first, last, vector_begin, vector_end);
  for (int64_t k = vector_begin; k < vector_end; k += kLanes) {
    Vec wide[R];
    for (int r = 0; r < R; ++r) wide[r] = w.values(n + r, k, sv[r], ov[r]);
    for (int m = 0; m < M; ++m) {
      const Vec xv = Vec::loadu(x + m * K + k);
      for (int r = 0; r < R; ++r) acc[r][m] = at::vec::fmadd(xv, wide[r], acc[r][m]);
    }
  }
  for (int64_t k = first; k < last; ++k) {
    if (k == vector_begin) k = vector_end;
    if (k >= last) break;
    for (int r = 0; r < R; ++r) {
      const float value = w.value(n + r, k, s[r], o[r]);
      for (int m = 0; m < M; ++m) tail[r][m] += x[m * K + k] * value;
    }
  }
}

// Accumulates rows [n, n + R) of W against the M rows of x over group g, which is VG whole vectors: C = 2
// deals the vectors to acc and odd in turn (two independent chains of fused multiply-adds a pair, hiding
// their latency where R * M pairs are too few), C = 1 leaves odd alone.
template <int M, int R, int VG, int C, typename W>
inline void accumulate_whole_group(const W& w, const float* x, int64_t n, int64_t g, Vec (&acc)[R][M],
                                   Vec (&odd)[R][M]) {
  const int64_t K = w.K, first = g * (VG * kLanes);
  Vec sv[R], ov[R];
  for (int r = 0; r < R; ++r) {
    sv[r] = Vec(w.scale(n + r, g));
    ov[r] = Vec(w.offset(n + r, g));
  }
  for (int v = 0; v < VG; ++v) {
    const int64_t k = first + v * kLanes;
    Vec wide[R];
    for (int r = 0; r < R; ++r) wide[r] = w.values(n + r, k, sv[r], ov[r]);
    for (int m = 0; m < M; ++m) {
      const Vec xv = Vec::loadu(x + m * K + k);
      for (int r = 0; r < R; ++r) {
        if (C == 2 && v % 2 == 1) {
          odd[r][m] = at::vec::fmadd(xv, wide[r], odd[r][m]);
        } else {
          acc[r][m] = at::vec::fmadd(xv, wide[r], acc[r][m]);
        }
      }
    }
  }
}

#if defined(CPU_CAPABILITY_AVX512)
// The w4 group as a table lookup: its 16 possible values q * scale + offset (q = 0..15, rounded exactly as the
// layout defines) fill one vector, and vpermps picks each column's value by its nibble. 32 columns (16 bytes) at
// a time: the bytes widened to 32-bit lanes index by their low 4 bits (even columns) and, shifted, by their high
// 4 bits (odd columns); x holds each chunk's even columns first, then its odd ones (split_columns). C = 2: the
// odd columns' products go to the chains of odd (see the generic accumulate_whole_group).
template <int M, int R, int VG, int C>
inline void accumulate_whole_group(const Int4Weight& w, const float* x, int64_t n, int64_t g, Vec (&acc)[R][M],
                                   Vec (&odd_acc)[R][M]) {
  static_assert(VG % 2 == 0, "the lookup takes 32-column chunks");
  const int64_t K = w.K, first = g * (VG * kLanes);
  const __m512 levels = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  __m512 table[R];
  for (int r = 0; r < R; ++r) {
    const __m512 scaled = _mm512_mul_ps(levels, _mm512_set1_ps(w.scale(n + r, g)));
    table[r] = _mm512_add_ps(scaled, _mm512_set1_ps(w.offset(n + r, g)));
  }
  for (int c = 0; c < VG / 2; ++c) {
    const int64_t k = first + c * 2 * kLanes;
    Vec even[R], odd[R];
    for (int r = 0; r < R; ++r) {
      const __m512i bytes =
          _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w.q + (n + r) * (K / 2) + k / 2)));
      even[r] = Vec(_mm512_permutexvar_ps(bytes, table[r]));
      odd[r] = Vec(_mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), table[r]));
    }
    for (int m = 0; m < M; ++m) {
      const Vec x_even = Vec::loadu(x + m * K + k), x_odd = Vec::loadu(x + m * K + k + kLanes);
      for (int r = 0; r < R; ++r) {
        acc[r][m] = at::vec::fmadd(x_even, even[r], acc[r][m]);
        if (C == 2) {
          odd_acc[r][m] = at::vec::fmadd(x_odd, odd[r], odd_acc[r][m]);
        } else {
          acc[r][m] = at::vec::fmadd(x_odd, odd[r], acc[r][m]);
        }
      }
    }
  }
}
#endif

// x [rows, K] with every 2 * kLanes-column chunk of [0, columns) reordered even columns first, then odd ones.
inline std::vector<float> split_columns(const float* x, int64_t rows, int64_t K, int64_t columns) {
  std::vector<float> split(x, x + rows * K);
  for (int64_t m = 0; m < rows; ++m) {
    for (int64_t k = 0; k + 2 * kLanes <= columns; k += 2 * kLanes) {
      for (int64_t i = 0; i < kLanes; ++i) {
        split[m * K + k + i] = x[m * K + k + 2 * i];
        split[m * K + k + kLanes + i] = x[m * K + k + 2 * i + 1];
      }
    }
  }
  return split;
}

// out[m, n] = x[m, :] . W[n, :] + bias[n] for n in [begin, end), R weight rows at a time, group by group.
// VG > 0: the group size is VG vectors, so every whole group runs a loop of fixed length with no tails (the
// short last group, if any, takes the general path), reading x_whole (x, or x reordered as W::kSplitsColumns
// says); VG = 0: every group takes the general path.
// C accumulator chains per (weight row, x row) pair in the whole groups (see accumulate_whole_group). Each block
// first asks for the weight bytes kPrefetchBytes past its rows, up to the end of the task's rows (as gemv_int8.h).
template <int M, int R, int VG, int C, typename W>
void gemv_block(const W& w, const float* x, const float* x_whole, const float* bias, float* out, int64_t begin,
                int64_t end) {
  const int64_t K = w.K, N = w.N;
  const int64_t whole_groups = VG > 0 ? K / w.group_size : 0;
  const uint8_t* prefetch_end = w.row(end);
  // The scales (and offsets) as many rows ahead as the weight bytes.
  const int64_t ahead = std::max<int64_t>(1, kPrefetchBytes / std::max<int64_t>(w.row_bytes(), 1));
  int64_t n = begin;
  for (; n + R <= end; n += R) {
    prefetch_span(w.row(n) + kPrefetchBytes, w.row(n + R) + kPrefetchBytes, prefetch_end);
    for (int64_t i = (n + ahead) * w.groups; i < std::min(n + R + ahead, end) * w.groups; i += 16) {
      w.prefetch_parameters(i);
    }
    Vec acc[R][M], odd[R][M];
    float tail[R][M] = {};
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < M; ++m) acc[r][m] = odd[r][m] = Vec(0.f);
    for (int64_t g = 0; g < whole_groups; ++g) accumulate_whole_group<M, R, VG, C>(w, x_whole, n, g, acc, odd);
    for (int64_t g = whole_groups; g < w.groups; ++g) {
      accumulate_group<M, R>(w, x, n, g, g * w.group_size, std::min((g + 1) * w.group_size, K), acc, tail);
    }
    for (int r = 0; r < R; ++r) {
      for (int m = 0; m < M; ++m) {
        const float total = hsum(C == 2 ? acc[r][m] + odd[r][m] : acc[r][m]) + tail[r][m];
        out[m * N + n + r] = bias ? total + bias[n + r] : total;
      }
    }
  }
  if (n < end) gemv_block<M, 1, VG, C>(w, x, x_whole, bias, out, n, end);
}

template <int M, int VG, typename W>
void gemv(const W& w, const float* x, const float* bias, float* out) {
  // R * M * C independent chains of fused multiply-adds: 8 for one or two rows of x, 6 to 16 above.
  constexpr int R = M <= 2 ? 4 : 2;
  constexpr int C = M == 1 ? 2 : 1;
  const int64_t blocks = (w.N + R - 1) / R;
  // Whole R-row blocks per task, at least kGemvTaskBytes of weights each, so small layers do not pay for threads.
  const int64_t grain = std::max<int64_t>(1, kGemvTaskBytes / std::max<int64_t>(w.row_bytes() * R, 1));
  std::vector<float> split;
  if (VG > 0 && W::kSplitsColumns) split = split_columns(x, M, w.K, w.K / w.group_size * w.group_size);
  const float* x_whole = split.empty() ? x : split.data();
  at::parallel_for(0, blocks, grain, [&](int64_t begin, int64_t end) {
    gemv_block<M, R, VG, C>(w, x, x_whole, bias, out, begin * R, std::min(end * R, w.N));
  });
}

// The common group sizes (2, 4 or 8 vectors: 32 to 128 columns with AVX-512, 16 to 64 with AVX2) get loops of
// fixed length; per-row scales and other sizes run long or general loops, where the length matters less.
template <int M, typename W>
void gemv_groups(const W& w, const float* x, const float* bias, float* out) {
  if (w.group_size == 2 * kLanes && w.K >= w.group_size) return gemv<M, 2>(w, x, bias, out);
  if (w.group_size == 4 * kLanes && w.K >= w.group_size) return gemv<M, 4>(w, x, bias, out);
  if (w.group_size == 8 * kLanes && w.K >= w.group_size) return gemv<M, 8>(w, x, bias, out);
  gemv<M, 0>(w, x, bias, out);
}

template <typename W>
void gemv_dispatch(int64_t rows, const W& w, const float* x, const float* bias, float* out) {
  switch (rows) {
    case 1: return gemv_groups<1>(w, x, bias, out);
    case 2: return gemv_groups<2>(w, x, bias, out);
    case 3: return gemv_groups<3>(w, x, bias, out);
    case 4: return gemv_groups<4>(w, x, bias, out);
    case 5: return gemv_groups<5>(w, x, bias, out);
    case 6: return gemv_groups<6>(w, x, bias, out);
    case 7: return gemv_groups<7>(w, x, bias, out);
    case 8: return gemv_groups<8>(w, x, bias, out);
    default: TORCH_CHECK(false, "quantized linear: gemv takes 1 to ", kGemvRows, " rows, got ", rows);
  }
}

inline void gemv_for(int64_t rows, const Int4Weight& w, const float* x, const float* bias, float* out) {
  gemv_dispatch(rows, w, x, bias, out);
}

inline void gemv_for(int64_t rows, const Fp8Weight& w, const float* x, const float* bias, float* out) {
  gemv_dispatch(rows, w, x, bias, out);
}

// w8: scaled group sums where gemv_int8 applies (see there), else each weight dequantized as the layout defines.
inline void gemv_for(int64_t rows, const Int8Weight& w, const float* x, const float* bias, float* out) {
  if (gemv_int8(rows, Int8Matrix{w.q, w.scales, w.N, w.K, w.group_size, w.groups}, x, bias, out)) return;
  gemv_dispatch(rows, w, x, bias, out);
}

}  // namespace octavo_cpu
