// A grammar's token bitmask applied to float32 logits in place: every token whose bit is 0 gets
// -inf. A piece of the mask is one vector register of logits (16 bits per zmm, 8 per ymm), so a
// row is a few thousand masked moves, where torch unpacks every bit into a tensor first
// (docs/architecture.md). One row's work is row_ban (cpu_rows.cpp, or cpu_rows_avx2.cpp).

#include "cpu_kernels.h"

#include <ATen/Parallel.h>

namespace sparkrelay {

// logits float32 [R, V] (rows any stride, V contiguous), bitmask int32 [R, W] contiguous with
// W >= ceil(V / 32): token t of row r is kept when bit t % 32 of bitmask[r][t / 32] is set
void apply_token_bitmask(torch::Tensor& logits, const torch::Tensor& bitmask) {
  TORCH_CHECK(logits.device().is_cpu() && logits.scalar_type() == torch::kFloat32 &&
                  logits.dim() == 2 && logits.stride(1) == 1,
              "apply_token_bitmask: logits must be a float32 CPU tensor [R, V], V contiguous");
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  TORCH_CHECK(bitmask.scalar_type() == torch::kInt32 && bitmask.is_contiguous() &&
                  bitmask.dim() == 2 && bitmask.size(0) == rows &&
                  bitmask.size(1) * 32 >= vocab,
              "apply_token_bitmask: bitmask must be int32 [R, ceil(V / 32)], contiguous");
  float* lp = logits.data_ptr<float>();
  const int32_t* mp = bitmask.data_ptr<int32_t>();
  const int64_t ld = logits.stride(0), words = bitmask.size(1);
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) row_ban(lp + r * ld, mp + r * words, vocab);
  });
}

}  // namespace sparkrelay
