// One draw per row from non-negative float32 weights by the inverse CDF: the first index whose
// running sum exceeds u * total, sums in double. It replaces the exponential race (the argmax of
// p / E, E ~ Exp(1)), which needs one exponential per vocabulary entry, where a row here is two
// passes over data in cache and one uniform (figures: docs/architecture.md, speed notes). A zero
// weight is never drawn; the weights need not sum to one (a residual). One row's work is row_draw
// (cpu_rows.cpp, or cpu_rows_avx2.cpp in the AVX2 build); here the checks and the threads.

#include "cpu_kernels.h"

#include <ATen/Parallel.h>

namespace sparkrelay {

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
