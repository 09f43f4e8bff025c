// Causal attention of a few queries per sequence over the KV cache as it lies, for CPUs with AVX512F: a decode
// step's one query per row, or the queries of a prefill's last, incomplete chunk. transformer.block_attention
// is the same computation in PyTorch operators; this one reads each row's bf16 keys and values in place (no
// gather of the window, no fp32 copy of it) and skips the keys past the query.
//
// For each query head, in fp32:
//
//     s_j = (q . k_j) / sqrt(D)  for j = 0..p (p: the query's position),  out = sum_j e^(s_j - max s) v_j / sum_j e^(s_j - max s)
//
// Every sum runs over d or j in one fixed order, and a query head is computed by one thread (beside the heads
// that share its kv head, which share the conversion of each key and value but none of the sums), so its result
// depends only on its own vector and its sequence's keys 0..p: not on the other rows, queries or heads of the
// call, not on the number of threads, not on how far the cache was written past p.
//
// Built at first use by attention_kernel.py (torch.utils.cpp_extension) and registered as
// draft_server_attention::query_attention.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <cmath>
#include <utility>
#include <vector>

namespace {

constexpr int LANES = 16;      // fp32 lanes of a zmm register
constexpr int MAX_VECTORS = 16;  // head_dim up to 256

inline __m512 load_bf16(const at::BFloat16* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}

// fp32 -> bf16, rounding to nearest even as PyTorch's conversion does (without NaN's special case: none occur).
inline __m256i to_bf16(__m512 x) {
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
}

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

// HEADS query heads q (HEADS, D) that share one kv head, over its keys and values (p + 1, D) in bf16 -> out
// (HEADS, D) in bf16. Each key and value is converted once for all HEADS; each head's sums are its own, in the
// order above. VECTORS: D / 16 where the compiler knows it (queries and accumulators then stay in registers),
// else 0 (HEADS 1). scores: room for HEADS x (p + 1) floats.
template <int VECTORS, int HEADS>
void attend(const at::BFloat16* q, const at::BFloat16* keys, const at::BFloat16* values, int64_t count, int64_t D,
            float scale, float* scores, at::BFloat16* out) {
  constexpr int SLOTS = VECTORS ? VECTORS : MAX_VECTORS;
  const int vectors = VECTORS ? VECTORS : D / LANES;
  __m512 query[HEADS][SLOTS];
  for (int h = 0; h < HEADS; ++h)
    for (int v = 0; v < vectors; ++v) query[h][v] = load_bf16(q + h * D + LANES * v);
  for (int64_t j = 0; j < count; ++j) {
    __m512 key[SLOTS];
    for (int v = 0; v < vectors; ++v) key[v] = load_bf16(keys + j * D + LANES * v);
    for (int h = 0; h < HEADS; ++h) {
      __m512 dot = _mm512_mul_ps(query[h][0], key[0]);
      for (int v = 1; v < vectors; ++v) dot = _mm512_fmadd_ps(query[h][v], key[v], dot);
      scores[h * count + j] = _mm512_reduce_add_ps(dot) * scale;
    }
  }
  float totals[HEADS];
  for (int h = 0; h < HEADS; ++h) totals[h] = softmax_numerators(scores + h * count, count);
  __m512 acc[HEADS][SLOTS];
  for (int h = 0; h < HEADS; ++h)
    for (int v = 0; v < vectors; ++v) acc[h][v] = _mm512_setzero_ps();
  for (int64_t j = 0; j < count; ++j) {
    __m512 weight[HEADS];
    for (int h = 0; h < HEADS; ++h) weight[h] = _mm512_set1_ps(scores[h * count + j]);
    for (int v = 0; v < vectors; ++v) {
      const __m512 value = load_bf16(values + j * D + LANES * v);
      for (int h = 0; h < HEADS; ++h) acc[h][v] = _mm512_fmadd_ps(weight[h], value, acc[h][v]);
    }
  }
  for (int h = 0; h < HEADS; ++h)
    for (int v = 0; v < vectors; ++v)
      _mm256_storeu_si256((__m256i*)(out + h * D + LANES * v),
                          to_bf16(_mm512_div_ps(acc[h][v], _mm512_set1_ps(totals[h]))));
}

using Attend = void (*)(const at::BFloat16*, const at::BFloat16*, const at::BFloat16*, int64_t, int64_t, float,
                        float*, at::BFloat16*);

// The instance for head_dim D that takes the most heads of a kv group at once with its queries and accumulators
// in 32 registers, and how many heads that is.
std::pair<Attend, int64_t> choose_attend(int64_t D, int64_t group) {
  if (D == 64) {
    if (group % 4 == 0) return {attend<4, 4>, 4};
    if (group % 3 == 0) return {attend<4, 3>, 3};
    if (group % 2 == 0) return {attend<4, 2>, 2};
    return {attend<4, 1>, 1};
  }
  if (D == 128) return group % 2 == 0 ? std::pair<Attend, int64_t>{attend<8, 2>, 2} : std::pair<Attend, int64_t>{attend<8, 1>, 1};
  return {attend<0, 1>, 1};
}

}  // namespace

// q (G, T, H, D) bf16; keys, values (S, H_kv, C, D) bf16, a layer's cache; slots (G,) and positions (G, T) int64:
// query t of row g sits at positions[g, t] of cache slot slots[g] -> (G, T, H, D) bf16.
at::Tensor query_attention(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                           const at::Tensor& slots, const at::Tensor& positions) {
  TORCH_CHECK(q.dim() == 4 && q.scalar_type() == at::kBFloat16 && q.is_contiguous(), "q: contiguous (G, T, H, D) bf16");
  TORCH_CHECK(keys.dim() == 4 && keys.scalar_type() == at::kBFloat16 && keys.is_contiguous() &&
                  values.sizes() == keys.sizes() && values.scalar_type() == at::kBFloat16 && values.is_contiguous(),
              "keys, values: contiguous (S, H_kv, C, D) bf16");
  const int64_t G = q.size(0), T = q.size(1), H = q.size(2), D = q.size(3);
  const int64_t S = keys.size(0), H_kv = keys.size(1), C = keys.size(2);
  TORCH_CHECK(keys.size(3) == D && D % LANES == 0 && D <= LANES * MAX_VECTORS, "head_dim: a multiple of 16, at most 256");
  TORCH_CHECK(H % H_kv == 0, "query heads: a multiple of the kv heads");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.numel() == G, "slots: (G,) int64");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.sizes() == at::IntArrayRef({G, T}),
              "positions: (G, T) int64");
  const auto slot = slots.contiguous();
  const auto position = positions.contiguous();
  const int64_t* slot_ptr = slot.data_ptr<int64_t>();
  const int64_t* position_ptr = position.data_ptr<int64_t>();
  for (int64_t i = 0; i < G; ++i) TORCH_CHECK(0 <= slot_ptr[i] && slot_ptr[i] < S, "slot out of range");
  for (int64_t i = 0; i < G * T; ++i) TORCH_CHECK(0 <= position_ptr[i] && position_ptr[i] < C, "position out of range");
  auto out = at::empty_like(q);
  const auto* q_ptr = q.data_ptr<at::BFloat16>();
  const auto* key_ptr = keys.data_ptr<at::BFloat16>();
  const auto* value_ptr = values.data_ptr<at::BFloat16>();
  auto* out_ptr = out.data_ptr<at::BFloat16>();
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  const auto [heads_at_once, at_once] = choose_attend(D, H / H_kv);
  const int64_t tasks = G * T * H / at_once;  // each: at_once query heads of one query, sharing a kv head
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(at_once * C);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t h = task * at_once % H, query = task * at_once / H, g = query / T;
      const int64_t kv = (slot_ptr[g] * H_kv + h / (H / H_kv)) * C * D;
      heads_at_once(q_ptr + task * at_once * D, key_ptr + kv, value_ptr + kv, position_ptr[query] + 1, D, scale,
                    scores.data(), out_ptr + task * at_once * D);
    }
  });
  return out;
}

TORCH_LIBRARY(draft_server_attention, m) {
  m.def("query_attention(Tensor q, Tensor keys, Tensor values, Tensor slots, Tensor positions) -> Tensor");
}

TORCH_LIBRARY_IMPL(draft_server_attention, CPU, m) { m.impl("query_attention", &query_attention); }
