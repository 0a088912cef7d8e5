// sparkrelay's CPU kernels: the torch entry points bindings.cpp exports, over cpu_simd.h's helpers
// and one-row functions. The AVX2 build (SPARKRELAY_AVX2_ONLY: cpu_linear_avx2.cpp,
// cpu_rows_avx2.cpp and the ISA-free entry points) sees the declarations only: the AVX-512 helpers
// need their flags to compile.
#pragma once

#include <torch/extension.h>

#include <cstdint>

#include "cpu_simd.h"

namespace sparkrelay {

// cpu_kernel_linear.cpp: the checked bf16 product over one build's bf16_product
torch::Tensor linear_bf16(const torch::Tensor& x, const torch::Tensor& packed, int64_t n,
                          const c10::optional<torch::Tensor>& bias,
                          const c10::optional<torch::Tensor>& base,
                          const c10::optional<torch::Tensor>& out);
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
// cpu_argmax.cpp, cpu_draw.cpp, cpu_mask.cpp: the row kernels' checked entry points (both builds)
torch::Tensor argmax_rows(const torch::Tensor& x);
torch::Tensor draw_rows(const torch::Tensor& weights, const torch::Tensor& u);
void apply_token_bitmask(torch::Tensor& logits, const torch::Tensor& bitmask);
// cpu_elementwise.cpp: a layer's element-wise steps (both builds)
torch::Tensor rms_norm_bf16(const torch::Tensor& x, const torch::Tensor& weight, double eps);
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

// cpu_decode_layer.cpp (both builds)
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
