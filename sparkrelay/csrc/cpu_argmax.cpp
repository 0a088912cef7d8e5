// The index of each row's largest value, as torch.argmax(x, -1) gives it (the first of equal
// maxima; the first NaN when a row has one), for float32 and bfloat16 rows. torch's CPU argmax is
// slow on a row of logits, bf16 most of all (figures: docs/cpu_kernels.md), and greedy decoding
// and a DSpark round take several per step. Here a row is two vector passes over data still in
// cache: its maximum, then the first lane equal to it.

#include "cpu_kernels.h"

#include <ATen/Parallel.h>

#include <limits>

namespace sparkrelay {
namespace {

// the first index of a NaN in row [n], or -1
template <typename T>
int64_t first_nan(const T* row, int64_t n) {
  for (int64_t i = 0; i < n; i += kLanes) {
    const __mmask16 keep = first(n - i);
    const __m512 v = load16(row + i, keep);
    const __mmask16 nan = _mm512_mask_cmp_ps_mask(keep, v, v, _CMP_UNORD_Q);
    if (nan) return i + __builtin_ctz(nan);
  }
  return -1;
}

template <typename T>
int64_t row_argmax(const T* row, int64_t n) {
  const __m512 low = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 top = low;
  __mmask16 nan = 0;
  for (int64_t i = 0; i < n; i += kLanes) {
    const __mmask16 keep = first(n - i);
    const __m512 v = _mm512_mask_mov_ps(low, keep, load16(row + i, keep));
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    top = _mm512_max_ps(top, v);
  }
  if (nan) return first_nan(row, n);
  const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(top));
  for (int64_t i = 0; i < n; i += kLanes) {
    const __mmask16 keep = first(n - i);
    const __mmask16 hit = _mm512_mask_cmp_ps_mask(keep, load16(row + i, keep), m, _CMP_EQ_OQ);
    if (hit) return i + __builtin_ctz(hit);
  }
  return 0;  // every value -inf: torch answers the first index too
}

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
