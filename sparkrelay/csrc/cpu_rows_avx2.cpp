// One row's work for the row kernels and a layer's element-wise steps on CPUs with AVX2 and FMA
// but not AVX-512 (the AVX2 build, SPARKRELAY_AVX2_ONLY): cpu_rows.cpp's functions over 8 fp32
// lanes per ymm register (cpu_simd.h's helpers). AVX2 has no lane-masked loads of 16-bit values,
// so a row's last n % 8 (or % 16) values go through scalar code or a zero-padded vector with the
// same answer.

#include <immintrin.h>

#include <cmath>
#include <cstring>
#include <limits>

#include "cpu_simd.h"

namespace sparkrelay {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
inline float value(float v) { return v; }
inline float value(uint16_t v) {
  const uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
inline float max_of(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps(m, m, 1)));
}
inline double sum_of(__m256d v) {
  __m128d s = _mm_add_pd(_mm256_castpd256_pd128(v), _mm256_extractf128_pd(v, 1));
  return _mm_cvtsd_f64(_mm_add_sd(s, _mm_unpackhi_pd(s, s)));
}
inline float sum_of(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)));
}
inline __m256d widened_sum(const float* p) {  // 8 floats at p as 4 doubles of pairwise sums
  const __m256 v = _mm256_loadu_ps(p);
  return _mm256_add_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(v)),
                       _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1)));
}

template <typename T>
int64_t first_nan(const T* row, int64_t n) {
  for (int64_t j = 0; j < n; ++j) {
    const float x = value(row[j]);
    if (x != x) return j;
  }
  return -1;
}

// the maximum over row [n] and whether a NaN is in it: two accumulators over 16 values a step
template <typename T>
float row_max(const T* row, int64_t n, bool* nan) {
  const int64_t body = n - n % kWide;
  __m256 top0 = _mm256_set1_ps(kNegInf), top1 = top0, odd = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 2 * kWide <= body; i += 2 * kWide) {
    const __m256 a = load8(row + i), b = load8(row + i + kWide);
    odd = _mm256_or_ps(odd, _mm256_cmp_ps(a, b, _CMP_UNORD_Q));  // a NaN in either
    top0 = _mm256_max_ps(top0, a);
    top1 = _mm256_max_ps(top1, b);
  }
  for (; i < body; i += kWide) {
    const __m256 a = load8(row + i);
    odd = _mm256_or_ps(odd, _mm256_cmp_ps(a, a, _CMP_UNORD_Q));
    top0 = _mm256_max_ps(top0, a);
  }
  float m = max_of(_mm256_max_ps(top0, top1));
  *nan = _mm256_movemask_ps(odd) != 0;
  for (int64_t j = body; j < n; ++j) {
    const float x = value(row[j]);
    *nan = *nan || x != x;
    m = x > m ? x : m;
  }
  return m;
}

template <typename T>
int64_t argmax_of(const T* row, int64_t n) {
  bool nan = false;
  const float m = row_max(row, n, &nan);
  if (nan) return first_nan(row, n);
  const int64_t body = n - n % kWide;
  const __m256 mv = _mm256_set1_ps(m);
  for (int64_t i = 0; i < body; i += kWide) {
    const int hit = _mm256_movemask_ps(_mm256_cmp_ps(load8(row + i), mv, _CMP_EQ_OQ));
    if (hit) return i + __builtin_ctz(hit);
  }
  for (int64_t j = body; j < n; ++j) {
    if (value(row[j]) == m) return j;
  }
  return 0;  // every value -inf: torch answers the first index too
}

}  // namespace

int64_t row_argmax(const float* row, int64_t n) { return argmax_of(row, n); }
int64_t row_argmax(const uint16_t* row, int64_t n) { return argmax_of(row, n); }

int64_t row_draw(const float* w, int64_t n, double u) {
  constexpr int64_t kBlock = 2 * kWide;  // values per block the second pass may skip whole
  const int64_t body = n - n % kBlock;
  __m256d acc0 = _mm256_setzero_pd(), acc1 = _mm256_setzero_pd();
  for (int64_t i = 0; i < body; i += kBlock) {
    acc0 = _mm256_add_pd(acc0, widened_sum(w + i));
    acc1 = _mm256_add_pd(acc1, widened_sum(w + i + kWide));
  }
  double total = sum_of(_mm256_add_pd(acc0, acc1));
  for (int64_t j = body; j < n; ++j) total += w[j];
  const double target = u * total;
  return walk_past<kBlock>(w, n, target, [&](int64_t i) {
    return i < body ? sum_of(_mm256_add_pd(widened_sum(w + i), widened_sum(w + i + kWide)))
                    : std::numeric_limits<double>::infinity();  // the tail: value by value
  });
}

void row_ban(float* row, const int32_t* bits, int64_t vocab) {
  const auto* bytes = reinterpret_cast<const uint8_t*>(bits);  // little endian: tokens 0-7 first
  const __m256i lane_bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  const __m256 neg_inf = _mm256_set1_ps(kNegInf);
  const int64_t body = vocab - vocab % kWide;
  for (int64_t i = 0; i < body; i += kWide) {  // one byte of the mask per ymm of logits
    const uint8_t keep = bytes[i / kWide];
    if (keep == 0xFF) continue;
    const __m256i kept = _mm256_and_si256(_mm256_set1_epi32(keep), lane_bit);
    const __m256 banned = _mm256_castsi256_ps(_mm256_cmpeq_epi32(kept, _mm256_setzero_si256()));
    _mm256_storeu_ps(row + i, _mm256_blendv_ps(_mm256_loadu_ps(row + i), neg_inf, banned));
  }
  for (int64_t j = body; j < vocab; ++j) {
    if (!((bytes[j / kWide] >> (j % kWide)) & 1)) row[j] = kNegInf;
  }
}


// the layer's element-wise rows: 8 values a step, a row's last n % 8 through a zero-padded vector
void row_norm(const uint16_t* x, const uint16_t* w, float eps, int64_t d, uint16_t* y) {
  const int64_t body = d - d % kWide;
  __m256 squares = _mm256_setzero_ps();
  for (int64_t i = 0; i < body; i += kWide) {
    const __m256 v = load8(x + i);
    squares = _mm256_fmadd_ps(v, v, squares);
  }
  if (body < d) {
    const __m256 v = load_tail8(x + body, d - body);
    squares = _mm256_fmadd_ps(v, v, squares);
  }
  const float r = 1.f / std::sqrt(sum_of(squares) / static_cast<float>(d) + eps);
  const __m256 scale = _mm256_set1_ps(r);
  for (int64_t i = 0; i < body; i += kWide) {
    // round the normalized value to bf16 before the weight, as the reference does
    store8(y + i, _mm256_mul_ps(round8(_mm256_mul_ps(load8(x + i), scale)), load8(w + i)));
  }
  if (body < d) {
    const __m256 n = round8(_mm256_mul_ps(load_tail8(x + body, d - body), scale));
    store_bf16(y + body, _mm256_mul_ps(n, load_tail8(w + body, d - body)), d - body);
  }
}

namespace {
inline __m256 silu_mul8(__m256 g, __m256 u) {  // bf16(silu(g)) * u, silu(g) = g / (1 + e^-g)
  const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
  return _mm256_mul_ps(round8(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.f), e))), u);
}
}  // namespace

void row_silu_mul(const uint16_t* gate, const uint16_t* up, int64_t n, uint16_t* y) {
  const int64_t body = n - n % kWide;
  for (int64_t i = 0; i < body; i += kWide) {
    store8(y + i, silu_mul8(load8(gate + i), load8(up + i)));
  }
  if (body < n) {
    const int64_t c = n - body;
    store_bf16(y + body, silu_mul8(load_tail8(gate + body, c), load_tail8(up + body, c)), c);
  }
}

void row_rope(const uint16_t* x, const uint16_t* cos, const uint16_t* sin, int64_t d,
              uint16_t* y) {
  const int64_t half = d / 2;
  for (int64_t i = 0; i < d; i += kWide) {
    const int64_t j = i < half ? i + half : i - half;  // roll(x, D/2)[i] = x[i - D/2 mod D]
    const __m256 a = round8(_mm256_mul_ps(load8(x + i), load8(cos + i)));
    const __m256 b = round8(_mm256_mul_ps(load8(x + j), load8(sin + i)));
    store8(y + i, _mm256_add_ps(a, b));
  }
}

}  // namespace sparkrelay
