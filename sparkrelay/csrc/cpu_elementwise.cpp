// A layer's element-wise bf16 steps that torch runs as several ops each (a dispatch, an
// allocation and a pass over memory per op), fused into one pass per row, each op rounded to bf16:
//   rms_norm_bf16: bf16(w * bf16(x / sqrt(mean(x^2) + eps))), the row normalized in fp32 (as
//                  transformers does; torch's bf16 path is eight ops and four dtype conversions)
//   silu_mul_bf16: SwiGLU's bf16(bf16(silu(g)) * u), silu(g) = g / (1 + e^-g) in fp32
//   rope_bf16:     bf16(bf16(x * cos) + bf16(roll(x, D/2) * sin)), sin's first half negated
// RoPE equals torch's bit for bit (products of two bf16 values are exact in fp32, each op rounds
// once); the norm's sum of squares and SiLU's e^x are not torch's own, so a value may differ by one
// bf16 step where the two land on either side of a rounding boundary (docs/cpu_kernels.md). Here:
// the checks and the threads; the rows are cpu_rows.cpp's or cpu_rows_avx2.cpp's.

#include "cpu_kernels.h"

#include <ATen/Parallel.h>

namespace sparkrelay {
namespace {

constexpr int64_t kGrainValues = 32768;  // values per parallel task: small calls stay on one thread

const uint16_t* bits(const torch::Tensor& t) {
  return reinterpret_cast<const uint16_t*>(t.data_ptr<at::BFloat16>());
}
uint16_t* bits_out(torch::Tensor& t) {
  return reinterpret_cast<uint16_t*>(t.data_ptr<at::BFloat16>());
}

// x [T, G, D] bf16 with D contiguous and a token's G rows D apart (tokens any stride), as the
// norm and RoPE read it
void check_heads(const torch::Tensor& x, const char* what) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kBFloat16 && x.dim() == 3, what,
              ": x must be a 3-D bfloat16 CPU tensor [T, G, D]");
  TORCH_CHECK(x.stride(2) == 1 && (x.size(1) == 1 || x.stride(1) == x.size(2)), what,
              ": x's G rows must be contiguous");
}

}  // namespace

// x [T, G, D] bf16 (D contiguous, the G rows of a token D apart, tokens any stride), weight [G, D]
// bf16 -> y [T, G, D] bf16, contiguous
torch::Tensor rms_norm_bf16(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  check_heads(x, "rms_norm_bf16");
  const int64_t t = x.size(0), g = x.size(1), d = x.size(2);
  TORCH_CHECK(weight.scalar_type() == torch::kBFloat16 && weight.is_contiguous() &&
                  weight.numel() == g * d,
              "rms_norm_bf16: weight must be bfloat16 [G, D] matching x");
  torch::Tensor y = torch::empty({t, g, d}, x.options());
  const uint16_t *xp = bits(x), *wp = bits(weight);
  uint16_t* yp = bits_out(y);
  const int64_t ldx = x.stride(0);
  const float e = static_cast<float>(eps);
  const int64_t grain = std::max<int64_t>(1, kGrainValues / 2 / (g * d));
  at::parallel_for(0, t, grain, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      for (int64_t j = 0; j < g; ++j) {
        row_norm(xp + i * ldx + j * d, wp + j * d, e, d, yp + (i * g + j) * d);
      }
    }
  });
  return y;
}

// gate_up [T, 2I] bf16 (gate then up, I contiguous, rows any stride) -> [T, I] bf16
torch::Tensor silu_mul_bf16(const torch::Tensor& gate_up) {
  TORCH_CHECK(gate_up.device().is_cpu() && gate_up.scalar_type() == torch::kBFloat16 &&
                  gate_up.dim() == 2 && gate_up.stride(1) == 1 && gate_up.size(1) % 2 == 0,
              "silu_mul_bf16: gate_up must be a bfloat16 CPU tensor [T, 2I], I contiguous");
  const int64_t t = gate_up.size(0), n = gate_up.size(1) / 2, ld = gate_up.stride(0);
  torch::Tensor y = torch::empty({t, n}, gate_up.options());
  const uint16_t* g = bits(gate_up);
  uint16_t* yp = bits_out(y);
  at::parallel_for(0, t, std::max<int64_t>(1, kGrainValues / n), [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) row_silu_mul(g + r * ld, g + r * ld + n, n, yp + r * n);
  });
  return y;
}

// x [T, G, D] bf16 (D contiguous, a token's G rows D apart, tokens any stride), cos and sin
// [T, 1, D] bf16 (D contiguous) -> [T, G, D] bf16, contiguous; D a multiple of 32 (each half whole
// vectors)
torch::Tensor rope_bf16(const torch::Tensor& x, const torch::Tensor& cos,
                        const torch::Tensor& sin) {
  check_heads(x, "rope_bf16");
  const int64_t t = x.size(0), g = x.size(1), d = x.size(2);
  TORCH_CHECK(d % 32 == 0, "rope_bf16: D must be a multiple of 32");
  for (const auto* table : {&cos, &sin}) {
    TORCH_CHECK(table->scalar_type() == torch::kBFloat16 && table->dim() == 3 &&
                    table->size(0) == t && table->size(1) == 1 && table->size(2) == d &&
                    table->stride(2) == 1,
                "rope_bf16: cos and sin must be bfloat16 [T, 1, D], D contiguous");
  }
  torch::Tensor y = torch::empty({t, g, d}, x.options());
  const uint16_t *xp = bits(x), *cp = bits(cos), *sp = bits(sin);
  uint16_t* yp = bits_out(y);
  const int64_t ldx = x.stride(0), ldc = cos.stride(0), lds = sin.stride(0);
  const int64_t grain = std::max<int64_t>(1, kGrainValues / (g * d));
  at::parallel_for(0, t, grain, [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) {
      for (int64_t h = 0; h < g; ++h) {
        row_rope(xp + r * ldx + h * d, cp + r * ldc, sp + r * lds, d, yp + (r * g + h) * d);
      }
    }
  });
  return y;
}

}  // namespace sparkrelay
