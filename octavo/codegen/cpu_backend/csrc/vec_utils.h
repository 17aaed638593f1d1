// Vector helpers shared by the Octavo CPU kernels: float vectors (ATen's at::vec, which follows the
// CPU_CAPABILITY_* macro the build defines), widening loads from every cache/weight element type, and
// a scheduler that hands work items to threads one at a time.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>

namespace octavo_cpu {

// Calls body(std::integral_constant<int, M>{}) with M = rows, 1 to 8: the kernels unroll over the rows of x.
template <typename Body>
void with_row_count(int64_t rows, const char* name, const Body& body) {
  switch (rows) {
    case 1: return body(std::integral_constant<int, 1>{});
    case 2: return body(std::integral_constant<int, 2>{});
    case 3: return body(std::integral_constant<int, 3>{});
    case 4: return body(std::integral_constant<int, 4>{});
    case 5: return body(std::integral_constant<int, 5>{});
    case 6: return body(std::integral_constant<int, 6>{});
    case 7: return body(std::integral_constant<int, 7>{});
    case 8: return body(std::integral_constant<int, 8>{});
    default: TORCH_CHECK(false, name, ": takes 1 to 8 rows of x, got ", rows);
  }
}

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kLanes = Vec::size();

inline int64_t round_up(int64_t value, int64_t multiple) { return (value + multiple - 1) / multiple * multiple; }

// ---- widening loads: n elements of T -> n floats -------------------------------------------------

// The float value of every float8_e4m3fn bit pattern (x86 has no instruction for it).
inline const float* fp8_e4m3fn_table() {
  static const float* table = [] {
    static float values[256];
    for (int bits = 0; bits < 256; ++bits) {
      values[bits] = static_cast<float>(c10::Float8_e4m3fn(static_cast<uint8_t>(bits), c10::Float8_e4m3fn::from_bits()));
    }
    return values;
  }();
  return table;
}

template <typename T>
inline void widen(const T* src, int64_t n, float* dst) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

template <>
inline void widen<float>(const float* src, int64_t n, float* dst) {
  std::memcpy(dst, src, n * sizeof(float));
}

template <>
inline void widen<c10::BFloat16>(const c10::BFloat16* src, int64_t n, float* dst) {
  int64_t i = 0;
#if defined(CPU_CAPABILITY_AVX512)
  for (; i + 16 <= n; i += 16) {
    __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i)));
    _mm512_storeu_ps(dst + i, _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16)));
  }
#elif defined(CPU_CAPABILITY_AVX2)
  for (; i + 8 <= n; i += 8) {
    __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i)));
    _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16)));
  }
#endif
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

template <>
inline void widen<c10::Half>(const c10::Half* src, int64_t n, float* dst) {
  int64_t i = 0;
#if defined(CPU_CAPABILITY_AVX512)
  for (; i + 16 <= n; i += 16) {
    _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i))));
  }
#elif defined(CPU_CAPABILITY_AVX2)
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
  }
#endif
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

template <>
inline void widen<int8_t>(const int8_t* src, int64_t n, float* dst) {
  int64_t i = 0;
#if defined(CPU_CAPABILITY_AVX512)
  for (; i + 16 <= n; i += 16) {
    __m512i wide = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i)));
    _mm512_storeu_ps(dst + i, _mm512_cvtepi32_ps(wide));
  }
#elif defined(CPU_CAPABILITY_AVX2)
  for (; i + 8 <= n; i += 8) {
    __m256i wide = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + i)));
    _mm256_storeu_ps(dst + i, _mm256_cvtepi32_ps(wide));
  }
#endif
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

template <>
inline void widen<c10::Float8_e4m3fn>(const c10::Float8_e4m3fn* src, int64_t n, float* dst) {
  const float* table = fp8_e4m3fn_table();
  for (int64_t i = 0; i < n; ++i) dst[i] = table[src[i].x];
}

// One vector (kLanes elements) of 16-bit floats widened to float, in registers.
inline Vec load_widened(const c10::BFloat16* src) {
#if defined(CPU_CAPABILITY_AVX512)
  __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src)));
  return Vec(_mm512_castsi512_ps(_mm512_slli_epi32(wide, 16)));
#elif defined(CPU_CAPABILITY_AVX2)
  __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
  return Vec(_mm256_castsi256_ps(_mm256_slli_epi32(wide, 16)));
#else
  __at_align__ float values[kLanes];
  widen(src, kLanes, values);
  return Vec::loadu(values);
#endif
}

inline Vec load_widened(const c10::Half* src) {
#if defined(CPU_CAPABILITY_AVX512)
  return Vec(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src))));
#elif defined(CPU_CAPABILITY_AVX2)
  return Vec(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src))));
#else
  __at_align__ float values[kLanes];
  widen(src, kLanes, values);
  return Vec::loadu(values);
#endif
}

inline Vec load_widened(const float* src) { return Vec::loadu(src); }

inline Vec load_widened(const int8_t* src) {
#if defined(CPU_CAPABILITY_AVX512)
  return Vec(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)))));
#elif defined(CPU_CAPABILITY_AVX2)
  return Vec(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src)))));
#else
  __at_align__ float values[kLanes];
  widen(src, kLanes, values);
  return Vec::loadu(values);
#endif
}

// One vector of float8_e4m3fn values widened to float, in registers, exactly as c10's conversion: a normal value
// (exponent field e > 0) moves its exponent and mantissa bits into float32's and rebiases e by 127 - 7; a
// subnormal one (e = 0) is its mantissa times 2^-9; the sign bit is copied; both NaN patterns give NaN.
inline Vec load_widened(const c10::Float8_e4m3fn* src) {
#if defined(CPU_CAPABILITY_AVX512)
  const __m512i bits = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
  const __m512i magnitude = _mm512_and_si512(bits, _mm512_set1_epi32(0x7F));
  const __m512 sign = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_and_si512(bits, _mm512_set1_epi32(0x80)), 24));
  const __m512 normal =
      _mm512_castsi512_ps(_mm512_add_epi32(_mm512_slli_epi32(magnitude, 20), _mm512_set1_epi32(120 << 23)));
  const __m512 subnormal = _mm512_mul_ps(_mm512_cvtepi32_ps(magnitude), _mm512_set1_ps(1.0f / 512));
  __m512 value = _mm512_mask_blend_ps(_mm512_cmpge_epi32_mask(magnitude, _mm512_set1_epi32(8)), subnormal, normal);
  value = _mm512_mask_blend_ps(_mm512_cmpeq_epi32_mask(magnitude, _mm512_set1_epi32(0x7F)), value,
                               _mm512_set1_ps(std::numeric_limits<float>::quiet_NaN()));
  return Vec(_mm512_or_ps(value, sign));
#elif defined(CPU_CAPABILITY_AVX2)
  const __m256i bits = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src)));
  const __m256i magnitude = _mm256_and_si256(bits, _mm256_set1_epi32(0x7F));
  const __m256 sign = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_and_si256(bits, _mm256_set1_epi32(0x80)), 24));
  const __m256 normal =
      _mm256_castsi256_ps(_mm256_add_epi32(_mm256_slli_epi32(magnitude, 20), _mm256_set1_epi32(120 << 23)));
  const __m256 subnormal = _mm256_mul_ps(_mm256_cvtepi32_ps(magnitude), _mm256_set1_ps(1.0f / 512));
  __m256 value = _mm256_blendv_ps(subnormal, normal,
                                  _mm256_castsi256_ps(_mm256_cmpgt_epi32(magnitude, _mm256_set1_epi32(7))));
  value = _mm256_blendv_ps(value, _mm256_set1_ps(std::numeric_limits<float>::quiet_NaN()),
                           _mm256_castsi256_ps(_mm256_cmpeq_epi32(magnitude, _mm256_set1_epi32(0x7F))));
  return Vec(_mm256_or_ps(value, sign));
#else
  __at_align__ float values[kLanes];
  widen(src, kLanes, values);
  return Vec::loadu(values);
#endif
}

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
constexpr bool kHasTransposeSum = true;

#if defined(CPU_CAPABILITY_AVX512)
// The tree of transpose_sum on 16 vectors of 16 lanes, combining with `add` (float or integer addition of the
// vectors' bits): lane j of the result is acc[j]'s lanes combined in an order that depends only on j.
template <typename Add>
__attribute__((always_inline)) inline __m512 transpose_tree(const __m512* acc, const Add& add) {
  __m512 pairs[8], quads[4], octets[2];
  for (int i = 0; i < 8; ++i) {  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3]
    const __m512 a = acc[2 * i], b = acc[2 * i + 1];
    pairs[i] = add(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  }
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane: keys 4i..4i+3, each summed over that lane's 4 floats
    const __m512 a = pairs[2 * i], b = pairs[2 * i + 1];
    quads[i] = add(_mm512_shuffle_ps(a, b, _MM_SHUFFLE(1, 0, 1, 0)), _mm512_shuffle_ps(a, b, _MM_SHUFFLE(3, 2, 3, 2)));
  }
  for (int i = 0; i < 2; ++i) {  // [keys 8i..8i+3 over lanes 0+1, over 2+3, keys 8i+4..8i+7 over 0+1, over 2+3]
    const __m512 a = quads[2 * i], b = quads[2 * i + 1];
    octets[i] = add(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(2, 0, 2, 0)),
                    _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 1, 3, 1)));
  }
  return add(_mm512_shuffle_f32x4(octets[0], octets[1], _MM_SHUFFLE(2, 0, 2, 0)),
             _mm512_shuffle_f32x4(octets[0], octets[1], _MM_SHUFFLE(3, 1, 3, 1)));
}
#endif

// The kLanes horizontal sums of acc[0:kLanes] as one vector: lane j = sum of the lanes of acc[j]. A tree of
// unpack/shuffle adds (kLanes - 1 combining steps of ~3 instructions) instead of kLanes horizontal sums; the
// order in which lane j's terms are added depends only on j, never on the other vectors' values.
__attribute__((always_inline)) inline Vec transpose_sum(const Vec* acc) {
#if defined(CPU_CAPABILITY_AVX512)
  __m512 vectors[16];
  for (int i = 0; i < 16; ++i) vectors[i] = acc[i];
  return Vec(transpose_tree(vectors, [](__m512 a, __m512 b) { return _mm512_add_ps(a, b); }));
#else
  __m256 pairs[4], quads[2];
  for (int i = 0; i < 4; ++i) {
    const __m256 a = acc[2 * i], b = acc[2 * i + 1];
    pairs[i] = _mm256_add_ps(_mm256_unpacklo_ps(a, b), _mm256_unpackhi_ps(a, b));
  }
  for (int i = 0; i < 2; ++i) {
    const __m256 a = pairs[2 * i], b = pairs[2 * i + 1];
    quads[i] = _mm256_add_ps(_mm256_shuffle_ps(a, b, _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm256_shuffle_ps(a, b, _MM_SHUFFLE(3, 2, 3, 2)));
  }
  return Vec(_mm256_add_ps(_mm256_permute2f128_ps(quads[0], quads[1], 0x20),
                           _mm256_permute2f128_ps(quads[0], quads[1], 0x31)));
#endif
}
#else
constexpr bool kHasTransposeSum = false;
#endif

// ---- float vector arithmetic over padded rows (lengths are multiples of kLanes) ------------------

// Horizontal sum / max of one vector (the generic Vectorized<float>::reduce_add does not compile in
// torch's DEFAULT headers, so the portable build sums lane by lane in a fixed order).
inline float hsum(const Vec& v) {
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  return v.reduce_add();
#else
  __at_align__ float lanes[kLanes];
  v.store(lanes);
  float total = 0.f;
  for (int64_t i = 0; i < kLanes; ++i) total += lanes[i];
  return total;
#endif
}

inline float hmax(const Vec& v) {
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  return v.reduce_max();
#else
  __at_align__ float lanes[kLanes];
  v.store(lanes);
  float best = lanes[0];
  for (int64_t i = 1; i < kLanes; ++i) best = std::max(best, lanes[i]);
  return best;
#endif
}

inline float dot(const float* a, const float* b, int64_t n) {
  Vec acc0(0.f), acc1(0.f);
  int64_t i = 0;
  for (; i + 2 * kLanes <= n; i += 2 * kLanes) {
    acc0 = at::vec::fmadd(Vec::loadu(a + i), Vec::loadu(b + i), acc0);
    acc1 = at::vec::fmadd(Vec::loadu(a + i + kLanes), Vec::loadu(b + i + kLanes), acc1);
  }
  if (i < n) acc0 = at::vec::fmadd(Vec::loadu(a + i), Vec::loadu(b + i), acc0);
  return hsum(acc0 + acc1);
}

// acc[0:n] += weight * row[0:n]
inline void axpy(float weight, const float* row, float* acc, int64_t n) {
  const Vec w(weight);
  for (int64_t i = 0; i < n; i += kLanes) at::vec::fmadd(w, Vec::loadu(row + i), Vec::loadu(acc + i)).store(acc + i);
}

// scores[j] = (q . rows[j]) * scale for j in [0, n), rows of NV vectors, with q held in registers.
template <int NV>
inline void score_rows_fixed(const float* q, const float* const* rows, int64_t n, float scale, float* scores) {
  Vec qv[NV];
  for (int v = 0; v < NV; ++v) qv[v] = Vec::loadu(q + v * kLanes);
  for (int64_t j = 0; j < n; ++j) {
    Vec acc = qv[0] * Vec::loadu(rows[j]);
    for (int v = 1; v < NV; ++v) acc = at::vec::fmadd(qv[v], Vec::loadu(rows[j] + v * kLanes), acc);
    scores[j] = hsum(acc) * scale;
  }
}

// score_rows_fixed for any row length (a multiple of kLanes).
inline void score_rows(const float* q, const float* const* rows, int64_t n, float scale, float* scores,
                       int64_t length) {
  switch (length / kLanes) {
    case 1: return score_rows_fixed<1>(q, rows, n, scale, scores);
    case 2: return score_rows_fixed<2>(q, rows, n, scale, scores);
    case 4: return score_rows_fixed<4>(q, rows, n, scale, scores);
    case 6: return score_rows_fixed<6>(q, rows, n, scale, scores);
    case 8: return score_rows_fixed<8>(q, rows, n, scale, scores);
    case 16: return score_rows_fixed<16>(q, rows, n, scale, scores);
    default: break;
  }
  for (int64_t j = 0; j < n; ++j) scores[j] = dot(q, rows[j], length) * scale;
}

// out[0:NV * kLanes] = out * factor + sum_j weights[j] * rows[j][0:NV * kLanes], j in [0, n) in order, with the
// accumulators in registers (one load of each row, no load/store of out per row).
template <int NV>
inline void accumulate_rows(float factor, const float* weights, const float* const* rows, int64_t n, float* out) {
  Vec acc[NV];
  const Vec f(factor);
  for (int v = 0; v < NV; ++v) acc[v] = Vec::loadu(out + v * kLanes) * f;
  for (int64_t j = 0; j < n; ++j) {
    const Vec w(weights[j]);
    for (int v = 0; v < NV; ++v) acc[v] = at::vec::fmadd(w, Vec::loadu(rows[j] + v * kLanes), acc[v]);
  }
  for (int v = 0; v < NV; ++v) acc[v].store(out + v * kLanes);
}

// accumulate_rows for any row length (a multiple of kLanes): register-held up to 16 vectors, else in memory.
inline void accumulate(float factor, const float* weights, const float* const* rows, int64_t n, float* out,
                       int64_t length) {
  switch (length / kLanes) {
    case 1: return accumulate_rows<1>(factor, weights, rows, n, out);
    case 2: return accumulate_rows<2>(factor, weights, rows, n, out);
    case 4: return accumulate_rows<4>(factor, weights, rows, n, out);
    case 6: return accumulate_rows<6>(factor, weights, rows, n, out);
    case 8: return accumulate_rows<8>(factor, weights, rows, n, out);
    case 16: return accumulate_rows<16>(factor, weights, rows, n, out);
    default: break;
  }
  for (int64_t i = 0; i < length; i += kLanes) {
    Vec acc = Vec::loadu(out + i) * Vec(factor);
    for (int64_t j = 0; j < n; ++j) acc = at::vec::fmadd(Vec(weights[j]), Vec::loadu(rows[j] + i), acc);
    acc.store(out + i);
  }
}

inline void scale_row(float factor, float* row, int64_t n) {
  const Vec f(factor);
  for (int64_t i = 0; i < n; i += kLanes) (Vec::loadu(row + i) * f).store(row + i);
}

// max over row[0:n] (any n).
inline float row_max(const float* row, int64_t n) {
  Vec best(-std::numeric_limits<float>::infinity());
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) best = at::vec::maximum(best, Vec::loadu(row + i));
  float result = hmax(best);
  for (; i < n; ++i) result = std::max(result, row[i]);
  return result;
}

// row[i] = exp(row[i] - shift) for i < n; returns the sum of the new values (any n).
inline float exp_shift_sum(float* row, int64_t n, float shift) {
  const Vec s(shift);
  Vec total(0.f);
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    Vec e = (Vec::loadu(row + i) - s).exp();
    e.store(row + i);
    total = total + e;
  }
  if (i < n) {
    // The tail runs through the same vector exp as the body, so a value's result never depends on its lane.
    Vec e = (Vec::loadu(row + i, n - i) - s).exp();
    e.store(row + i, n - i);
    __at_align__ float tail[kLanes] = {};
    e.store(tail, n - i);
    total = total + Vec::loadu(tail);
  }
  return hsum(total);
}

// row[i] = cap * tanh(row[i] / cap) for i < n (attention score soft-capping; a no-op for cap <= 0). Each value
// runs through the same vector tanh whatever its lane, like exp_shift_sum.
inline void soft_cap_row(float* row, int64_t n, float cap) {
  if (cap <= 0.f) return;
  const Vec c(cap), inverse(1.f / cap);
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) (c * (Vec::loadu(row + i) * inverse).tanh()).store(row + i);
  if (i < n) (c * (Vec::loadu(row + i, n - i) * inverse).tanh()).store(row + i, n - i);
}

// Asks for the cache lines of bytes [0, n) of `data` (rows of a paged pool are scattered: the hardware
// prefetcher cannot follow them).
inline void prefetch_bytes(const void* data, int64_t n) {
  for (int64_t offset = 0; offset < n; offset += 64) __builtin_prefetch(static_cast<const char*>(data) + offset);
}

// Asks for the cache lines of [from, min(to, limit)): streaming kernels ask a fixed distance ahead of what they
// read, never past their task's end. Written as a loop over the lines: GCC 12 deleted the same request made as
// prefetch_bytes with a clamped count, so check the built library for prefetcht0 after changing it.
//
// kReadOnce, for lines a kernel reads exactly once (a GEMV's weights) on CPUs where read_once_prefetch_pays():
// asked for with the non-temporal hint (prefetchnta), which keeps them out of the caches past L1 as far as the CPU
// allows. Lines that are read again (a GEMM's blocks, by each tile of rows) must not take it: they are not kept
// in L2.
template <bool kReadOnce = false>
__attribute__((always_inline)) inline void prefetch_span(const void* from, const void* to, const void* limit) {
  const char* last = std::min(static_cast<const char*>(to), static_cast<const char*>(limit));
  for (const char* line = static_cast<const char*>(from); line < last; line += 64) {
    __builtin_prefetch(line, 0, kReadOnce ? 0 : 3);
  }
}

// Whether a kernel's lines read once should be asked for with prefetchnta (prefetch_span<true>) on this CPU, as
// measured on each (SmolLM2 in bfloat16, 2 threads, the one-row GEMV streaming 270 MB of weights a step):
// - AMD (Zen 5): yes. Asked for with prefetcht0 the weights pushed out of L2 and L3 whatever the host's Python and
//   the next kernels work on; the step's host work ran up to twice as long, the whole step ~3% slower.
// - Intel (Xeon with AMX): no. With the hint the GEMV read 11 GB/s, with prefetcht0 25 GB/s.
// - any other CPU: no (prefetcht0 is what every other kernel asks for).
// OCTAVO_CPU_READ_ONCE_PREFETCH=nta / t0 overrides the choice, for comparisons and tests (read at every call).
inline bool read_once_prefetch_pays() {
  const char* env = std::getenv("OCTAVO_CPU_READ_ONCE_PREFETCH");
  const std::string choice = env == nullptr ? "" : env;
  TORCH_CHECK(choice.empty() || choice == "nta" || choice == "t0",
              "OCTAVO_CPU_READ_ONCE_PREFETCH must be nta or t0 (or unset), got ", choice);
  if (!choice.empty()) return choice == "nta";
#if defined(__x86_64__) || defined(__i386__)
  static const bool amd = __builtin_cpu_is("amd") != 0;
  return amd;
#else
  return false;
#endif
}

#if defined(CPU_CAPABILITY_AVX512)
// Whether this CPU executes AVX512_BF16 (asked once; the AVX-512 build runs only where AVX-512 does).
inline bool cpu_has_avx512_bf16() {
  static const bool present = __builtin_cpu_supports("avx512bf16");
  return present;
}
#endif

// ---- dynamic scheduling ---------------------------------------------------------------------------

// Runs body(item, thread_state) for item in [0, count) on at::parallel_for's threads, each thread taking
// the next unclaimed item (work items of unequal cost, such as prefill tiles and shared chunks, balance
// themselves). A thread claims its next item before it runs the current one and calls
// prefetch(next, thread_state) first: the memory that item reads is on its way while this one computes.
template <typename State, typename Body, typename Prefetch>
void for_each_item_ahead(int64_t count, const Body& body, const Prefetch& prefetch) {
  if (count == 0) return;
  std::atomic<int64_t> next{0};
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), count);
  at::parallel_for(0, workers, 1, [&](int64_t begin, int64_t end) {
    for (int64_t worker = begin; worker < end; ++worker) {
      State state;
      for (int64_t item = next.fetch_add(1); item < count;) {
        const int64_t following = next.fetch_add(1);
        if (following < count) prefetch(following, state);
        body(item, state);
        item = following;
      }
    }
  });
}

}  // namespace octavo_cpu
