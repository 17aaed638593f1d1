// octavo_cpu::linear_w16: float32 x @ float(W).T + bias with W stored in bfloat16 or float16
// (semantics: octavo.ir.ops.linear.linear_w16). The weights are widened inside the kernel, never stored
// widened: decode reads half the bytes of a float32 linear.
//
// Up to kGemvRows rows of x: a streaming kernel that reads every weight once and keeps the rows of x in
// cache, memory-bound by design. More rows: the weights are widened a tile of output columns at a time
// into a per-thread float32 buffer and multiplied by the BLAS GEMM (compute-bound shapes).
#include "huge_pages.h"
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
constexpr int64_t kTileColumns = 128;  // output columns (weight rows) widened per GEMM tile

// out[m, n] = x[m, :] . float(w[n, :]) + bias[n] for n in [begin, end), R weight rows at a time.
template <int M, int R, typename WT>
void gemv_block(const float* x, const WT* w, const float* bias, float* out, int64_t K, int64_t N, int64_t begin,
                int64_t end) {
  const int64_t vector_end = K / kLanes * kLanes;
  int64_t n = begin;
  for (; n + R <= end; n += R) {
    Vec acc[R][M];
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < M; ++m) acc[r][m] = Vec(0.f);
    for (int64_t k = 0; k < vector_end; k += kLanes) {
      Vec wide[R];
      for (int r = 0; r < R; ++r) wide[r] = load_widened(w + (n + r) * K + k);
      for (int m = 0; m < M; ++m) {
        const Vec xv = Vec::loadu(x + m * K + k);
        for (int r = 0; r < R; ++r) acc[r][m] = at::vec::fmadd(xv, wide[r], acc[r][m]);
      }
    }
    for (int r = 0; r < R; ++r) {
      for (int m = 0; m < M; ++m) {
        float total = hsum(acc[r][m]);
        for (int64_t k = vector_end; k < K; ++k) total += x[m * K + k] * static_cast<float>(w[(n + r) * K + k]);
        out[m * N + n + r] = bias ? total + bias[n + r] : total;
      }
    }
  }
  if (n < end) gemv_block<M, 1>(x, w, bias, out, K, N, n, end);
}

template <int M, typename WT>
void gemv(const float* x, const WT* w, const float* bias, float* out, int64_t K, int64_t N) {
  constexpr int R = M <= 2 ? 4 : 2;
  // Blocks of whole R-row groups; at least 64 KiB of weights per task, so small layers do not pay for threads.
  const int64_t grain = std::max<int64_t>(R, (32768 / std::max<int64_t>(K, 1)) / R * R);
  at::parallel_for(0, (N + R - 1) / R, (grain + R - 1) / R, [&](int64_t begin, int64_t end) {
    gemv_block<M, R>(x, w, bias, out, K, N, begin * R, std::min(end * R, N));
  });
}

template <typename WT>
void gemv_dispatch(int64_t rows, const float* x, const WT* w, const float* bias, float* out, int64_t K, int64_t N) {
  switch (rows) {
    case 1: return gemv<1>(x, w, bias, out, K, N);
    case 2: return gemv<2>(x, w, bias, out, K, N);
    case 3: return gemv<3>(x, w, bias, out, K, N);
    case 4: return gemv<4>(x, w, bias, out, K, N);
    case 5: return gemv<5>(x, w, bias, out, K, N);
    case 6: return gemv<6>(x, w, bias, out, K, N);
    case 7: return gemv<7>(x, w, bias, out, K, N);
    case 8: return gemv<8>(x, w, bias, out, K, N);
    default: TORCH_CHECK(false, "linear_w16: gemv takes 1 to ", kGemvRows, " rows, got ", rows);
  }
}

// out = x @ float(w).T (+ bias): each thread widens kTileColumns weight rows at a time into its own buffer
// and multiplies them with one single-threaded BLAS call writing that tile's output columns.
template <typename WT>
void tiled_gemm(const at::Tensor& x, const WT* w, const std::optional<at::Tensor>& bias, at::Tensor& out) {
  const int64_t M = x.size(0), K = x.size(1), N = out.size(1);
  const int64_t tiles = (N + kTileColumns - 1) / kTileColumns;
  // The ATen calls below run on worker threads: give them the caller's inference mode and dispatch state.
  const at::ThreadLocalState caller_state;
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    at::ThreadLocalStateGuard state_guard(caller_state);
    std::vector<float> buffer(kTileColumns * K);
    for (int64_t tile = begin; tile < end; ++tile) {
      const int64_t first = tile * kTileColumns, count = std::min(kTileColumns, N - first);
      widen(w + first * K, count * K, buffer.data());
      const at::Tensor wide = at::from_blob(buffer.data(), {count, K}, x.options());
      at::Tensor target = out.narrow(1, first, count);
      if (bias.has_value()) {
        at::addmm_out(target, bias->narrow(0, first, count), x, wide.t());
      } else {
        at::mm_out(target, x, wide.t());
      }
    }
  });
}

at::Tensor linear_w16(const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(input.device().is_cpu() && weight.device().is_cpu(), "octavo_cpu::linear_w16 runs on CPU tensors");
  TORCH_CHECK(input.scalar_type() == at::kFloat, "linear_w16: input must be float32, got ", input.scalar_type());
  TORCH_CHECK(weight.dim() == 2 && (weight.scalar_type() == at::kBFloat16 || weight.scalar_type() == at::kHalf),
              "linear_w16: weight must be a 2-d bfloat16 or float16 tensor, got ", weight.scalar_type(), " ",
              weight.sizes());
  const int64_t N = weight.size(0), K = weight.size(1);
  TORCH_CHECK(input.dim() >= 1 && input.size(-1) == K, "linear_w16: input ", input.sizes(), " does not end in ", K);
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->dim() == 1 && bias->size(0) == N,
                "linear_w16: bias must be float32 [", N, "], got ", bias->scalar_type(), " ", bias->sizes());
  }
  const at::Tensor w = weight.contiguous();
  collapse_to_huge_pages(w.const_data_ptr(), w.nbytes());
  const at::Tensor x = input.reshape({-1, K}).contiguous();
  const int64_t M = x.size(0);
  std::vector<int64_t> shape(input.sizes().begin(), input.sizes().end());
  shape.back() = N;
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out.view(shape);
  const std::optional<at::Tensor> b = bias.has_value() ? std::optional<at::Tensor>(bias->contiguous()) : std::nullopt;
  auto run = [&](auto tag) {
    using WT = decltype(tag);
    const WT* data = static_cast<const WT*>(w.const_data_ptr());
    if (M <= kGemvRows) {
      gemv_dispatch<WT>(M, x.const_data_ptr<float>(), data, b ? b->const_data_ptr<float>() : nullptr,
                        out.data_ptr<float>(), K, N);
    } else {
      tiled_gemm<WT>(x, data, b, out);
    }
  };
  if (w.scalar_type() == at::kBFloat16) {
    run(c10::BFloat16{});
  } else {
    run(c10::Half{});
  }
  return out.view(shape);
}

}  // namespace
}  // namespace octavo_cpu

TORCH_LIBRARY_IMPL(octavo_cpu, CPU, m) { m.impl("linear_w16", &octavo_cpu::linear_w16); }
