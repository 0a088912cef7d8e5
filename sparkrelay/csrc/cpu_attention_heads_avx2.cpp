// Decode attention's inner loops for one task (cpu_attention.cpp) on CPUs with AVX2 and FMA but not
// AVX-512 (the AVX2 build): cpu_attention_heads.cpp's work over 8 fp32 lanes. A task converts its
// query rows to fp32 once and each group of eight keys once for all its rows (zero-padded to a
// multiple of 8, so any even D reads nothing past a head); scores sum a key's products lane by
// lane in D order, eight keys' sums in flight per row, then each four keys' lanes through one hadd
// tree; the values are weighed six rows and 16 dims at a time, each value widened once for the six.
// Every row's sums run in the same order whatever rows share its task, as attend_rows promises.
// Both replace one row and four keys at a time (4 sums in flight; each value widened again per
// row), which left a verify block far from the FMA peak (figures: docs/cpu_kernels.md).

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

constexpr int64_t kScoreKeys = 8;  // keys scored together: 8 sums of a row in flight

// scores[r][j] = scale * q_r . k_j for rows r < n (qf: [n, dp] fp32) and keys j < len, eight keys
// at a time (each key's lanes through sum4's tree); the last group repeats its last key
void score_rows(const float* qf, int64_t n, int64_t dp, const Pools& p, int64_t head,
                const int64_t* slots, int64_t len, float scale, float* scores, int64_t ld,
                float* kf) {
  const __m128 sv = _mm_set1_ps(scale);
  for (int64_t j = 0; j < len; j += kScoreKeys) {
    for (int64_t i = 0; i < kScoreKeys; ++i) {
      widen(p.k + slots[std::min(j + i, len - 1)] * p.row + head, p.d, kf + i * dp);
    }
    for (int64_t i = j + kPrefetchKeys; i < std::min(j + kPrefetchKeys + kScoreKeys, len); ++i) {
      prefetch_head(p.k + slots[i] * p.row + head, p.d);
    }
    for (int64_t r = 0; r < n; ++r) {
      __m256 acc[kScoreKeys];
#pragma GCC unroll 8
      for (int64_t i = 0; i < kScoreKeys; ++i) acc[i] = _mm256_setzero_ps();
      for (int64_t c = 0; c < dp; c += kWide) {
        const __m256 qc = _mm256_loadu_ps(qf + r * dp + c);
#pragma GCC unroll 8
        for (int64_t i = 0; i < kScoreKeys; ++i) {
          acc[i] = _mm256_fmadd_ps(qc, _mm256_loadu_ps(kf + i * dp + c), acc[i]);
        }
      }
      // all eight lanes: a row is a multiple of 16 wide, and past len nobody reads it (a variable
      // memcpy here compiled to a byte loop, a third of the scoring time)
      float* out = scores + r * ld + j;
      _mm_storeu_ps(out, _mm_mul_ps(sum4(acc[0], acc[1], acc[2], acc[3]), sv));
      _mm_storeu_ps(out + 4, _mm_mul_ps(sum4(acc[4], acc[5], acc[6], acc[7]), sv));
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

// out[r] dims [c0, c0 + dims) = sum_j w[r][j] v_j * inv[r] for R rows and keys j < len, dims at
// most 8 B: each value is read and widened once for the R rows (R x B sums, B widened values and a
// broadcast weight in the 16 ymm registers), and each row's sums run over j in order, as alone.
// Whole: dims a multiple of 8 (else a zero-padded copy; apart, so that the whole loop calls no
// function and GCC keeps the sums in registers)
template <int R, int B, bool Whole>
void weigh_block(const float* const* w, const float* inv, const Pools& p, int64_t head,
                 const int64_t* slots, int64_t len, int64_t c0, int64_t dims,
                 uint16_t* const* out) {
  __m256 acc[R][B];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
    for (int b = 0; b < B; ++b) acc[r][b] = _mm256_setzero_ps();
  alignas(32) float part[B * kWide];
  for (int64_t j = 0; j < len; ++j) {
    const uint16_t* vj = p.v + slots[j] * p.row + head + c0;
    if (j + kPrefetchKeys < len) {
      prefetch_head(p.v + slots[j + kPrefetchKeys] * p.row + head + c0, dims);
    }
    __m256 v[B];
    if constexpr (Whole) {
#pragma GCC unroll 2
      for (int b = 0; b < B; ++b) {
        const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(vj + kWide * b));
        v[b] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
      }
    } else {  // D not a multiple of 8: the last block through a zero-padded copy
      widen(vj, dims, part);
#pragma GCC unroll 2
      for (int b = 0; b < B; ++b) v[b] = _mm256_load_ps(part + kWide * b);
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m256 wr = _mm256_broadcast_ss(w[r] + j);
#pragma GCC unroll 2
      for (int b = 0; b < B; ++b) acc[r][b] = _mm256_fmadd_ps(v[b], wr, acc[r][b]);
    }
  }
  // unrolled like the loops above: an array indexed in a loop left rolled stays in memory (GCC)
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    const __m256 iv = _mm256_set1_ps(inv[r]);
#pragma GCC unroll 2
    for (int b = 0; b < B; ++b) {
      store_bf16(out[r] + c0 + kWide * b, _mm256_mul_ps(acc[r][b], iv),
                 std::min(kWide, dims - kWide * b));
    }
  }
}

constexpr int kWeighRows = 6;  // rows per pass over the values
constexpr int64_t kWeighDims = 2 * kWide;

template <int R>
void weigh_rows(const float* const* w, const float* inv, const Pools& p, int64_t head,
                const int64_t* slots, int64_t len, uint16_t* const* out) {
  for (int64_t c0 = 0; c0 < p.d; c0 += kWeighDims) {
    const int64_t dims = std::min(kWeighDims, p.d - c0);
    if (dims == kWeighDims) {
      weigh_block<R, 2, true>(w, inv, p, head, slots, len, c0, dims, out);
    } else if (dims > kWide) {
      weigh_block<R, 2, false>(w, inv, p, head, slots, len, c0, dims, out);
    } else {
      weigh_block<R, 1, false>(w, inv, p, head, slots, len, c0, dims, out);
    }
  }
}

using WeighFn = void (*)(const float* const*, const float*, const Pools&, int64_t, const int64_t*,
                         int64_t, uint16_t* const*);
constexpr WeighFn kWeighFns[kWeighRows + 1] = {nullptr,       weigh_rows<1>, weigh_rows<2>,
                                               weigh_rows<3>, weigh_rows<4>, weigh_rows<5>,
                                               weigh_rows<6>};

}  // namespace

void attend_rows(const uint16_t* const* q, uint16_t* const* out, const int64_t* lens, int64_t n,
                 const Pools& p, int64_t head, const int64_t* slots, int64_t longest, float scale,
                 float* scores, int64_t width, float* totals) {
  const int64_t dp = padded(p.d);
  thread_local std::vector<float> scratch;
  scratch.resize((n + kScoreKeys) * dp);
  float* qf = scratch.data();  // [n, dp]
  float* kf = qf + n * dp;     // [kScoreKeys, dp]
  for (int64_t r = 0; r < n; ++r) widen(q[r], p.d, qf + r * dp);
  score_rows(qf, n, dp, p, head, slots, longest, scale, scores, width, kf);
  for (int64_t r = 0; r < n; ++r) totals[r] = softmax_numerators(scores + r * width, lens[r], longest);
  for (int64_t r0 = 0; r0 < n; r0 += kWeighRows) {
    const int64_t rows = std::min<int64_t>(kWeighRows, n - r0);
    const float* w[kWeighRows];
    float inv[kWeighRows];
    for (int64_t r = 0; r < rows; ++r) {
      w[r] = scores + (r0 + r) * width;
      inv[r] = 1.f / totals[r0 + r];
    }
    kWeighFns[rows](w, inv, p, head, slots, longest, out + r0);
  }
}

}  // namespace sparkrelay
