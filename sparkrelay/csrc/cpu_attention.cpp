// Decode attention for bfloat16 KV pools: a few queries per sequence (a decode token, a DSpark
// verify block) against their keys, read in place from the paged pool through the sequence's
// slot list (no gather into a padded copy). One task serves a chunk of up to four queries of one
// sequence and the query heads that share a KV head (GQA): each key and value is read and converted
// once for all the task's rows, and four keys' scores share one shuffle tree.
//
//   q [T, H, D], k_pool / v_pool [S, n_kv, D], slots [B, Lk] (pool row of each key position),
//   seq [T] (the sequence of each query), lengths [T] (query t sees keys 0..lengths[t]-1 of its
//   sequence: its position + 1, so a block is causal) -> out [T, H, D]
//
// Scores, softmax and the weighted sum are fp32, the output is rounded to bf16 once; a task's inner
// loops are attend_rows (cpu_attention_heads.cpp with _mm512_dpbf16_ps, or
// cpu_attention_heads_avx2.cpp). Here the checks and the tasks (sequence, query chunk, KV head),
// split over threads.

#include "cpu_kernels.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

namespace sparkrelay {
namespace {

struct Task {  // one sequence's queries first..first+count-1 (in `order`) against one KV head
  int64_t first, count, kv_head;
};

}  // namespace

torch::Tensor decode_attention_bf16(const torch::Tensor& q, const torch::Tensor& k_pool,
                                    const torch::Tensor& v_pool, const torch::Tensor& slots,
                                    const torch::Tensor& seq, const torch::Tensor& lengths,
                                    double scale) {
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous() && q.scalar_type() == torch::kBFloat16,
              "decode_attention_bf16: q must be contiguous bfloat16 [T, H, D]");
  const int64_t t = q.size(0), h = q.size(1), d = q.size(2);
  TORCH_CHECK(k_pool.dim() == 3 && k_pool.is_contiguous() && v_pool.is_contiguous() &&
                  k_pool.sizes() == v_pool.sizes() && k_pool.size(2) == d &&
                  k_pool.scalar_type() == torch::kBFloat16 &&
                  v_pool.scalar_type() == torch::kBFloat16,
              "decode_attention_bf16: pools must be contiguous bfloat16 [S, n_kv, D] like q");
  const int64_t n_kv = k_pool.size(1), b = slots.size(0), lk = slots.size(1);
  TORCH_CHECK(d % 2 == 0 && d <= kMaxHeadDim && h % n_kv == 0,
              "decode_attention_bf16: D even and at most 256, H a multiple of n_kv");
  TORCH_CHECK(slots.dim() == 2 && slots.is_contiguous() && slots.scalar_type() == torch::kLong,
              "decode_attention_bf16: slots must be int64 [B, Lk]");
  TORCH_CHECK(seq.numel() == t && seq.is_contiguous() && seq.scalar_type() == torch::kLong &&
                  lengths.numel() == t && lengths.is_contiguous() &&
                  lengths.scalar_type() == torch::kLong,
              "decode_attention_bf16: seq [T] and lengths [T] must be int64");
  const int64_t* lens = lengths.data_ptr<int64_t>();
  const int64_t* rows = seq.data_ptr<int64_t>();
  for (int64_t i = 0; i < t; ++i) {
    TORCH_CHECK(rows[i] >= 0 && rows[i] < b && lens[i] >= 1 && lens[i] <= lk,
                "decode_attention_bf16: seq must be in 0..B-1 and lengths in 1..Lk");
  }
  torch::Tensor out = torch::empty_like(q);
  const Pools pools{reinterpret_cast<const uint16_t*>(k_pool.data_ptr<at::BFloat16>()),
                    reinterpret_cast<const uint16_t*>(v_pool.data_ptr<at::BFloat16>()), n_kv * d,
                    d};
  const auto* qp = reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>());
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t group = h / n_kv;
  // queries grouped by sequence (stable), cut into chunks of kChunkQueries: a task per chunk and
  // KV head
  std::vector<int64_t> order(t);
  for (int64_t i = 0; i < t; ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t x, int64_t y) { return rows[x] < rows[y]; });
  std::vector<Task> tasks;
  for (int64_t i = 0; i < t;) {
    int64_t n = 1;
    while (i + n < t && n < kChunkQueries && rows[order[i + n]] == rows[order[i]]) ++n;
    for (int64_t kvh = 0; kvh < n_kv; ++kvh) tasks.push_back({i, n, kvh});
    i += n;
  }
  at::parallel_for(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t begin, int64_t end) {
    const int64_t width = (lk + kScoreLanes - 1) / kScoreLanes * kScoreLanes;
    const int64_t most = kChunkQueries * group;
    std::vector<float> scores(most * width), totals(most);
    std::vector<const uint16_t*> qs(most);
    std::vector<uint16_t*> outs(most);
    std::vector<int64_t> row_lens(most);
    for (int64_t ti = begin; ti < end; ++ti) {
      const Task& task = tasks[ti];
      const int64_t* keys = sp + rows[order[task.first]] * lk;
      const int64_t n = task.count * group;
      int64_t longest = 0;
      for (int64_t r = 0; r < n; ++r) {  // row r: query r / group, head kv_head * group + r % group
        const int64_t query = order[task.first + r / group];
        const int64_t at = (query * h + task.kv_head * group + r % group) * d;
        qs[r] = qp + at;
        outs[r] = op + at;
        row_lens[r] = lens[query];
        longest = std::max(longest, lens[query]);
      }
      attend_rows(qs.data(), outs.data(), row_lens.data(), n, pools, task.kv_head * d, keys,
                  longest, static_cast<float>(scale), scores.data(), width, totals.data());
    }
  });
  return out;
}

}  // namespace sparkrelay
