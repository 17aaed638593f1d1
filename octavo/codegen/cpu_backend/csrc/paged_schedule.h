// The schedule of one paged_attention call (paged_attention.cpp): its work items. Prefill and chunked-prefill
// sequences give a tile of query positions per kv head; a decode sequence's context is cut at fixed chunk
// boundaries (kChunkTokens, whole blocks, counted from position 0), one item per chunk covering every kv head (a
// token's rows of all heads lie side by side in the pool, so the item reads them as one run of memory), or, when
// the batch has too few chunks to keep every thread busy that way, one item per (chunk, kv head); a full chunk
// whose blocks several decode sequences share is one shared item for all of them (cascade). Either split runs
// the same arithmetic per (query, chunk), so the results do not depend on it.
#pragma once

#include "paged_attention_types.h"

#include <algorithm>
#include <map>
#include <vector>

namespace octavo_cpu {
namespace paged {

struct DecodeSeq {
  int64_t seq, token, first_chunk, num_chunks, slot;  // slot: index of its first chunk's partial
};

enum class Kind { kPrefill, kChunk, kShared };

struct Item {
  Kind kind;
  int64_t index;  // prefill: sequence; chunk: decode sequence; shared: shared chunk
  int64_t value;  // prefill: first position; chunk: chunk number
  int64_t head;   // kv head, or kAllHeads (decode items only)
};

struct SharedChunk {
  int64_t chunk;
  std::vector<int64_t> members;  // decode sequences
};

struct Schedule {
  std::vector<Item> items;
  std::vector<DecodeSeq> decodes;
  std::vector<SharedChunk> shared;
  int64_t num_slots = 0;
};

inline int64_t chunk_tokens(int64_t block_size) { return round_up(std::max(kChunkTokens, block_size), block_size); }

// Decode items of chunk (d, c): one for every kv head, or one per head.
inline void add_decode_items(std::vector<Item>& items, Kind kind, int64_t index, int64_t c, int64_t num_kv_heads,
                             bool whole) {
  if (whole) {
    items.push_back({kind, index, c, kAllHeads});
    return;
  }
  for (int64_t h = 0; h < num_kv_heads; ++h) items.push_back({kind, index, c, h});
}

inline Schedule plan(const Problem& p, const int32_t* seq_lens, const int32_t* starts, int64_t batch,
                     int64_t threads) {
  Schedule schedule;
  const int64_t chunk = chunk_tokens(p.block_size), blocks_per_chunk = chunk / p.block_size;
  std::map<std::vector<int32_t>, std::vector<std::pair<int64_t, int64_t>>> full_chunks;  // blocks -> (decode, chunk)
  std::vector<Item> prefill, single;
  std::vector<std::pair<int64_t, int64_t>> unshared;  // (decode, chunk) of chunks that are not full
  const int64_t rows_per_item = std::max<int64_t>(1, kPrefillRows / p.group);
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t q_len = starts[b + 1] - starts[b], seq_len = seq_lens[b];
    if (q_len == 0 || (p.computed_elsewhere != nullptr && p.computed_elsewhere[b])) continue;
    if (q_len > 1) {
      for (int64_t i = 0; i < q_len; i += rows_per_item) {
        for (int64_t h = 0; h < p.num_kv_heads; ++h) prefill.push_back({Kind::kPrefill, b, seq_len - q_len + i, h});
      }
      continue;
    }
    const int64_t position = seq_len - 1;
    const int64_t lowest = p.window > 0 ? std::max<int64_t>(0, position - p.window + 1) : 0;
    DecodeSeq decode{b, starts[b], lowest / chunk, position / chunk - lowest / chunk + 1, schedule.num_slots};
    schedule.num_slots += decode.num_chunks;
    const int64_t d = static_cast<int64_t>(schedule.decodes.size());
    for (int64_t c = decode.first_chunk; c < decode.first_chunk + decode.num_chunks; ++c) {
      if (c * chunk >= lowest && (c + 1) * chunk <= seq_len) {
        const int32_t* row = p.block_tables + b * p.table_stride + c * blocks_per_chunk;
        full_chunks[std::vector<int32_t>(row, row + blocks_per_chunk)].emplace_back(d, c);
      } else {
        unshared.emplace_back(d, c);
      }
    }
    schedule.decodes.push_back(decode);
  }
  const bool whole = schedule.num_slots >= kChunksPerThreadForWholeItems * threads;
  for (auto [d, c] : unshared) add_decode_items(single, Kind::kChunk, d, c, p.num_kv_heads, whole);
  std::vector<Item> shared;
  for (auto& [blocks, users] : full_chunks) {
    if (users.size() == 1) {
      add_decode_items(single, Kind::kChunk, users[0].first, users[0].second, p.num_kv_heads, whole);
      continue;
    }
    SharedChunk group{users[0].second, {}};
    for (auto& [d, c] : users) group.members.push_back(d);
    // A block sits at one table position in every sequence (its hash covers its prefix), so c agrees; the
    // partial does not depend on it anyway: a full chunk has no mask.
    const int64_t index = static_cast<int64_t>(schedule.shared.size());
    schedule.shared.push_back(std::move(group));
    add_decode_items(shared, Kind::kShared, index, 0, p.num_kv_heads, whole);
  }
  // Largest items first, so that the last ones to finish are small: prefill tiles by how many keys they
  // attend (their last position), then shared chunks, then chunks of one sequence.
  std::stable_sort(prefill.begin(), prefill.end(), [](const Item& a, const Item& b) { return a.value > b.value; });
  for (auto* part : {&prefill, &shared, &single}) schedule.items.insert(schedule.items.end(), part->begin(), part->end());
  return schedule;
}

// plan() reads only these: the problem's block size, window, kv heads and group, the batch's lengths, query
// starts, which sequences another kernel attends, the table entries of the blocks its sequences use, and the
// thread count.
inline std::vector<int64_t> plan_inputs(const Problem& p, const int32_t* seq_lens, const int32_t* starts,
                                        int64_t batch, int64_t threads) {
  std::vector<int64_t> key{p.block_size, p.window, p.num_kv_heads, p.group, batch, threads};
  key.insert(key.end(), seq_lens, seq_lens + batch);
  key.insert(key.end(), starts, starts + batch + 1);
  key.push_back(p.computed_elsewhere != nullptr);
  if (p.computed_elsewhere != nullptr) key.insert(key.end(), p.computed_elsewhere, p.computed_elsewhere + batch);
  for (int64_t b = 0; b < batch; ++b) {
    const int32_t* row = p.block_tables + b * p.table_stride;
    key.insert(key.end(), row, row + (seq_lens[b] + p.block_size - 1) / p.block_size);
  }
  return key;
}

// plan(), remembered per calling thread: every layer of a model step attends the same batch through the same
// block tables, so the step's first call plans and the other layers reuse its schedule (planning a 64-sequence
// decode batch costs about as much as a tenth of its attention). The schedule is a function of plan_inputs,
// compared in full, so a reused schedule is the one plan() would return.
inline const Schedule& cached_plan(const Problem& p, const int32_t* seq_lens, const int32_t* starts, int64_t batch,
                                   int64_t threads) {
  thread_local std::vector<int64_t> last_inputs;
  thread_local Schedule last;
  std::vector<int64_t> inputs = plan_inputs(p, seq_lens, starts, batch, threads);
  if (inputs != last_inputs) {
    last = plan(p, seq_lens, starts, batch, threads);
    last_inputs = std::move(inputs);
  }
  return last;
}

}  // namespace paged
}  // namespace octavo_cpu
