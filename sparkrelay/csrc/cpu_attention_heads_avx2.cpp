// Decode attention's inner loops for one task (cpu_attention.cpp) on CPUs with AVX2 and FMA but not
// AVX-512 (the AVX2 build): cpu_attention_heads.cpp's work over 8 fp32 lanes. A task converts its
// query rows to fp32 once and each group of four keys once for all its rows (zero-padded to a
// multiple of 8, so any even D reads nothing past a head); scores sum a key's products lane by
// lane in D order, then the four keys' lanes through one hadd tree; the values are weighed one row
// and up to 64 dims at a time (8 ymm sums). Every row's sums run in the same order whatever rows
// share its task, as attend_rows promises.

#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <vector>

#include "cpu_simd.h"

namespace sparkrelay {
namespace {

constexpr int64_t kValueDims = 64;  // dims of one row weighed per pass over the values
constexpr int64_t kPrefetchKeys = 8;

inline int64_t padded(int64_t d) { return (d + kWide - 1) / kWide * kWide; }

// x [count] bf16 -> dst [padded(count)] fp32, zeros past count
void widen(const uint16_t* x, int64_t count, float* dst) {
  int64_t i = 0;
  for (; i + kWide <= count; i += kWide) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x + i));
    _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)));
  }
  for (; i < count; ++i) {
    const uint32_t bits = static_cast<uint32_t>(x[i]) << 16;
    std::memcpy(dst + i, &bits, sizeof(float));
  }
  for (; i < padded(count); ++i) dst[i] = 0.f;
}

inline void prefetch_head(const uint16_t* p, int64_t d) {
  for (int64_t e = 0; e < d; e += 32) {
    _mm_prefetch(reinterpret_cast<const char*>(p + e), _MM_HINT_T0);
  }
}

// the sums of four 8-lane vectors, in lanes 0..3
inline __m128 sum4(__m256 a, __m256 b, __m256 c, __m256 d) {
  const __m256 abcd = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
  return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}

// scores[r][j] = scale * q_r . k_j for rows r < n (qf: [n, dp] fp32) and keys j < len, four keys
// at a time; the last group repeats its last key
void score_rows(const float* qf, int64_t n, int64_t dp, const Pools& p, int64_t head,
                const int64_t* slots, int64_t len, float scale, float* scores, int64_t ld,
                float* kf) {
  for (int64_t j = 0; j < len; j += 4) {
    for (int64_t i = 0; i < 4; ++i) {
      widen(p.k + slots[std::min(j + i, len - 1)] * p.row + head, p.d, kf + i * dp);
    }
    for (int64_t i = j + kPrefetchKeys; i < std::min(j + kPrefetchKeys + 4, len); ++i) {
      prefetch_head(p.k + slots[i] * p.row + head, p.d);
    }
    const int64_t valid = std::min<int64_t>(4, len - j);
    for (int64_t r = 0; r < n; ++r) {
      __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                       _mm256_setzero_ps()};
      for (int64_t c = 0; c < dp; c += kWide) {
        const __m256 qc = _mm256_loadu_ps(qf + r * dp + c);
        for (int64_t i = 0; i < 4; ++i) {
          acc[i] = _mm256_fmadd_ps(qc, _mm256_loadu_ps(kf + i * dp + c), acc[i]);
        }
      }
      alignas(16) float s[4];
      _mm_store_ps(s, _mm_mul_ps(sum4(acc[0], acc[1], acc[2], acc[3]), _mm_set1_ps(scale)));
      std::memcpy(scores + r * ld + j, s, sizeof(float) * valid);
    }
  }
}

// scores [len] -> e^(s - max) in place, zeros from len to width; returns the sum
float softmax_numerators(float* scores, int64_t len, int64_t width) {
  const int64_t body = len - len % kWide;
  __m256 top = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t j = 0; j < body; j += kWide) top = _mm256_max_ps(top, _mm256_loadu_ps(scores + j));
  alignas(32) float lanes[kWide];
  _mm256_store_ps(lanes, top);
  float m = *std::max_element(lanes, lanes + kWide);
  for (int64_t j = body; j < len; ++j) m = std::max(m, scores[j]);
  const __m256 mv = _mm256_set1_ps(m);
  __m256 sum = _mm256_setzero_ps();
  for (int64_t j = 0; j < body; j += kWide) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(scores + j), mv));
    _mm256_storeu_ps(scores + j, e);
    sum = _mm256_add_ps(sum, e);
  }
  if (body < len) {  // the tail through one vector, lanes past len weighing nothing
    alignas(32) float tail[kWide] = {0};
    for (int64_t j = body; j < len; ++j) tail[j - body] = scores[j] - m;
    const __m256 keep = _mm256_cmp_ps(
        _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_ps(static_cast<float>(len - body)),
        _CMP_LT_OQ);
    const __m256 e = _mm256_and_ps(exp8(_mm256_load_ps(tail)), keep);
    _mm256_store_ps(tail, e);
    std::memcpy(scores + body, tail, sizeof(float) * (len - body));
    sum = _mm256_add_ps(sum, e);
  }
  std::fill(scores + len, scores + width, 0.f);  // keys this row may not see weigh nothing
  _mm256_store_ps(lanes, sum);
  float total = 0.f;
  for (float x : lanes) total += x;
  return total;
}

// out [D] (bf16) = sum_j w[j] v_j / total for keys j < len, dims in passes of kValueDims
void weigh_row(const float* w, float total, const Pools& p, int64_t head, const int64_t* slots,
               int64_t len, uint16_t* out) {
  const float inv = 1.f / total;
  for (int64_t c0 = 0; c0 < p.d; c0 += kValueDims) {
    const int64_t dims = std::min(kValueDims, p.d - c0), blocks = (dims + kWide - 1) / kWide;
    const bool whole = dims % kWide == 0;
    __m256 acc[kValueDims / kWide];
    for (int64_t b = 0; b < blocks; ++b) acc[b] = _mm256_setzero_ps();
    alignas(32) float part[kValueDims];
    for (int64_t j = 0; j < len; ++j) {
      const uint16_t* vj = p.v + slots[j] * p.row + head + c0;
      if (j + kPrefetchKeys < len) {
        prefetch_head(p.v + slots[j + kPrefetchKeys] * p.row + head + c0, dims);
      }
      const __m256 wj = _mm256_set1_ps(w[j]);
      if (whole) {
        for (int64_t b = 0; b < blocks; ++b) {
          const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(vj + kWide * b));
          const __m256 v = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
          acc[b] = _mm256_fmadd_ps(v, wj, acc[b]);
        }
      } else {  // D not a multiple of 8: the last block through a zero-padded copy
        widen(vj, dims, part);
        for (int64_t b = 0; b < blocks; ++b) {
          acc[b] = _mm256_fmadd_ps(_mm256_load_ps(part + kWide * b), wj, acc[b]);
        }
      }
    }
    const __m256 iv = _mm256_set1_ps(inv);
    for (int64_t b = 0; b < blocks; ++b) {
      store_bf16(out + c0 + kWide * b, _mm256_mul_ps(acc[b], iv),
                 std::min(kWide, dims - kWide * b));
    }
  }
}

}  // namespace

void attend_rows(const uint16_t* const* q, uint16_t* const* out, const int64_t* lens, int64_t n,
                 const Pools& p, int64_t head, const int64_t* slots, int64_t longest, float scale,
                 float* scores, int64_t width, float* totals) {
  const int64_t dp = padded(p.d);
  thread_local std::vector<float> scratch;
  scratch.resize((n + 4) * dp);
  float* qf = scratch.data();  // [n, dp]
  float* kf = qf + n * dp;     // [4, dp]
  for (int64_t r = 0; r < n; ++r) widen(q[r], p.d, qf + r * dp);
  score_rows(qf, n, dp, p, head, slots, longest, scale, scores, width, kf);
  for (int64_t r = 0; r < n; ++r) {
    totals[r] = softmax_numerators(scores + r * width, lens[r], longest);
    weigh_row(scores + r * width, totals[r], p, head, slots, longest, out[r]);
  }
}

}  // namespace sparkrelay
