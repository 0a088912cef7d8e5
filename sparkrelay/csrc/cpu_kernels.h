// sparkrelay's CPU kernels: what the sources share (AVX-512 helpers) and what bindings.cpp exports.
// The AVX2 build (SPARKRELAY_AVX2_ONLY: cpu_linear_avx2.cpp, cpu_kernel_linear.cpp, bindings.cpp)
// sees the declarations only: the helpers need AVX-512 to compile.
#pragma once

#include <immintrin.h>
#include <torch/extension.h>

#include <cstdint>

namespace sparkrelay {

#ifndef SPARKRELAY_AVX2_ONLY
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

// e^x, 16 lanes: 2^n * p(f), x = n ln 2 + f, |f| <= ln2 / 2 (0 below -87, inf past ~88.7)
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));  // below: e^x underflows to 0 anyway
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693147181f), x);
  __m512 p = _mm512_set1_ps(1.f / 720);  // Taylor to f^6: error < 2e-7 on |f| <= 0.35
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 120));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 24));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}
inline __m512 round_bf16(__m512 v) {  // v rounded to bf16 (nearest even) and back: one torch bf16 op
  const __m256i h = (__m256i)_mm512_cvtneps_pbh(v);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
#endif  // SPARKRELAY_AVX2_ONLY

// cpu_kernel_linear.cpp: the checked bf16 product over one build's bf16_product
constexpr int64_t kPackedCols = 32;  // output columns per packed tile (models/cpu_kernels.py TILE)
constexpr int64_t kPackedPair = 64;  // bf16 elements per (tile, pair of K)
torch::Tensor linear_bf16(const torch::Tensor& x, const torch::Tensor& packed, int64_t n,
                          const c10::optional<torch::Tensor>& bias,
                          const c10::optional<torch::Tensor>& base,
                          const c10::optional<torch::Tensor>& out);
// y [rows, n] (N contiguous, ldy apart) = x [rows, 2 pairs] W^T + bias + base, as checked there
struct Bf16Operands {
  const uint16_t* x;     // [rows, 2 pairs] bf16, ldx apart
  int64_t ldx;
  const uint16_t* w;     // packed (cpu_linear.cpp's order)
  const float* bias;     // [n padded to 32] or null
  const uint16_t* base;  // [rows, n] bf16, ldb apart, or null
  int64_t ldb, rows, pairs, n, ldy;
};
// cpu_linear.cpp (AVX-512, AMX) or cpu_linear_avx2.cpp (AVX2): one of them per build
void bf16_product(const Bf16Operands& o, float* y);
void bf16_product(const Bf16Operands& o, uint16_t* y);
// cpu_linear.cpp
bool use_amx(bool on);
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

// cpu_draw.cpp
torch::Tensor draw_rows(const torch::Tensor& weights, const torch::Tensor& u);
// cpu_mask.cpp
void apply_token_bitmask(torch::Tensor& logits, const torch::Tensor& bitmask);
// cpu_norm.cpp
torch::Tensor rms_norm_bf16(const torch::Tensor& x, const torch::Tensor& weight, double eps);
// cpu_elementwise.cpp
torch::Tensor silu_mul_bf16(const torch::Tensor& gate_up);
torch::Tensor rope_bf16(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin);

// cpu_kernel_linear.cpp
// one frozen linear in a kernel's packed layout: bf16, or int8 with per-column scale and sums
class KernelLinear {
 public:
  KernelLinear(torch::Tensor packed, int64_t n, int64_t k, c10::optional<torch::Tensor> bias,
               c10::optional<torch::Tensor> scale, c10::optional<torch::Tensor> qsum);
  torch::Tensor operator()(const torch::Tensor& x) const;  // x [M, K] -> [M, N] in x's dtype
  // out [M, N] (fp32 or bf16, N contiguous) = base [M, N] (bf16) + x [M, K] W^T: bf16 weights
  // (even K) in one pass, the sum rounded once; int8 as out = base, out += the product
  void add_into(const torch::Tensor& x, const torch::Tensor& base, torch::Tensor& out) const;
  int64_t n() const { return n_; }
  int64_t k() const { return k_; }

 private:
  torch::Tensor packed_;
  c10::optional<torch::Tensor> bias_, scale_, qsum_;
  int64_t n_, k_;
};

// cpu_decode_layer.cpp
// a decoder layer's forward for a few bf16 rows, bit-equal to models/decoder.py's on the kernels
class DecodeLayer {
 public:
  DecodeLayer(KernelLinear qkv, KernelLinear o, KernelLinear gate_up, KernelLinear down,
              torch::Tensor input_norm, torch::Tensor post_norm,
              c10::optional<torch::Tensor> qk_norm, int64_t heads, int64_t kv_heads,
              int64_t head_dim, double eps, double qk_eps, double scale);
  torch::Tensor forward(const torch::Tensor& h, const torch::Tensor& cos, const torch::Tensor& sin,
                        torch::Tensor& k_pool, torch::Tensor& v_pool, const torch::Tensor& slots,
                        const torch::Tensor& kv_index, const torch::Tensor& seq,
                        const torch::Tensor& lengths) const;

 private:
  KernelLinear qkv_, o_, gate_up_, down_;
  torch::Tensor input_norm_, post_norm_;
  c10::optional<torch::Tensor> qk_norm_;
  int64_t heads_, kv_heads_, head_dim_;
  double eps_, qk_eps_, scale_;
};

// cpu_markov.cpp
// the vanilla Markov head's greedy block: {drafts [R, B], Z [R, B, V] fp32}
std::vector<torch::Tensor> markov_greedy(const torch::Tensor& u, const torch::Tensor& w1,
                                         const KernelLinear& w2,
                                         const c10::optional<torch::Tensor>& vocab,
                                         const torch::Tensor& anchors);

}  // namespace sparkrelay
