// The KV-cache write of paged_attention (paged_attention.cpp): new K/V rows stored into their pool slots, widened
// or narrowed to the cache type, int8 and float8 rows quantized with one scale per (token, kv head).
#pragma once

#include "paged_attention_types.h"

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cmath>
#include <cstring>

namespace octavo_cpu {
namespace paged {

// dst[0:n] = round(src / scale) in the cache type; returns the scale: max|x| / 127 (int8) or / 448 (fp8), 1 for 0.
template <typename CT>
inline float quantize_row(const float* src, int64_t n, CT* dst) {
  float amax = 0.f;
  for (int64_t i = 0; i < n; ++i) amax = std::max(amax, std::abs(src[i]));
  constexpr float kMax = std::is_same_v<CT, int8_t> ? 127.f : 448.f;
  const float scale = amax == 0.f ? 1.f : amax / kMax;
  for (int64_t i = 0; i < n; ++i) {
    const float x = src[i] / scale;
    if constexpr (std::is_same_v<CT, int8_t>) {
      dst[i] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, std::nearbyint(x))));
    } else {
      dst[i] = static_cast<CT>(x);
    }
  }
  return scale;
}

// rows [T, Hkv, dim] (any token and head strides, the last dim contiguous) -> pool slots `slots` (negative slots
// skipped); rows are float unless `same_type`.
template <typename CT>
inline void write_pool(const at::Tensor& rows, const Pool& pool, const int64_t* slots, int64_t block_size, bool same_type) {
  const int64_t num_tokens = rows.size(0), num_heads = rows.size(1), dim = rows.size(2);
  // Rows are small: a decode step (a few hundred rows) writes on one thread, without a parallel region.
  at::parallel_for(0, num_tokens * num_heads, 1024, [&](int64_t begin, int64_t end) {
    for (int64_t index = begin; index < end; ++index) {
      const int64_t t = index / num_heads, h = index % num_heads, slot = slots[t];
      if (slot < 0) continue;
      const int64_t block = slot / block_size, offset = slot % block_size;
      CT* dst = static_cast<CT*>(pool.data) + block * pool.block_stride + offset * pool.token_stride +
                h * pool.head_stride;
      const int64_t source = t * rows.stride(0) + h * rows.stride(1);
      if (same_type) {
        std::memcpy(dst, static_cast<const CT*>(rows.const_data_ptr()) + source, dim * sizeof(CT));
        continue;
      }
      const float* src = rows.const_data_ptr<float>() + source;
      if constexpr (kQuantized<CT>) {
        pool.scales[block * pool.scale_block_stride + offset * pool.scale_token_stride + h * pool.scale_head_stride] =
            quantize_row(src, dim, dst);
      } else {
        for (int64_t i = 0; i < dim; ++i) dst[i] = static_cast<CT>(src[i]);
      }
    }
  });
}

}  // namespace paged
}  // namespace octavo_cpu
