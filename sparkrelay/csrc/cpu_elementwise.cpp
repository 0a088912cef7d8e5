// Element-wise bf16 steps of a layer that torch runs as several ops (each a dispatch, an
// allocation and a pass over memory), fused into one pass with the same per-op rounding to bf16:
//   silu_mul_bf16: SwiGLU's bf16(bf16(silu(g)) * u), silu(g) = g / (1 + e^-g) in fp32
//   rope_bf16:     bf16(bf16(x * cos) + bf16(roll(x, D/2) * sin)), sin's first half negated
// RoPE equals torch's bit for bit (products of two bf16 values are exact in fp32, each op rounds
// once); SiLU's e^x is exp16, not torch's, so a value may differ by one bf16 step where the two
// land on either side of a rounding boundary (docs/cpu_kernels.md).

#include "cpu_kernels.h"

#include <ATen/Parallel.h>

namespace sparkrelay {
namespace {

constexpr int64_t kGrainValues = 32768;  // values per parallel task: small calls stay on one thread

void silu_mul_row(const uint16_t* gate, const uint16_t* up, int64_t n, uint16_t* y) {
  const __m512 one = _mm512_set1_ps(1.f);
  for (int64_t i = 0; i < n; i += kLanes) {
    const __mmask16 keep = first(n - i);
    const __m512 g = load16(gate + i, keep);
    const __m512 minus = _mm512_sub_ps(_mm512_setzero_ps(), g);
    const __m512 silu = round_bf16(_mm512_div_ps(g, _mm512_add_ps(one, exp16(minus))));
    store16(y + i, keep, _mm512_mul_ps(silu, load16(up + i, keep)));
  }
}

// one head row of D values: the halves swap for the rotated term
void rope_row(const uint16_t* x, const uint16_t* cos, const uint16_t* sin, int64_t d,
              uint16_t* y) {
  const int64_t half = d / 2;
  for (int64_t i = 0; i < d; i += kLanes) {
    const int64_t j = i < half ? i + half : i - half;  // roll(x, D/2)[i] = x[i - D/2 mod D]
    const __m512 a = round_bf16(_mm512_mul_ps(load16(x + i, 0xFFFF), load16(cos + i, 0xFFFF)));
    const __m512 b = round_bf16(_mm512_mul_ps(load16(x + j, 0xFFFF), load16(sin + i, 0xFFFF)));
    store16(y + i, 0xFFFF, _mm512_add_ps(a, b));
  }
}

const uint16_t* bits(const torch::Tensor& t) {
  return reinterpret_cast<const uint16_t*>(t.data_ptr<at::BFloat16>());
}

}  // namespace

// gate_up [T, 2I] bf16 (gate then up, I contiguous, rows any stride) -> [T, I] bf16
torch::Tensor silu_mul_bf16(const torch::Tensor& gate_up) {
  TORCH_CHECK(gate_up.device().is_cpu() && gate_up.scalar_type() == torch::kBFloat16 &&
                  gate_up.dim() == 2 && gate_up.stride(1) == 1 && gate_up.size(1) % 2 == 0,
              "silu_mul_bf16: gate_up must be a bfloat16 CPU tensor [T, 2I], I contiguous");
  const int64_t t = gate_up.size(0), n = gate_up.size(1) / 2, ld = gate_up.stride(0);
  torch::Tensor y = torch::empty({t, n}, gate_up.options());
  const uint16_t* g = bits(gate_up);
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  at::parallel_for(0, t, std::max<int64_t>(1, kGrainValues / n), [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) silu_mul_row(g + r * ld, g + r * ld + n, n, yp + r * n);
  });
  return y;
}

// x [T, G, D] bf16 (D contiguous, a token's G rows D apart, tokens any stride), cos and sin [T, 1, D]
// bf16 (D contiguous) -> [T, G, D] bf16, contiguous; D a multiple of 32 (each half whole vectors)
torch::Tensor rope_bf16(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kBFloat16 && x.dim() == 3,
              "rope_bf16: x must be a 3-D bfloat16 CPU tensor [T, G, D]");
  const int64_t t = x.size(0), g = x.size(1), d = x.size(2);
  TORCH_CHECK(d % 32 == 0 && x.stride(2) == 1 && (g == 1 || x.stride(1) == d),
              "rope_bf16: x's head rows must be contiguous, D a multiple of 32");
  for (const auto* table : {&cos, &sin}) {
    TORCH_CHECK(table->scalar_type() == torch::kBFloat16 && table->dim() == 3 &&
                    table->size(0) == t && table->size(1) == 1 && table->size(2) == d &&
                    table->stride(2) == 1,
                "rope_bf16: cos and sin must be bfloat16 [T, 1, D], D contiguous");
  }
  torch::Tensor y = torch::empty({t, g, d}, x.options());
  const uint16_t *xp = bits(x), *cp = bits(cos), *sp = bits(sin);
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  const int64_t ldx = x.stride(0), ldc = cos.stride(0), lds = sin.stride(0);
  at::parallel_for(0, t, std::max<int64_t>(1, kGrainValues / (g * d)), [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) {
      for (int64_t h = 0; h < g; ++h) {
        rope_row(xp + r * ldx + h * d, cp + r * ldc, sp + r * lds, d, yp + (r * g + h) * d);
      }
    }
  });
  return y;
}

}  // namespace sparkrelay
