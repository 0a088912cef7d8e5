// One draw per row from non-negative float32 weights by the inverse CDF: the first index whose
// running sum exceeds u * total, sums in double. It replaces the exponential race (the argmax of
// p / E, E ~ Exp(1)), which needs one exponential per vocabulary entry, where a row here is two
// passes over data in cache and one uniform (figures: docs/architecture.md, speed notes). A zero weight is never drawn; the weights need not sum to one (a residual).

#include "cpu_kernels.h"

#include <ATen/Parallel.h>

namespace sparkrelay {
namespace {

// the sum of 16 floats at p (lanes past `keep` zero), in double
inline double block_sum(const float* p, __mmask16 keep) {
  const __m512 v = _mm512_maskz_loadu_ps(keep, p);
  const __m512d lo = _mm512_cvtps_pd(_mm512_castps512_ps256(v));
  const __m512d hi = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
  return _mm512_reduce_add_pd(_mm512_add_pd(lo, hi));
}

int64_t row_draw(const float* w, int64_t n, double u) {
  __m512d acc0 = _mm512_setzero_pd(), acc1 = _mm512_setzero_pd();
  for (int64_t i = 0; i < n; i += kLanes) {
    const __m512 v = _mm512_maskz_loadu_ps(first(n - i), w + i);
    acc0 = _mm512_add_pd(acc0, _mm512_cvtps_pd(_mm512_castps512_ps256(v)));
    acc1 = _mm512_add_pd(
        acc1, _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1))));
  }
  const double target = u * _mm512_reduce_add_pd(_mm512_add_pd(acc0, acc1));
  double run = 0.0;
  for (int64_t i = 0; i < n; i += kLanes) {
    const double block = block_sum(w + i, first(n - i));
    if (run + block <= target) {  // not in this block: skip it whole
      run += block;
      continue;
    }
    for (int64_t j = i; j < std::min(n, i + kLanes); ++j) {
      run += w[j];
      if (run > target) return j;  // w[j] > 0: a zero weight leaves run where it was
    }
  }
  for (int64_t j = n - 1; j > 0; --j) {  // rounding left the target past every sum: the last weight
    if (w[j] > 0.f) return j;
  }
  return 0;
}

}  // namespace

// weights [R, V] float32 (>= 0, V contiguous, rows any stride), u [R] float64 in [0, 1) -> int64 [R]
torch::Tensor draw_rows(const torch::Tensor& weights, const torch::Tensor& u) {
  TORCH_CHECK(weights.device().is_cpu() && weights.dim() == 2 && weights.size(1) > 0 &&
                  weights.scalar_type() == torch::kFloat32 &&
                  (weights.stride(1) == 1 || weights.size(1) == 1),
              "draw_rows: weights must be a float32 CPU tensor [R, V] with V > 0 contiguous");
  TORCH_CHECK(u.scalar_type() == torch::kFloat64 && u.is_contiguous() &&
                  u.numel() == weights.size(0),
              "draw_rows: u must be float64 [R], one uniform per row");
  const int64_t rows = weights.size(0), n = weights.size(1), ld = weights.stride(0);
  torch::Tensor out = torch::empty({rows}, torch::kLong);
  int64_t* op = out.data_ptr<int64_t>();
  const float* wp = weights.data_ptr<float>();
  const double* up = u.data_ptr<double>();
  at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) op[r] = row_draw(wp + r * ld, n, up[r]);
  });
  return out;
}

}  // namespace sparkrelay
