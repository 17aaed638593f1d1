// octavo_cpu::argmax_rows(logits [N, V]) -> int64 [N]: each row's index of its largest value, exactly what
// torch.argmax(logits, dim=-1) returns: the first index where several values are equal (-0.0 equals 0.0), and
// the first NaN's index in a row holding a NaN (torch counts NaN as the largest). float32, bfloat16 or float16
// rows, widened to float exactly.
//
// Two passes over a row: its maximum by vector max (a NaN anywhere makes it NaN), then the first index whose
// value equals it (or is NaN), a vector of comparisons at a time. torch's own argmax tracks an index beside
// every lane and runs several times slower on a vocabulary-sized row (greedy sampling's one reduction).
#include "vec_utils.h"

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cmath>
#include <limits>

namespace octavo_cpu {
namespace {

template <typename T>
float row_maximum(const T* row, int64_t n) {
  int64_t i = 0;
  float result = -std::numeric_limits<float>::infinity();
  if (n >= kLanes) {
    Vec best = load_widened(row);
    for (i = kLanes; i + kLanes <= n; i += kLanes) best = at::vec::maximum(best, load_widened(row + i));
    __at_align__ float lanes[kLanes];
    best.store(lanes);
    for (int64_t lane = 0; lane < kLanes; ++lane) {
      if (std::isnan(lanes[lane])) return lanes[lane];
      result = std::max(result, lanes[lane]);
    }
  }
  for (; i < n; ++i) {
    const float value = static_cast<float>(row[i]);
    if (std::isnan(value)) return value;
    result = std::max(result, value);
  }
  return result;
}

// The first index of row[0:n] whose value is `target` (a NaN target: the first NaN); n when none is.
template <typename T>
int64_t first_index_of(const T* row, int64_t n, float target) {
  const bool nan = std::isnan(target);
  int64_t i = 0;
  const Vec wanted(target);
  for (; i + kLanes <= n; i += kLanes) {
    const Vec values = load_widened(row + i);
    // zero_mask: bit l set where lane l of the comparison is all zeros, that is where it does not match.
    const int misses = (nan ? values.isnan() : (values == wanted)).zero_mask();
    if (misses != (1 << kLanes) - 1) return i + __builtin_ctz(~misses);
  }
  for (; i < n; ++i) {
    const float value = static_cast<float>(row[i]);
    if (nan ? std::isnan(value) : value == target) return i;
  }
  return n;
}

template <typename T>
void argmax_of_rows(const at::Tensor& logits, at::Tensor& out) {
  const int64_t rows = logits.size(0), n = logits.size(1), stride = logits.stride(0);
  const T* data = logits.const_data_ptr<T>();
  int64_t* result = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* row = data + r * stride;
      result[r] = first_index_of(row, n, row_maximum(row, n));
    }
  });
}

}  // namespace

at::Tensor argmax_rows(const at::Tensor& logits) {
  TORCH_CHECK(logits.device().is_cpu() && logits.dim() == 2, "argmax_rows: logits must be a 2-d CPU tensor, got ",
              logits.sizes(), " on ", logits.device());
  TORCH_CHECK(logits.size(1) > 0, "argmax_rows: rows must not be empty");
  const at::Tensor rows = logits.stride(1) == 1 ? logits : logits.contiguous();
  at::Tensor out = at::empty({rows.size(0)}, rows.options().dtype(at::kLong));
  switch (rows.scalar_type()) {
    case at::kFloat: argmax_of_rows<float>(rows, out); break;
    case at::kBFloat16: argmax_of_rows<c10::BFloat16>(rows, out); break;
    case at::kHalf: argmax_of_rows<c10::Half>(rows, out); break;
    default: TORCH_CHECK(false, "argmax_rows: logits must be float32, bfloat16 or float16, got ", rows.scalar_type());
  }
  return out;
}

}  // namespace octavo_cpu

TORCH_LIBRARY_FRAGMENT(octavo_cpu, m) {
  m.def("argmax_rows(Tensor logits) -> Tensor");
}

TORCH_LIBRARY_IMPL(octavo_cpu, CPU, m) {
  m.impl("argmax_rows", &octavo_cpu::argmax_rows);
}
