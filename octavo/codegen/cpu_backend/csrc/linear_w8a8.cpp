// octavo_cpu::pack_w8a8(qweight) and octavo_cpu::linear_w8a8(x, packed, scales, bias, out_features, in_features):
// the linears of a w8a8 artifact, int8 weights with one scale per output row [N] times x rounded to int8 at run
// time, one step per 64 columns of a row (the arithmetic, the packed layout and the bound: gemm_w8a8.h).
//
// x is float32, bfloat16 or float16 [..., K]; the result has x's dtype. On CPUs with AVX512_VNNI (AVX-512 build)
// the sums run through vpdpbusd, 4 columns of 16 output rows per instruction: twice the multiplies per instruction
// of vdpbf16ps, from one byte per weight; in the AVX2 build through vpmaddubsw on |q| and x signed by q; on AVX-512
// CPUs without AVX512_VNNI and in the default build as plain loops (OCTAVO_CPU_W8A8_KERNEL=portable takes them on
// every CPU, for comparisons and tests). Every path computes the same bits.
#include "gemm_w8a8.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <torch/library.h>

#include <cstdlib>
#include <optional>
#include <string>
#include <vector>

namespace octavo_cpu {
namespace {

at::Tensor pack_w8a8(const at::Tensor& qweight) {
  TORCH_CHECK(qweight.device().is_cpu() && qweight.scalar_type() == at::kChar && qweight.dim() == 2,
              "pack_w8a8: qweight must be a 2-d int8 CPU tensor, got ", qweight.scalar_type(), " ", qweight.sizes());
  const int64_t N = qweight.size(0), K = qweight.size(1), steps = w8a8_steps(K), blocks = w8a8_blocks(N);
  const at::Tensor q = qweight.contiguous();
  at::Tensor packed = at::full({blocks, steps, kW8a8BlockRows, 4}, 128, qweight.options().dtype(at::kByte));
  const int8_t* src = q.const_data_ptr<int8_t>();
  uint8_t* dst = packed.data_ptr<uint8_t>();
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      for (int64_t i = 0; i < kW8a8BlockRows && b * kW8a8BlockRows + i < N; ++i) {
        const int8_t* row = src + (b * kW8a8BlockRows + i) * K;
        for (int64_t k = 0; k < K; ++k) {
          dst[((b * steps + k / 4) * kW8a8BlockRows + i) * 4 + k % 4] = static_cast<uint8_t>(row[k] + 128);
        }
      }
    }
  });
  return packed;
}

// Whether OCTAVO_CPU_W8A8_KERNEL asks for the plain loops ("portable": for comparisons and tests) instead of this
// CPU's vector kernel; read at every call, a bad value refused by name.
bool portable_w8a8_asked() {
  const char* env = std::getenv("OCTAVO_CPU_W8A8_KERNEL");
  const std::string choice = env == nullptr ? "" : env;
  TORCH_CHECK(choice.empty() || choice == "portable", "OCTAVO_CPU_W8A8_KERNEL must be portable (or unset), got ",
              choice);
  return choice == "portable";
}

constexpr size_t kKeptRowBytes = size_t{1} << 20;

// Frees a QuantizedRows' buffers as it leaves scope where they outgrew kKeptRowBytes.
struct ReleaseLargeRows {
  QuantizedRows& rows;
  ~ReleaseLargeRows() {
    if (rows.q.capacity() > kKeptRowBytes) rows = QuantizedRows{};
  }
};

template <typename T>
void run_w8a8(const at::Tensor& packed, int64_t N, int64_t K, const at::Tensor& x, int64_t M, const float* scales,
              const float* bias, at::Tensor& out) {
  // The caller's thread keeps its rows' buffers from call to call (up to kKeptRowBytes: a long prompt's are freed):
  // a decode step's linears quantize one row each, and three allocations a call were a visible share of that.
  thread_local QuantizedRows rows;
  quantize_rows_int8(x.const_data_ptr<T>(), M, K, rows);
  const ReleaseLargeRows release{rows};
  const uint8_t* weights = packed.const_data_ptr<uint8_t>();
  const bool portable = portable_w8a8_asked();
#if defined(CPU_CAPABILITY_AVX512)
  if (!portable && w8a8_vnni_usable()) return gemm_w8a8_vnni(weights, N, K, rows, M, scales, bias, out.data_ptr<T>());
#elif defined(CPU_CAPABILITY_AVX2)
  if (!portable) return gemm_w8a8_avx2(weights, N, K, rows, M, scales, bias, out.data_ptr<T>());
#endif
  gemm_w8a8_portable(weights, N, K, rows, M, scales, bias, out.data_ptr<T>());
}

at::Tensor linear_w8a8(const at::Tensor& input, const at::Tensor& packed, const at::Tensor& scales,
                       const std::optional<at::Tensor>& bias, int64_t out_features, int64_t in_features) {
  const int64_t N = out_features, K = in_features;
  TORCH_CHECK(K > 0 && N > 0, "linear_w8a8: out_features and in_features must be positive, got ", N, " and ", K);
  TORCH_CHECK(packed.device().is_cpu() && packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                  packed.dim() == 4 && packed.size(0) == w8a8_blocks(N) && packed.size(1) == w8a8_steps(K) &&
                  packed.size(2) == kW8a8BlockRows && packed.size(3) == 4,
              "linear_w8a8: packed must be pack_w8a8's uint8 tensor of a [", N, ", ", K, "] weight, got ",
              packed.scalar_type(), " ", packed.sizes());
  TORCH_CHECK(scales.device().is_cpu() && scales.scalar_type() == at::kFloat && scales.numel() == N,
              "linear_w8a8: scales must be a float32 tensor of ", N, " values, got ", scales.scalar_type(), " ",
              scales.sizes());
  const auto type = input.scalar_type();
  TORCH_CHECK(input.device().is_cpu() && (type == at::kFloat || type == at::kBFloat16 || type == at::kHalf),
              "linear_w8a8: input must be a float32, bfloat16 or float16 CPU tensor, got ", type, " on ",
              input.device());
  TORCH_CHECK(input.dim() >= 1 && input.size(-1) == K, "linear_w8a8: input ", input.sizes(), " does not end in ", K,
              " (the weight's input features)");
  std::optional<at::Tensor> b;
  if (bias.has_value()) {
    TORCH_CHECK(bias->device().is_cpu() && bias->dim() == 1 && bias->size(0) == N, "linear_w8a8: bias must be a ",
                "tensor [", N, "], got ", bias->sizes());
    b = bias->to(at::kFloat).contiguous();
  }
  // Rows of x and scales read through their data as contiguous [M, K] and [N] (no reshape: its dispatch cost as
  // much as a one-row call's quantizing).
  const at::Tensor x = input.contiguous();  // contiguous() of a contiguous tensor is the tensor, no dispatch
  const at::Tensor s = scales.contiguous();
  const int64_t M = x.numel() / K;
  std::vector<int64_t> shape(input.sizes().begin(), input.sizes().end());
  shape.back() = N;
  at::Tensor out = at::empty(shape, input.options());
  if (M == 0) return out;
  const float* bias_data = b ? b->const_data_ptr<float>() : nullptr;
  switch (type) {
    case at::kBFloat16: run_w8a8<c10::BFloat16>(packed, N, K, x, M, s.const_data_ptr<float>(), bias_data, out); break;
    case at::kHalf: run_w8a8<c10::Half>(packed, N, K, x, M, s.const_data_ptr<float>(), bias_data, out); break;
    default: run_w8a8<float>(packed, N, K, x, M, s.const_data_ptr<float>(), bias_data, out); break;
  }
  return out;
}

}  // namespace
}  // namespace octavo_cpu

TORCH_LIBRARY_IMPL(octavo_cpu, CPU, m) {
  m.impl("pack_w8a8", &octavo_cpu::pack_w8a8);
  m.impl("linear_w8a8", &octavo_cpu::linear_w8a8);
}
