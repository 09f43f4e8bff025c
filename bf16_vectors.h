// 16 bf16 values <-> one vector of fp32 lanes (AVX512F): how this project's CPU kernels (query_attention.cpp,
// rms_norm.cpp) read bf16 tensors and write their results, each conversion as PyTorch's own.
#pragma once

#include <ATen/ATen.h>
#include <immintrin.h>

namespace bf16_vectors {

constexpr int LANES = 16;  // fp32 lanes of a zmm register

// 16 bf16 values from p -> fp32, exactly (a bf16 is the top half of an fp32).
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

}  // namespace bf16_vectors
