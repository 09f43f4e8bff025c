// RMSNorm's normalisation of bf16 rows in one pass over each row:
//
//     out = x / sqrt(sum_d x_d^2 / D + eps), in fp32, rounded to bf16
//
// PyTorch composes the same from about eight operators (a conversion, a pow, a mean, an add, a rsqrt, a multiply,
// a conversion back), and at a decode step's one row of a few hundred values their dispatch costs far more than
// their arithmetic; a model norms twice a layer.
//
// A row's sum of squares runs in one fixed order (16 fp32 lanes along the row, the lanes then summed by
// _mm512_reduce_add_ps, the last D mod 16 values after), and a row is computed by one thread, so its bits depend
// only on the row: not on the other rows of the call, nor on the number of threads. That order is not PyTorch's,
// so a value may differ from F.rms_norm's in its last bit: a model takes one or the other for all its norms
// (transformer.RMSNorm), whichever call computes a token. For CPUs with AVX512F.
//
// Built at first use by attention_kernel.py (torch.utils.cpp_extension) and registered as
// draft_server_rms_norm::rms_norm.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <cmath>

#include "bf16_vectors.h"

namespace {

using bf16_vectors::LANES;
using bf16_vectors::load_bf16;
using bf16_vectors::to_bf16;

constexpr int64_t ROWS_PER_TASK = 16;  // rows a thread takes at least: a decode step's rows stay on the caller

// One row x (D) -> out (D).
void normalise_row(const at::BFloat16* x, int64_t D, float eps, at::BFloat16* out) {
  const int64_t whole = D / LANES * LANES;
  __m512 squares = _mm512_setzero_ps();
  for (int64_t d = 0; d < whole; d += LANES) {
    const __m512 v = load_bf16(x + d);
    squares = _mm512_fmadd_ps(v, v, squares);
  }
  float sum = _mm512_reduce_add_ps(squares);
  for (int64_t d = whole; d < D; ++d) sum += static_cast<float>(x[d]) * static_cast<float>(x[d]);
  const float scale = 1.0f / std::sqrt(sum / static_cast<float>(D) + eps);
  const __m512 scales = _mm512_set1_ps(scale);
  for (int64_t d = 0; d < whole; d += LANES)
    _mm256_storeu_si256((__m256i*)(out + d), to_bf16(_mm512_mul_ps(load_bf16(x + d), scales)));
  for (int64_t d = whole; d < D; ++d) out[d] = at::BFloat16(static_cast<float>(x[d]) * scale);
}

}  // namespace

// x (..., D) contiguous bf16 -> the same shape, each row normalised.
at::Tensor rms_norm(const at::Tensor& x, double eps) {
  TORCH_CHECK(x.dim() >= 1 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(), "x: contiguous (..., D) bf16");
  at::Tensor out = at::empty_like(x);
  const int64_t D = x.size(-1), rows = D ? x.numel() / D : 0;
  const auto* in = x.data_ptr<at::BFloat16>();
  auto* normalised = out.data_ptr<at::BFloat16>();
  at::parallel_for(0, rows, ROWS_PER_TASK, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row)
      normalise_row(in + row * D, D, static_cast<float>(eps), normalised + row * D);
  });
  return out;
}

TORCH_LIBRARY(draft_server_rms_norm, m) { m.def("rms_norm(Tensor x, float eps) -> Tensor"); }

TORCH_LIBRARY_IMPL(draft_server_rms_norm, CPU, m) { m.impl("rms_norm", &rms_norm); }
