// Memory for the weights that decode steps stream, backed by 2 MiB pages where Linux allows.
//
// A decode step reads every weight once, a few hundred MB at the memory's full rate. On 4 KiB pages every 4 KiB of
// that stream is another TLB entry to walk and another point where the hardware prefetchers stop; on 2 MiB pages
// the bfloat16 GEMV read SmolLM2's weights at 30-33 GB/s instead of 20-24 (Xeon with AMX, one sitting). Two ways:
// - HugePageArena (linear_bf16's packed copies): tensors carved side by side from 64 MiB mappings marked
//   MADV_HUGEPAGE, so that the pages they fault in as they are first written are huge ones (transparent huge pages
//   "always" or "madvise"; with "never" ordinary pages); weights of a few hundred KB each would never fill a huge
//   page alone. Untouched parts of a mapping take no memory.
// - collapse_to_huge_pages (weights read where they lie: the quantized and 16-bit linears'): their memory, already
//   written, moved onto huge pages in place at their first call.
// Only the physical pages differ: every value is the same on either.
//
// The price is paid once, as the weights are packed or first used: Linux zeroes or copies each 2 MiB page, and may
// compact memory to find one (in a VM whose host backs memory lazily, SmolLM2's first step took 1.3-2.4 s instead
// of 0.1). OCTAVO_CPU_HUGE_PAGES=0 keeps ordinary pages.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/from_blob.h>

#include <sys/mman.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <unordered_set>
#include <utility>
#include <vector>

namespace octavo_cpu {

constexpr int64_t kHugePageBytes = int64_t{2} << 20;
constexpr int64_t kArenaChunkBytes = int64_t{64} << 20;  // the mapping a run of weights shares
constexpr int64_t kArenaAlignment = 64;                   // each tensor starts on a cache line

// Whether packed weights go onto huge pages: OCTAVO_CPU_HUGE_PAGES unset or "1"; "0" turns them off (read once; any
// other value is refused by name).
inline bool huge_pages_wanted() {
  static const bool wanted = [] {
    const char* env = std::getenv("OCTAVO_CPU_HUGE_PAGES");
    const std::string value = env == nullptr ? "1" : env;
    TORCH_CHECK(value == "0" || value == "1", "OCTAVO_CPU_HUGE_PAGES must be 0 or 1 (or unset), got ", value);
    return value == "1";
  }();
  return wanted;
}

class HugePageArena {
 public:
  // An uninitialized contiguous tensor of `sizes` and `dtype` in the arena. It keeps its mapping alive; a mapping
  // is unmapped once its last tensor is freed and no later tensor can land in it.
  at::Tensor empty(at::IntArrayRef sizes, at::ScalarType dtype) {
    const bool advise = huge_pages_wanted();  // a bad switch is refused before anything is mapped
    int64_t count = 1;
    for (int64_t size : sizes) count *= size;
    const int64_t bytes = std::max<int64_t>(1, count * static_cast<int64_t>(c10::elementSize(dtype)));
    std::shared_ptr<Chunk> chunk;
    char* data;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (current_ == nullptr || current_->used + bytes > current_->size) {
        current_ = Chunk::map(std::max(kArenaChunkBytes, round_up_to(bytes, kHugePageBytes)), advise);
      }
      chunk = current_;
      data = chunk->base + chunk->used;
      chunk->used = round_up_to(chunk->used + bytes, kArenaAlignment);
      ++chunk->live;
    }
    return at::from_blob(data, sizes, [this, chunk](void*) mutable { release(std::move(chunk)); },
                         at::TensorOptions().dtype(dtype).device(at::kCPU));
  }

  static HugePageArena& instance() {
    static HugePageArena* arena = new HugePageArena();  // never destroyed: tensors may outlive static teardown
    return *arena;
  }

 private:
  static int64_t round_up_to(int64_t value, int64_t multiple) { return (value + multiple - 1) / multiple * multiple; }

  struct Chunk {
    char* base = nullptr;  // 2 MiB-aligned
    int64_t size = 0, used = 0, live = 0;
    void* mapping = nullptr;
    size_t mapped = 0;

    static std::shared_ptr<Chunk> map(int64_t size, bool advise) {
      // Mapped with a huge page of slack, so that an aligned start lies inside it.
      const size_t mapped = static_cast<size_t>(size + kHugePageBytes);
      void* mapping = mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      TORCH_CHECK(mapping != MAP_FAILED, "could not map ", mapped, " bytes for packed weights");
      auto chunk = std::make_shared<Chunk>();
      chunk->mapping = mapping;
      chunk->mapped = mapped;
      chunk->base = reinterpret_cast<char*>(round_up_to(reinterpret_cast<int64_t>(mapping), kHugePageBytes));
      chunk->size = size;
      if (advise) madvise(chunk->base, static_cast<size_t>(size), MADV_HUGEPAGE);  // a refusal leaves ordinary pages
      return chunk;
    }

    ~Chunk() {
      if (mapping != nullptr) munmap(mapping, mapped);
    }
  };

  // A tensor of `chunk` is freed: the arena lets go of its current chunk when nothing lives in it any more.
  void release(std::shared_ptr<Chunk> chunk) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (--chunk->live == 0 && current_ == chunk) current_.reset();
  }

  std::mutex mutex_;
  std::shared_ptr<Chunk> current_;
};

// Asks Linux to move the 2 MiB pages that hold [data, data + bytes) onto huge pages (MADV_COLLAPSE, Linux 6.1 and
// later): for weights the kernels read where they lie (a compiled graph's constants, an eager engine's tensors)
// instead of a packed copy. Once per range and once per page for the life of the process, and only where
// huge_pages_wanted(). The memory must be mapped and written; every byte of those pages keeps its value, whatever it
// belongs to. A page Linux refuses (past the mapping, file-backed, an older kernel) stays as it is.
inline void collapse_to_huge_pages(const void* data, int64_t bytes) {
#ifndef MADV_COLLAPSE
  constexpr int MADV_COLLAPSE = 25;  // Linux 6.1's value, for older headers
#endif
  static std::mutex mutex;
  static std::set<uintptr_t> ranges, pages;
  // Every call of a linear asks again for its weight: the ranges this thread already asked for are answered
  // without the lock.
  thread_local std::unordered_set<uintptr_t> asked;
  if (bytes <= 0 || !huge_pages_wanted()) return;
  const uintptr_t page = static_cast<uintptr_t>(kHugePageBytes), begin = reinterpret_cast<uintptr_t>(data);
  if (!asked.insert(begin).second) return;
  std::vector<uintptr_t> todo;
  {
    std::lock_guard<std::mutex> lock(mutex);
    if (!ranges.insert(begin).second) return;
    for (uintptr_t p = begin / page * page; p < begin + static_cast<uintptr_t>(bytes); p += page) {
      if (pages.insert(p).second) todo.push_back(p);
    }
  }
  for (uintptr_t p : todo) madvise(reinterpret_cast<void*>(p), page, MADV_COLLAPSE);
}

}  // namespace octavo_cpu
