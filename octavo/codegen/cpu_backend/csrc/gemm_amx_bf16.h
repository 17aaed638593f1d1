// The AMX GEMM of octavo_cpu::linear_bf16 (AVX-512 build, CPUs with AMX-BF16): out [M, N] = x [M, K] @ W.T
// (+ bias), W packed (bf16_packing.h).
//
// TDPBF16PS multiplies A [16 rows, 32 bfloat16] by B [16 pairs, 16 columns of pairs] into C [16, 16] float32,
// each product exact, summed in float32. x (row-major, its K padded to whole tiles) is A; a packed block is B
// as it lies (16 pairs of rows of 32 words: two B tiles side by side). A thread takes whole blocks and runs
// every 32-row tile of x through each: 2 x 2 C tiles (32 rows of x by the block's 32 columns) over the whole K,
// the other four tiles holding two of A and two of B. The block's words are reused from the cache by every
// tile of x, the rows of x are streamed (asked for with the non-temporal hint, so that they do not push the
// block out).
#pragma once

#include "bf16_packing.h"
#include "vec_utils.h"

#if defined(CPU_CAPABILITY_AVX512)
#include <ATen/cpu/Utils.h>
#include <immintrin.h>

#include <cstring>
#include <new>
#include <vector>

namespace octavo_cpu {

constexpr int64_t kAmxRows = 32;  // rows of x per block of C

// The allocator of the buffers tiles are loaded from and stored to: each starts on a cache line, so that a tile's
// 64-byte rows do too (a std::vector's 16-byte start splits every row over two lines: twice the lines to move).
template <typename T>
struct LineAligned {
  using value_type = T;
  LineAligned() = default;
  template <typename U>
  LineAligned(const LineAligned<U>&) {}
  T* allocate(std::size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t(64))); }
  void deallocate(T* p, std::size_t) { ::operator delete(p, std::align_val_t(64)); }
  template <typename U>
  bool operator==(const LineAligned<U>&) const { return true; }
  template <typename U>
  bool operator!=(const LineAligned<U>&) const { return false; }
};

template <typename T>
using TileVector = std::vector<T, LineAligned<T>>;

// Whether AMX-BF16 runs in this process (the CPU has it and Linux granted the tile state; asked once).
inline bool amx_bf16_usable() {
  static const bool usable = __builtin_cpu_supports("amx-bf16") && at::cpu::init_amx();
  return usable;
}

// The one tile configuration: eight tiles of 16 rows of 64 bytes (palette 1).
struct alignas(64) AmxConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
  AmxConfig() {
    for (int t = 0; t < 8; ++t) {
      bytes_per_row[t] = 64;
      rows[t] = 16;
    }
  }
};

__attribute__((target("amx-tile"))) inline void amx_configure(const AmxConfig& config) { _tile_loadconfig(&config); }
__attribute__((target("amx-tile"))) inline void amx_release() { _tile_release(); }

// sums [32 rows of a][32 columns] (+)= the 32 rows at `a` (ld `lda` elements) times `pairs` pairs of rows of the
// block at `words`: the sums start from zero when `accumulate` is false, from `sums` otherwise. The rows of `a` are
// loaded with the streaming hint unless `kKeepRows` (rows that other calls read again right after).
template <bool kKeepRows = false>
__attribute__((target("amx-tile,amx-bf16"))) inline void amx_block(const c10::BFloat16* a, int64_t lda,
                                                                   const uint32_t* words, int64_t pairs,
                                                                   float* sums, bool accumulate) {
  const int64_t a_stride = lda * 2, b_stride = kBf16BlockColumns * 4, c_stride = kBf16BlockColumns * 4;
  const c10::BFloat16* a_high = a + 16 * lda;
  if (accumulate) {
    _tile_loadd(0, sums, c_stride);
    _tile_loadd(1, sums + 16, c_stride);
    _tile_loadd(2, sums + 16 * kBf16BlockColumns, c_stride);
    _tile_loadd(3, sums + 16 * kBf16BlockColumns + 16, c_stride);
  } else {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
  }
  for (int64_t p = 0; p < pairs; p += 16) {
    const uint32_t* b = words + p * kBf16BlockColumns;
    if constexpr (kKeepRows) {
      _tile_loadd(4, a + 2 * p, a_stride);
      _tile_loadd(5, a_high + 2 * p, a_stride);
    } else {
      _tile_stream_loadd(4, a + 2 * p, a_stride);
      _tile_stream_loadd(5, a_high + 2 * p, a_stride);
    }
    _tile_loadd(6, b, b_stride);
    _tile_loadd(7, b + 16, b_stride);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, sums, c_stride);
  _tile_stored(1, sums + 16, c_stride);
  _tile_stored(2, sums + 16 * kBf16BlockColumns, c_stride);
  _tile_stored(3, sums + 16 * kBf16BlockColumns + 16, c_stride);
}

// Pairs of a block's rows multiplied per sweep over the tiles of x: the whole block up to 24 KiB of words, else
// equal parts of at most 16 KiB, whole tiles deep; each part stays in L1 for every tile of x (whose rows stream
// past it) while the tiles' sums wait in memory. Measured on SmolLM2's shapes at 64 rows (AMX Xeon, one thread):
// parts of 16 KiB 0.65-0.69x oneDNN's time on its prepacked weights, 32 KiB 0.77-0.79x, 64 KiB 0.71x.
inline int64_t amx_chunk_pairs(int64_t pairs) {
  if (pairs * kBf16BlockColumns * 4 <= 24 * 1024) return pairs;
  const int64_t most = 16 * 1024 / (kBf16BlockColumns * 4), chunks = (pairs + most - 1) / most;
  return round_up((pairs + chunks - 1) / chunks, 16);
}

// out[r, n0 + c] = T(sums[r * 32 + c] + bias[n0 + c]) for r < rows, c < columns (T bfloat16: rounded to nearest
// even; T float: as summed).
template <typename T>
inline void store_sums(const float* sums, int64_t rows, int64_t columns, const float* bias, int64_t n0, T* out,
                       int64_t N) {
  __at_align__ float row[kBf16BlockColumns];
  for (int64_t r = 0; r < rows; ++r) {
    const float* source = sums + r * kBf16BlockColumns;
    if (bias) {
      for (int64_t c = 0; c < columns; c += kLanes) {
        const int64_t count = std::min(kLanes, columns - c);
        (Vec::loadu(source + c) + Vec::loadu(bias + n0 + c, count)).store(row + c);
      }
      source = row;
    }
    at::vec::convert(source, out + r * N + n0, columns);
  }
}

// The last tile of x [M, lda] zero-padded to 32 rows when M is no multiple of 32 (A tiles read 16 whole rows), else
// empty.
inline TileVector<c10::BFloat16> amx_last_tile(const c10::BFloat16* x, int64_t lda, int64_t M) {
  TileVector<c10::BFloat16> last_tile;
  const int64_t tail = M % kAmxRows;
  if (tail != 0) {
    last_tile.assign(kAmxRows * lda, c10::BFloat16(0.f));
    std::memcpy(last_tile.data(), x + (M - tail) * lda, tail * lda * sizeof(c10::BFloat16));
  }
  return last_tile;
}

// out [M, N] = x [M, lda] @ W.T (+ bias), x's columns padded with zeros to 2 * w.pairs (lda >= that).
inline void gemm_amx_bf16(const PackedBf16& w, const float* bias, const c10::BFloat16* x, int64_t lda, int64_t M,
                          c10::BFloat16* out) {
  const int64_t tiles = (M + kAmxRows - 1) / kAmxRows;
  const TileVector<c10::BFloat16> last_tile = amx_last_tile(x, lda, M);
  const int64_t chunk = amx_chunk_pairs(w.pairs);
  at::parallel_for(0, w.blocks, 1, [&](int64_t begin, int64_t end) {
    const AmxConfig config;
    amx_configure(config);
    TileVector<float> sums(tiles * kAmxRows * kBf16BlockColumns);
    for (int64_t b = begin; b < end; ++b) {
      const int64_t n0 = b * kBf16BlockColumns, columns = std::min(kBf16BlockColumns, w.N - n0);
      for (int64_t first = 0; first < w.pairs; first += chunk) {
        const int64_t count = std::min(chunk, w.pairs - first);
        for (int64_t t = 0; t < tiles; ++t) {
          const c10::BFloat16* a = t * kAmxRows + kAmxRows > M ? last_tile.data() : x + t * kAmxRows * lda;
          amx_block(a + 2 * first, lda, w.block(b) + first * kBf16BlockColumns, count,
                    sums.data() + t * kAmxRows * kBf16BlockColumns, first > 0);
        }
      }
      for (int64_t t = 0; t < tiles; ++t) {
        store_sums(sums.data() + t * kAmxRows * kBf16BlockColumns, std::min(kAmxRows, M - t * kAmxRows), columns,
                   bias, n0, out + t * kAmxRows * w.N, w.N);
      }
    }
    amx_release();
  });
}

}  // namespace octavo_cpu
#endif
