// Prefill attention through ATen's flash attention for CPUs (aten::_scaled_dot_product_flash_attention_for_cpu),
// which multiplies bf16 tiles with AMX where the CPU has it: there the op runs 1.2-2.2x faster than with the paged
// prefill kernel's AVX-512 dot products on SmolLM2's shapes (whole prompts of 67-508 tokens, chunks of 32-96 over
// 384 cached tokens).
//
// - A whole prompt (no cached context) attends only to its own new keys, which the call received as contiguous
//   rows: the dense kernel reads them where they are, causal.
// - A prompt chunk over cached blocks (prefix caching, chunked prefill): its context's keys and values, the new
//   rows included (the call wrote them first), are copied out of the pool's blocks into one contiguous run
//   (O(context) bytes against O(chunk x context) arithmetic), and an additive mask of the query dtype (0 where a key's position is at most the query's, -inf
//   elsewhere) gives the causal alignment of the chunk's last row with the context's end.
// Query, key, value and cache share a dtype, so these are the values the cache holds. Decodes, sliding windows and
// quantized caches stay on the paged kernels.
//
// OCTAVO_CPU_PREFILL_ATTENTION chooses, in the AVX-512 build (the others never take this path): "auto" (the
// default: bf16 on CPUs with AMX-BF16, whole prompts of at least kWholePromptMinTokens, chunks of at least
// kChunkMinTokens), "aten" (every prefill of 2 or more query tokens in any float dtype: what the tests use to
// check this path on AVX-512 machines without AMX) or "paged" (never).
#pragma once

#include "paged_attention_types.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/_scaled_dot_product_flash_attention_for_cpu.h>
#include <ATen/ops/full.h>
#include <ATen/ops/index_select.h>
#include <c10/util/Exception.h>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <optional>
#include <tuple>
#include <vector>

namespace octavo_cpu {
namespace paged {

// Shorter prefills gain little (ATen's per-call set-up, and for chunks the copy and the mask, are a larger part of
// them) and the paged kernel runs several of them in one parallel region.
constexpr int64_t kWholePromptMinTokens = 64;
constexpr int64_t kChunkMinTokens = 32;

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

enum class PrefillPath { kAuto, kAten, kPaged };

inline PrefillPath prefill_path_mode() {
  const char* value = std::getenv("OCTAVO_CPU_PREFILL_ATTENTION");
  if (value == nullptr || *value == '\0' || std::strcmp(value, "auto") == 0) return PrefillPath::kAuto;
  if (std::strcmp(value, "aten") == 0) return PrefillPath::kAten;
  if (std::strcmp(value, "paged") == 0) return PrefillPath::kPaged;
  TORCH_CHECK(false, "OCTAVO_CPU_PREFILL_ATTENTION must be auto, aten or paged, got '", value, "'");
}

// One flag per sequence of the batch: 1 where ATen's kernel computes its attention; empty when none does.
inline std::vector<uint8_t> aten_prefills(const at::Tensor& query, const at::Tensor& key, at::ScalarType cache_type,
                                          int64_t sliding_window, bool square_heads, const int32_t* seq_lens,
                                          const int32_t* starts, int64_t batch) {
  const PrefillPath mode = prefill_path_mode();
#if !defined(CPU_CAPABILITY_AVX512)
  // Only the AVX-512 build: under ATEN_CPU_CAPABILITY=avx2 or default on an AMX CPU, ATen's own reduced-precision
  // flash kernel still packs for AMX and fails ("pack_vnni2 is only supported when avx512 is supported").
  return {};
#endif
  const at::ScalarType type = query.scalar_type();
  const bool eligible = mode != PrefillPath::kPaged && type == cache_type && key.scalar_type() == type &&
                        sliding_window <= 0 && square_heads;
  const bool wanted = mode == PrefillPath::kAten || (type == at::kBFloat16 && cpu_has_amx_bf16());
  std::vector<uint8_t> flags;
  if (!eligible || !wanted) return flags;
  const bool any = mode == PrefillPath::kAten;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t q_len = starts[b + 1] - starts[b];
    const int64_t shortest = any ? 2 : (q_len == seq_lens[b] ? kWholePromptMinTokens : kChunkMinTokens);
    if (q_len >= shortest) {
      flags.resize(batch, 0);
      flags[b] = 1;
    }
  }
  return flags;
}

struct AtenPrefill {
  const at::Tensor& query;
  const at::Tensor& key;
  const at::Tensor& value;
  const at::Tensor& key_cache;    // already holding this call's rows
  const at::Tensor& value_cache;
  const at::Tensor& block_tables;  // int32 [batch, max_blocks]
  double scale;
};

// Positions [0, n) of sequence b's rows in `cache` (every kv head): its first blocks, taken whole, then cut.
inline at::Tensor context_rows(const at::Tensor& cache, const at::Tensor& block_tables, int64_t b, int64_t n) {
  const int64_t block_size = cache.size(1), blocks = (n + block_size - 1) / block_size;
  return cache.index_select(0, block_tables[b].narrow(0, 0, blocks)).flatten(0, 1).narrow(0, 0, n);
}

// result[rows of b] = softmax(q k^T * scale + causal mask) v over sequence b's cached and new rows, for every
// flagged b (result: [tokens, heads, value_dim] in the query's dtype).
inline void attend_aten_prefills(const AtenPrefill& a, const std::vector<uint8_t>& flags, const int32_t* seq_lens,
                                 const int32_t* starts, at::Tensor& result) {
  for (size_t b = 0; b < flags.size(); ++b) {
    if (!flags[b]) continue;
    const int64_t begin = starts[b], n = starts[b + 1] - starts[b], length = seq_lens[b];
    at::Tensor keys = a.key.narrow(0, begin, n), values = a.value.narrow(0, begin, n);
    std::optional<at::Tensor> mask;
    if (length > n) {
      keys = context_rows(a.key_cache, a.block_tables, b, length);
      values = context_rows(a.value_cache, a.block_tables, b, length);
      // Query i (position length - n + i) sees keys 0 .. length - n + i: -inf above that diagonal, 0 elsewhere.
      mask = at::full({1, 1, n, length}, -std::numeric_limits<double>::infinity(), a.query.options())
                 .triu(length - n + 1);
    }
    // [rows, heads, dim] seen as [1, heads, rows, dim]: the kernel takes strided inputs and grouped kv heads.
    const auto as_batch = [](const at::Tensor& rows) { return rows.unsqueeze(0).transpose(1, 2); };
    const auto attended = at::_scaled_dot_product_flash_attention_for_cpu(
        as_batch(a.query.narrow(0, begin, n)), as_batch(keys), as_batch(values), 0.0, !mask.has_value(), mask,
        a.scale);
    result.narrow(0, begin, n).copy_(std::get<0>(attended)[0].transpose(0, 1));
  }
}

}  // namespace paged
}  // namespace octavo_cpu
