// Collectives through shared memory, for the ranks of one host: an all_reduce that gloo runs in ~0.17 ms over
// loopback TCP (its latency, not its bandwidth, at the sizes of a decode step) takes a few microseconds here.
//
// A group is one file mapped by every rank (created by the group's first rank, unlinked once all have mapped it):
// a header with one arrival counter per rank, then two buffers of `world` slots of `slot_bytes` each.
//
//   octavo_cpu::shm_group_open(path, rank, world, slot_bytes, timeout_s, create) -> int
//       map the region (creating it when `create`), record this process's pid in it; a handle for the ops below.
//   octavo_cpu::shm_group_peers_alive(handle) -> bool
//       every rank has recorded its pid and each of those processes runs (is visible to this one).
//   octavo_cpu::shm_all_reduce(x, handle) -> Tensor
//       the sum of every rank's x (float32, bfloat16 or float16, same shape on every rank): each element summed
//       in float32 in rank order, left to right, and rounded once to x's dtype; identical on every rank.
//   octavo_cpu::shm_all_gather(x, handle) -> Tensor [world, *x.shape]
//       every rank's x, stacked in rank order (any dtype: bytes are copied).
//   octavo_cpu::shm_group_close(handle)
//
// Every rank must call the same collectives in the same order with the same sizes. One collective moves its
// bytes in chunks of slot_bytes; per chunk: copy this rank's chunk into its slot of buffer (sequence & 1),
// publish the sequence number in its counter (release), wait until every counter has reached it (acquire),
// read all slots. The two buffers make one wait per chunk enough: a rank writes buffer b again only two
// sequences later, after every rank has arrived at the sequence between, so after each has read b.
//
// A rank waiting spins (each rank is meant to own its cores), then sleeps briefly; every 100 ms it checks that
// the processes it waits for still run (a dead peer fails the wait at once, a zombie counts as dead) and it
// gives up after timeout_s.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <fcntl.h>
#include <memory>
#include <mutex>
#include <string>
#include <sys/mman.h>
#include <sys/stat.h>
#include <thread>
#include <type_traits>
#include <unistd.h>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

namespace octavo_cpu {
namespace {

constexpr int64_t kMaxRanks = 64;
constexpr int64_t kMaxGroups = 256;
constexpr uint64_t kMagic = 0x4f435441564f5348ULL;  // "OCTAVOSH"
constexpr int64_t kSpinsBeforeSleeping = 1 << 16;
constexpr auto kLivenessInterval = std::chrono::milliseconds(100);

struct alignas(64) ArrivalCounter {
  std::atomic<uint64_t> sequence;
};

struct RegionHeader {
  std::atomic<uint64_t> magic;
  int64_t world;
  int64_t slot_bytes;
  std::atomic<int64_t> pids[kMaxRanks];
  ArrivalCounter arrived[kMaxRanks];
};

constexpr int64_t kDataOffset = ((sizeof(RegionHeader) + 4095) / 4096) * 4096;

struct Group {
  char* base = nullptr;
  int64_t bytes = 0;
  int64_t rank = 0;
  int64_t world = 0;
  int64_t slot_bytes = 0;
  double timeout_s = 0.0;
  uint64_t sequence = 0;

  RegionHeader* header() const { return reinterpret_cast<RegionHeader*>(base); }
  char* slot(uint64_t sequence_number, int64_t of_rank) const {
    const int64_t buffer = static_cast<int64_t>(sequence_number & 1);
    return base + kDataOffset + (buffer * world + of_rank) * slot_bytes;
  }
};

std::mutex groups_mutex;
std::array<std::atomic<Group*>, kMaxGroups> groups{};

Group& group_of(int64_t handle) {
  TORCH_CHECK(handle >= 0 && handle < kMaxGroups, "shared-memory collective: no group ", handle);
  Group* group = groups[handle].load(std::memory_order_acquire);
  TORCH_CHECK(group != nullptr, "shared-memory collective: group ", handle, " is not open");
  return *group;
}

inline void cpu_relax() {
#if defined(__x86_64__) || defined(_M_X64)
  _mm_pause();
#else
  std::atomic_signal_fence(std::memory_order_seq_cst);
#endif
}

// Whether process `pid` still runs: it exists and is not a zombie (a dead child its parent has not reaped yet,
// which kill(pid, 0) still finds, and the parent may be the very rank that waits for it).
bool process_runs(int64_t pid) {
  if (pid <= 0) return false;
  char path[64];
  std::snprintf(path, sizeof(path), "/proc/%lld/stat", static_cast<long long>(pid));
  if (FILE* stat = std::fopen(path, "r")) {
    char line[512];
    const bool read = std::fgets(line, sizeof(line), stat) != nullptr;
    std::fclose(stat);
    if (!read) return false;
    const char* state = std::strrchr(line, ')');  // the state follows the parenthesised command name
    return state == nullptr || state[1] == '\0' || state[2] == '\0' || (state[2] != 'Z' && state[2] != 'X');
  }
  return ::kill(static_cast<pid_t>(pid), 0) == 0 || errno == EPERM;
}

void wait_for_every_rank(const Group& group, uint64_t sequence_number) {
  RegionHeader* header = group.header();
  const auto start = std::chrono::steady_clock::now();
  auto next_check = start + kLivenessInterval;
  for (int64_t rank = 0; rank < group.world; ++rank) {
    int64_t spins = 0;
    while (header->arrived[rank].sequence.load(std::memory_order_acquire) < sequence_number) {
      if (++spins < kSpinsBeforeSleeping) {
        cpu_relax();
        continue;
      }
      std::this_thread::sleep_for(std::chrono::microseconds(20));
      const auto now = std::chrono::steady_clock::now();
      if (now < next_check) continue;
      next_check = now + kLivenessInterval;
      const int64_t pid = header->pids[rank].load(std::memory_order_relaxed);
      TORCH_CHECK(process_runs(pid), "rank ", rank, " of the shared-memory group (pid ", pid,
                  ") exited during a shared-memory collective");
      const double waited_s = std::chrono::duration<double>(now - start).count();
      TORCH_CHECK(waited_s < group.timeout_s, "Timed out waiting ", group.timeout_s, "s for rank ", rank,
                  " of the shared-memory group (pid ", pid, ") in a shared-memory collective");
    }
  }
}

// Copy this rank's chunk into its slot of the next sequence's buffer, publish it, wait for every rank's; returns
// the sequence number, whose buffer then holds every rank's chunk.
uint64_t exchange_chunk(Group& group, const void* chunk, int64_t bytes) {
  const uint64_t sequence_number = ++group.sequence;
  std::memcpy(group.slot(sequence_number, group.rank), chunk, bytes);
  group.header()->arrived[group.rank].sequence.store(sequence_number, std::memory_order_release);
  wait_for_every_rank(group, sequence_number);
  return sequence_number;
}

template <typename T>
void sum_chunk(const Group& group, uint64_t sequence_number, int64_t count, T* out, std::vector<float>& totals) {
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(out, group.slot(sequence_number, 0), count * sizeof(float));
    for (int64_t rank = 1; rank < group.world; ++rank) {
      const float* part = reinterpret_cast<const float*>(group.slot(sequence_number, rank));
      for (int64_t i = 0; i < count; ++i) out[i] += part[i];
    }
  } else {
    totals.resize(count);
    const T* first = reinterpret_cast<const T*>(group.slot(sequence_number, 0));
    for (int64_t i = 0; i < count; ++i) totals[i] = static_cast<float>(first[i]);
    for (int64_t rank = 1; rank < group.world; ++rank) {
      const T* part = reinterpret_cast<const T*>(group.slot(sequence_number, rank));
      for (int64_t i = 0; i < count; ++i) totals[i] += static_cast<float>(part[i]);
    }
    for (int64_t i = 0; i < count; ++i) out[i] = static_cast<T>(totals[i]);
  }
}

template <typename T>
void all_reduce_into(Group& group, const T* input, T* out, int64_t numel) {
  const int64_t chunk = group.slot_bytes / static_cast<int64_t>(sizeof(T));
  std::vector<float> totals;
  for (int64_t offset = 0; offset < numel; offset += chunk) {
    const int64_t count = std::min(chunk, numel - offset);
    const uint64_t sequence_number = exchange_chunk(group, input + offset, count * sizeof(T));
    sum_chunk<T>(group, sequence_number, count, out + offset, totals);
  }
}

int64_t shm_group_open(const std::string& path, int64_t rank, int64_t world, int64_t slot_bytes, double timeout_s,
                       bool create) {
  TORCH_CHECK(world >= 1 && world <= kMaxRanks, "shm_group_open: world must be 1..", kMaxRanks, ", got ", world);
  TORCH_CHECK(rank >= 0 && rank < world, "shm_group_open: rank ", rank, " is not in 0..", world - 1);
  TORCH_CHECK(slot_bytes > 0 && slot_bytes % 64 == 0, "shm_group_open: slot_bytes must be a positive multiple of 64");
  const int64_t bytes = kDataOffset + 2 * world * slot_bytes;
  const int fd = create ? ::open(path.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600) : ::open(path.c_str(), O_RDWR);
  TORCH_CHECK(fd >= 0, "shm_group_open: cannot open ", path, ": ", std::strerror(errno));
  if (create) {
    // fallocate rather than ftruncate: a full /dev/shm fails here, not with SIGBUS on the first write.
    const int error = ::posix_fallocate(fd, 0, bytes);
    if (error != 0) {
      ::close(fd);
      ::unlink(path.c_str());
      TORCH_CHECK(false, "shm_group_open: cannot allocate ", bytes, " bytes at ", path, ": ", std::strerror(error));
    }
  } else {
    struct stat status {};
    const bool sized = ::fstat(fd, &status) == 0 && status.st_size == bytes;
    if (!sized) ::close(fd);
    TORCH_CHECK(sized, "shm_group_open: ", path, " is not the region of a group of ", world, " x ", slot_bytes);
  }
  void* mapped = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const int map_errno = errno;
  ::close(fd);
  TORCH_CHECK(mapped != MAP_FAILED, "shm_group_open: cannot map ", path, ": ", std::strerror(map_errno));
  auto group = std::make_unique<Group>();
  group->base = static_cast<char*>(mapped);
  group->bytes = bytes;
  group->rank = rank;
  group->world = world;
  group->slot_bytes = slot_bytes;
  group->timeout_s = timeout_s;
  RegionHeader* header = group->header();
  if (create) {
    header->world = world;
    header->slot_bytes = slot_bytes;
    header->magic.store(kMagic, std::memory_order_release);
  } else if (header->magic.load(std::memory_order_acquire) != kMagic || header->world != world ||
             header->slot_bytes != slot_bytes) {
    ::munmap(mapped, bytes);
    TORCH_CHECK(false, "shm_group_open: ", path, " does not hold a group of ", world, " x ", slot_bytes);
  }
  header->pids[rank].store(static_cast<int64_t>(::getpid()), std::memory_order_release);
  std::lock_guard<std::mutex> lock(groups_mutex);
  for (int64_t handle = 0; handle < kMaxGroups; ++handle) {
    if (groups[handle].load(std::memory_order_relaxed) == nullptr) {
      groups[handle].store(group.release(), std::memory_order_release);
      return handle;
    }
  }
  ::munmap(mapped, bytes);
  TORCH_CHECK(false, "shm_group_open: more than ", kMaxGroups, " groups open in one process");
}

bool shm_group_peers_alive(int64_t handle) {
  const Group& group = group_of(handle);
  for (int64_t rank = 0; rank < group.world; ++rank) {
    if (!process_runs(group.header()->pids[rank].load(std::memory_order_acquire))) return false;
  }
  return true;
}

void shm_group_close(int64_t handle) {
  std::lock_guard<std::mutex> lock(groups_mutex);
  Group* group = &group_of(handle);
  groups[handle].store(nullptr, std::memory_order_release);
  ::munmap(group->base, group->bytes);
  delete group;
}

at::Tensor shm_all_reduce(const at::Tensor& x, int64_t handle) {
  Group& group = group_of(handle);
  TORCH_CHECK(x.device().is_cpu(), "shm_all_reduce: x must be on the CPU, got ", x.device());
  const at::Tensor input = x.contiguous();
  at::Tensor out = at::empty(input.sizes(), input.options());
  switch (input.scalar_type()) {
    case at::kFloat:
      all_reduce_into<float>(group, input.const_data_ptr<float>(), out.mutable_data_ptr<float>(), input.numel());
      break;
    case at::kBFloat16:
      all_reduce_into<c10::BFloat16>(group, input.const_data_ptr<c10::BFloat16>(),
                                     out.mutable_data_ptr<c10::BFloat16>(), input.numel());
      break;
    case at::kHalf:
      all_reduce_into<c10::Half>(group, input.const_data_ptr<c10::Half>(), out.mutable_data_ptr<c10::Half>(),
                                 input.numel());
      break;
    default:
      TORCH_CHECK(false, "shm_all_reduce: x must be float32, bfloat16 or float16, got ", input.scalar_type());
  }
  return out;
}

at::Tensor shm_all_gather(const at::Tensor& x, int64_t handle) {
  Group& group = group_of(handle);
  TORCH_CHECK(x.device().is_cpu(), "shm_all_gather: x must be on the CPU, got ", x.device());
  const at::Tensor input = x.contiguous();
  std::vector<int64_t> shape{group.world};
  shape.insert(shape.end(), input.sizes().begin(), input.sizes().end());
  at::Tensor out = at::empty(shape, input.options());
  const int64_t total = input.numel() * static_cast<int64_t>(input.element_size());
  const char* source = static_cast<const char*>(input.const_data_ptr());
  char* destination = static_cast<char*>(out.mutable_data_ptr());
  for (int64_t offset = 0; offset < total; offset += group.slot_bytes) {
    const int64_t count = std::min(group.slot_bytes, total - offset);
    const uint64_t sequence_number = exchange_chunk(group, source + offset, count);
    for (int64_t rank = 0; rank < group.world; ++rank) {
      std::memcpy(destination + rank * total + offset, group.slot(sequence_number, rank), count);
    }
  }
  return out;
}

}  // namespace
}  // namespace octavo_cpu

TORCH_LIBRARY_FRAGMENT(octavo_cpu, m) {
  // No tensor arguments: catch-all kernels.
  m.def("shm_group_open(str path, int rank, int world, int slot_bytes, float timeout_s, bool create) -> int",
        &octavo_cpu::shm_group_open);
  m.def("shm_group_peers_alive(int handle) -> bool", &octavo_cpu::shm_group_peers_alive);
  m.def("shm_group_close(int handle) -> ()", &octavo_cpu::shm_group_close);
  m.def("shm_all_reduce(Tensor x, int handle) -> Tensor");
  m.def("shm_all_gather(Tensor x, int handle) -> Tensor");
}

TORCH_LIBRARY_IMPL(octavo_cpu, CPU, m) {
  m.impl("shm_all_reduce", &octavo_cpu::shm_all_reduce);
  m.impl("shm_all_gather", &octavo_cpu::shm_all_gather);
}
