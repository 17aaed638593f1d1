// octavo_cpu::linear_w8 / linear_w4 / linear_fp8: x @ W.T (+ bias) over the int8, 4-bit and float8_e4m3fn weight
// layouts of octavo.ir.quantized_layout (semantics: octavo.ir.ops.quantized_linear, same schemas), never stored
// dequantized: decode reads the int8 / int4 / fp8 bytes. x, the accumulation, the bias and the result are float32; x of another float
// dtype is widened first and the result rounded to it once at the end (the AMX GEMM reads a bfloat16 x as it is and
// rounds its sums to x's dtype as it stores them: the same values without the float32 copies).
//
// Up to kGemvRows rows of x: a streaming kernel that reads every weight once and keeps the rows of x in cache
// (memory-bound by design). More rows with bf16_gemm on CPUs with AMX-BF16 (AVX-512 build): int8 weights with one
// scale per row on CPUs with AMX-INT8 take gemm_amx_int8.h, which multiplies the int8 bytes as they are by x's rows
// rounded to 16-bit integers (on SmolLM2's shapes, 2 threads: about linear_bf16's time at 64 rows, 1.15x at 512);
// the other layouts the AMX GEMM of gemm_amx_dequantizing.h, which dequantizes 32 weight rows at a time into
// packed bfloat16 tiles (0.45x oneDNN's time at 16 and 64 rows, 0.66x at 512). On CPUs with AVX512_BF16 and no AMX,
// gemm_dot_dequantizing.h dequantizes the same blocks and multiplies them with vdpbf16ps. More rows otherwise: a tile
// of output columns at a time is dequantized into a per-thread float32 buffer and multiplied by the BLAS GEMM.
// OCTAVO_CPU_QUANTIZED_GEMM=onednn sends these rows to the BLAS GEMM too, =amx_bf16 every layout to the
// dequantizing AMX GEMM, =dot to the vdpbf16ps one, for comparisons and tests (read at every call above the GEMV's
// rows).
//
// The arithmetic, each step rounded to float32, the sums in the kernel's own order:
// - fp8 (every path), w4 but its integer GEMV, and the w8 GEMM but its AMX-INT8 one: each weight dequantized
//   exactly as the layout defines it (w8 and fp8: float(q) * scale; w4: float(q) * scale, then + offset), then
//   out = sum over k of x * weight (+ bias).
// - w8 AMX-INT8 GEMM (per-row scales, bf16_gemm, AMX-INT8 CPUs): x's rows rounded to integers on a step of their
//   own, exact integer sums, scaled once (see gemm_amx_int8.h).
// - w8 GEMV with bf16_gemm on bfloat16 / float16 rows, per-row scales, AMX-INT8 CPUs (and 1 to 5 rows on other
//   AVX512_VNNI CPUs; gemv_int8_vnni.h): the AMX-INT8 GEMM's integer arithmetic, bit for bit (x's rows rounded to
//   integers, exact sums, scaled once);
//   groups of a multiple of 32 columns there: exact integer sums per 4 columns, scaled by their group's scale and
//   summed in float32, times x's step.
// - w4 GEMV with bf16_gemm on bfloat16 / float16 rows, groups of a multiple of 32 columns, AVX512_VNNI CPUs
//   (gemv_int4_vnni.h): x's rows rounded to integers as above, exact integer sums per group, then
//   out = step * (sum over groups of scale * sum(q * xi) + offset * sum(xi)) (+ bias) in float32.
// - w8 GEMV with bf16_gemm on 4 (6 where the integer GEMV runs) to 8 bfloat16 / float16 rows, per-row scales or
//   groups of a multiple of 32 columns, AVX512_BF16 CPUs where the integer GEMV does not run (gemv_int8_dot.h):
//   the vdpbf16ps GEMM's arithmetic below (each weight dequantized as the layout defines it and rounded to
//   bfloat16, x rounded to bfloat16, exact products summed in float32 in 16 lanes, the lanes added at the end), the
//   result rounded to x's dtype once.
// - w8 GEMV (gemv_int8.h) otherwise, for per-row scales and for grouped weights up to kScaledGroupRows rows of x:
//   out = sum over groups of scale * (sum over the group's k of x * float(q)) (+ bias): the scale multiplies a
//   group's sum, not each weight. Grouped weights with more rows take the dequantizing GEMV of the first case.
//
// bf16_gemm (default false) lets that GEMM run in bfloat16: x and the dequantized weights rounded to bfloat16
// (relative error 2^-8 each), products summed in float32 (AMX tiles, vdpbf16ps or oneDNN), the bias added in
// float32; oneDNN's result is rounded to bfloat16 once more and widened, the AMX and vdpbf16ps ones stay float32
// (per-row int8 weights on AMX-INT8 CPUs take the integer GEMM instead). Only the rows above kGemvRows are
// affected, and a bfloat16 / float16 x's GEMV rows with int8 weights on AMX-INT8 CPUs (1 to 5 rows on other
// AVX512_VNNI CPUs) or 4-bit weights in groups of
// a multiple of 32 on AVX512_VNNI CPUs (the integer GEMVs), and its other GEMV rows (up to 8) with int8 weights on
// AVX512_BF16 CPUs (gemv_int8_dot.h); the GEMV is float32 otherwise.
#include "gemm_amx_dequantizing.h"
#include "gemm_amx_int8.h"
#include "gemm_dot_dequantizing.h"
#include "gemv_int8_dot.h"
#include "gemv_dequantizing.h"
#include "gemv_int4_vnni.h"
#include "gemv_int8_vnni.h"
#include "huge_pages.h"
#include "vec_utils.h"

#include <ATen/ThreadLocalState.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/addmm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/mm.h>
#include <torch/library.h>

#include <cstdlib>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

namespace octavo_cpu {
namespace {

constexpr int64_t kTileColumns = 128;      // output columns (weight rows) dequantized per GEMM tile

// dst[0:K] = W[n, :] in float32, the same values the GEMV computes in registers.
template <typename W>
void dequantize_row(const W& w, int64_t n, float* dst) {
  for_each_group(w, n, [&](const RowGroup& g) {
    for (int64_t k = g.first; k < g.vector_begin; ++k) dst[k] = w.value(n, k, g.s, g.o);
    for (int64_t k = g.vector_begin; k < g.vector_end; k += kLanes) w.values(n, k, g.sv, g.ov).store(dst + k);
    for (int64_t k = g.vector_end; k < g.last; ++k) dst[k] = w.value(n, k, g.s, g.o);
  });
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

// The group-wise parameters (scales or offsets) [N, groups], contiguous, in their own float dtype (read as float32
// where used).
at::Tensor group_parameters(const char* name, const char* role, const at::Tensor& t, int64_t N, int64_t groups,
                            int64_t group_size) {
  TORCH_CHECK(t.device().is_cpu() && is_float(t) && t.dim() == 2 && t.size(0) == N && t.size(1) == groups, name,
              ": ", role, " must be a float16, bfloat16 or float32 tensor [", N, ", ", groups, "] (group size ",
              group_size, "), got ", t.scalar_type(), " ", t.sizes());
  return t.contiguous();
}

Parameters parameters_of(const at::Tensor& t) {
  const auto type = t.scalar_type() == at::kHalf       ? Parameters::Type::kHalf
                    : t.scalar_type() == at::kBFloat16 ? Parameters::Type::kBFloat16
                                                       : Parameters::Type::kFloat;
  return Parameters{t.const_data_ptr(), type};
}

// Where a bf16_gemm above the GEMV's rows runs.
enum class QuantizedGemm {
  kOneDnn,   // dequantized tiles into oneDNN's GEMM
  kAmxBf16,  // gemm_amx_dequantizing.h
  kAmx,      // gemm_amx_int8.h for int8 weights with one scale per row where the CPU has AMX-INT8, else kAmxBf16
  kDot,      // gemm_dot_dequantizing.h
};

// The CPU's choice (AVX-512 build, CPUs with AVX512_BF16, which rounds the dequantized weights to bfloat16 in
// registers: AMX where the CPU has AMX-BF16, else the vdpbf16ps GEMM of gemm_dot_dequantizing.h), or what
// OCTAVO_CPU_QUANTIZED_GEMM asks for: onednn, amx_bf16 (the dequantizing AMX GEMM for every layout, where AMX runs)
// or dot (the vdpbf16ps GEMM on AMX CPUs too), for comparisons and tests. Read at every call above the GEMV's rows.
QuantizedGemm quantized_gemm_choice() {
  const char* env = std::getenv("OCTAVO_CPU_QUANTIZED_GEMM");
  const std::string choice = env == nullptr ? "" : env;
  TORCH_CHECK(choice.empty() || choice == "onednn" || choice == "amx_bf16" || choice == "dot",
              "OCTAVO_CPU_QUANTIZED_GEMM must be onednn, amx_bf16 or dot (or unset), got ", choice);
#if defined(CPU_CAPABILITY_AVX512)
  if (choice == "onednn" || !cpu_has_avx512_bf16()) return QuantizedGemm::kOneDnn;
  if (choice == "dot" || !amx_bf16_usable()) return QuantizedGemm::kDot;
  return choice.empty() ? QuantizedGemm::kAmx : QuantizedGemm::kAmxBf16;
#else
  return QuantizedGemm::kOneDnn;
#endif
}

#if defined(CPU_CAPABILITY_AVX512)
// The AMX and vdpbf16ps GEMMs straight from x's own dtype to out's: each sum rounded to x's dtype once as it is
// stored, so a bfloat16 model's activations never pass through float32 tensors (at 512 rows those copies took as
// long as the GEMM's dequantizing). The dequantizing GEMMs read x rounded to bfloat16 (a bfloat16 x as it is, its K
// padded only where it is no whole number of tiles).
template <typename T, typename W>
at::Tensor gemm_linear_as(const W& w, const at::Tensor& x, const float* bias, QuantizedGemm choice) {
  const int64_t M = x.size(0);
  at::Tensor out = at::empty({M, w.N}, x.options());
  if constexpr (std::is_same_v<W, Int8Weight>) {
    if (choice == QuantizedGemm::kAmx && w.groups == 1 && w.K < kInt8GemmMaxK && amx_int8_usable()) {
      gemm_amx_int8(w.q, w.scales, w.N, w.K, x.const_data_ptr<T>(), M, bias, out.data_ptr<T>());
      return out;
    }
  }
  const int64_t lda = 2 * packed_pairs(w.K);
  const at::Tensor a = padded(x, lda, at::kBFloat16);
  if (choice == QuantizedGemm::kDot) {
    gemm_dot_dequantizing(w, a.const_data_ptr<c10::BFloat16>(), M, bias, out.data_ptr<T>());
  } else {
    gemm_amx_dequantizing(w, a.const_data_ptr<c10::BFloat16>(), lda, M, bias, out.data_ptr<T>());
  }
  return out;
}

template <typename W>
at::Tensor gemm_linear(const W& w, const at::Tensor& rows, const std::optional<at::Tensor>& bias,
                       QuantizedGemm choice) {
  const at::Tensor x = rows.contiguous();
  const float* bias_data = bias ? bias->const_data_ptr<float>() : nullptr;
  switch (x.scalar_type()) {
    case at::kBFloat16:
      return gemm_linear_as<c10::BFloat16>(w, x, bias_data, choice);
    case at::kHalf:
      return gemm_linear_as<c10::Half>(w, x, bias_data, choice);
    default:
      return gemm_linear_as<float>(w, x, bias_data, choice);
  }
}
#endif

// Whether OCTAVO_CPU_W8_GEMV / OCTAVO_CPU_W4_GEMV (`variable`) asks for the float32 GEMV ("float": for comparisons
// and tests) instead of the integer one where that runs; read at every call, a bad value refused by name on every
// build.
bool float_gemv_asked(const char* variable) {
  const char* env = std::getenv(variable);
  const std::string choice = env == nullptr ? "" : env;
  TORCH_CHECK(choice.empty() || choice == "float", variable, " must be float (or unset), got ", choice);
  return choice == "float";
}

#if defined(CPU_CAPABILITY_AVX512)
constexpr int64_t kIntegerW8GemvRows = 5;  // GEMV rows of the integer w8 kernel on CPUs without AMX-INT8

// Whether a w8 GEMV with bf16_gemm on bfloat16 or float16 rows (a reduced-precision model's decode; a float32 x
// keeps the float32 GEMV) takes the integer kernel (gemv_int8_vnni.h): one scale per row or groups of whole
// 32-column blocks, K within its exact int32 range, an AVX512_VNNI CPU, and no OCTAVO_CPU_W8_GEMV=float; on CPUs
// with AMX-INT8 for every GEMV row (the GEMM above them runs the same integer arithmetic), elsewhere for up to
// kIntegerW8GemvRows rows (the vdpbf16ps GEMV takes the rest on AVX512_BF16 CPUs). It spends two vpdpbusd per 64
// weight bytes and row where the float32 GEMV spends four widenings and four multiply-adds: measured faster where
// the CPU's instructions bound the step (SmolLM2 w8 on a Sapphire Rapids: 8.3-9.4 against 10.2 ms a decode step;
// SmolLM2's 120 w8 linears on a Zen 5 in a slow hour, 0.56x the float32 GEMV's time at 1 row, 0.57-0.65x at 2,
// 0.70-0.98x at 3, and 0.74-0.98x the vdpbf16ps GEMV's at 4 and 5 rows, level at 6, 1.07x at 8).
bool integer_w8_gemv_usable(const Int8Weight& w, int64_t M) {
  return !float_gemv_asked("OCTAVO_CPU_W8_GEMV") && (amx_int8_usable() || M <= kIntegerW8GemvRows) &&
         int8_vnni_shape_fits(w.K, w.group_size, w.groups);
}

// The same for w4 (gemv_int4_vnni.h): groups of whole 32-column blocks, K within its range, an AVX512_VNNI CPU,
// and no OCTAVO_CPU_W4_GEMV=float.
bool integer_w4_gemv_usable(const Int4Weight& w) {
  return !float_gemv_asked("OCTAVO_CPU_W4_GEMV") && int4_vnni_shape_fits(w.K, w.group_size);
}

// The integer w8 GEMV from x's own dtype (bfloat16 or float16) to out's (no float32 copies of x or of the result).
at::Tensor vnni_linear(const Int8Weight& w, const at::Tensor& rows, const std::optional<at::Tensor>& bias) {
  const at::Tensor x = rows.contiguous();
  const int64_t M = x.size(0);
  at::Tensor out = at::empty({M, w.N}, x.options());
  const float* bias_data = bias ? bias->const_data_ptr<float>() : nullptr;
  const Int8Matrix matrix{w.q, w.scales, w.N, w.K, w.group_size, w.groups};
  if (x.scalar_type() == at::kBFloat16) {
    gemv_int8_vnni(matrix, x.const_data_ptr<c10::BFloat16>(), M, bias_data, out.data_ptr<c10::BFloat16>());
  } else {
    gemv_int8_vnni(matrix, x.const_data_ptr<c10::Half>(), M, bias_data, out.data_ptr<c10::Half>());
  }
  return out;
}

// The integer w4 GEMV from x's own dtype (bfloat16 or float16) to out's.
at::Tensor vnni_linear(const Int4Weight& w, const at::Tensor& rows, const std::optional<at::Tensor>& bias) {
  const at::Tensor x = rows.contiguous();
  const int64_t M = x.size(0);
  at::Tensor out = at::empty({M, w.N}, x.options());
  const float* bias_data = bias ? bias->const_data_ptr<float>() : nullptr;
  const Int4Matrix matrix{w.q, w.scales, w.offsets, w.N, w.K, w.group_size, w.groups};
  if (x.scalar_type() == at::kBFloat16) {
    gemv_int4_vnni(matrix, x.const_data_ptr<c10::BFloat16>(), M, bias_data, out.data_ptr<c10::BFloat16>());
  } else {
    gemv_int4_vnni(matrix, x.const_data_ptr<c10::Half>(), M, bias_data, out.data_ptr<c10::Half>());
  }
  return out;
}

// Whether a w8 GEMV with bf16_gemm on 4 to 8 bfloat16 or float16 rows takes the vdpbf16ps GEMV (gemv_int8_dot.h):
// one scale per row or groups of whole 32-column blocks, a CPU with AVX512_BF16, no OCTAVO_CPU_W8_GEMV=float (the
// integer GEMV of AMX-INT8 CPUs is asked first). On a Zen 5 (AVX512_BF16, no AMX), SmolLM2's w8 linears at 8 rows
// of x: 0.7x the float32 GEMV's time (0.9x at 4 rows).
bool dot_w8_gemv_usable(const Int8Weight& w, int64_t M) {
  return M >= kDotGemvMinRows && !float_gemv_asked("OCTAVO_CPU_W8_GEMV") && cpu_has_avx512_bf16() &&
         int8_dot_shape_fits(w.groups, w.group_size);
}

// The vdpbf16ps w8 GEMV from x's own dtype to out's: a float16 x rounded to bfloat16 first (nearest even).
at::Tensor dot_linear(const Int8Weight& w, const at::Tensor& rows, const std::optional<at::Tensor>& bias) {
  const at::Tensor x = rows.to(at::kBFloat16).contiguous();
  const int64_t M = x.size(0);
  at::Tensor out = at::empty({M, w.N}, rows.options());
  const float* bias_data = bias ? bias->const_data_ptr<float>() : nullptr;
  const Int8Matrix matrix{w.q, w.scales, w.N, w.K, w.group_size, w.groups};
  const auto* x_data = x.const_data_ptr<c10::BFloat16>();
  if (rows.scalar_type() == at::kBFloat16) {
    gemv_int8_dot(matrix, x_data, M, bias_data, out.data_ptr<c10::BFloat16>());
  } else {
    gemv_int8_dot(matrix, x_data, M, bias_data, out.data_ptr<c10::Half>());
  }
  return out;
}

template <typename W>
bool integer_gemv_usable(const W& w, int64_t M) {
  if constexpr (std::is_same_v<W, Int8Weight>) return integer_w8_gemv_usable(w, M);
  if constexpr (std::is_same_v<W, Int4Weight>) return integer_w4_gemv_usable(w);
  return false;
}
#endif

// The float32 GEMV (gemv_for) on rows [M, K] of any float dtype, the result in rows' dtype: a 16-bit x is widened
// and the float32 result rounded to its dtype (nearest even) in per-thread buffers, by at::vec::convert, which
// gives the bits of ATen's .to() without its two tensor copies a call (at one row, most of a small linear's time).
template <typename W>
at::Tensor float_gemv(const W& w, const at::Tensor& rows, const std::optional<at::Tensor>& bias) {
  const at::Tensor x = rows.contiguous();
  const int64_t M = x.size(0), N = w.N, K = w.K;
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  const float* bias_data = bias ? bias->const_data_ptr<float>() : nullptr;
  if (x.scalar_type() == at::kFloat) {
    gemv_for(M, w, x.const_data_ptr<float>(), bias_data, out.data_ptr<float>());
    return out;
  }
  thread_local std::vector<float> wide_x, wide_out;
  wide_x.resize(M * K);
  wide_out.resize(M * N);
  const auto run_widened = [&](auto tag) {
    using T = decltype(tag);
    at::vec::convert(x.const_data_ptr<T>(), wide_x.data(), M * K);
    gemv_for(M, w, wide_x.data(), bias_data, wide_out.data());
    at::vec::convert(wide_out.data(), out.data_ptr<T>(), M * N);
  };
  if (x.scalar_type() == at::kBFloat16) {
    run_widened(c10::BFloat16());
  } else {
    run_widened(c10::Half());
  }
  return out;
}

// x @ W.T (+ bias) for x [..., K] of any float dtype: checks x and bias, computes in float32 (the AMX GEMM from x's
// own dtype where bf16_gemm chose it), shapes the result.
template <typename W>
at::Tensor run_linear(const char* name, const at::Tensor& input, const W& w, const std::optional<at::Tensor>& bias,
                      bool bf16_gemm) {
  const int64_t N = w.N, K = w.K;
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
  const at::Tensor rows = input.reshape({-1, K});
  const int64_t M = rows.size(0);
  std::vector<int64_t> shape(input.sizes().begin(), input.sizes().end());
  shape.back() = N;
#if defined(CPU_CAPABILITY_AVX512)
  if (M > kGemvRows && N > 0 && bf16_gemm) {
    const QuantizedGemm choice = quantized_gemm_choice();
    if (choice != QuantizedGemm::kOneDnn) return gemm_linear(w, rows, b, choice).view(shape);
  }
  // A reduced-precision model's GEMV rows: the integer GEMVs where they run, else (w8, 4 to 8 rows) the
  // vdpbf16ps one.
  const bool reduced_rows = M > 0 && M <= kGemvRows && N > 0 && bf16_gemm &&
                            (rows.scalar_type() == at::kBFloat16 || rows.scalar_type() == at::kHalf);
  if constexpr (!std::is_same_v<W, Fp8Weight>) {
    if (reduced_rows && integer_gemv_usable(w, M)) return vnni_linear(w, rows, b).view(shape);
  }
  if constexpr (std::is_same_v<W, Int8Weight>) {
    if (reduced_rows && dot_w8_gemv_usable(w, M)) return dot_linear(w, rows, b).view(shape);
  }
#else
  if (M > kGemvRows && bf16_gemm) quantized_gemm_choice();  // a bad value is refused on every build
  if (std::is_same_v<W, Int8Weight> && M <= kGemvRows && bf16_gemm) float_gemv_asked("OCTAVO_CPU_W8_GEMV");
  if (std::is_same_v<W, Int4Weight> && M <= kGemvRows && bf16_gemm) float_gemv_asked("OCTAVO_CPU_W4_GEMV");
#endif
  if (M <= kGemvRows) return float_gemv(w, rows, b).view(shape);
  const at::Tensor x = rows.to(at::kFloat).contiguous();
  at::Tensor out = at::empty({M, N}, x.options());
  if (M > 0 && N > 0) tiled_gemm(w, x, b, out, bf16_gemm);
  return out.to(input.scalar_type()).view(shape);
}

at::Tensor linear_w8(const at::Tensor& input, const at::Tensor& qweight, const at::Tensor& scales,
                     const std::optional<at::Tensor>& bias, int64_t group_size, bool bf16_gemm) {
  TORCH_CHECK(qweight.device().is_cpu() && qweight.scalar_type() == at::kChar && qweight.dim() == 2,
              "linear_w8: qweight must be a 2-d int8 CPU tensor, got ", qweight.scalar_type(), " ", qweight.sizes());
  TORCH_CHECK(group_size > 0, "linear_w8: group_size must be positive, got ", group_size);
  const int64_t N = qweight.size(0), K = qweight.size(1), groups = (K + group_size - 1) / group_size;
  const at::Tensor s = group_parameters("linear_w8", "scales", scales, N, groups, group_size);
  const at::Tensor q = qweight.contiguous();
  collapse_to_huge_pages(q.const_data_ptr(), q.nbytes());
  collapse_to_huge_pages(s.const_data_ptr(), s.nbytes());
  return run_linear("linear_w8", input,
                    Int8Weight{q.const_data_ptr<int8_t>(), parameters_of(s), N, K, group_size, groups}, bias,
                    bf16_gemm);
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
  collapse_to_huge_pages(q.const_data_ptr(), q.nbytes());
  collapse_to_huge_pages(s.const_data_ptr(), s.nbytes());
  collapse_to_huge_pages(o.const_data_ptr(), o.nbytes());
  return run_linear("linear_w4", input,
                    Int4Weight{q.const_data_ptr<uint8_t>(), parameters_of(s), parameters_of(o), N, K,
                               group_size, groups},
                    bias, bf16_gemm);
}

at::Tensor linear_fp8(const at::Tensor& input, const at::Tensor& qweight, const at::Tensor& scales,
                      const std::optional<at::Tensor>& bias, bool bf16_gemm) {
  TORCH_CHECK(qweight.device().is_cpu() && qweight.scalar_type() == at::kFloat8_e4m3fn && qweight.dim() == 2,
              "linear_fp8: qweight must be a 2-d float8_e4m3fn CPU tensor, got ", qweight.scalar_type(), " ",
              qweight.sizes());
  const int64_t N = qweight.size(0), K = qweight.size(1);
  TORCH_CHECK(scales.device().is_cpu() && is_float(scales) && scales.numel() == N, "linear_fp8: scales must be a ",
              "float tensor of ", N, " values (one per output channel), got ", scales.scalar_type(), " ",
              scales.sizes());
  const at::Tensor s = scales.reshape({N}).contiguous();
  const at::Tensor q = qweight.contiguous();
  collapse_to_huge_pages(q.const_data_ptr(), q.nbytes());
  return run_linear("linear_fp8", input,
                    Fp8Weight{q.const_data_ptr<c10::Float8_e4m3fn>(), parameters_of(s), N, K, K, 1}, bias,
                    bf16_gemm);
}

}  // namespace
}  // namespace octavo_cpu

TORCH_LIBRARY_IMPL(octavo_cpu, CPU, m) {
  m.impl("linear_w8", &octavo_cpu::linear_w8);
  m.impl("linear_w4", &octavo_cpu::linear_w4);
  m.impl("linear_fp8", &octavo_cpu::linear_fp8);
}
