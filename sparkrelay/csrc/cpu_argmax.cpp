// The index of each row's largest value, as torch.argmax(x, -1) gives it (the first of equal
// maxima; the first NaN when a row has one), for float32 and bfloat16 rows. torch's CPU argmax is
// slow on a row of logits, bf16 most of all (figures: docs/cpu_kernels.md), and greedy decoding
// and a DSpark round take several per step. One row's work is row_argmax (cpu_rows.cpp, or
// cpu_rows_avx2.cpp in the AVX2 build); here the checks and the threads.

#include "cpu_kernels.h"

#include <ATen/Parallel.h>

namespace sparkrelay {
namespace {

template <typename T>
void rows_argmax(const T* x, int64_t rows, int64_t n, int64_t ld, int64_t* out) {
  at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) out[r] = row_argmax(x + r * ld, n);
  });
}

}  // namespace

torch::Tensor argmax_rows(const torch::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.size(1) > 0 &&
                  (x.stride(1) == 1 || x.size(1) == 1),
              "argmax_rows: x must be a CPU tensor [R, V] with V > 0 contiguous");
  const int64_t rows = x.size(0), n = x.size(1), ld = x.stride(0);
  torch::Tensor out = torch::empty({rows}, torch::kLong);
  int64_t* op = out.data_ptr<int64_t>();
  if (x.scalar_type() == torch::kFloat32) {
    rows_argmax(x.data_ptr<float>(), rows, n, ld, op);
  } else {
    TORCH_CHECK(x.scalar_type() == torch::kBFloat16, "argmax_rows: x must be float32 or bfloat16");
    rows_argmax(reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()), rows, n, ld, op);
  }
  return out;
}

}  // namespace sparkrelay
