// An INT4 x bf16 matmul whose cost grows slowly with the rows of a call, for CPUs with AVX512-BF16. It reads
// PyTorch's CPU INT4 layout as it is (int4.py: Int4Linear) and computes, per group of G inputs,
//
//     out[m, n] += scale[g, n] * sum_k x[m, k] (q[n, k] - 8) + offset[g, n] * sum_k x[m, k]
//
// Per 64-column strip and group, the 4-bit integers are unpacked once per call into bf16 (q - 8, exact) in
// the (k, k + 1) pairs vdpbf16ps multiplies, and every row of the call reuses them: PyTorch's kernel
// dequantizes again for every 4 rows. The products x (q - 8) are exact in fp32; the sums run over k in order.
// A row's result therefore depends on nothing but the row and the weights: the same instructions in the
// same order for any number of rows and of threads (threads split the columns, never K).
//
// A LoRA adapter beside the layer (transformer.LoRALinear) rides along: its rank-r side product is added to
// each row's fp32 result before the one rounding to bf16, so a step makes no side matmuls of its own.
//
// Built at first use by int4.py (torch.utils.cpp_extension) and registered as draft_server::int4_bf16dot_mm.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <vector>

namespace {

constexpr int STRIP = 64;           // output columns per strip: the layout's block of 64 rows of W
constexpr int MAX_GROUP_PAIRS = 128;  // k pairs in the largest group (256): 128 x 4 x 64 bytes = 32 KiB
constexpr int ROW_BLOCK = 4;        // rows whose 4 x 4 fp32 group sums stay in registers
constexpr int SUM_ROWS = 16;        // rows whose sums over a group of x accumulate side by side

// One strip's group, its 4-bit integers centred (q - 8, exact in bf16): per k pair, four vectors of 16
// columns x (k, k+1), the pairs vdpbf16ps multiplies.
struct Group {
  alignas(64) __m512bh pairs[MAX_GROUP_PAIRS][4];
};

// bf16(i - 8) for i = 0..15, twice: the table permutexvar_epi16 reads with 5-bit indices.
inline __m512i centred_table() {
  alignas(64) uint16_t table[32];
  for (int i = 0; i < 32; ++i) {
    const float value = static_cast<float>(i % 16 - 8);
    uint32_t bits;
    std::memcpy(&bits, &value, sizeof(bits));
    table[i] = static_cast<uint16_t>(bits >> 16);  // exact: small integers fit bf16
  }
  return _mm512_load_si512(table);
}

// Unpack one group of a strip. bytes: the strip's (K, 32) bytes, the low nibble of byte j holding column j
// and the high nibble column 32 + j; k0: the group's first input.
inline void unpack_group(const uint8_t* bytes, int64_t k0, int64_t pairs, const __m512i table, Group& group) {
  const __m512i nibble = _mm512_set1_epi16(0xF);
  for (int64_t i = 0; i < pairs; ++i) {
    const __m256i row0 = _mm256_loadu_si256((const __m256i*)(bytes + (k0 + 2 * i) * 32));
    const __m256i row1 = _mm256_loadu_si256((const __m256i*)(bytes + (k0 + 2 * i + 1) * 32));
    for (int half = 0; half < 2; ++half) {  // bytes 16 half .. 16 half + 15: columns 16 half.. and 32 + 16 half..
      const __m128i b0 = half ? _mm256_extracti128_si256(row0, 1) : _mm256_castsi256_si128(row0);
      const __m128i b1 = half ? _mm256_extracti128_si256(row1, 1) : _mm256_castsi256_si128(row1);
      // 32 16-bit lanes (k, c0), (k + 1, c0), (k, c1), ...: each byte of k beside the same column's of k + 1
      const __m512i both = _mm512_cvtepu8_epi16(
          _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_unpacklo_epi8(b0, b1)), _mm_unpackhi_epi8(b0, b1), 1));
      const __m512i low = _mm512_and_si512(both, nibble);
      const __m512i high = _mm512_and_si512(_mm512_srli_epi16(both, 4), nibble);
      group.pairs[i][half] = (__m512bh)_mm512_permutexvar_epi16(low, table);
      group.pairs[i][half + 2] = (__m512bh)_mm512_permutexvar_epi16(high, table);
    }
  }
}

// The group's scales and offsets of the strip's 64 columns, 16 per vector. params: (group, strip's first
// column, 0) of the (K/G, N, 2) bf16 tensor, {s0, o0, s1, o1, ...}.
inline void load_params(const at::BFloat16* params, __m512 scale[4], __m512 offset[4]) {
  const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
  const __m512i odd = _mm512_set_epi32(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
  for (int v = 0; v < 4; ++v) {
    const __m256i first = _mm256_loadu_si256((const __m256i*)(params + 32 * v));
    const __m256i second = _mm256_loadu_si256((const __m256i*)(params + 32 * v + 16));
    const __m512 a = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(first), 16));
    const __m512 b = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(second), 16));
    scale[v] = _mm512_permutex2var_ps(a, even, b);
    offset[v] = _mm512_permutex2var_ps(a, odd, b);
  }
}

// For ROWS rows of x (stride K) and one group: acc (ROWS x 64) += scale * sum_k x (q - 8) + offset * sum_k x,
// the sums over the group's inputs in order. row_sums: each row's sum over the group (stride groups).
template <int ROWS>
inline void multiply_group(const at::BFloat16* x, int64_t K, int64_t k0, int64_t pairs, const Group& group,
                           const __m512 scale[4], const __m512 offset[4], const float* row_sums, int64_t groups,
                           float* acc) {
  __m512 sums[ROWS][4];
  for (int r = 0; r < ROWS; ++r)
    for (int v = 0; v < 4; ++v) sums[r][v] = _mm512_setzero_ps();
  for (int64_t i = 0; i < pairs; ++i) {
    for (int r = 0; r < ROWS; ++r) {
      int32_t pair;
      std::memcpy(&pair, x + r * K + k0 + 2 * i, sizeof(pair));
      const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
      for (int v = 0; v < 4; ++v) sums[r][v] = _mm512_dpbf16_ps(sums[r][v], a, group.pairs[i][v]);
    }
  }
  for (int r = 0; r < ROWS; ++r) {
    const __m512 row_sum = _mm512_set1_ps(row_sums[r * groups]);
    for (int v = 0; v < 4; ++v) {
      __m512 c = _mm512_loadu_ps(acc + r * STRIP + 16 * v);
      c = _mm512_fmadd_ps(sums[r][v], scale[v], c);
      c = _mm512_fmadd_ps(row_sum, offset[v], c);
      _mm512_storeu_ps(acc + r * STRIP + 16 * v, c);
    }
  }
}

inline void multiply_rows(const at::BFloat16* x, int64_t rows, int64_t K, int64_t k0, int64_t pairs,
                          const Group& group, const __m512 scale[4], const __m512 offset[4], const float* row_sums,
                          int64_t groups, float* acc) {
  int64_t r = 0;
  for (; r + ROW_BLOCK <= rows; r += ROW_BLOCK)
    multiply_group<ROW_BLOCK>(x + r * K, K, k0, pairs, group, scale, offset, row_sums + r * groups, groups,
                              acc + r * STRIP);
  const int64_t rest = rows - r;
  if (rest == 3)
    multiply_group<3>(x + r * K, K, k0, pairs, group, scale, offset, row_sums + r * groups, groups, acc + r * STRIP);
  if (rest == 2)
    multiply_group<2>(x + r * K, K, k0, pairs, group, scale, offset, row_sums + r * groups, groups, acc + r * STRIP);
  if (rest == 1)
    multiply_group<1>(x + r * K, K, k0, pairs, group, scale, offset, row_sums + r * groups, groups, acc + r * STRIP);
}

}  // namespace

// The sums x[m] . a[r] of RANKS consecutive rows r of A, each over k in order (side by side, so that their
// fused multiply-adds do not wait on each other).
template <int RANKS>
inline void adapter_sums(const at::BFloat16* x, const float* a, int64_t K, float* t) {
  __m512 dot[RANKS];
  for (int r = 0; r < RANKS; ++r) dot[r] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 16) {
    const __m256i bits = _mm256_loadu_si256((const __m256i*)(x + k));
    const __m512 xs = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
    for (int r = 0; r < RANKS; ++r) dot[r] = _mm512_fmadd_ps(xs, _mm512_loadu_ps(a + r * K + k), dot[r]);
  }
  for (int r = 0; r < RANKS; ++r) t[r] = _mm512_reduce_add_ps(dot[r]);
}

// A LoRA adapter's rank-R input of each row, t = x A^T: (M, R) fp32.
static std::vector<float> adapter_inputs(const at::BFloat16* x, int64_t M, int64_t K, const at::Tensor& lora_A) {
  const int64_t R = lora_A.size(0);
  const float* a = lora_A.data_ptr<float>();
  std::vector<float> t(M * R);
  for (int64_t m = 0; m < M; ++m) {
    int64_t r = 0;
    for (; r + 4 <= R; r += 4) adapter_sums<4>(x + m * K, a + r * K, K, &t[m * R + r]);
    for (; r < R; ++r) adapter_sums<1>(x + m * K, a + r * K, K, &t[m * R + r]);
  }
  return t;
}

// x (M, K) bf16 @ W^T -> (M, N) bf16, W the INT4 weight in PyTorch's CPU layout: packed (N, K/2) uint8 and
// scales_and_offsets (K/G, N, 2) bf16, W[n, k] = (q - 8) * scale + offset. With a LoRA adapter, lora_A (R, K)
// and lora_Bt (N/64, R, 64) fp32 (B transposed and cut into the strips' blocks, its scale folded in), each
// row's side product (x A^T) B^T is added to its fp32 result before the one rounding to bf16: the sum over r
// in order, after the INT4 product.
at::Tensor int4_bf16dot_mm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales_and_offsets,
                           int64_t group_size, const c10::optional<at::Tensor>& lora_A,
                           const c10::optional<at::Tensor>& lora_Bt) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(), "x: contiguous (M, K) bf16");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous(), "packed: contiguous uint8");
  const int64_t M = x.size(0), K = x.size(1), N = packed.size(0);
  TORCH_CHECK(packed.size(1) * 2 == K && N % STRIP == 0 && K % 2 == 0, "packed: (N, K/2) with N a multiple of 64");
  TORCH_CHECK(scales_and_offsets.scalar_type() == at::kBFloat16 && scales_and_offsets.is_contiguous() &&
                  scales_and_offsets.size(0) * group_size == K && scales_and_offsets.size(1) == N,
              "scales_and_offsets: contiguous (K/G, N, 2) bf16");
  TORCH_CHECK(group_size % 2 == 0 && group_size / 2 <= MAX_GROUP_PAIRS, "group size: even, at most 256");
  const bool adapter = lora_A.has_value();
  TORCH_CHECK(adapter == lora_Bt.has_value(), "lora_A and lora_Bt: both or neither");
  const int64_t R = adapter ? lora_A->size(0) : 0;
  if (adapter)
    TORCH_CHECK(lora_A->scalar_type() == at::kFloat && lora_A->is_contiguous() && lora_A->dim() == 2 &&
                    lora_A->size(1) == K && K % 16 == 0 && lora_Bt->scalar_type() == at::kFloat &&
                    lora_Bt->is_contiguous() && lora_Bt->dim() == 3 && lora_Bt->size(0) == N / STRIP &&
                    lora_Bt->size(1) == R && lora_Bt->size(2) == STRIP,
                "lora_A (R, K) and lora_Bt (N/64, R, 64): contiguous fp32, K a multiple of 16");
  auto out = at::empty({M, N}, x.options());
  if (M == 0) return out;
  const int64_t groups = K / group_size;
  // Each row's sum over each group, in order: the offset's share of the product. Rows go SUM_ROWS at a time with
  // their sums side by side, so that the additions of different rows overlap instead of waiting on each other.
  std::vector<float> row_sums(M * groups);
  const auto* x_ptr = x.data_ptr<at::BFloat16>();
  for (int64_t r0 = 0; r0 < M; r0 += SUM_ROWS) {
    const int64_t rows = std::min<int64_t>(SUM_ROWS, M - r0);
    for (int64_t g = 0; g < groups; ++g) {
      float sums[SUM_ROWS] = {};
      for (int64_t k = g * group_size; k < (g + 1) * group_size; ++k)
        for (int64_t r = 0; r < rows; ++r) sums[r] += static_cast<float>(x_ptr[(r0 + r) * K + k]);
      for (int64_t r = 0; r < rows; ++r) row_sums[(r0 + r) * groups + g] = sums[r];
    }
  }
  const auto* bytes = packed.data_ptr<uint8_t>();
  const auto* params = scales_and_offsets.data_ptr<at::BFloat16>();
  auto* out_ptr = out.data_ptr<at::BFloat16>();
  const std::vector<float> side_inputs = adapter ? adapter_inputs(x_ptr, M, K, *lora_A) : std::vector<float>();
  const float* b_t = adapter ? lora_Bt->data_ptr<float>() : nullptr;
  const __m512i table = centred_table();
  at::parallel_for(0, N / STRIP, 1, [&](int64_t begin, int64_t end) {
    Group group;
    __m512 scale[4], offset[4];
    std::vector<float> acc(M * STRIP);
    for (int64_t strip = begin; strip < end; ++strip) {
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t g = 0; g < groups; ++g) {
        const int64_t k0 = g * group_size;
        unpack_group(bytes + strip * K * 32, k0, group_size / 2, table, group);
        load_params(params + (g * N + strip * STRIP) * 2, scale, offset);
        multiply_rows(x_ptr, M, K, k0, group_size / 2, group, scale, offset, row_sums.data() + g, groups, acc.data());
      }
      for (int64_t r = 0; r < M; ++r) {
        __m512 c[4];
        for (int v = 0; v < 4; ++v) c[v] = _mm512_loadu_ps(acc.data() + r * STRIP + 16 * v);
        if (adapter) {
          const float* block = b_t + strip * R * STRIP;  // the strip's (R, 64) part of B^T, contiguous
          __m512 side[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
          for (int64_t i = 0; i < R; ++i) {
            const __m512 t = _mm512_set1_ps(side_inputs[r * R + i]);
            for (int v = 0; v < 4; ++v) side[v] = _mm512_fmadd_ps(t, _mm512_loadu_ps(block + i * STRIP + 16 * v), side[v]);
          }
          for (int v = 0; v < 4; ++v) c[v] = _mm512_add_ps(c[v], side[v]);
        }
        for (int v = 0; v < 4; ++v)
          _mm256_storeu_si256((__m256i*)(out_ptr + r * N + strip * STRIP + 16 * v), (__m256i)_mm512_cvtneps_pbh(c[v]));
      }
    }
  });
  return out;
}

TORCH_LIBRARY(draft_server, m) {
  m.def(
      "int4_bf16dot_mm(Tensor x, Tensor packed, Tensor scales_and_offsets, int group_size, Tensor? lora_A=None, "
      "Tensor? lora_Bt=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(draft_server, CPU, m) { m.impl("int4_bf16dot_mm", &int4_bf16dot_mm); }
