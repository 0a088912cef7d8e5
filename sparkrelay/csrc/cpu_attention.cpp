// Decode attention for bfloat16 KV pools: a few queries per sequence (a decode token, a DSpark
// verify block) against their keys, read in place from the paged pool through the sequence's
// slot list (no gather into a padded copy), the query heads that share a KV head (GQA) served by
// one task so the keys are read once per task.
//
//   q [T, H, D], k_pool / v_pool [S, n_kv, D], slots [B, Lk] (pool row of each key position),
//   seq [T] (the sequence of each query), lengths [T] (query t sees keys 0..lengths[t]-1 of its
//   sequence: its position + 1, so a block is causal) -> out [T, H, D]
//
// Scores, softmax and the weighted sum are fp32 (q.k with _mm512_dpbf16_ps, exp vectorized), the
// output is rounded to bf16 once. Tasks (query, KV head) are split over threads.

#include "cpu_kernels.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <limits>
#include <vector>

namespace sparkrelay {
namespace {

constexpr int64_t kMaxHeadDim = 256;  // 16 fp32 accumulators of 16 lanes

// e^x for x <= 0 (scores minus their max), 16 lanes: 2^n * p(f), x = n ln 2 + f, |f| <= ln2 / 2
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));  // below: e^x underflows to 0 anyway
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693147181f), x);
  __m512 p = _mm512_set1_ps(1.f / 720);  // Taylor to f^6: error < 2e-7 on |f| <= 0.35
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 120));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 24));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

struct Pools {  // the layer's pools and how to find a key of one KV head
  const uint16_t* k;
  const uint16_t* v;
  int64_t row;  // elements per slot: n_kv * D
  int64_t d;
};

// scores[j] = scale * q . k_j for the len keys of one KV head (offset `head` in a slot)
void score(const uint16_t* q, const Pools& p, int64_t head, const int64_t* slots, int64_t len,
           float scale, float* scores) {
  const int64_t chunks = (p.d + 31) / 32;
  __m512bh qv[kMaxHeadDim / 32];
  for (int64_t c = 0; c < chunks; ++c) {
    qv[c] = (__m512bh)_mm512_maskz_loadu_epi32(first((p.d - 32 * c) / 2), q + 32 * c);
  }
  for (int64_t j = 0; j < len; ++j) {
    const uint16_t* kj = p.k + slots[j] * p.row + head;
    __m512 acc = _mm512_setzero_ps();
    for (int64_t c = 0; c < chunks; ++c) {
      const __mmask16 keep = first((p.d - 32 * c) / 2);
      acc = _mm512_dpbf16_ps(acc, qv[c], (__m512bh)_mm512_maskz_loadu_epi32(keep, kj + 32 * c));
    }
    scores[j] = scale * _mm512_reduce_add_ps(acc);
  }
}

// scores [len] -> e^(s - max) in place; returns their sum
float softmax_numerators(float* scores, int64_t len) {
  __m512 top = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t j = 0; j < len; j += kLanes) {
    const __mmask16 keep = first(len - j);  // masked: never read past the scores
    top = _mm512_mask_max_ps(top, keep, top, _mm512_maskz_loadu_ps(keep, scores + j));
  }
  const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(top));
  __m512 sum = _mm512_setzero_ps();
  for (int64_t j = 0; j < len; j += kLanes) {
    const __mmask16 keep = first(len - j);
    const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(keep, scores + j), m));
    _mm512_mask_storeu_ps(scores + j, keep, e);
    sum = _mm512_mask_add_ps(sum, keep, sum, e);
  }
  return _mm512_reduce_add_ps(sum);
}

// out [D] = sum_j w[j] v_j / total (bf16)
void weigh_values(const float* w, float total, const Pools& p, int64_t head, const int64_t* slots,
                  int64_t len, uint16_t* out) {
  const int64_t blocks = (p.d + kLanes - 1) / kLanes;
  __m512 acc[kMaxHeadDim / kLanes];
  for (int64_t c = 0; c < blocks; ++c) acc[c] = _mm512_setzero_ps();
  for (int64_t j = 0; j < len; ++j) {
    const uint16_t* vj = p.v + slots[j] * p.row + head;
    const __m512 wj = _mm512_set1_ps(w[j]);
    for (int64_t c = 0; c < blocks; ++c) {
      acc[c] = _mm512_fmadd_ps(load16(vj + kLanes * c, first(p.d - kLanes * c)), wj, acc[c]);
    }
  }
  const __m512 inv = _mm512_set1_ps(1.f / total);
  for (int64_t c = 0; c < blocks; ++c) {
    store16(out + kLanes * c, first(p.d - kLanes * c), _mm512_mul_ps(acc[c], inv));
  }
}

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
  at::parallel_for(0, t * n_kv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(lk);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t row = task / n_kv, kvh = task % n_kv, len = lens[row];
      const int64_t* keys = sp + rows[row] * lk;
      for (int64_t i = 0; i < group; ++i) {
        const int64_t head = kvh * group + i, at = (row * h + head) * d;
        score(qp + at, pools, kvh * d, keys, len, static_cast<float>(scale), scores.data());
        const float total = softmax_numerators(scores.data(), len);
        weigh_values(scores.data(), total, pools, kvh * d, keys, len, op + at);
      }
    }
  });
  return out;
}

}  // namespace sparkrelay
