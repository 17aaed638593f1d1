// octavo_cpu::paged_attention: the KV-cache write and causal attention of a flattened varlen batch over a
// paged KV cache, read in place through the block table (semantics: octavo.ir.ops.attention.paged_attention).
//
// Decode (one query token): every context is cut at fixed chunk boundaries (kChunkTokens, whole blocks,
// counted from position 0). Each (sequence, kv head, chunk) yields a partial (max, exp-sum, weighted sum)
// for the group's query heads, so every K/V row is loaded once per group; the partials of a sequence are
// merged by log-sum-exp in chunk order. Float, 16-bit and int8 rows of whole vectors are read in place
// (paged_decode.h); other rows are widened into a float tile first. A full chunk whose blocks several
// decode sequences share (prefix caching) is computed once for all of them (cascade): the arithmetic of
// each query is the same code in the same order either way, so results are bitwise equal with or without
// sharing, and equal whatever else is in the batch.
// Prefill and chunked prefill (several query tokens): flash attention over key tiles with an online
// softmax, one work item per (sequence, kv head, tile of query positions) (paged_prefill.h); on CPUs with
// AMX, long enough prefills take ATen's flash attention instead (prefill_aten.h).
// All work items of a call share one pool of threads, handed out one at a time.
#include "paged_cache_write.h"
#include "paged_decode.h"
#include "paged_prefill.h"
#include "paged_schedule.h"
#include "prefill_aten.h"
#include "vec_utils.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace octavo_cpu {
namespace {

using namespace paged;  // the kernels' shapes and the in-place decode kernel

// Float rows (length `padded`, zero past `dim`) of positions [begin, begin + n) of one kv head: pointers into
// the pool itself when it already holds such rows (float32, dim a multiple of the vector width), else into
// `tile`, filled here.
template <typename CT>
void gather_rows(const Pool& pool, const int32_t* blocks, int64_t block_size, int64_t begin, int64_t n,
                 int64_t head, int64_t dim, int64_t padded, std::vector<float>& tile,
                 std::vector<const float*>& rows) {
  rows.resize(n);
  if constexpr (std::is_same_v<CT, float>) {
    if (dim == padded) {
      for (int64_t j = 0; j < n; ++j) {
        const int64_t position = begin + j, block = blocks[position / block_size];
        rows[j] = static_cast<const float*>(pool.data) + block * pool.block_stride +
                  (position % block_size) * pool.token_stride + head * pool.head_stride;
      }
      return;
    }
  }
  if (static_cast<int64_t>(tile.size()) < n * padded) tile.resize(n * padded);
  for (int64_t j = 0; j < n; ++j) {
    float* row = tile.data() + j * padded;
    std::fill(row + dim, row + padded, 0.f);
    read_row<CT>(pool, blocks, block_size, begin + j, head, dim, padded, row);
    rows[j] = row;
  }
}

// chunk_partials with every K and V row first widened (and dequantized) into a float tile.
template <typename CT>
void chunk_partials_tiled(const Problem& p, const int32_t* blocks, int64_t head, int64_t begin, int64_t end,
                    const float* const* queries, float* const* records, int64_t nq, Scratch& s) {
  const int64_t n = end - begin, pvd = p.padded_value_dim;
  // Each K and V row is read from the pool (and widened) once for all queries.
  gather_rows<CT>(p.keys, blocks, p.block_size, begin, n, head, p.head_dim, p.padded_dim, s.key_tile, s.key_rows);
  gather_rows<CT>(p.values, blocks, p.block_size, begin, n, head, p.value_dim, pvd, s.value_tile, s.value_rows);
  s.scores.resize(n);
  float* scores = s.scores.data();
  for (int64_t q = 0; q < nq; ++q) {
    score_rows(queries[q], s.key_rows.data(), n, p.scale, scores, p.padded_dim);
    soft_cap_row(scores, n, p.soft_cap);
    const float m = row_max(scores, n);
    records[q][pvd] = m;
    records[q][pvd + 1] = exp_shift_sum(scores, n, m);
    std::fill(records[q], records[q] + pvd, 0.f);
    accumulate(1.f, scores, s.value_rows.data(), n, records[q], pvd);
  }
}

// Partial attention of queries[0:nq] over context positions [begin, end) of kv head `head`: for each query,
// record[0:padded_value_dim] = sum_j exp(s_j - m) v_j, record[pvd] = m = max_j s_j, record[pvd + 1] =
// sum_j exp(s_j - m), with s_j = scale * (q . k_j). One query's arithmetic never depends on the others.
template <typename CT>
void chunk_partials(const Problem& p, const int32_t* blocks, int64_t head, int64_t begin, int64_t end,
                    const float* const* queries, float* const* records, int64_t nq, Scratch& s) {
  if (const ChunkKernel<CT> kernel = direct_kernel<CT>(p)) return kernel(p, blocks, head, begin, end, queries, records, nq, s);
  chunk_partials_tiled<CT>(p, blocks, head, begin, end, queries, records, nq, s);
}

struct Partials {
  float* data;
  int64_t record_size, num_kv_heads, group;
  float* record(int64_t slot, int64_t head, int64_t g) const {
    return data + ((slot * num_kv_heads + head) * group + g) * record_size;
  }
};

struct ChunkRange {
  int64_t seq, begin, end;  // the sequence whose block table the chunk is read through, its positions
};

// The context positions a decode chunk item (kChunk or kShared) attends.
ChunkRange chunk_range(const Problem& p, const Schedule& schedule, const int32_t* seq_lens, const Item& item) {
  const int64_t chunk = chunk_tokens(p.block_size);
  int64_t seq, c;
  if (item.kind == Kind::kChunk) {
    seq = schedule.decodes[item.index].seq;
    c = item.value;
  } else {
    const SharedChunk& group = schedule.shared[item.index];
    seq = schedule.decodes[group.members[0]].seq;
    c = group.chunk;
  }
  const int64_t position = seq_lens[seq] - 1;
  const int64_t lowest = p.window > 0 ? std::max<int64_t>(0, position - p.window + 1) : 0;
  return {seq, std::max(c * chunk, lowest), std::min((c + 1) * chunk, position + 1)};
}

// The kv heads [first, end) of a work item.
std::pair<int64_t, int64_t> item_heads(const Problem& p, const Item& item) {
  if (item.head == kAllHeads) return {0, p.num_kv_heads};
  return {item.head, item.head + 1};
}

template <typename CT>
void run_item(const Problem& p, const Schedule& schedule, const Partials& partials, const int32_t* seq_lens,
              const int32_t* starts, const Item& item, Scratch& s) {
  const int64_t chunk = chunk_tokens(p.block_size);
  if (item.kind == Kind::kPrefill) {
    s.finished.clear();
    const int64_t b = item.index, q_len = starts[b + 1] - starts[b], seq_len = seq_lens[b];
    const int64_t offset = item.value - (seq_len - q_len);
    const int64_t count = std::min(std::max<int64_t>(1, kPrefillRows / p.group), q_len - offset);
    prefill_tile<CT>(p, p.block_tables + b * p.table_stride, item.head, starts[b] + offset, item.value, count, s);
    return;
  }
  auto add_queries = [&](int64_t d, int64_t c, int64_t head) {
    const DecodeSeq& decode = schedule.decodes[d];
    for (int64_t g = 0; g < p.group; ++g) {
      s.queries.push_back(p.query + (decode.token * p.num_heads + head * p.group + g) * p.padded_dim);
      s.records.push_back(partials.record(decode.slot + c - decode.first_chunk, head, g));
    }
  };
  s.finished.clear();
  if (item.kind == Kind::kChunk) {
    s.finished.push_back(item.index);
  } else {
    s.finished = schedule.shared[item.index].members;
  }
  const int64_t c = item.kind == Kind::kChunk ? item.value : schedule.shared[item.index].chunk;
  const ChunkRange range = chunk_range(p, schedule, seq_lens, item);
  const auto [first_head, end_head] = item_heads(p, item);
  for (int64_t head = first_head; head < end_head; ++head) {
    s.queries.clear();
    s.records.clear();
    for (int64_t d : s.finished) add_queries(d, c, head);
    chunk_partials<CT>(p, p.block_tables + range.seq * p.table_stride, head, range.begin, range.end,
                       s.queries.data(), s.records.data(), static_cast<int64_t>(s.queries.size()), s);
  }
}

// Queues (s.ahead) the K and V lines a decode item will read, for the item before it to ask for while it runs (a
// prefill item reads its keys tile by tile).
template <typename CT>
void prefetch_item(const Problem& p, const Schedule& schedule, const int32_t* seq_lens, const Item& item,
                   Scratch& s) {
  s.ahead.clear();
  if (item.kind == Kind::kPrefill || direct_kernel<CT>(p) == nullptr) return;
  const ChunkRange range = chunk_range(p, schedule, seq_lens, item);
  const int32_t* blocks = p.block_tables + range.seq * p.table_stride;
  const auto [first_head, end_head] = item_heads(p, item);
  constexpr int64_t bytes = sizeof(CT);
  if constexpr (kQuantized<CT>) {  // the rows' scales first: the chunk reads them before any row
    for (const Pool* pool : {&p.keys, &p.values}) {
      for (int64_t position = range.begin; position < range.end;) {
        const int64_t block = position / p.block_size, last = std::min(range.end, (block + 1) * p.block_size);
        const float* first = pool->scales + blocks[block] * pool->scale_block_stride +
                             (position % p.block_size) * pool->scale_token_stride + first_head * pool->scale_head_stride;
        // One run over the segment's span, from its first line (other heads' scales between come along).
        const float* end = first + (last - 1 - position) * pool->scale_token_stride +
                           (end_head - 1 - first_head) * pool->scale_head_stride + 1;
        const char* line = reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(first) & ~uintptr_t{63});
        s.ahead.add(line, 1, 0, reinterpret_cast<const char*>(end) - line);
        position = last;
      }
    }
  }
  for (const Pool* pool : {&p.keys, &p.values}) {
    const int64_t row_bytes = (pool == &p.keys ? p.head_dim : p.value_dim) * bytes;
    const int64_t stride = pool->token_stride * bytes, heads = end_head - first_head;
    // Token-major rows (a token's heads side by side): the item's heads of a token are one row.
    const bool side_by_side = pool->head_stride * bytes == row_bytes;
    for (int64_t position = range.begin; position < range.end;) {
      const int64_t block = position / p.block_size, last = std::min(range.end, (block + 1) * p.block_size);
      const char* token = static_cast<const char*>(pool->data) +
                          (blocks[block] * pool->block_stride + (position % p.block_size) * pool->token_stride) * bytes;
      if (side_by_side) {
        s.ahead.add(token + first_head * row_bytes, last - position, stride, heads * row_bytes);
      } else {
        for (int64_t head = first_head; head < end_head; ++head) {
          s.ahead.add(token + head * pool->head_stride * bytes, last - position, stride, row_bytes);
        }
      }
      position = last;
    }
  }
}

// Merge one decode sequence's chunk partials of one kv head, in chunk order: softmax over the union of the
// chunks. `acc` is scratch of padded_value_dim floats.
void merge_decode(const Problem& p, const DecodeSeq& decode, int64_t head, const Partials& partials, float* acc) {
  const int64_t pvd = p.padded_value_dim;
  for (int64_t g = 0; g < p.group; ++g) {
    float best = kNegInf;
    for (int64_t c = 0; c < decode.num_chunks; ++c) best = std::max(best, partials.record(decode.slot + c, head, g)[pvd]);
    float total = 0.f;
    std::fill(acc, acc + pvd, 0.f);
    for (int64_t c = 0; c < decode.num_chunks; ++c) {
      const float* record = partials.record(decode.slot + c, head, g);
      const float weight = std::exp(record[pvd] - best);
      total += weight * record[pvd + 1];
      axpy(weight, record, acc, pvd);
    }
    float* out = p.output + (decode.token * p.num_heads + head * p.group + g) * pvd;
    const Vec sum(total);
    for (int64_t i = 0; i < pvd; i += kLanes) (Vec::loadu(acc + i) / sum).store(out + i);
  }
}

// All work items in one parallel region: the thread that writes the last chunk partial of a (decode
// sequence, kv head) merges them (the counter's acquire-release orders the other threads' writes before it).
// While an item runs, its loops ask for the lines of the item this thread runs next (Scratch::ahead).
template <typename CT>
void attend(const Problem& p, const int32_t* seq_lens, const int32_t* starts, int64_t batch) {
  const Schedule& schedule = cached_plan(p, seq_lens, starts, batch, at::get_num_threads());
  const int64_t record_size = p.record_size();
  std::vector<float> storage(schedule.num_slots * p.num_kv_heads * p.group * record_size);
  const Partials partials{storage.data(), record_size, p.num_kv_heads, p.group};
  std::vector<std::atomic<int32_t>> remaining(schedule.decodes.size() * p.num_kv_heads);
  for (size_t index = 0; index < remaining.size(); ++index) {
    remaining[index].store(static_cast<int32_t>(schedule.decodes[index / p.num_kv_heads].num_chunks),
                           std::memory_order_relaxed);
  }
  const auto body = [&](int64_t index, Scratch& scratch) {
    const Item& item = schedule.items[index];
    run_item<CT>(p, schedule, partials, seq_lens, starts, item, scratch);
    scratch.ahead.finish();
    const auto [first_head, end_head] = item_heads(p, item);
    for (int64_t d : scratch.finished) {
      for (int64_t head = first_head; head < end_head; ++head) {
        if (remaining[d * p.num_kv_heads + head].fetch_sub(1, std::memory_order_acq_rel) == 1) {
          scratch.merged.resize(p.padded_value_dim);
          merge_decode(p, schedule.decodes[d], head, partials, scratch.merged.data());
        }
      }
    }
  };
  const auto prefetch = [&](int64_t index, Scratch& scratch) {
    prefetch_item<CT>(p, schedule, seq_lens, schedule.items[index], scratch);
  };
  for_each_item_ahead<Scratch>(static_cast<int64_t>(schedule.items.size()), body, prefetch);
}

// ---- argument checks ----------------------------------------------------------------------------------

Pool make_pool(const at::Tensor& cache, const std::optional<at::Tensor>& scales, const char* name) {
  TORCH_CHECK(cache.dim() == 4, "paged_attention: ", name, " must be [num_blocks, block_size, kv_heads, head_dim], got ",
              cache.sizes());
  TORCH_CHECK(cache.stride(3) == 1, "paged_attention: ", name, "'s last dim must be contiguous");
  Pool pool{cache.data_ptr(), cache.stride(0), cache.stride(1), cache.stride(2)};
  const bool quantized = cache.scalar_type() == at::kChar || cache.scalar_type() == at::kFloat8_e4m3fn;
  if (!quantized) {
    TORCH_CHECK(!scales.has_value(), "paged_attention: ", name, " is ", cache.scalar_type(),
                ": scale caches are only for int8 and float8_e4m3fn caches");
    return pool;
  }
  TORCH_CHECK(scales.has_value(), "paged_attention: an ", cache.scalar_type(), " ", name,
              " needs its scale cache (float32 [num_blocks, block_size, kv_heads])");
  const at::Tensor& s = *scales;
  TORCH_CHECK(s.scalar_type() == at::kFloat && s.dim() == 3 && s.size(0) == cache.size(0) &&
                  s.size(1) == cache.size(1) && s.size(2) == cache.size(2),
              "paged_attention: the scale cache of ", name, " must be float32 ", cache.sizes().slice(0, 3), ", got ",
              s.scalar_type(), " ", s.sizes());
  pool.scales = s.data_ptr<float>();
  pool.scale_block_stride = s.stride(0);
  pool.scale_token_stride = s.stride(1);
  pool.scale_head_stride = s.stride(2);
  return pool;
}

void check_tables(const int32_t* seq_lens, const int32_t* starts, const int32_t* tables, int64_t batch,
                  int64_t table_stride, int64_t max_blocks, int64_t block_size, int64_t num_blocks, int64_t num_tokens) {
  TORCH_CHECK(starts[0] >= 0 && starts[batch] <= num_tokens, "paged_attention: query_start_loc spans [", starts[0],
              ", ", starts[batch], ") but there are ", num_tokens, " tokens");
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t q_len = starts[b + 1] - starts[b], seq_len = seq_lens[b];
    TORCH_CHECK(q_len >= 0, "paged_attention: query_start_loc decreases at sequence ", b);
    if (q_len == 0) continue;
    TORCH_CHECK(seq_len >= q_len, "paged_attention: sequence ", b, " has ", q_len, " query tokens but seq_len ",
                seq_len);
    const int64_t needed = (seq_len + block_size - 1) / block_size;
    TORCH_CHECK(needed <= max_blocks, "paged_attention: sequence ", b, " needs ", needed,
                " blocks but block_tables has ", max_blocks, " columns");
    for (int64_t i = 0; i < needed; ++i) {
      const int64_t block = tables[b * table_stride + i];
      TORCH_CHECK(block >= 0 && block < num_blocks, "paged_attention: block_tables[", b, ", ", i, "] = ", block,
                  " is outside the cache's ", num_blocks, " blocks");
    }
  }
}

// t as a contiguous tensor of `type`: t itself where it already is one (without a dispatcher call: a decode
// step's index tensors are, and four .to().contiguous() a layer were a measurable share of a small model's step).
at::Tensor contiguous_as(const at::Tensor& t, at::ScalarType type) {
  return t.scalar_type() == type && t.is_contiguous() ? t : t.to(type).contiguous();
}

template <typename F>
void dispatch_cache_type(at::ScalarType type, const F& body) {
  switch (type) {
    case at::kFloat: return body(float{});
    case at::kBFloat16: return body(c10::BFloat16{});
    case at::kHalf: return body(c10::Half{});
    case at::kChar: return body(int8_t{});
    case at::kFloat8_e4m3fn: return body(c10::Float8_e4m3fn{});
    default: TORCH_CHECK(false, "paged_attention: unsupported KV cache dtype ", type);
  }
}

constexpr int64_t kConvertRowsPerTask = 256;  // rows a task widens or narrows: a decode step's few run inline

// t [tokens, heads, dim] (float, bfloat16 or float16; its last dim contiguous, the others any stride) as float
// rows of `padded` values, zero past dim. The conversion runs here rather than through ATen's copy: at a decode
// step's handful of rows the dispatch of .to() and .contiguous() cost more than the conversion itself.
at::Tensor padded_float(const at::Tensor& t, int64_t padded) {
  if (t.stride(2) != 1) return padded_float(t.contiguous(), padded);
  const int64_t heads = t.size(1), dim = t.size(2), rows = t.size(0) * heads;
  at::Tensor result = at::empty({t.size(0), heads, padded}, t.options().dtype(at::kFloat));
  float* out = result.data_ptr<float>();
  const int64_t token_stride = t.stride(0), head_stride = t.stride(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, t.scalar_type(), "padded_float", [&] {
    const scalar_t* data = t.const_data_ptr<scalar_t>();
    at::parallel_for(0, rows, kConvertRowsPerTask, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        float* row = out + r * padded;
        widen<scalar_t>(data + (r / heads) * token_stride + (r % heads) * head_stride, dim, row);
        std::fill(row + dim, row + padded, 0.f);
      }
    });
  });
  return result;
}

// The first `dim` values of each float row of `padded` (rows [tokens, heads]) as a contiguous [tokens, heads, dim]
// tensor of `dtype`, rounded to nearest even as ATen's .to() rounds.
at::Tensor narrowed_rows(const at::Tensor& rows_f, int64_t dim, at::ScalarType dtype) {
  const int64_t heads = rows_f.size(1), padded = rows_f.size(2), rows = rows_f.size(0) * heads;
  at::Tensor result = at::empty({rows_f.size(0), heads, dim}, rows_f.options().dtype(dtype));
  const float* in = rows_f.const_data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, "narrowed_rows", [&] {
    scalar_t* out = result.data_ptr<scalar_t>();
    at::parallel_for(0, rows, kConvertRowsPerTask, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) at::vec::convert(in + r * padded, out + r * dim, dim);
    });
  });
  return result;
}

at::Tensor paged_attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                           at::Tensor& key_cache, at::Tensor& value_cache, const at::Tensor& slot_mapping_in,
                           const at::Tensor& block_tables_in, const at::Tensor& seq_lens_in,
                           const at::Tensor& query_start_loc_in, double scale, int64_t sliding_window,
                           const std::optional<at::Tensor>& key_scale_cache,
                           const std::optional<at::Tensor>& value_scale_cache, double soft_cap) {
  TORCH_CHECK(query.device().is_cpu(), "octavo_cpu::paged_attention runs on CPU tensors");
  TORCH_CHECK(query.dim() == 3 && key.dim() == 3 && value.dim() == 3,
              "paged_attention: query, key and value must be [tokens, heads, head_dim]");
  const int64_t num_tokens = query.size(0), num_heads = query.size(1), head_dim = query.size(2);
  const int64_t num_kv_heads = key.size(1), value_dim = value.size(2);
  TORCH_CHECK(key.size(0) == num_tokens && value.size(0) == num_tokens && value.size(1) == num_kv_heads &&
                  key.size(2) == head_dim,
              "paged_attention: key ", key.sizes(), " and value ", value.sizes(), " do not fit query ", query.sizes());
  TORCH_CHECK(num_kv_heads > 0 && num_heads % num_kv_heads == 0, "paged_attention: ", num_heads,
              " query heads are not a multiple of ", num_kv_heads, " kv heads");
  TORCH_CHECK(query.scalar_type() == at::kFloat || query.scalar_type() == at::kBFloat16 ||
                  query.scalar_type() == at::kHalf,
              "paged_attention: query dtype ", query.scalar_type(), " is not float32, bfloat16 or float16");
  TORCH_CHECK(key_cache.scalar_type() == value_cache.scalar_type(), "paged_attention: key cache ",
              key_cache.scalar_type(), " and value cache ", value_cache.scalar_type(), " differ in dtype");
  Pool keys = make_pool(key_cache, key_scale_cache, "key_cache");
  Pool values = make_pool(value_cache, value_scale_cache, "value_cache");
  const int64_t num_blocks = key_cache.size(0), block_size = key_cache.size(1);
  TORCH_CHECK(value_cache.size(0) == num_blocks && value_cache.size(1) == block_size &&
                  key_cache.size(2) == num_kv_heads && value_cache.size(2) == num_kv_heads &&
                  key_cache.size(3) == head_dim && value_cache.size(3) == value_dim,
              "paged_attention: caches ", key_cache.sizes(), " / ", value_cache.sizes(), " do not fit key ",
              key.sizes(), " / value ", value.sizes());
  const at::Tensor slots = contiguous_as(slot_mapping_in, at::kLong);
  const at::Tensor tables = contiguous_as(block_tables_in, at::kInt);
  const at::Tensor seq_lens = contiguous_as(seq_lens_in, at::kInt);
  const at::Tensor starts = contiguous_as(query_start_loc_in, at::kInt);
  TORCH_CHECK(slots.dim() == 1 && slots.size(0) == num_tokens, "paged_attention: slot_mapping must be [", num_tokens,
              "], got ", slots.sizes());
  TORCH_CHECK(tables.dim() == 2 && seq_lens.dim() == 1 && tables.size(0) == seq_lens.size(0) &&
                  starts.dim() == 1 && starts.size(0) == seq_lens.size(0) + 1,
              "paged_attention: block_tables ", tables.sizes(), ", seq_lens ", seq_lens.sizes(),
              " and query_start_loc ", starts.sizes(), " disagree on the batch size");
  const int64_t batch = seq_lens.size(0);
  const int64_t* slot_data = slots.const_data_ptr<int64_t>();
  for (int64_t t = 0; t < num_tokens; ++t) {
    TORCH_CHECK(slot_data[t] < num_blocks * block_size, "paged_attention: slot_mapping[", t, "] = ", slot_data[t],
                " is outside the cache's ", num_blocks * block_size, " slots");
  }
  check_tables(seq_lens.const_data_ptr<int32_t>(), starts.const_data_ptr<int32_t>(), tables.const_data_ptr<int32_t>(),
               batch, tables.stride(0), tables.size(1), block_size, num_blocks, num_tokens);

  // 1. The cache write.
  const bool quantized = key_cache.scalar_type() == at::kChar || key_cache.scalar_type() == at::kFloat8_e4m3fn;
  dispatch_cache_type(key_cache.scalar_type(), [&](auto tag) {
    using CT = decltype(tag);
    for (auto [rows, pool] : {std::pair{&key, &keys}, std::pair{&value, &values}}) {
      const bool same_type = !quantized && rows->scalar_type() == key_cache.scalar_type();
      // write_pool reads rows through their token and head strides (a decode step's K and V are views into the
      // fused qkv projection's output): only the last dim must be contiguous.
      const at::Tensor source = same_type ? (rows->stride(2) == 1 ? *rows : rows->contiguous())
                                          : rows->to(at::kFloat).contiguous();
      write_pool<CT>(source, *pool, slot_data, block_size, same_type);
    }
  });

  // 2. Attention: the prefills ATen's flash attention takes write their rows of the result directly; the paged
  // kernels write the other sequences' rows into a float buffer with rows padded to whole vectors.
  const int32_t* start_data = starts.const_data_ptr<int32_t>();
  const int32_t* length_data = seq_lens.const_data_ptr<int32_t>();
  // ATen's flash attention has no score soft-cap: capped attention stays on the paged kernels.
  const std::vector<uint8_t> by_aten =
      soft_cap > 0 ? std::vector<uint8_t>()
                   : aten_prefills(query, key, key_cache.scalar_type(), sliding_window, head_dim == value_dim,
                                   length_data, start_data, batch);
  bool paged_rows = by_aten.empty();
  for (int64_t b = 0; b < batch && !paged_rows; ++b) paged_rows = !by_aten[b] && start_data[b + 1] > start_data[b];
  const int64_t padded_dim = round_up(head_dim, kLanes), padded_value_dim = round_up(value_dim, kLanes);
  const at::Tensor query_f = paged_rows ? padded_float(query, padded_dim) : at::Tensor();
  at::Tensor output_f = at::empty({paged_rows ? num_tokens : 0, num_heads, padded_value_dim},
                                  query.options().dtype(at::kFloat));
  const int64_t used = start_data[batch];
  if (paged_rows && used < num_tokens) output_f.narrow(0, used, num_tokens - used).zero_();
  Problem problem{num_heads, num_kv_heads, num_heads / num_kv_heads, head_dim, value_dim, padded_dim, padded_value_dim,
                  block_size, static_cast<float>(scale), sliding_window, tables.const_data_ptr<int32_t>(),
                  tables.stride(0), paged_rows ? query_f.const_data_ptr<float>() : nullptr,
                  paged_rows ? output_f.data_ptr<float>() : nullptr, keys, values};
  problem.bf16_queries = query.scalar_type() == at::kBFloat16;
  if (problem.bf16_queries && key_cache.scalar_type() == at::kChar) problem.int8_dot = int8_dot_choice();
  problem.soft_cap = static_cast<float>(soft_cap);
  problem.computed_elsewhere = by_aten.empty() ? nullptr : by_aten.data();
  if (paged_rows) {
    dispatch_cache_type(key_cache.scalar_type(), [&](auto tag) {
      attend<decltype(tag)>(problem, length_data, start_data, batch);
    });
  }
  if (by_aten.empty()) {
    if (query.scalar_type() == at::kFloat && padded_value_dim == value_dim) return output_f;
    // Contiguous like the reference op's result: graphs view it as [tokens, heads * value_dim].
    return narrowed_rows(output_f, value_dim, query.scalar_type());
  }
  at::Tensor result = at::empty({num_tokens, num_heads, value_dim}, query.options());
  const AtenPrefill aten{query, key, value, key_cache, value_cache, tables, scale};
  attend_aten_prefills(aten, by_aten, length_data, start_data, result);
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t n = start_data[b + 1] - start_data[b];
    if (!by_aten[b] && n > 0) {
      result.narrow(0, start_data[b], n).copy_(output_f.narrow(0, start_data[b], n).narrow(2, 0, value_dim));
    }
  }
  if (used < num_tokens) result.narrow(0, used, num_tokens - used).zero_();
  return result;
}

// How paged_attention would split a batch into work items at the current thread count: {prefill tiles, shared
// (cascade) chunks, chunks of one sequence, decode sequences, decode items that cover every kv head}, the first
// three counted once per kv head. For tests and diagnostics.
std::vector<int64_t> paged_attention_schedule(const at::Tensor& block_tables_in, const at::Tensor& seq_lens_in,
                                              const at::Tensor& query_start_loc_in, int64_t block_size,
                                              int64_t num_kv_heads, int64_t group, int64_t sliding_window) {
  const at::Tensor tables = block_tables_in.to(at::kInt).contiguous();
  const at::Tensor seq_lens = seq_lens_in.to(at::kInt).contiguous();
  const at::Tensor starts = query_start_loc_in.to(at::kInt).contiguous();
  TORCH_CHECK(tables.dim() == 2 && seq_lens.dim() == 1 && starts.size(0) == seq_lens.size(0) + 1,
              "paged_attention_schedule: inconsistent batch shapes");
  Problem p{};
  p.num_kv_heads = num_kv_heads;
  p.group = group;
  p.block_size = block_size;
  p.window = sliding_window;
  p.block_tables = tables.const_data_ptr<int32_t>();
  p.table_stride = tables.stride(0);
  const Schedule schedule = plan(p, seq_lens.const_data_ptr<int32_t>(), starts.const_data_ptr<int32_t>(),
                                 seq_lens.size(0), at::get_num_threads());
  std::vector<int64_t> counts{0, 0, 0, static_cast<int64_t>(schedule.decodes.size()), 0};
  for (const Item& item : schedule.items) {
    counts[static_cast<int>(item.kind)] += item.head == kAllHeads ? num_kv_heads : 1;
    counts[4] += item.head == kAllHeads;
  }
  std::swap(counts[1], counts[2]);  // Kind order is prefill, chunk, shared
  return counts;
}

}  // namespace

// The vector ISA this library was compiled for (CPU_CAPABILITY) and its vector width in floats.
std::string build_info() {
  return std::string(C10_STRINGIZE(CPU_CAPABILITY)) + " " + std::to_string(kLanes) + " float lanes";
}

}  // namespace octavo_cpu

TORCH_LIBRARY(octavo_cpu, m) {
  m.def(
      "paged_attention(Tensor query, Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "
      "Tensor slot_mapping, Tensor block_tables, Tensor seq_lens, Tensor query_start_loc, float scale, "
      "SymInt sliding_window=-1, Tensor(c!)? key_scale_cache=None, Tensor(d!)? value_scale_cache=None, "
      "float soft_cap=0.0) -> Tensor");
  m.def("linear_w16(Tensor input, Tensor weight, Tensor? bias=None) -> Tensor");
  m.def(
      "linear_w8(Tensor x, Tensor qweight, Tensor scales, Tensor? bias, int group_size, bool bf16_gemm=False) -> "
      "Tensor");
  m.def(
      "linear_w4(Tensor x, Tensor qweight, Tensor scales, Tensor offsets, Tensor? bias, int group_size, "
      "bool bf16_gemm=False) -> Tensor");
  m.def("linear_fp8(Tensor x, Tensor qweight, Tensor scales, Tensor? bias, bool bf16_gemm=False) -> Tensor");
  m.def("pack_w8a8(Tensor qweight) -> Tensor");
  m.def(
      "linear_w8a8(Tensor x, Tensor packed, Tensor scales, Tensor? bias, int out_features, int in_features) -> "
      "Tensor");
  m.def("build_info() -> str", &octavo_cpu::build_info);
  m.def(
      "paged_attention_schedule(Tensor block_tables, Tensor seq_lens, Tensor query_start_loc, int block_size, "
      "int num_kv_heads, int num_queries_per_kv, int sliding_window=-1) -> int[]");
}

TORCH_LIBRARY_IMPL(octavo_cpu, CPU, m) {
  m.impl("paged_attention", &octavo_cpu::paged_attention);
  m.impl("paged_attention_schedule", &octavo_cpu::paged_attention_schedule);
}
