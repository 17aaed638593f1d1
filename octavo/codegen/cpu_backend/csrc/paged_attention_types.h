// Shapes, scratch and pool addressing shared by the paged-attention kernels (paged_attention.cpp, paged_decode.h,
// paged_prefill.h).
#pragma once

#include "vec_utils.h"

#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

namespace octavo_cpu {
namespace paged {

constexpr int64_t kChunkTokens = 64;  // decode chunk length (rounded up to whole blocks)
constexpr int64_t kKeyTile = 32;      // keys per prefill tile
constexpr int64_t kPrefillRows = 96;  // query rows (positions x heads of a group) per prefill work item
constexpr int64_t kAllHeads = -1;     // Item::head of a decode item that covers every kv head
// Decode items cover every kv head once the batch has this many chunks per thread (else one item per head,
// so that a short batch still spreads over the threads).
constexpr int64_t kChunksPerThreadForWholeItems = 4;
// Lines of the next item asked for per group of kLanes keys scored, and per value row accumulated (Lookahead).
constexpr int kLookaheadPerScoredGroup = 8, kLookaheadPerValueRow = 2;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
static_assert(kKeyTile % kLanes == 0, "a key tile is whole vectors");

#if defined(CPU_CAPABILITY_AVX512)
// Two rows of 32 bfloat16 as VNNI words, the pairs vdpbf16ps multiplies: low[i] = (even[i], odd[i]) and
// high[i] = (even[16 + i], odd[16 + i]) for i < 16, the even row's value in the low half of each word.
__attribute__((always_inline)) inline void interleave_bf16_rows(const uint16_t* even, const uint16_t* odd,
                                                                 __m512i& low, __m512i& high) {
  alignas(64) static constexpr uint16_t kLow[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                                  8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  alignas(64) static constexpr uint16_t kHigh[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
                                                   24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
  const __m512i a = _mm512_loadu_si512(even), b = _mm512_loadu_si512(odd);
  low = _mm512_permutex2var_epi16(a, _mm512_load_si512(kLow), b);
  high = _mm512_permutex2var_epi16(a, _mm512_load_si512(kHigh), b);
}
#endif

// How a decode chunk's int8 rows meet a bfloat16 model's queries (paged_decode_int8.h): widened to float, or as
// int16 pairs by vpmaddwd or by AVX512_VNNI's vpdpwssd (the same int32 sums).
enum class Int8Dot { kFloat, kMadd, kVnni };

template <typename T>
constexpr bool kQuantized = std::is_same_v<T, int8_t> || std::is_same_v<T, c10::Float8_e4m3fn>;

// One paged pool [num_blocks, block_size, Hkv, D], with its scales [num_blocks, block_size, Hkv] if quantized.
struct Pool {
  void* data = nullptr;
  int64_t block_stride = 0, token_stride = 0, head_stride = 0;
  float* scales = nullptr;
  int64_t scale_block_stride = 0, scale_token_stride = 0, scale_head_stride = 0;
};

// Pool rows of positions [begin, begin + n) of kv head `head`: pointers to their CT values, held as Row
// (an untyped pointer, or one to the values' raw bits).
template <typename CT, typename Row = const void*>
void row_pointers(const Pool& pool, const int32_t* blocks, int64_t block_size, int64_t begin, int64_t n, int64_t head,
                  std::vector<Row>& rows) {
  rows.resize(n);
  const CT* base = static_cast<const CT*>(pool.data) + head * pool.head_stride;
  int64_t block = begin / block_size, offset = begin % block_size;
  const CT* start = base + blocks[block] * pool.block_stride;
  for (int64_t j = 0; j < n; ++j) {  // block by block: no division per row
    if (offset == block_size) {
      offset = 0;
      start = base + blocks[++block] * pool.block_stride;
    }
    rows[j] = reinterpret_cast<Row>(start + offset++ * pool.token_stride);
  }
}

struct Problem {
  int64_t num_heads, num_kv_heads, group, head_dim, value_dim, padded_dim, padded_value_dim, block_size;
  float scale;
  int64_t window;
  const int32_t* block_tables;
  int64_t table_stride;
  const float* query;  // [T, Hq, padded_dim], zero past head_dim
  float* output;       // [T, Hq, padded_value_dim]
  Pool keys, values;
  bool bf16_queries = false;  // every query value is a bf16 number (the query tensor is bfloat16)
  Int8Dot int8_dot = Int8Dot::kFloat;  // int8 caches under bf16 queries: how decode chunks compute
  float soft_cap = 0.f;       // scores s become soft_cap * tanh(s / soft_cap) when positive
  const uint8_t* computed_elsewhere = nullptr;  // per sequence: 1 where another kernel attends it (no items)
  int64_t record_size() const { return padded_value_dim + kLanes; }  // partial: o[padded_value_dim], m, l
};

// The cache lines of the next work item, asked for a few at a time from inside the current item's loops: its
// loads then overlap this item's arithmetic, where asking for them all at once stalls the core until the
// requests drain (a core keeps only a few dozen misses in flight). They go to L2 only: a whole next item (for
// SmolLM2 in bf16, 64 tokens x 3 heads x 64 dims x 2 bytes = 24 KB each of K and V) would push the current
// item's rows out of a 48 KB L1. The lines are runs of equally spaced rows.
class Lookahead {
 public:
  void clear() {
    runs_.clear();
    run_ = 0;
    row_ = offset_ = 0;
  }
  // `rows` rows of `row_bytes` bytes, `stride` bytes apart, from `first`.
  void add(const void* first, int64_t rows, int64_t stride, int64_t row_bytes) {
    if (rows > 0) runs_.push_back({static_cast<const char*>(first), rows, stride, row_bytes});
  }
  // Asks for the next `lines` cache lines, if any are left.
  __attribute__((always_inline)) void step(int lines) {
    for (int i = 0; i < lines && run_ < runs_.size(); ++i) {
      const Run& run = runs_[run_];
      __builtin_prefetch(run.first + row_ * run.stride + offset_, 0, 1);  // prefetcht2: L2, not L1
      offset_ += 64;
      if (offset_ >= run.row_bytes) {
        offset_ = 0;
        if (++row_ == run.rows) {
          row_ = 0;
          ++run_;
        }
      }
    }
  }
  // Asks for every line not asked for yet.
  void finish() {
    while (run_ < runs_.size()) step(64);
  }

 private:
  struct Run {
    const char* first;
    int64_t rows, stride, row_bytes;
  };
  std::vector<Run> runs_;
  size_t run_ = 0;
  int64_t row_ = 0, offset_ = 0;
};

struct Scratch {
  std::vector<float> scores, key_row, key_tile, value_tile, row_max, row_sum, factors, accumulators, merged;
  std::vector<const float*> queries, key_rows, value_rows;
  std::vector<const void*> key_sources, value_sources;
  std::vector<float> key_scales, value_scales;  // per row of the chunk, for quantized caches
  std::vector<float*> records;
  std::vector<int64_t> finished;  // decode sequences whose chunk partial the last item wrote
  std::vector<uint16_t> bf16_queries;       // decode queries as bfloat16 bits, for dpbf16 scoring
  std::vector<const uint16_t*> dot_queries;  // per query: its bfloat16 bits, nullptr where not exact
  std::vector<uint32_t> weight_pairs;        // softmax weights as bfloat16 pairs, for dpbf16 weighting
  std::vector<int16_t> int16_queries;        // decode queries as int16, for int8 rows (paged_decode_int8.h)
  std::vector<float> query_steps;            // per query: the step of its int16 values
  std::vector<int16_t> int16_weights;        // softmax weights as int16, for int8 value rows
  Lookahead ahead;                           // the next decode item's K and V lines
};

}  // namespace paged
}  // namespace octavo_cpu
