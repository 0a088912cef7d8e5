// sparkrelay's CPU kernels: what the sources share (AVX-512 helpers) and what bindings.cpp exports.
#pragma once

#include <immintrin.h>
#include <torch/extension.h>

#include <cstdint>

namespace sparkrelay {

constexpr int64_t kLanes = 16;  // fp32 values per zmm register

inline __mmask16 first(int64_t count) {  // the first min(count, 16) lanes, none when count <= 0
  return count >= kLanes ? (__mmask16)0xFFFF : count <= 0 ? 0 : (__mmask16)((1u << count) - 1);
}
inline __m512 load16(const float* p, __mmask16 keep) { return _mm512_maskz_loadu_ps(keep, p); }
inline __m512 load16(const uint16_t* p, __mmask16 keep) {  // bf16 -> fp32: the high half
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(keep, p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
inline void store16(float* p, __mmask16 keep, __m512 v) { _mm512_mask_storeu_ps(p, keep, v); }
inline void store16(uint16_t* p, __mmask16 keep, __m512 v) {  // fp32 -> bf16, round to nearest even
  _mm256_mask_storeu_epi16(p, keep, (__m256i)_mm512_cvtneps_pbh(v));
}

// cpu_linear.cpp
bool use_amx(bool on);
torch::Tensor linear_bf16(const torch::Tensor& x, const torch::Tensor& packed, int64_t n,
                          const c10::optional<torch::Tensor>& bias,
                          const c10::optional<torch::Tensor>& base,
                          const c10::optional<torch::Tensor>& out);
torch::Tensor linear_int8(const torch::Tensor& x, const torch::Tensor& packed,
                          const torch::Tensor& scale, const torch::Tensor& qsum, int64_t n,
                          const c10::optional<torch::Tensor>& bias);
// cpu_attention.cpp
torch::Tensor decode_attention_bf16(const torch::Tensor& q, const torch::Tensor& k_pool,
                                    const torch::Tensor& v_pool, const torch::Tensor& slots,
                                    const torch::Tensor& seq, const torch::Tensor& lengths,
                                    double scale);
// cpu_argmax.cpp
torch::Tensor argmax_rows(const torch::Tensor& x);
// cpu_mask.cpp
void apply_token_bitmask(torch::Tensor& logits, const torch::Tensor& bitmask);
// cpu_norm.cpp
torch::Tensor rms_norm_bf16(const torch::Tensor& x, const torch::Tensor& weight, double eps);

}  // namespace sparkrelay
