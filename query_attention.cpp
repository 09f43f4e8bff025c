// Causal attention over the KV cache as it lies, in two kernels:
//
// * query_attention: a few queries per sequence, a decode step's one query per row or the queries of a
//   prefill's last, incomplete chunk. transformer.block_attention is the same computation in PyTorch operators;
//   this one reads each row's bf16 keys and values in place (no gather of the window, no fp32 copy of it) and
//   skips the keys past the query. For CPUs with AVX512F.
// * chunk_attention: the 64 queries of each complete chunk of a prefill, in place of the flash kernel (SDPA).
//   The queries of a chunk share every key, so the keys are laid out once per chunk and kv head with 16 keys per
//   vector, and each query's scores come out 16 keys at a time by AVX512-BF16's dot product of bf16 pairs, with
//   no horizontal sums and no conversion. For CPUs with AVX512-BF16.
//
// For each query head, in fp32 (the products of bf16 values are exact in fp32):
//
//     s_j = (q . k_j) / sqrt(D)  for j = 0..p (p: the query's position),  out = sum_j e^(s_j - max s) v_j / sum_j e^(s_j - max s)
//
// Every sum runs over d or j in one fixed order, and a query head is computed by one thread (beside the heads
// or queries that share its kv head, which share the conversion of each key and value but none of the sums), so
// its result depends only on its own vector and its sequence's keys 0..p: not on the other rows, queries or
// heads of the call, not on the number of threads, not on how far the cache was written past p. The two kernels
// sum q . k_j in different orders (query_attention in 16-lane parts, then the parts of 16 keys at once by one
// fixed tree of shuffles; chunk_attention along d), so their bits differ: a token takes one or the other by its
// place in its sequence (planning.py), never by its batch.
//
// Built at first use by attention_kernel.py (torch.utils.cpp_extension) and registered as
// draft_server_attention::query_attention and draft_server_attention::chunk_attention.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "bf16_vectors.h"

namespace {

using bf16_vectors::LANES;
using bf16_vectors::load_bf16;
using bf16_vectors::to_bf16;

constexpr int MAX_VECTORS = 16;  // head_dim up to 256
constexpr int MAX_QUERIES = 4;   // queries of a chunk the chunk kernel takes at once (choose)

// e^x for x <= 0 (a score minus the maximum): x = n ln2 + r with |r| <= ln2 / 2, e^r by its degree-6 Taylor
// polynomial (relative error below 2e-7), scaled by 2^n. Below -87 the result is flushed towards zero.
inline __m512 exp_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// 16 vectors v[0..15] -> one vector whose lane j is the sum of v[j]'s 16 lanes: halves added to halves in three
// rounds of shuffles (a fixed tree per lane, no lane ever meeting another vector's), then one permutation.
inline __m512 sum_lanes(const __m512 v[LANES]) {
  __m512 halves[8], quarters[4];
  for (int i = 0; i < 8; ++i)  // lanes 0-7: v[2i]'s 8 partial sums, lanes 8-15: v[2i+1]'s
    halves[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                              _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int i = 0; i < 4; ++i)  // 128-bit block k: v[4i+k]'s 4 partial sums
    quarters[i] = _mm512_add_ps(_mm512_shuffle_f32x4(halves[2 * i], halves[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                                _mm512_shuffle_f32x4(halves[2 * i], halves[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  // Block k: v[k]'s and v[4+k]'s 2 partial sums, then v[8+k]'s and v[12+k]'s.
  const __m512 low = _mm512_add_ps(_mm512_shuffle_ps(quarters[0], quarters[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                   _mm512_shuffle_ps(quarters[0], quarters[1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 high = _mm512_add_ps(_mm512_shuffle_ps(quarters[2], quarters[3], _MM_SHUFFLE(1, 0, 1, 0)),
                                    _mm512_shuffle_ps(quarters[2], quarters[3], _MM_SHUFFLE(3, 2, 3, 2)));
  // Lane 4k+m: the sum of v[4m+k]; the permutation puts it in lane 4m+k.
  const __m512 sums = _mm512_add_ps(_mm512_shuffle_ps(low, high, _MM_SHUFFLE(2, 0, 2, 0)),
                                    _mm512_shuffle_ps(low, high, _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512i order = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
  return _mm512_permutexvar_ps(order, sums);
}

// e^(s - max s) in place over scores (count); returns their sum, each sum in one fixed order.
inline float softmax_numerators(float* scores, int64_t count) {
  float maximum = -INFINITY;
  for (int64_t j = 0; j < count; ++j) maximum = std::max(maximum, scores[j]);
  const __m512 shift = _mm512_set1_ps(maximum);
  __m512 sums = _mm512_setzero_ps();
  for (int64_t j = 0; j < count; j += LANES) {
    const __mmask16 live = count - j >= LANES ? 0xFFFF : (__mmask16)((1u << (count - j)) - 1);
    const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, scores + j), shift));
    _mm512_mask_storeu_ps(scores + j, live, e);
    sums = _mm512_add_ps(sums, _mm512_maskz_mov_ps(live, e));
  }
  return _mm512_reduce_add_ps(sums);
}

// acc[r] += weight[r] v_j for the rows r in 0..ROWS-1 that `live` marks, v_j a key's value (D) in bf16, converted
// once for all of them.
template <int VECTORS, int ROWS, int SLOTS>
inline void add_value(__m512 (&acc)[ROWS][SLOTS], const float* weights, int64_t stride, int64_t j,
                      const at::BFloat16* value, int vectors, const bool* live) {
  for (int v = 0; v < vectors; ++v) {
    const __m512 element = load_bf16(value + LANES * v);
    for (int r = 0; r < ROWS; ++r)
      if (live == nullptr || live[r])
        acc[r][v] = _mm512_fmadd_ps(_mm512_set1_ps(weights[r * stride + j]), element, acc[r][v]);
  }
}

// The weighted values of ROWS query heads that share one kv head, from their softmax numerators (scores, row r at
// r * stride, keys 0..counts[r]-1; sums in totals) and the keys' values (count, D) in bf16 -> out[r] (D) in bf16.
// Each value is converted once for all the rows that use it; each row's sum runs over j in order, so a row's bits
// do not depend on the rows beside it. Rows of consecutive queries have counts a few apart: keys past a row's
// count are never read for it (they may be unwritten memory for a query alone).
template <int VECTORS, int ROWS>
void weighted_values(const float* scores, int64_t stride, const float* totals, const at::BFloat16* values,
                     const int64_t* counts, int64_t D, at::BFloat16* const* out) {
  constexpr int SLOTS = VECTORS ? VECTORS : MAX_VECTORS;
  const int vectors = VECTORS ? VECTORS : D / LANES;
  const int64_t shared = *std::min_element(counts, counts + ROWS), last = *std::max_element(counts, counts + ROWS);
  __m512 acc[ROWS][SLOTS];
  for (int r = 0; r < ROWS; ++r)
    for (int v = 0; v < vectors; ++v) acc[r][v] = _mm512_setzero_ps();
  for (int64_t j = 0; j < shared; ++j)
    add_value<VECTORS, ROWS, SLOTS>(acc, scores, stride, j, values + j * D, vectors, nullptr);
  for (int64_t j = shared; j < last; ++j) {
    bool live[ROWS];
    for (int r = 0; r < ROWS; ++r) live[r] = j < counts[r];
    add_value<VECTORS, ROWS, SLOTS>(acc, scores, stride, j, values + j * D, vectors, live);
  }
  for (int r = 0; r < ROWS; ++r)
    for (int v = 0; v < vectors; ++v)
      _mm256_storeu_si256((__m256i*)(out[r] + LANES * v),
                          to_bf16(_mm512_div_ps(acc[r][v], _mm512_set1_ps(totals[r]))));
}

// HEADS query heads q (HEADS, D) that share one kv head, over its keys and values (p + 1, D) in bf16 -> out
// (HEADS, D) in bf16: query_attention's work for one query. Each key is converted once for all HEADS; each
// head's sums are its own, in the order above. VECTORS: D / 16 where the compiler knows it (queries and
// accumulators then stay in registers), else 0 (HEADS 1). scores: room for HEADS x (p + 1) floats.
template <int VECTORS, int HEADS>
void attend(const at::BFloat16* q, const at::BFloat16* keys, const at::BFloat16* values, int64_t count, int64_t D,
            float scale, float* scores, at::BFloat16* out) {
  constexpr int SLOTS = VECTORS ? VECTORS : MAX_VECTORS;
  const int vectors = VECTORS ? VECTORS : D / LANES;
  __m512 query[HEADS][SLOTS];
  for (int h = 0; h < HEADS; ++h)
    for (int v = 0; v < vectors; ++v) query[h][v] = load_bf16(q + h * D + LANES * v);
  for (int64_t j0 = 0; j0 < count; j0 += LANES) {  // 16 keys at a time: each head's 16 dot products in one tree
    const int64_t keys_here = std::min<int64_t>(LANES, count - j0);
    __m512 dots[HEADS][LANES];
    for (int j = 0; j < LANES; ++j) {
      if (j >= keys_here) {  // past the last key: nothing is read there
        for (int h = 0; h < HEADS; ++h) dots[h][j] = _mm512_setzero_ps();
        continue;
      }
      __m512 key[SLOTS];
      for (int v = 0; v < vectors; ++v) key[v] = load_bf16(keys + (j0 + j) * D + LANES * v);
      for (int h = 0; h < HEADS; ++h) {
        __m512 dot = _mm512_mul_ps(query[h][0], key[0]);
        for (int v = 1; v < vectors; ++v) dot = _mm512_fmadd_ps(query[h][v], key[v], dot);
        dots[h][j] = dot;
      }
    }
    const __mmask16 live = keys_here == LANES ? 0xFFFF : (__mmask16)((1u << keys_here) - 1);
    for (int h = 0; h < HEADS; ++h)
      _mm512_mask_storeu_ps(scores + h * count + j0, live, _mm512_mul_ps(sum_lanes(dots[h]), _mm512_set1_ps(scale)));
  }
  float totals[HEADS];
  int64_t counts[HEADS];
  at::BFloat16* rows[HEADS];
  for (int h = 0; h < HEADS; ++h) {
    totals[h] = softmax_numerators(scores + h * count, count);
    counts[h] = count;
    rows[h] = out + h * D;
  }
  weighted_values<VECTORS, HEADS>(scores, count, totals, values, counts, D, rows);
}

constexpr int TILE_KEYS = 4 * LANES;  // keys per tile of a chunk's scores: 4 vectors per head

// A chunk's keys 0..count-1 (count, D) in bf16 -> (D / 2, stride) 32-bit words: word (i, j) holds key j's
// elements 2i and 2i + 1, the pairs AVX512-BF16's dot product takes, so that a vector holds 16 keys; keys
// count..stride-1 (stride: a multiple of TILE_KEYS) are zero.
void pair_keys(const at::BFloat16* keys, int64_t count, int64_t D, int64_t stride, uint32_t* out) {
  const auto* words = reinterpret_cast<const uint32_t*>(keys);
  for (int64_t i = 0; i < D / 2; ++i) std::fill(out + i * stride + count, out + (i + 1) * stride, 0u);
  for (int64_t j = 0; j < count; ++j)
    for (int64_t i = 0; i < D / 2; ++i) out[i * stride + j] = words[j * D / 2 + i];
}

// The scores of ROWS query heads q[r] (D) in bf16 over the paired keys (D / 2, stride), TILE_KEYS keys at a time:
// lane j sums the exact fp32 products q[d] k_j[d] a pair of d at a time, in order of d (vdpbf16ps; its sums round
// to nearest even, denormals flushed). Each key vector is loaded once for all rows. Keys past `count` within the
// last tile are scored, never used. scores: row r at r * stride.
template <int ROWS>
__attribute__((target("avx512f,avx512bf16"))) void chunk_scores(const at::BFloat16* const* q, const uint32_t* pairs,
                                                                 int64_t stride, int64_t count, int64_t D,
                                                                 float scale, float* scores) {
  constexpr int KEY_VECTORS = TILE_KEYS / LANES;
  for (int64_t j0 = 0; j0 < count; j0 += TILE_KEYS) {
    __m512 acc[ROWS][KEY_VECTORS];
    for (int r = 0; r < ROWS; ++r)
      for (int k = 0; k < KEY_VECTORS; ++k) acc[r][k] = _mm512_setzero_ps();
    for (int64_t i = 0; i < D / 2; ++i) {
      __m512bh key[KEY_VECTORS];
      for (int k = 0; k < KEY_VECTORS; ++k)
        key[k] = (__m512bh)_mm512_loadu_si512(pairs + i * stride + j0 + k * LANES);
      for (int r = 0; r < ROWS; ++r) {
        const __m512bh element = (__m512bh)_mm512_set1_epi32(reinterpret_cast<const uint32_t*>(q[r])[i]);
        for (int k = 0; k < KEY_VECTORS; ++k) acc[r][k] = _mm512_dpbf16_ps(acc[r][k], element, key[k]);
      }
    }
    for (int r = 0; r < ROWS; ++r)
      for (int k = 0; k < KEY_VECTORS; ++k)
        _mm512_storeu_ps(scores + r * stride + j0 + k * LANES, _mm512_mul_ps(acc[r][k], _mm512_set1_ps(scale)));
  }
}

// chunk_attention's work for QUERIES consecutive queries of a chunk (the row of query i at q + i * step, its
// position + 1 in counts[i]), HEADS query heads of each, over the paired keys (D / 2, stride) and the values in
// bf16 -> out, laid out as q. Their keys are read once for all QUERIES x HEADS rows; each row's sums are its own,
// so a query's bits are those it gets alone. scores: room for QUERIES x HEADS x stride floats.
template <int VECTORS, int HEADS, int QUERIES>
void attend_chunk(const at::BFloat16* q, int64_t step, const uint32_t* pairs, int64_t stride,
                  const at::BFloat16* values, const int64_t* counts, int64_t D, float scale, float* scores,
                  at::BFloat16* out) {
  constexpr int ROWS = QUERIES * HEADS;
  const at::BFloat16* queries[ROWS];
  at::BFloat16* rows[ROWS];
  int64_t row_counts[ROWS];
  float totals[ROWS];
  for (int r = 0; r < ROWS; ++r) {
    const int64_t at = r / HEADS * step + r % HEADS * D;
    queries[r] = q + at;
    rows[r] = out + at;
    row_counts[r] = counts[r / HEADS];
  }
  chunk_scores<ROWS>(queries, pairs, stride, *std::max_element(counts, counts + QUERIES), D, scale, scores);
  for (int r = 0; r < ROWS; ++r) totals[r] = softmax_numerators(scores + r * stride, row_counts[r]);
  weighted_values<VECTORS, ROWS>(scores, stride, totals, values, row_counts, D, rows);
}

using Attend = void (*)(const at::BFloat16*, const at::BFloat16*, const at::BFloat16*, int64_t, int64_t, float,
                        float*, at::BFloat16*);
using AttendChunk = void (*)(const at::BFloat16*, int64_t, const uint32_t*, int64_t, const at::BFloat16*,
                             const int64_t*, int64_t, float, float*, at::BFloat16*);

// The instances for one head shape: how many heads of a kv group each takes at once, and how many queries of a
// chunk the chunk kernel takes at once (chunk_one: one, for a chunk's last queries).
struct Instances {
  Attend query;
  AttendChunk chunk, chunk_one;
  int64_t heads, queries;
};

template <int VECTORS, int HEADS, int QUERIES>
Instances instances() {
  return {attend<VECTORS, HEADS>, attend_chunk<VECTORS, HEADS, QUERIES>, attend_chunk<VECTORS, HEADS, 1>, HEADS,
          QUERIES};
}

// The instances for head_dim D that take the most heads of a kv group at once, and the most queries of a chunk,
// with their accumulators (at most 24) and operands in 32 registers.
Instances choose(int64_t D, int64_t group) {
  if (D == 64) {
    if (group % 4 == 0) return instances<4, 4, 1>();
    if (group % 3 == 0) return instances<4, 3, 2>();
    if (group % 2 == 0) return instances<4, 2, 2>();
    return instances<4, 1, 4>();
  }
  if (D == 128) return group % 2 == 0 ? instances<8, 2, 1>() : instances<8, 1, 2>();
  return instances<0, 1, 1>();
}

// One call of either kernel: its sizes, its tensors' data, its output, and the instances for its head shape.
struct Call {
  int64_t G, T, H, D, S, H_kv, C;
  const at::BFloat16 *q, *keys, *values;
  const int64_t *slots, *positions;
  at::Tensor out;
  float scale;
  Instances kernel;
};

// The checks both kernels make of their arguments (see query_attention), and the call they make.
Call prepare(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values, const at::Tensor& slots,
             const at::Tensor& positions) {
  TORCH_CHECK(q.dim() == 4 && q.scalar_type() == at::kBFloat16 && q.is_contiguous(), "q: contiguous (G, T, H, D) bf16");
  TORCH_CHECK(keys.dim() == 4 && keys.scalar_type() == at::kBFloat16 && keys.is_contiguous() &&
                  values.sizes() == keys.sizes() && values.scalar_type() == at::kBFloat16 && values.is_contiguous(),
              "keys, values: contiguous (S, H_kv, C, D) bf16");
  const int64_t G = q.size(0), T = q.size(1), H = q.size(2), D = q.size(3);
  const int64_t S = keys.size(0), H_kv = keys.size(1), C = keys.size(2);
  TORCH_CHECK(keys.size(3) == D && D % LANES == 0 && D <= LANES * MAX_VECTORS, "head_dim: a multiple of 16, at most 256");
  TORCH_CHECK(H % H_kv == 0, "query heads: a multiple of the kv heads");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.numel() == G && slots.is_contiguous(),
              "slots: contiguous (G,) int64");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.sizes() == at::IntArrayRef({G, T}) &&
                  positions.is_contiguous(),
              "positions: contiguous (G, T) int64");
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int64_t* position = positions.data_ptr<int64_t>();
  for (int64_t i = 0; i < G; ++i) TORCH_CHECK(0 <= slot[i] && slot[i] < S, "slot out of range");
  for (int64_t i = 0; i < G * T; ++i) TORCH_CHECK(0 <= position[i] && position[i] < C, "position out of range");
  return {G, T, H, D, S, H_kv, C, q.data_ptr<at::BFloat16>(), keys.data_ptr<at::BFloat16>(),
          values.data_ptr<at::BFloat16>(), slot, position, at::empty_like(q), 1.0f / std::sqrt(static_cast<float>(D)),
          choose(D, H / H_kv)};
}

// Calls work(first, step) once per thread, which computes tasks first, first + step, first + 2 step, ...: tasks
// that read more keys come later (a prefill's chunks in position order, a batch's longer rows), so dealing them
// in turn balances the threads where contiguous runs would not. Which thread computes a task changes none of
// its bits.
template <typename Work>
void deal_tasks(int64_t tasks, const Work& work) {
  const int64_t parts = std::min<int64_t>(at::get_num_threads(), tasks);
  at::parallel_for(0, parts, 1, [&](int64_t begin, int64_t end) {
    for (int64_t part = begin; part < end; ++part) work(part, parts);
  });
}

}  // namespace

// q (G, T, H, D) bf16; keys, values (S, H_kv, C, D) bf16, a layer's cache; slots (G,) and positions (G, T) int64:
// query t of row g sits at positions[g, t] of cache slot slots[g] -> (G, T, H, D) bf16.
at::Tensor query_attention(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                           const at::Tensor& slots, const at::Tensor& positions) {
  const Call c = prepare(q, keys, values, slots, positions);
  auto* out = c.out.data_ptr<at::BFloat16>();
  const int64_t heads = c.kernel.heads;
  const int64_t tasks = c.G * c.T * c.H / heads;  // each: `heads` query heads of one query, sharing a kv head
  deal_tasks(tasks, [&](int64_t first, int64_t step) {
    std::vector<float> scores(heads * c.C);
    for (int64_t task = first; task < tasks; task += step) {
      const int64_t h = task * heads % c.H, query = task * heads / c.H, g = query / c.T;
      const int64_t kv = (c.slots[g] * c.H_kv + h / (c.H / c.H_kv)) * c.C * c.D;
      c.kernel.query(c.q + task * heads * c.D, c.keys + kv, c.values + kv, c.positions[query] + 1, c.D, c.scale,
                     scores.data(), out + task * heads * c.D);
    }
  });
  return c.out;
}

// The same arguments as query_attention, each row g the queries of a complete chunk at increasing positions; for
// CPUs with AVX512-BF16 (the caller checks).
at::Tensor chunk_attention(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                           const at::Tensor& slots, const at::Tensor& positions) {
  const Call c = prepare(q, keys, values, slots, positions);
  auto* out = c.out.data_ptr<at::BFloat16>();
  const int64_t group = c.H / c.H_kv;
  const int64_t tasks = c.G * c.H_kv;  // each: one chunk's queries over one kv head
  deal_tasks(tasks, [&](int64_t first, int64_t step) {
    std::vector<float> scores;
    std::vector<uint32_t> pairs;
    for (int64_t task = first; task < tasks; task += step) {
      const int64_t g = task / c.H_kv, kv_head = task % c.H_kv;
      const int64_t* position = c.positions + g * c.T;
      const int64_t count = *std::max_element(position, position + c.T) + 1;
      const int64_t stride = (count + TILE_KEYS - 1) / TILE_KEYS * TILE_KEYS;
      const int64_t kv = (c.slots[g] * c.H_kv + kv_head) * c.C * c.D;
      scores.resize(c.kernel.queries * c.kernel.heads * stride);
      pairs.resize(c.D / 2 * stride);
      pair_keys(c.keys + kv, count, c.D, stride, pairs.data());
      for (int64_t t = 0; t < c.T;) {
        const bool together = t + c.kernel.queries <= c.T;
        const AttendChunk attend = together ? c.kernel.chunk : c.kernel.chunk_one;
        int64_t counts[MAX_QUERIES];
        for (int64_t i = 0; i < (together ? c.kernel.queries : 1); ++i) counts[i] = position[t + i] + 1;
        for (int64_t h = kv_head * group; h < (kv_head + 1) * group; h += c.kernel.heads) {
          const int64_t at = ((g * c.T + t) * c.H + h) * c.D;
          attend(c.q + at, c.H * c.D, pairs.data(), stride, c.values + kv, counts, c.D, c.scale, scores.data(),
                 out + at);
        }
        t += together ? c.kernel.queries : 1;
      }
    }
  });
  return c.out;
}

TORCH_LIBRARY(draft_server_attention, m) {
  m.def("query_attention(Tensor q, Tensor keys, Tensor values, Tensor slots, Tensor positions) -> Tensor");
  m.def("chunk_attention(Tensor q, Tensor keys, Tensor values, Tensor slots, Tensor positions) -> Tensor");
}

TORCH_LIBRARY_IMPL(draft_server_attention, CPU, m) {
  m.impl("query_attention", &query_attention);
  m.impl("chunk_attention", &chunk_attention);
}
