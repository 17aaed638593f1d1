// The bf16 prefill kernel (prefill_tile_bf16, AVX-512 builds only; see paged_prefill.h for where it runs):
// q . k and p . v in vdpbf16ps bf16 dot products with float32 sums, the online softmax in float32 over
// scores kept transposed ([key][row], 16 rows per vector), the weights rounded to bf16 for p . v.
#pragma once

#include "paged_attention_types.h"

#include <algorithm>
#include <cstring>
#include <vector>

namespace octavo_cpu {
namespace paged {

#if defined(CPU_CAPABILITY_AVX512)
// Functions using AVX512_BF16 instructions: compiled for them whatever the build's flags (one AVX-512 build
// serves CPUs with and without them) and only called where the CPU has them (cpu_has_avx512_bf16).
#define OCTAVO_BF16_TARGET __attribute__((target("avx512bf16")))

constexpr int64_t kBf16KeyTile = 64;  // keys per tile of the bf16 kernel
constexpr int kBf16RowVectors = 4;    // 16-row vectors scored together (with 4 to 8 keys: ~16 accumulators)

// Per-thread buffers of the bf16 kernel. Words are pairs of bf16 (the element of even index in the low half).
struct Bf16Tile {
  std::vector<uint32_t> queries;  // [head_dim / 2][r16]: (q_r[2i], q_r[2i + 1])
  std::vector<float> scores;      // [kBf16KeyTile][r16]: scale * q_r . k_j, then masked
  std::vector<uint32_t> weights;  // [kBf16KeyTile / 2][r16]: bf16 (p_r[j], p_r[j + 1]) for even j
  std::vector<uint32_t> values;   // [kBf16KeyTile / 2][value_dim]: (v_j[d], v_j+1[d]) for even j
  std::vector<float> out, row_max, row_sum, factors;  // out: [rows][value_dim]; the others [r16]
  std::vector<int32_t> positions;                     // [r16]: a row's position, -1 for padding rows
  std::vector<uint16_t> zeros;                        // a zero value row (the partner of an odd last key)
  std::vector<const uint16_t*> key_rows, value_rows;
};

inline uint32_t load_word(const uint16_t* pair) {
  uint32_t word;
  std::memcpy(&word, pair, sizeof(word));
  return word;
}

// scores[k][rv * 16 + i] = scale * q . k for NK keys and RV vectors of 16 rows; the accumulators stay in
// registers for the whole dot product (one query vector load and one key broadcast serve several of them).
template <int RV, int NK>
OCTAVO_BF16_TARGET inline void bf16_score_block(const uint32_t* queries, int64_t r16, int64_t pairs,
                                                const uint16_t* const* keys, float scale, float* scores) {
  __m512 acc[NK][RV];
  for (int k = 0; k < NK; ++k)
    for (int v = 0; v < RV; ++v) acc[k][v] = _mm512_setzero_ps();
  for (int64_t i = 0; i < pairs; ++i) {
    __m512bh q[RV];
    for (int v = 0; v < RV; ++v) q[v] = (__m512bh)_mm512_loadu_si512(queries + i * r16 + v * 16);
    for (int k = 0; k < NK; ++k) {
      const __m512bh key = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(load_word(keys[k] + 2 * i)));
      for (int v = 0; v < RV; ++v) acc[k][v] = _mm512_dpbf16_ps(acc[k][v], q[v], key);
    }
  }
  const __m512 s = _mm512_set1_ps(scale);
  for (int k = 0; k < NK; ++k)
    for (int v = 0; v < RV; ++v) _mm512_storeu_ps(scores + k * r16 + v * 16, _mm512_mul_ps(acc[k][v], s));
}

// bf16_score_block over keys [0, n), NK keys at a time so that about 16 accumulators hide vdpbf16ps' latency.
template <int RV>
OCTAVO_BF16_TARGET void bf16_score_keys(const uint32_t* queries, int64_t r16, int64_t pairs,
                                        const uint16_t* const* keys, int64_t n, float scale, float* scores) {
  constexpr int NK = RV >= 4 ? 4 : RV == 3 ? 5 : 8;
  int64_t j = 0;
  for (; j + NK <= n; j += NK) bf16_score_block<RV, NK>(queries, r16, pairs, keys + j, scale, scores + j * r16);
  for (; j < n; ++j) bf16_score_block<RV, 1>(queries, r16, pairs, keys + j, scale, scores + j * r16);
}

// Online-softmax step of one key tile (keys [tile, tile + n)) for every row vector: masks the scores where
// `masked`, updates row_max / row_sum, sets factors (exp(old max - new max)) and writes the bf16 weight pairs.
// A row that has seen no visible key keeps max -inf; its shift is 0 so that its weights are exp(-inf) = 0.
OCTAVO_BF16_TARGET inline void bf16_softmax(Bf16Tile& t, int64_t r16, int64_t n, int64_t tile, bool masked,
                                            int64_t window) {
  alignas(64) static constexpr uint16_t kInterleave[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                                         8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i interleave = _mm512_load_si512(kInterleave);
  const __m512 neg_inf = _mm512_set1_ps(kNegInf);
  for (int64_t r = 0; r < r16; r += 16) {
    float* scores = t.scores.data() + r;
    const __m512 old_max = _mm512_loadu_ps(t.row_max.data() + r);
    __m512 best = old_max;
    if (masked) {
      const __m512i position = _mm512_loadu_si512(t.positions.data() + r);
      const __m512i too_old = _mm512_sub_epi32(position, _mm512_set1_epi32(static_cast<int32_t>(window)));
      for (int64_t j = 0; j < n; ++j) {
        const __m512i key = _mm512_set1_epi32(static_cast<int32_t>(tile + j));
        __mmask16 hidden = _mm512_cmpgt_epi32_mask(key, position);
        if (window > 0) hidden |= _mm512_cmple_epi32_mask(key, too_old);
        const __m512 s = _mm512_mask_mov_ps(_mm512_loadu_ps(scores + j * r16), hidden, neg_inf);
        _mm512_storeu_ps(scores + j * r16, s);
        best = _mm512_max_ps(best, s);
      }
    } else {
      for (int64_t j = 0; j < n; ++j) best = _mm512_max_ps(best, _mm512_loadu_ps(scores + j * r16));
    }
    const __m512 shift = _mm512_mask_mov_ps(best, _mm512_cmp_ps_mask(best, neg_inf, _CMP_EQ_OQ), _mm512_setzero_ps());
    const __m512 factor = Vec(_mm512_sub_ps(old_max, shift)).exp_u20();
    __m512 sum = _mm512_setzero_ps();
    for (int64_t j = 0; j < n; j += 2) {
      const __m512 p0 = Vec(_mm512_sub_ps(_mm512_loadu_ps(scores + j * r16), shift)).exp_u20();
      const __m512 p1 = j + 1 < n ? __m512(Vec(_mm512_sub_ps(_mm512_loadu_ps(scores + (j + 1) * r16), shift)).exp_u20())
                                  : _mm512_setzero_ps();
      sum = _mm512_add_ps(_mm512_add_ps(sum, p0), p1);
      const __m512i pairs = _mm512_permutexvar_epi16(interleave, (__m512i)_mm512_cvtne2ps_pbh(p1, p0));
      _mm512_storeu_si512(t.weights.data() + (j / 2) * r16 + r, pairs);
    }
    _mm512_storeu_ps(t.row_sum.data() + r, _mm512_add_ps(_mm512_mul_ps(_mm512_loadu_ps(t.row_sum.data() + r), factor), sum));
    _mm512_storeu_ps(t.row_max.data() + r, best);
    _mm512_storeu_ps(t.factors.data() + r, factor);
  }
}

// out[r][v * 16 + i] = out * factors[r] + sum over key pairs of the bf16 weight pair . the value pair, for NR
// rows and NV vectors of 16 value dims held in registers over the whole tile.
template <int NR, int NV>
OCTAVO_BF16_TARGET inline void bf16_weigh_block(const uint32_t* weights, int64_t r16, int64_t key_pairs,
                                                const uint32_t* values, int64_t value_dim, const float* factors,
                                                float* out) {
  __m512 acc[NR][NV];
  for (int r = 0; r < NR; ++r) {
    const __m512 f = _mm512_set1_ps(factors[r]);
    for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_mul_ps(_mm512_loadu_ps(out + r * value_dim + v * 16), f);
  }
  for (int64_t i = 0; i < key_pairs; ++i) {
    __m512bh value[NV];
    for (int v = 0; v < NV; ++v) value[v] = (__m512bh)_mm512_loadu_si512(values + i * value_dim + v * 16);
    for (int r = 0; r < NR; ++r) {
      const __m512bh w = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(weights[i * r16 + r]));
      for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], w, value[v]);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(out + r * value_dim + v * 16, acc[r][v]);
}

template <int NV>
OCTAVO_BF16_TARGET void bf16_weigh_rows(const Bf16Tile& t, int64_t rows, int64_t r16, int64_t key_pairs,
                                        int64_t value_dim, int64_t dim, float* out) {
  const uint32_t* values = t.values.data() + dim;
  int64_t r = 0;
  for (; r + 4 <= rows; r += 4) {
    bf16_weigh_block<4, NV>(t.weights.data() + r, r16, key_pairs, values, value_dim, t.factors.data() + r,
                            out + r * value_dim + dim);
  }
  for (; r < rows; ++r) {
    bf16_weigh_block<1, NV>(t.weights.data() + r, r16, key_pairs, values, value_dim, t.factors.data() + r,
                            out + r * value_dim + dim);
  }
}

// t.values = the value rows of the tile as pairs of keys (VNNI layout), an odd last key paired with zeros.
inline void bf16_pack_values(Bf16Tile& t, int64_t n, int64_t value_dim) {
  for (int64_t j = 0; j < n; j += 2) {
    const uint16_t* even = t.value_rows[j];
    const uint16_t* odd = j + 1 < n ? t.value_rows[j + 1] : t.zeros.data();
    uint32_t* dst = t.values.data() + (j / 2) * value_dim;
    for (int64_t d = 0; d < value_dim; d += 32) {
      __m512i low, high;
      interleave_bf16_rows(even + d, odd + d, low, high);
      _mm512_storeu_si512(dst + d, low);
      _mm512_storeu_si512(dst + d + 16, high);
    }
  }
}

// out[k] = column k of the 16 x 16 matrix of 32-bit words whose rows are in[0:16].
inline void transpose_words(const __m512i* in, __m512i* out) {
  __m512i t[16], u[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(in[i], in[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(in[i], in[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // u[i + c]: per 128-bit lane L, column 4L + c of rows i..i+3
    u[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    u[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    u[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    u[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int c = 0; c < 4; ++c) {
    const __m512i x0 = _mm512_shuffle_i32x4(u[c], u[4 + c], _MM_SHUFFLE(2, 0, 2, 0));
    const __m512i y0 = _mm512_shuffle_i32x4(u[c], u[4 + c], _MM_SHUFFLE(3, 1, 3, 1));
    const __m512i x1 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], _MM_SHUFFLE(2, 0, 2, 0));
    const __m512i y1 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], _MM_SHUFFLE(3, 1, 3, 1));
    out[c] = _mm512_shuffle_i32x4(x0, x1, _MM_SHUFFLE(2, 0, 2, 0));
    out[8 + c] = _mm512_shuffle_i32x4(x0, x1, _MM_SHUFFLE(3, 1, 3, 1));
    out[4 + c] = _mm512_shuffle_i32x4(y0, y1, _MM_SHUFFLE(2, 0, 2, 0));
    out[12 + c] = _mm512_shuffle_i32x4(y0, y1, _MM_SHUFFLE(3, 1, 3, 1));
  }
}

// queries[i * r16 + r] = (q_r[2i], q_r[2i + 1]) as bf16 for the item's rows (0 for padding rows up to r16): the
// high halves of the float queries, which are bf16 values widened. 16 rows x 16 pairs at a time: each row's
// 32 values narrowed in one permute, then a word transpose.
inline void bf16_pack_queries(const Problem& p, int64_t head, int64_t token, int64_t rows, int64_t r16,
                              uint32_t* queries) {
  alignas(64) static constexpr uint16_t kHighHalves[32] = {1,  3,  5,  7,  9,  11, 13, 15, 17, 19, 21,
                                                         23, 25, 27, 29, 31, 33, 35, 37, 39, 41, 43,
                                                         45, 47, 49, 51, 53, 55, 57, 59, 61, 63};
  const __m512i high = _mm512_load_si512(kHighHalves);
  __m512i packed[16], columns[16];
  for (int64_t r0 = 0; r0 < r16; r0 += 16) {
    for (int64_t d = 0; d < p.head_dim; d += 32) {
      for (int64_t i = 0; i < 16; ++i) {
        const int64_t r = r0 + i;
        if (r >= rows) {
          packed[i] = _mm512_setzero_si512();
          continue;
        }
        const float* q = p.query + ((token + r / p.group) * p.num_heads + head * p.group + r % p.group) * p.padded_dim;
        packed[i] = _mm512_permutex2var_epi16(_mm512_loadu_si512(q + d), high, _mm512_loadu_si512(q + d + 16));
      }
      transpose_words(packed, columns);
      for (int64_t k = 0; k < 16; ++k) _mm512_storeu_si512(queries + (d / 2 + k) * r16 + r0, columns[k]);
    }
  }
}

// Whether prefill_tile_bf16 runs this problem: bf16 queries (exact in bf16), key and value rows of whole
// 32-element vectors, and a CPU with AVX512_BF16.
inline bool bf16_prefill_applies(const Problem& p) {
  return p.bf16_queries && p.head_dim % 32 == 0 && p.value_dim % 32 == 0 && cpu_has_avx512_bf16();
}

// prefill_tile (paged_prefill.h: the arguments) for a bf16 cache and bf16 queries.
inline void prefill_tile_bf16(const Problem& p, const int32_t* blocks, int64_t head, int64_t token, int64_t first,
                              int64_t count) {
  static thread_local Bf16Tile t;
  const int64_t rows = count * p.group, r16 = round_up(rows, 16), pairs = p.head_dim / 2, vd = p.value_dim;
  t.queries.resize(pairs * r16);
  bf16_pack_queries(p, head, token, rows, r16, t.queries.data());
  t.positions.resize(r16);
  for (int64_t r = 0; r < r16; ++r) t.positions[r] = r < rows ? static_cast<int32_t>(first + r / p.group) : -1;
  t.scores.resize(kBf16KeyTile * r16);
  t.weights.resize(kBf16KeyTile / 2 * r16);
  t.values.resize(kBf16KeyTile / 2 * vd);
  t.zeros.assign(vd, 0);
  t.out.assign(rows * vd, 0.f);
  t.row_max.assign(r16, kNegInf);
  t.row_sum.assign(r16, 0.f);
  t.factors.resize(r16);
  const int64_t last = first + count - 1;
  const int64_t start = p.window > 0 ? std::max<int64_t>(0, first - p.window + 1) : 0;
  for (int64_t tile = start; tile <= last; tile += kBf16KeyTile) {
    const int64_t n = std::min(kBf16KeyTile, last + 1 - tile);
    row_pointers<c10::BFloat16, const uint16_t*>(p.keys, blocks, p.block_size, tile, n, head, t.key_rows);
    row_pointers<c10::BFloat16, const uint16_t*>(p.values, blocks, p.block_size, tile, n, head, t.value_rows);
    bf16_pack_values(t, n, vd);
    for (int64_t v = 0; v < r16 / 16; v += kBf16RowVectors) {
      const uint32_t* queries = t.queries.data() + v * 16;
      float* scores = t.scores.data() + v * 16;
      switch (std::min<int64_t>(kBf16RowVectors, r16 / 16 - v)) {
        case 1: bf16_score_keys<1>(queries, r16, pairs, t.key_rows.data(), n, p.scale, scores); break;
        case 2: bf16_score_keys<2>(queries, r16, pairs, t.key_rows.data(), n, p.scale, scores); break;
        case 3: bf16_score_keys<3>(queries, r16, pairs, t.key_rows.data(), n, p.scale, scores); break;
        default: bf16_score_keys<4>(queries, r16, pairs, t.key_rows.data(), n, p.scale, scores); break;
      }
    }
    soft_cap_row(t.scores.data(), n * r16, p.soft_cap);  // scores [key][row], capped before the mask
    // Every key of the tile visible to every row: at or before the first row's position, inside the last
    // row's window.
    const bool visible = tile + n - 1 <= first && (p.window <= 0 || tile > last - p.window);
    bf16_softmax(t, r16, n, tile, !visible, p.window);
    const int64_t key_pairs = (n + 1) / 2;
    int64_t d = 0;
    for (; d + 64 <= vd; d += 64) bf16_weigh_rows<4>(t, rows, r16, key_pairs, vd, d, t.out.data());
    if (d < vd) bf16_weigh_rows<2>(t, rows, r16, key_pairs, vd, d, t.out.data());
  }
  for (int64_t r = 0; r < rows; ++r) {
    float* out = p.output + ((token + r / p.group) * p.num_heads + head * p.group + r % p.group) * p.padded_value_dim;
    const Vec sum(t.row_sum[r]);
    for (int64_t i = 0; i < vd; i += kLanes) (Vec::loadu(t.out.data() + r * vd + i) / sum).store(out + i);
  }
}
#endif

}  // namespace paged
}  // namespace octavo_cpu
