// A grammar's token bitmask applied to float32 logits in place: every token whose bit is 0 gets
// -inf. One 16-bit half-word of the mask is one zmm register of logits, so a row of 49,152 tokens
// is 3,072 masked moves, where torch unpacks every bit into a tensor first (docs/architecture.md).

#include "cpu_kernels.h"

#include <ATen/Parallel.h>

#include <limits>

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
  const auto* mp = reinterpret_cast<const uint16_t*>(bitmask.data_ptr<int32_t>());
  const int64_t ld = logits.stride(0), words = bitmask.size(1);
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* row = lp + r * ld;
      const uint16_t* halves = mp + r * words * 2;  // little endian: tokens 0-15 first
      for (int64_t i = 0; i < vocab; i += kLanes) {
        const __mmask16 in_row = first(vocab - i);
        const __mmask16 banned = static_cast<__mmask16>(~halves[i / kLanes]) & in_row;
        if (banned) _mm512_mask_storeu_ps(row + i, banned, neg_inf);
      }
    }
  });
}

}  // namespace sparkrelay
