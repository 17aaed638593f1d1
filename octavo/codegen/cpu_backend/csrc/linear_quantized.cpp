// octavo_cpu::linear_w8 / linear_w4: x @ W.T (+ bias) over the int8 and 4-bit weight layouts of
// octavo.ir.quantized_layout (semantics: octavo.ir.ops.quantized_linear, same schemas), never stored dequantized:
// decode reads the int8 / int4 bytes. x, the accumulation, the bias and the result are float32; x of another float
// dtype is widened first and the result rounded to it once at the end.
//
// Up to kGemvRows rows of x: a streaming kernel that reads every weight once and keeps the rows of x in cache
// (memory-bound by design). More rows: a tile of output columns at a time is dequantized into a per-thread
// float32 buffer and multiplied by the BLAS GEMM (compute-bound shapes).
//
// The arithmetic, each step rounded to float32, the sums in the kernel's own order:
// - w4 (every path) and the w8 GEMM: each weight dequantized exactly as the layout defines it (w8: float(q) *
//   scale; w4: float(q) * scale, then + offset), then out = sum over k of x * weight (+ bias).
// - w8 GEMV (gemv_int8.h), for per-row scales and for grouped weights up to kScaledGroupRows rows of x:
//   out = sum over groups of scale * (sum over the group's k of x * float(q)) (+ bias): the scale multiplies a
//   group's sum, not each weight. Grouped weights with more rows take the dequantizing GEMV of the first case.
//
// bf16_gemm (default false) lets that GEMM run in bfloat16: x and the dequantized tile rounded to bfloat16
// (relative error 2^-9 each), products summed in float32 by oneDNN, the result rounded to bfloat16 once more and
// widened, the bias added in float32. Only the rows above kGemvRows are affected; the GEMV is float32 always.
#include "gemv_int8.h"
#include "vec_utils.h"

#include <ATen/ThreadLocalState.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/addmm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/mm.h>
#include <torch/library.h>

#include <optional>
#include <vector>

namespace octavo_cpu {
namespace {

constexpr int64_t kGemvRows = 8;
constexpr int64_t kTileColumns = 128;      // output columns (weight rows) dequantized per GEMM tile

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
  const float* scales;
  int64_t N, K, group_size, groups;

  float scale(int64_t n, int64_t g) const { return scales[n * groups + g]; }
  float offset(int64_t, int64_t) const { return 0.f; }
  Vec values(int64_t n, int64_t k, const Vec& s, const Vec&) const { return load_widened(q + n * K + k) * s; }
  float value(int64_t n, int64_t k, float s, float) const { return static_cast<float>(q[n * K + k]) * s; }
  int64_t row_bytes() const { return K; }
  const uint8_t* row(int64_t n) const { return reinterpret_cast<const uint8_t*>(q) + n * K; }
  void prefetch_parameters(int64_t i) const { __builtin_prefetch(scales + i); }
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
  const float* scales;
  const float* offsets;
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
    __builtin_prefetch(scales + i);
    __builtin_prefetch(offsets + i);
  }
};

// Columns [begin, end) of one group: the first column whose vectors can start there, and the end of the vectors.
template <typename W>
inline void vector_span(int64_t begin, int64_t end, int64_t& vector_begin, int64_t& vector_end) {
  vector_begin = (W::kNeedsEvenStart && (begin & 1)) ? std::min(begin + 1, end) : begin;
  vector_end = vector_begin + (end - vector_begin) / kLanes * kLanes;
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

void gemv_for(int64_t rows, const Int4Weight& w, const float* x, const float* bias, float* out) {
  gemv_dispatch(rows, w, x, bias, out);
}

// w8: scaled group sums where gemv_int8 applies (see there), else each weight dequantized as the layout defines.
void gemv_for(int64_t rows, const Int8Weight& w, const float* x, const float* bias, float* out) {
  if (gemv_int8(rows, Int8Matrix{w.q, w.scales, w.N, w.K, w.group_size, w.groups}, x, bias, out)) return;
  gemv_dispatch(rows, w, x, bias, out);
}

// dst[0:K] = W[n, :] in float32, the same values the GEMV computes in registers.
template <typename W>
void dequantize_row(const W& w, int64_t n, float* dst) {
  for (int64_t g = 0; g < w.groups; ++g) {
    const int64_t first = g * w.group_size, last = std::min(first + w.group_size, w.K);
    const float s = w.scale(n, g), o = w.offset(n, g);
    const Vec sv(s), ov(o);
    int64_t vector_begin, vector_end;
    vector_span<W>(first, last, vector_begin, vector_end);
    for (int64_t k = first; k < vector_begin; ++k) dst[k] = w.value(n, k, s, o);
    for (int64_t k = vector_begin; k < vector_end; k += kLanes) w.values(n, k, sv, ov).store(dst + k);
    for (int64_t k = vector_end; k < last; ++k) dst[k] = w.value(n, k, s, o);
  }
}

// out = x @ W.T (+ bias): each thread dequantizes kTileColumns weight rows at a time into its own buffer and
// multiplies them with one single-threaded BLAS call writing that tile's output columns. bf16_gemm: the tile is
// rounded to bfloat16 and multiplied with x rounded to bfloat16 (oneDNN's native bf16 GEMM, several times the
// float32 one where the CPU has AVX512_BF16 or AMX); its bfloat16 result is widened into out and the bias added
// in float32.
template <typename W>
void tiled_gemm(const W& w, const at::Tensor& x, const std::optional<at::Tensor>& bias, at::Tensor& out,
                bool bf16_gemm) {
  const int64_t K = w.K, N = w.N;
  const int64_t tiles = (N + kTileColumns - 1) / kTileColumns;
  const at::Tensor x_gemm = bf16_gemm ? x.to(at::kBFloat16) : x;
  // The ATen calls below run on worker threads: give them the caller's inference mode and dispatch state.
  const at::ThreadLocalState caller_state;
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    at::ThreadLocalStateGuard state_guard(caller_state);
    std::vector<float> buffer(kTileColumns * K);
    std::vector<c10::BFloat16> narrow_buffer(bf16_gemm ? kTileColumns * K : 0);
    for (int64_t tile = begin; tile < end; ++tile) {
      const int64_t first = tile * kTileColumns, count = std::min(kTileColumns, N - first);
      for (int64_t i = 0; i < count; ++i) dequantize_row(w, first + i, buffer.data() + i * K);
      at::Tensor target = out.narrow(1, first, count);
      if (bf16_gemm) {
        at::vec::convert(buffer.data(), narrow_buffer.data(), count * K);
        const at::Tensor tile_weight = at::from_blob(narrow_buffer.data(), {count, K}, x_gemm.options());
        target.copy_(at::mm(x_gemm, tile_weight.t()));
        if (bias.has_value()) target.add_(bias->narrow(0, first, count));
        continue;
      }
      const at::Tensor tile_weight = at::from_blob(buffer.data(), {count, K}, x.options());
      if (bias.has_value()) {
        at::addmm_out(target, bias->narrow(0, first, count), x, tile_weight.t());
      } else {
        at::mm_out(target, x, tile_weight.t());
      }
    }
  });
}

bool is_float(const at::Tensor& t) {
  const auto type = t.scalar_type();
  return type == at::kFloat || type == at::kBFloat16 || type == at::kHalf;
}

// The group-wise parameters (scales or offsets) as float32 [N, groups] (widening is exact).
at::Tensor group_parameters(const char* name, const char* role, const at::Tensor& t, int64_t N, int64_t groups,
                            int64_t group_size) {
  TORCH_CHECK(t.device().is_cpu() && is_float(t) && t.dim() == 2 && t.size(0) == N && t.size(1) == groups, name,
              ": ", role, " must be a float16, bfloat16 or float32 tensor [", N, ", ", groups, "] (group size ",
              group_size, "), got ", t.scalar_type(), " ", t.sizes());
  return t.to(at::kFloat).contiguous();
}

// Checks x and bias, runs `compute(x as float32 [M, K], bias as float32, out float32 [M, N])`, shapes the result.
template <typename Compute>
at::Tensor run_linear(const char* name, const at::Tensor& input, int64_t N, int64_t K,
                      const std::optional<at::Tensor>& bias, const Compute& compute) {
  TORCH_CHECK(input.device().is_cpu() && is_float(input), name,
              ": input must be a float32, bfloat16 or float16 CPU tensor, got ", input.scalar_type(), " on ",
              input.device());
  TORCH_CHECK(input.dim() >= 1 && input.size(-1) == K, name, ": input ", input.sizes(), " does not end in ", K,
              " (the weight's input features)");
  std::optional<at::Tensor> b;
  if (bias.has_value()) {
    TORCH_CHECK(bias->device().is_cpu() && is_float(*bias) && bias->dim() == 1 && bias->size(0) == N, name,
                ": bias must be a float tensor [", N, "], got ", bias->scalar_type(), " ", bias->sizes());
    b = bias->to(at::kFloat).contiguous();
  }
  const at::Tensor x = input.reshape({-1, K}).to(at::kFloat).contiguous();
  const int64_t M = x.size(0);
  std::vector<int64_t> shape(input.sizes().begin(), input.sizes().end());
  shape.back() = N;
  at::Tensor out = at::empty({M, N}, x.options());
  if (M > 0 && N > 0) compute(x, b, out);
  return out.to(input.scalar_type()).view(shape);
}

template <typename W>
void compute(const W& w, const at::Tensor& x, const std::optional<at::Tensor>& bias, at::Tensor& out,
             bool bf16_gemm) {
  const int64_t M = x.size(0);
  if (M <= kGemvRows) {
    gemv_for(M, w, x.const_data_ptr<float>(), bias ? bias->const_data_ptr<float>() : nullptr, out.data_ptr<float>());
  } else {
    tiled_gemm(w, x, bias, out, bf16_gemm);
  }
}

at::Tensor linear_w8(const at::Tensor& input, const at::Tensor& qweight, const at::Tensor& scales,
                     const std::optional<at::Tensor>& bias, int64_t group_size, bool bf16_gemm) {
  TORCH_CHECK(qweight.device().is_cpu() && qweight.scalar_type() == at::kChar && qweight.dim() == 2,
              "linear_w8: qweight must be a 2-d int8 CPU tensor, got ", qweight.scalar_type(), " ", qweight.sizes());
  TORCH_CHECK(group_size > 0, "linear_w8: group_size must be positive, got ", group_size);
  const int64_t N = qweight.size(0), K = qweight.size(1), groups = (K + group_size - 1) / group_size;
  const at::Tensor s = group_parameters("linear_w8", "scales", scales, N, groups, group_size);
  const at::Tensor q = qweight.contiguous();
  return run_linear("linear_w8", input, N, K, bias, [&](const at::Tensor& x, const auto& b, at::Tensor& out) {
    compute(Int8Weight{q.const_data_ptr<int8_t>(), s.const_data_ptr<float>(), N, K, group_size, groups}, x, b, out,
            bf16_gemm);
  });
}

at::Tensor linear_w4(const at::Tensor& input, const at::Tensor& qweight, const at::Tensor& scales,
                     const at::Tensor& offsets, const std::optional<at::Tensor>& bias, int64_t group_size,
                     bool bf16_gemm) {
  TORCH_CHECK(qweight.device().is_cpu() && qweight.scalar_type() == at::kByte && qweight.dim() == 2,
              "linear_w4: qweight must be a 2-d uint8 CPU tensor (two 4-bit values a byte), got ",
              qweight.scalar_type(), " ", qweight.sizes());
  TORCH_CHECK(group_size > 0, "linear_w4: group_size must be positive, got ", group_size);
  const int64_t N = qweight.size(0), K = 2 * qweight.size(1), groups = (K + group_size - 1) / group_size;
  const at::Tensor s = group_parameters("linear_w4", "scales", scales, N, groups, group_size);
  const at::Tensor o = group_parameters("linear_w4", "offsets", offsets, N, groups, group_size);
  const at::Tensor q = qweight.contiguous();
  return run_linear("linear_w4", input, N, K, bias, [&](const at::Tensor& x, const auto& b, at::Tensor& out) {
    compute(Int4Weight{q.const_data_ptr<uint8_t>(), s.const_data_ptr<float>(), o.const_data_ptr<float>(), N, K,
                       group_size, groups},
            x, b, out, bf16_gemm);
  });
}

}  // namespace
}  // namespace octavo_cpu

TORCH_LIBRARY_IMPL(octavo_cpu, CPU, m) {
  m.impl("linear_w8", &octavo_cpu::linear_w8);
  m.impl("linear_w4", &octavo_cpu::linear_w4);
}
