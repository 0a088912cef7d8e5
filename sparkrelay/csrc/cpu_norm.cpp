// RMSNorm for bfloat16 activations in one pass per row, as transformers computes it: the row
// normalized in fp32, rounded to bf16, then scaled by the weight (bf16 product):
//   y = bf16(w * bf16(x / sqrt(mean(x^2) + eps)))
// torch's bf16 path runs this as eight ops and four dtype conversions per call, and a decode step
// calls it three times a layer (figures: docs/architecture.md, speed notes).

#include "cpu_kernels.h"

#include <ATen/Parallel.h>

#include <cmath>

namespace sparkrelay {
namespace {

// one row of d values (bf16) with its weight row -> y
void norm_row(const uint16_t* x, const uint16_t* w, float eps, int64_t d, uint16_t* y) {
  __m512 squares = _mm512_setzero_ps();
  for (int64_t i = 0; i < d; i += kLanes) {
    const __m512 v = load16(x + i, first(d - i));
    squares = _mm512_fmadd_ps(v, v, squares);
  }
  const float r = 1.f / std::sqrt(_mm512_reduce_add_ps(squares) / static_cast<float>(d) + eps);
  const __m512 scale = _mm512_set1_ps(r);
  for (int64_t i = 0; i < d; i += kLanes) {
    const __mmask16 keep = first(d - i);
    // round the normalized value to bf16 before the weight, as the reference does
    const __m512 n = round_bf16(_mm512_mul_ps(load16(x + i, keep), scale));
    store16(y + i, keep, _mm512_mul_ps(n, load16(w + i, keep)));
  }
}

}  // namespace

// x [T, G, D] bf16 (D contiguous, the G rows of a token D apart, tokens any stride), weight [G, D]
// bf16 -> y [T, G, D] bf16, contiguous
torch::Tensor rms_norm_bf16(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kBFloat16 && x.dim() == 3,
              "rms_norm_bf16: x must be a 3-D bfloat16 CPU tensor [T, G, D]");
  const int64_t t = x.size(0), g = x.size(1), d = x.size(2);
  TORCH_CHECK(x.stride(2) == 1 && (g == 1 || x.stride(1) == d),
              "rms_norm_bf16: x's G rows must be contiguous");
  TORCH_CHECK(weight.scalar_type() == torch::kBFloat16 && weight.is_contiguous() &&
                  weight.numel() == g * d,
              "rms_norm_bf16: weight must be bfloat16 [G, D] matching x");
  torch::Tensor y = torch::empty({t, g, d}, x.options());
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const auto* wp = reinterpret_cast<const uint16_t*>(weight.data_ptr<at::BFloat16>());
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  const int64_t ldx = x.stride(0), grain = std::max<int64_t>(1, 16384 / (g * d));
  at::parallel_for(0, t, grain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      for (int64_t j = 0; j < g; ++j) {
        const int64_t row = i * g + j;
        norm_row(xp + i * ldx + j * d, wp + j * d, static_cast<float>(eps), d, yp + row * d);
      }
    }
  });
  return y;
}

}  // namespace sparkrelay
