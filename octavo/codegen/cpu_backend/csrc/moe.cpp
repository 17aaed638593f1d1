// octavo_cpu::moe: a mixture-of-experts MLP that reads only the experts its tokens chose (semantics:
// octavo.ir.ops.moe.moe, same schema).
//
// Three parts, each its own profiler range:
// - routing ("octavo_cpu::moe_routing"): the router linear and the float32 softmax are ATen's, so the
//   probabilities are bitwise torch's (and a top-k over them picks the experts Hugging Face picks); each token's
//   top_k experts are then selected here (decreasing probability, ties in expert order), renormalized and rounded;
// - permutation ("octavo_cpu::moe_permutation"): the (token, slot) pairs are counted and sorted by expert (a
//   counting sort, pairs of one expert in token order), each expert's rows gathered, and at the end every pair's
//   weighted output summed into its token in slot order, in float32;
// - expert GEMMs ("octavo_cpu::moe_experts"): per expert that some token chose, its gate/up projection, the gated
//   activation and its down projection on its rows only: ATen's linear over float weights, the octavo_cpu w8 / w4
//   linears (which read int8 / 4-bit weights in place) over quantized ones. An expert no token chose is never
//   read, so a decode step reads top_k experts' weights per token, not all of them.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include <c10/core/ScalarType.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>
#include <string>
#include <vector>

namespace octavo_cpu {
namespace {

struct Routing {
  std::vector<int64_t> experts;  // [T * top_k]: token t's slot j at t * top_k + j
  std::vector<float> weights;    // [T * top_k], already rounded when round_weights
};

float round_to(float value, at::ScalarType type) {
  if (type == at::kBFloat16) return static_cast<float>(c10::BFloat16(value));
  if (type == at::kHalf) return static_cast<float>(c10::Half(value));
  return value;
}

Routing route(const at::Tensor& x, const at::Tensor& router_weight, int64_t top_k, bool normalize,
              at::ScalarType weight_type) {
  const at::Tensor probabilities = at::softmax(at::linear(x, router_weight).to(at::kFloat), -1).contiguous();
  const int64_t tokens = probabilities.size(0), experts = probabilities.size(1);
  TORCH_CHECK(top_k >= 1 && top_k <= experts, "moe: top_k ", top_k, " is not in [1, ", experts, "]");
  Routing routing{std::vector<int64_t>(tokens * top_k), std::vector<float>(tokens * top_k)};
  const float* p = probabilities.const_data_ptr<float>();
  at::parallel_for(0, tokens, 64, [&](int64_t begin, int64_t end) {
    std::vector<int64_t> order(experts);
    for (int64_t t = begin; t < end; ++t) {
      const float* row = p + t * experts;
      for (int64_t e = 0; e < experts; ++e) order[e] = e;
      std::partial_sort(order.begin(), order.begin() + top_k, order.end(),
                        [row](int64_t a, int64_t b) { return row[a] > row[b] || (row[a] == row[b] && a < b); });
      float total = 0.f;
      for (int64_t j = 0; j < top_k; ++j) total += row[order[j]];
      for (int64_t j = 0; j < top_k; ++j) {
        const float weight = normalize ? row[order[j]] / total : row[order[j]];
        routing.experts[t * top_k + j] = order[j];
        routing.weights[t * top_k + j] = round_to(weight, weight_type);
      }
    }
  });
  return routing;
}

struct ExpertWeights {
  at::Tensor weight;  // [E, N, K] float, int8 (w8) or uint8 [E, N, K / 2] (w4)
  std::optional<at::Tensor> scales, offsets;
  int64_t group_size;
};

// rows [n, K] @ expert e's weight.T -> [n, N] in rows' dtype.
at::Tensor project(const at::Tensor& rows, const ExpertWeights& w, int64_t e) {
  if (!w.scales.has_value()) return at::linear(rows, w.weight[e]);
  static const auto linear_w8 = c10::Dispatcher::singleton().findSchemaOrThrow("octavo_cpu::linear_w8", "")
                                    .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                      const std::optional<at::Tensor>&, int64_t, bool)>();
  static const auto linear_w4 = c10::Dispatcher::singleton().findSchemaOrThrow("octavo_cpu::linear_w4", "")
                                    .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                      const at::Tensor&, const std::optional<at::Tensor>&, int64_t,
                                                      bool)>();
  // group_size 0: one scale per output channel, a group spanning the whole input.
  const int64_t in_features = w.offsets.has_value() ? 2 * w.weight.size(2) : w.weight.size(2);
  const int64_t group = w.group_size > 0 ? w.group_size : in_features;
  if (!w.offsets.has_value()) return linear_w8.call(rows, w.weight[e], (*w.scales)[e], std::nullopt, group, false);
  return linear_w4.call(rows, w.weight[e], (*w.scales)[e], (*w.offsets)[e], std::nullopt, group, false);
}

at::Tensor activate(const at::Tensor& gate, const std::string& activation) {
  if (activation == "silu") return at::silu(gate);
  if (activation == "gelu") return at::gelu(gate, "none");
  TORCH_CHECK(activation == "gelu_tanh", "moe: activation must be silu, gelu or gelu_tanh, got ", activation);
  return at::gelu(gate, "tanh");
}

void check_experts(const char* role, const ExpertWeights& w, int64_t experts) {
  TORCH_CHECK(w.weight.dim() == 3 && w.weight.size(0) == experts, "moe: ", role, " must be [", experts,
              ", N, K] (one matrix per expert), got ", w.weight.sizes());
  if (w.scales.has_value()) {
    TORCH_CHECK(w.scales->dim() == 3 && w.scales->size(0) == experts && w.group_size >= 0, "moe: ", role,
                " scales must be [", experts, ", N, groups] with a group_size >= 0, got ", w.scales->sizes());
  }
}

at::Tensor moe(const at::Tensor& x, const at::Tensor& router_weight, const at::Tensor& gate_up, const at::Tensor& down,
               int64_t top_k, bool normalize, std::string activation, bool round_weights,
               const std::optional<at::Tensor>& gate_up_scales, const std::optional<at::Tensor>& gate_up_offsets,
               const std::optional<at::Tensor>& down_scales, const std::optional<at::Tensor>& down_offsets,
               int64_t group_size) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2, "octavo_cpu::moe: x must be a [tokens, hidden] CPU tensor, got ",
              x.sizes());
  const int64_t tokens = x.size(0), hidden = x.size(1), experts = router_weight.size(0);
  const ExpertWeights first{gate_up, gate_up_scales, gate_up_offsets, group_size};
  const ExpertWeights second{down, down_scales, down_offsets, group_size};
  check_experts("gate_up", first, experts);
  check_experts("down", second, experts);
  const at::ScalarType type = x.scalar_type();
  Routing routing;
  {
    RECORD_FUNCTION("octavo_cpu::moe_routing", std::vector<c10::IValue>());
    routing = route(x, router_weight, top_k, normalize, round_weights ? type : at::kFloat);
  }
  const int64_t pairs = tokens * top_k;
  std::vector<int64_t> starts(experts + 1, 0), sorted(pairs);
  at::Tensor slot_outputs = at::empty({pairs, hidden}, x.options().dtype(at::kFloat));
  {
    RECORD_FUNCTION("octavo_cpu::moe_permutation", std::vector<c10::IValue>());
    for (int64_t pair = 0; pair < pairs; ++pair) ++starts[routing.experts[pair] + 1];
    for (int64_t e = 0; e < experts; ++e) starts[e + 1] += starts[e];
    std::vector<int64_t> next(starts.begin(), starts.end() - 1);
    for (int64_t pair = 0; pair < pairs; ++pair) sorted[next[routing.experts[pair]]++] = pair;
  }
  const at::Tensor x_rows = x.contiguous();
  for (int64_t e = 0; e < experts; ++e) {
    const int64_t count = starts[e + 1] - starts[e];
    if (count == 0) continue;
    at::Tensor rows, pair_index, weights;
    {
      RECORD_FUNCTION("octavo_cpu::moe_permutation", std::vector<c10::IValue>());
      pair_index = at::from_blob(sorted.data() + starts[e], {count}, at::kLong).clone();
      rows = x_rows.index_select(0, at::floor_divide(pair_index, top_k));
      std::vector<float> w(count);
      for (int64_t i = 0; i < count; ++i) w[i] = routing.weights[sorted[starts[e] + i]];
      weights = at::from_blob(w.data(), {count, 1}, at::kFloat).clone();
    }
    at::Tensor out;
    {
      RECORD_FUNCTION("octavo_cpu::moe_experts", std::vector<c10::IValue>());
      const at::Tensor projected = project(rows, first, e);
      const int64_t intermediate = projected.size(1) / 2;
      const at::Tensor hidden_rows = activate(projected.narrow(1, 0, intermediate).contiguous(), activation) *
                                     projected.narrow(1, intermediate, intermediate);
      out = project(hidden_rows, second, e);
    }
    {
      RECORD_FUNCTION("octavo_cpu::moe_permutation", std::vector<c10::IValue>());
      // The product in torch's promotion (x's dtype with rounded weights, float32 without), then float32.
      const at::Tensor weighted = round_weights ? (out * weights.to(type)).to(at::kFloat) : out.to(at::kFloat) * weights;
      slot_outputs.index_copy_(0, pair_index, weighted);
    }
  }
  RECORD_FUNCTION("octavo_cpu::moe_permutation", std::vector<c10::IValue>());
  const at::Tensor per_slot = slot_outputs.view({tokens, top_k, hidden});
  at::Tensor total = per_slot.select(1, 0).clone();
  for (int64_t j = 1; j < top_k; ++j) total.add_(per_slot.select(1, j));
  return total.to(type);
}

}  // namespace
}  // namespace octavo_cpu

TORCH_LIBRARY_FRAGMENT(octavo_cpu, m) {
  m.def(
      "moe(Tensor x, Tensor router_weight, Tensor gate_up, Tensor down, int top_k, bool normalize, "
      "str activation=\"silu\", bool round_weights=True, Tensor? gate_up_scales=None, Tensor? gate_up_offsets=None, "
      "Tensor? down_scales=None, Tensor? down_offsets=None, int group_size=0) -> Tensor");
}

TORCH_LIBRARY_IMPL(octavo_cpu, CPU, m) { m.impl("moe", &octavo_cpu::moe); }
