// Prefill of whole prompts (no cached context) through ATen's flash attention for CPUs
// (aten::_scaled_dot_product_flash_attention_for_cpu), which multiplies bf16 tiles with AMX where the CPU has
// it: there the op runs 1.5-1.8x faster than with the paged prefill kernel's AVX-512 dot products (SmolLM2's
// shapes: one prompt of 508 tokens, eight of 67-508). A prompt with no cached context attends only to its own new keys, which the call
// received as contiguous rows, so the dense kernel reads them where they are: nothing is gathered from the pool.
// Its keys and values are the ones the cache holds (query, key, value and cache share a dtype, so the cache
// write stores them unchanged). Every other sequence (decode, chunked prefill, prefixes from the cache, sliding
// windows, quantized caches) stays on the paged kernels.
//
// OCTAVO_CPU_FRESH_PREFILL chooses: "auto" (the default: bf16 on CPUs with AMX-BF16, prompts of at least
// kFreshPromptMinTokens), "aten" (every eligible prompt of 2 or more tokens in any float dtype, on any CPU: what
// the tests use to check this path on machines without AMX) or "paged" (never).
#pragma once

#include "paged_attention_types.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/_scaled_dot_product_flash_attention_for_cpu.h>
#include <c10/util/Exception.h>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <tuple>
#include <vector>

namespace octavo_cpu {
namespace paged {

// Shorter prompts gain little (ATen's per-call set-up is a larger part of them) and the paged kernel runs
// several of them in one parallel region.
constexpr int64_t kFreshPromptMinTokens = 64;

// Whether this CPU executes AMX-BF16 tile multiplies (CPUID leaf 7: AMX-BF16 is EDX bit 22, AMX-TILE bit 24).
inline bool cpu_has_amx_bf16() {
  static const bool present = [] {
#if defined(__x86_64__) || defined(__i386__)
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
    return ((edx >> 22) & 1u) != 0 && ((edx >> 24) & 1u) != 0;
#else
    return false;
#endif
  }();
  return present;
}

enum class FreshPrefill { kAuto, kAten, kPaged };

inline FreshPrefill fresh_prefill_mode() {
  const char* value = std::getenv("OCTAVO_CPU_FRESH_PREFILL");
  if (value == nullptr || *value == '\0' || std::strcmp(value, "auto") == 0) return FreshPrefill::kAuto;
  if (std::strcmp(value, "aten") == 0) return FreshPrefill::kAten;
  if (std::strcmp(value, "paged") == 0) return FreshPrefill::kPaged;
  TORCH_CHECK(false, "OCTAVO_CPU_FRESH_PREFILL must be auto, aten or paged, got '", value, "'");
}

// One flag per sequence of the batch: 1 where ATen's kernel computes its attention; empty when none does.
inline std::vector<uint8_t> fresh_prompts(const at::Tensor& query, const at::Tensor& key, at::ScalarType cache_type,
                                          int64_t sliding_window, bool square_heads, const int32_t* seq_lens,
                                          const int32_t* starts, int64_t batch) {
  const FreshPrefill mode = fresh_prefill_mode();
  const at::ScalarType type = query.scalar_type();
  const bool eligible = mode != FreshPrefill::kPaged && type == cache_type && key.scalar_type() == type &&
                        sliding_window <= 0 && square_heads;
  const bool wanted = mode == FreshPrefill::kAten || (type == at::kBFloat16 && cpu_has_amx_bf16());
  std::vector<uint8_t> fresh;
  if (!eligible || !wanted) return fresh;
  const int64_t shortest = mode == FreshPrefill::kAten ? 2 : kFreshPromptMinTokens;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t q_len = starts[b + 1] - starts[b];
    if (q_len >= shortest && q_len == seq_lens[b]) {
      fresh.resize(batch, 0);
      fresh[b] = 1;
    }
  }
  return fresh;
}

// result[rows of b] = causal softmax(q k^T * scale) v over sequence b's own rows, for every flagged b (result:
// [tokens, heads, value_dim] in the query's dtype).
inline void attend_fresh_prompts(const std::vector<uint8_t>& fresh, const at::Tensor& query, const at::Tensor& key,
                                 const at::Tensor& value, at::Tensor& result, const int32_t* starts, double scale) {
  for (size_t b = 0; b < fresh.size(); ++b) {
    if (!fresh[b]) continue;
    const int64_t begin = starts[b], n = starts[b + 1] - starts[b];
    // [n, heads, dim] rows seen as [1, heads, n, dim]: the kernel takes strided inputs and grouped kv heads.
    const auto as_batch = [&](const at::Tensor& rows) { return rows.narrow(0, begin, n).unsqueeze(0).transpose(1, 2); };
    const auto attended = at::_scaled_dot_product_flash_attention_for_cpu(as_batch(query), as_batch(key),
                                                                           as_batch(value), 0.0, true, std::nullopt,
                                                                           scale);
    result.narrow(0, begin, n).copy_(std::get<0>(attended)[0].transpose(0, 1));
  }
}

}  // namespace paged
}  // namespace octavo_cpu
