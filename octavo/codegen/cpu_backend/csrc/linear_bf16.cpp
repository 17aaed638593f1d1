// octavo_cpu::linear_bf16(input, weight, bias): aten.linear of a bfloat16 model,
//   out[m, n] = bf16( sum over k of float(x[m, k]) * float(W[n, k])  (+ float(bias[n])) ),
// x and out bfloat16 [..., K] / [..., N], W the model's bfloat16 weight [N, K] as the graph binds it, bias
// bfloat16 [N]; every product exact in float32, the sum in float32 in the kernel's own order, the result rounded
// to bfloat16 (nearest even) once: ATen's arithmetic for a bfloat16 linear on CPU.
//
// One op for every number of rows, so that a graph compiled once for all shapes (AOTInductor) picks the kernel
// per call, on one packed copy of the weight (bf16_packing.h, packed at the first call):
// - up to kBf16GemvRows rows: the streaming GEMV of gemv_bf16.h (decode steps; memory-bound);
// - more rows, on CPUs with AMX-BF16 (AVX-512 build): the AMX GEMM of gemm_amx_bf16.h;
// - more rows on CPUs with AVX512_BF16 and no AMX: the GEMV's dot kernel over tiles of 8 rows of x (on a Zen 5,
//   2 threads, SmolLM2's shapes: 0.70x the time of oneDNN on prepacked weights at 16 rows, 0.80x at 64, 0.93x at
//   256);
// - more rows otherwise: ATen's own linear on the weight as given (oneDNN).
// OCTAVO_CPU_BF16_GEMM=aten sends the rows above the GEMV's to ATen on every CPU, =dot to the dot kernel on CPUs
// with AVX512_BF16 (AMX ones included), for comparisons; it is read at every call above the GEMV's rows.
// OCTAVO_CPU_BF16_GEMV=widening makes the GEMV widen to float and FMA on CPUs with AVX512_BF16 too (the kernel
// AVX-512 CPUs without it run), for comparisons and tests; it is read at every GEMV call of the AVX-512 build.
#include "bf16_packing.h"
#include "gemm_amx_bf16.h"
#include "gemv_bf16.h"
#include "vec_utils.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <cstdlib>
#include <optional>
#include <string>
#include <vector>

namespace octavo_cpu {
namespace {

enum class Gemm { kAmx, kDot, kAten };

// The kernel for rows above the GEMV's on this CPU (and OCTAVO_CPU_BF16_GEMM).
Gemm gemm_kernel() {
  const char* env = std::getenv("OCTAVO_CPU_BF16_GEMM");
  const std::string choice = env == nullptr ? "" : env;
  TORCH_CHECK(choice.empty() || choice == "aten" || choice == "dot",
              "OCTAVO_CPU_BF16_GEMM must be aten or dot (or unset), got ", choice);
#if defined(CPU_CAPABILITY_AVX512)
  if (choice.empty() && amx_bf16_usable()) return Gemm::kAmx;
  if (choice != "aten" && cpu_has_avx512_bf16()) return Gemm::kDot;
#endif
  return Gemm::kAten;
}

#if defined(CPU_CAPABILITY_AVX512)
// Whether the GEMV may use vdpbf16ps: the CPU has it and OCTAVO_CPU_BF16_GEMV does not ask for the widening one.
bool gemv_dot_usable() {
  const char* env = std::getenv("OCTAVO_CPU_BF16_GEMV");
  const std::string choice = env == nullptr ? "" : env;
  TORCH_CHECK(choice.empty() || choice == "widening", "OCTAVO_CPU_BF16_GEMV must be widening (or unset), got ",
              choice);
  return choice.empty() && cpu_has_avx512_bf16();
}
#endif

at::Tensor linear_bf16(const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(input.device().is_cpu() && input.scalar_type() == at::kBFloat16,
              "linear_bf16: input must be a bfloat16 CPU tensor, got ", input.scalar_type(), " on ", input.device());
  TORCH_CHECK(weight.device().is_cpu() && weight.scalar_type() == at::kBFloat16 && weight.dim() == 2,
              "linear_bf16: weight must be a 2-d bfloat16 CPU tensor, got ", weight.scalar_type(), " ",
              weight.sizes());
  const int64_t N = weight.size(0), K = weight.size(1);
  TORCH_CHECK(input.dim() >= 1 && input.size(-1) == K, "linear_bf16: input ", input.sizes(), " does not end in ", K,
              " (the weight's input features)");
  if (bias.has_value()) {
    TORCH_CHECK(bias->device().is_cpu() && bias->dim() == 1 && bias->size(0) == N &&
                    bias->scalar_type() == at::kBFloat16,
                "linear_bf16: bias must be a bfloat16 tensor [", N, "], got ", bias->scalar_type(), " ", bias->sizes());
  }
  const at::Tensor x = input.reshape({-1, K}).contiguous();
  const int64_t M = x.size(0);
  std::vector<int64_t> shape(input.sizes().begin(), input.sizes().end());
  shape.back() = N;
  const Gemm gemm = M > kBf16GemvRows ? gemm_kernel() : Gemm::kAten;
  if (M > kBf16GemvRows && gemm == Gemm::kAten) return at::linear(x, weight, bias).view(shape);
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out.view(shape);
  const at::Tensor w = weight.contiguous();
  const at::Tensor packed = PackedWeightCache::instance().get(w);
  const PackedBf16 p{reinterpret_cast<const uint32_t*>(packed.const_data_ptr()), N, K, packed.size(1), packed.size(0)};
  const at::Tensor b = bias.has_value() ? bias->to(at::kFloat).contiguous() : at::Tensor();
  const float* bias_data = b.defined() ? b.const_data_ptr<float>() : nullptr;
  auto* out_data = out.mutable_data_ptr<c10::BFloat16>();
  const int64_t width = 2 * p.pairs;
#if defined(CPU_CAPABILITY_AVX512)
  if (M > kBf16GemvRows) {
    const at::Tensor a = padded(x, width, at::kBFloat16);
    if (gemm == Gemm::kAmx) {
      gemm_amx_bf16(p, bias_data, a.const_data_ptr<c10::BFloat16>(), width, M, out_data);
    } else {
      gemm_bf16_dot(p, static_cast<const uint32_t*>(a.const_data_ptr()), M, bias_data,
                    reinterpret_cast<uint16_t*>(out_data));
    }
    return out.view(shape);
  }
  if (gemv_dot_usable()) {
    const at::Tensor words = padded(x, width, at::kBFloat16);
    gemv_bf16(M, p, static_cast<const uint32_t*>(words.const_data_ptr()), nullptr, bias_data,
              reinterpret_cast<uint16_t*>(out_data));
    return out.view(shape);
  }
#endif
  const at::Tensor wide = padded(x, width, at::kFloat);
  gemv_bf16(M, p, nullptr, wide.const_data_ptr<float>(), bias_data, reinterpret_cast<uint16_t*>(out_data));
  return out.view(shape);
}

int64_t linear_bf16_packings() { return PackedWeightCache::instance().packings(); }

at::Tensor linear_bf16_packed(const at::Tensor& weight) {
  TORCH_CHECK(weight.device().is_cpu() && weight.scalar_type() == at::kBFloat16 && weight.dim() == 2,
              "linear_bf16_packed: weight must be a 2-d bfloat16 CPU tensor, got ", weight.scalar_type(), " ",
              weight.sizes());
  return PackedWeightCache::instance().get(weight.contiguous());
}

}  // namespace
}  // namespace octavo_cpu

TORCH_LIBRARY_FRAGMENT(octavo_cpu, m) {
  m.def("linear_bf16(Tensor input, Tensor weight, Tensor? bias=None) -> Tensor");
  // How many weights linear_bf16 has packed in this process: a graph that reuses its packed copies packs each of
  // its weights once, however many steps it runs.
  m.def("linear_bf16_packings() -> int", &octavo_cpu::linear_bf16_packings);
  // The packed copy linear_bf16 multiplies by (bf16_packing.h's layout, int32 [blocks, pairs, 32]), packed now
  // unless packed already: for tests and diagnostics.
  m.def("linear_bf16_packed(Tensor weight) -> Tensor", &octavo_cpu::linear_bf16_packed);
}

TORCH_LIBRARY_IMPL(octavo_cpu, CPU, m) { m.impl("linear_bf16", &octavo_cpu::linear_bf16); }
