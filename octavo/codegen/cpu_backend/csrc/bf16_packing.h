// The packed form of a bfloat16 weight that octavo_cpu::linear_bf16's kernels read, and the cache that keeps one
// packed copy per weight.
//
// Layout: W [N, K] as blocks of kBf16BlockColumns output columns (weight rows). Block b holds `pairs` =
// round_up(K, kBf16Depth) / 2 rows of 32-bit words; word (p, c) holds the bfloat16 W[32 b + c, 2p] in its low half
// and W[32 b + c, 2p + 1] in its high half, zeros past N and K. A block is contiguous (one stream of memory for
// the GEMV) and is the VNNI operand vdpbf16ps and AMX's TDPBF16PS multiply by: 32 columns a row of pairs.
//
// The op takes the model's weight as the graph binds it (row-major, as stored: nothing is packed into the
// artifact or the compiled package, so the weight stays one copy, memory-mapped or a constant of the package),
// and packs it at its first call. The packed copy is kept for as long as the weight's storage lives: keyed by
// the weight's data pointer and shape, and valid while a weak reference to its storage holds and its version
// counter (in-place writes) is unchanged. Entries of freed storages are dropped at the next packing. Packed
// weights live side by side in the huge-page arena (huge_pages.h): the GEMV streams them on 2 MiB pages.
#pragma once

#include "huge_pages.h"
#include "vec_utils.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/core/StorageImpl.h>
#include <c10/util/intrusive_ptr.h>

#include <mutex>
#include <unordered_map>

namespace octavo_cpu {

constexpr int64_t kBf16BlockColumns = 32;
constexpr int64_t kBf16Depth = 32;  // K is padded to whole tiles of AMX depth (16 pairs)

struct PackedBf16 {
  const uint32_t* words;
  int64_t N, K, pairs, blocks;
  const uint32_t* block(int64_t b) const { return words + b * pairs * kBf16BlockColumns; }
};

inline int64_t packed_pairs(int64_t K) { return round_up(K, kBf16Depth) / 2; }

// W [N, K] (row-major bfloat16) in the packed layout: a uint32 tensor [blocks, pairs, 32].
inline at::Tensor pack_bf16_weight(const at::Tensor& weight) {
  const int64_t N = weight.size(0), K = weight.size(1), pairs = packed_pairs(K);
  const int64_t blocks = (N + kBf16BlockColumns - 1) / kBf16BlockColumns;
  at::Tensor packed = HugePageArena::instance().empty({blocks, pairs, kBf16BlockColumns}, at::kInt);
  const auto* w = reinterpret_cast<const uint16_t*>(weight.const_data_ptr());
  auto* words = reinterpret_cast<uint32_t*>(packed.mutable_data_ptr());
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      uint32_t* block = words + b * pairs * kBf16BlockColumns;
      for (int64_t c = 0; c < kBf16BlockColumns; ++c) {
        const int64_t n = b * kBf16BlockColumns + c;
        for (int64_t p = 0; p < pairs; ++p) {
          const int64_t k = 2 * p;
          const uint32_t low = n < N && k < K ? w[n * K + k] : 0u;
          const uint32_t high = n < N && k + 1 < K ? w[n * K + k + 1] : 0u;
          block[p * kBf16BlockColumns + c] = low | (high << 16);
        }
      }
    }
  });
  return packed;
}

// x [M, K] with its columns zero-padded to `width` (x itself when K == width), in `dtype`.
inline at::Tensor padded(const at::Tensor& x, int64_t width, at::ScalarType dtype) {
  if (x.size(1) == width) return x.scalar_type() == dtype ? x : x.to(dtype);
  at::Tensor wide = at::zeros({x.size(0), width}, x.options().dtype(dtype));
  wide.narrow(1, 0, x.size(1)).copy_(x);
  return wide;
}

// The packed copy of `weight` (a contiguous bfloat16 [N, K]), packed at the first call for it.
class PackedWeightCache {
 public:
  at::Tensor get(const at::Tensor& weight) {
    const void* key = weight.const_data_ptr();
    const int64_t version = weight.is_inference() ? -1 : static_cast<int64_t>(weight._version());
    std::lock_guard<std::mutex> lock(mutex_);
    auto found = entries_.find(key);
    if (found != entries_.end()) {
      const Entry& entry = found->second;
      if (!entry.storage.expired() && entry.storage_impl == weight.storage().unsafeGetStorageImpl() &&
          entry.N == weight.size(0) && entry.K == weight.size(1) && entry.version == version) {
        return entry.packed;
      }
      entries_.erase(found);
    }
    for (auto it = entries_.begin(); it != entries_.end();) {
      it = it->second.storage.expired() ? entries_.erase(it) : std::next(it);
    }
    Entry entry{weight.storage().getWeakStorageImpl(), weight.storage().unsafeGetStorageImpl(), weight.size(0),
                weight.size(1), version, pack_bf16_weight(weight)};
    ++packings_;
    at::Tensor packed = entry.packed;
    entries_.emplace(key, std::move(entry));
    return packed;
  }

  // Weights packed since the process started (a weight packed again after a change counts again).
  int64_t packings() {
    std::lock_guard<std::mutex> lock(mutex_);
    return packings_;
  }

  static PackedWeightCache& instance() {
    static PackedWeightCache cache;
    return cache;
  }

 private:
  struct Entry {
    c10::weak_intrusive_ptr<c10::StorageImpl> storage;
    const c10::StorageImpl* storage_impl;
    int64_t N, K, version;
    at::Tensor packed;
  };
  std::mutex mutex_;
  std::unordered_map<const void*, Entry> entries_;
  int64_t packings_ = 0;
};

}  // namespace octavo_cpu
