// One row's work for the row kernels (cpu_argmax.cpp, cpu_draw.cpp, cpu_mask.cpp hold their checked
// entry points and threads) and for a layer's element-wise steps (cpu_elementwise.cpp's), AVX-512:
// 16 fp32 lanes per zmm register, a lane mask for a row's tail. cpu_rows_avx2.cpp is the same
// functions for CPUs with AVX2 only.

#include <cmath>
#include <limits>

#include "cpu_simd.h"

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

// two vector passes over a row still in cache: its maximum, then the first lane equal to it
template <typename T>
int64_t argmax_of(const T* row, int64_t n) {
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

// the sum of 16 floats at p (lanes past `keep` zero), in double
inline double block_sum(const float* p, __mmask16 keep) {
  const __m512 v = _mm512_maskz_loadu_ps(keep, p);
  const __m512d lo = _mm512_cvtps_pd(_mm512_castps512_ps256(v));
  const __m512d hi =
      _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
  return _mm512_reduce_add_pd(_mm512_add_pd(lo, hi));
}

}  // namespace

int64_t row_argmax(const float* row, int64_t n) { return argmax_of(row, n); }
int64_t row_argmax(const uint16_t* row, int64_t n) { return argmax_of(row, n); }

int64_t row_draw(const float* w, int64_t n, double u) {
  __m512d acc0 = _mm512_setzero_pd(), acc1 = _mm512_setzero_pd();
  for (int64_t i = 0; i < n; i += kLanes) {
    const __m512 v = _mm512_maskz_loadu_ps(first(n - i), w + i);
    acc0 = _mm512_add_pd(acc0, _mm512_cvtps_pd(_mm512_castps512_ps256(v)));
    acc1 = _mm512_add_pd(
        acc1, _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1))));
  }
  const double target = u * _mm512_reduce_add_pd(_mm512_add_pd(acc0, acc1));
  return walk_past<kLanes>(w, n, target, [&](int64_t i) { return block_sum(w + i, first(n - i)); });
}

void row_ban(float* row, const int32_t* bits, int64_t vocab) {
  const auto* halves = reinterpret_cast<const uint16_t*>(bits);  // little endian: tokens 0-15 first
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t i = 0; i < vocab; i += kLanes) {  // one half-word of the mask per zmm of logits
    const __mmask16 banned = static_cast<__mmask16>(~halves[i / kLanes]) & first(vocab - i);
    if (banned) _mm512_mask_storeu_ps(row + i, banned, neg_inf);
  }
}

// a decoder layer's element-wise rows, 16 values a step (masked at a row's end)
void row_norm(const uint16_t* x, const uint16_t* w, float eps, int64_t d, uint16_t* y) {
  __m512 squares = _mm512_setzero_ps();
  for (int64_t i = 0; i < d; i += kLanes) {
    const __m512 v = load16(x + i, first(d - i));
    squares = _mm512_fmadd_ps(v, v, squares);
  }
  const float r = 1.f / std::sqrt(_mm512_reduce_add_ps(squares) / static_cast<float>(d) + eps);
  const __m512 scale = _mm512_set1_ps(r);
  for (int64_t i = 0; i < d; i += kLanes) {
    const __mmask16 keep = first(d - i);
    // round the normalized value to bf16 before the weight, as the reference does
    const __m512 n = round_bf16(_mm512_mul_ps(load16(x + i, keep), scale));
    store16(y + i, keep, _mm512_mul_ps(n, load16(w + i, keep)));
  }
}

void row_silu_mul(const uint16_t* gate, const uint16_t* up, int64_t n, uint16_t* y) {
  const __m512 one = _mm512_set1_ps(1.f);
  for (int64_t i = 0; i < n; i += kLanes) {
    const __mmask16 keep = first(n - i);
    const __m512 g = load16(gate + i, keep);
    const __m512 minus = _mm512_sub_ps(_mm512_setzero_ps(), g);
    const __m512 silu = round_bf16(_mm512_div_ps(g, _mm512_add_ps(one, exp16(minus))));
    store16(y + i, keep, _mm512_mul_ps(silu, load16(up + i, keep)));
  }
}

void row_rope(const uint16_t* x, const uint16_t* cos, const uint16_t* sin, int64_t d,
              uint16_t* y) {
  const int64_t half = d / 2;
  for (int64_t i = 0; i < d; i += kLanes) {
    const int64_t j = i < half ? i + half : i - half;  // roll(x, D/2)[i] = x[i - D/2 mod D]
    const __m512 a = round_bf16(_mm512_mul_ps(load16(x + i, 0xFFFF), load16(cos + i, 0xFFFF)));
    const __m512 b = round_bf16(_mm512_mul_ps(load16(x + j, 0xFFFF), load16(sin + i, 0xFFFF)));
    store16(y + i, 0xFFFF, _mm512_add_ps(a, b));
  }
}

}  // namespace sparkrelay
