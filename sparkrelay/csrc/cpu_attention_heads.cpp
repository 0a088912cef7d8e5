// Decode attention's inner loops for one task (cpu_attention.cpp), AVX-512: scores with
// _mm512_dpbf16_ps, four keys' sums through one shuffle tree, softmax numerators with a vector exp,
// values weighed into fp32 sums held in registers and rounded to bf16 once.
// cpu_attention_heads_avx2.cpp is the same for CPUs with AVX2 only.

#include <algorithm>
#include <limits>

#include "cpu_simd.h"

namespace sparkrelay {
namespace {

constexpr int64_t kValueRows = 4;     // score rows weighed together per pass over the values
// A task reads one KV head's D values of each key: a short run (2 D bytes) every n_kv * D elements,
// a stride the hardware prefetcher follows late, so the passes ask for the row kPrefetchKeys keys
// ahead themselves (speed notes of docs/cpu_kernels.md).
constexpr int64_t kPrefetchKeys = 8;

// every cache line of one head's D bf16 values at p
inline void prefetch_head(const uint16_t* p, int64_t d) {
  for (int64_t e = 0; e < d; e += 32) _mm_prefetch(reinterpret_cast<const char*>(p + e), _MM_HINT_T0);
}

// the sums of four 16-lane vectors, in lanes 0..3 of the result (one shuffle tree for four scores)
inline __m128 sum4(__m512 a, __m512 b, __m512 c, __m512 d) {
  const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
  const __m512 x = _mm512_add_ps(
      _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(ab), _mm512_castps_pd(cd))),
      _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(ab), _mm512_castps_pd(cd))));
  const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1));
  const __m256 y = _mm256_add_ps(_mm512_castps512_ps256(x), hi);
  return _mm_add_ps(_mm256_castps256_ps128(y), _mm256_extractf128_ps(y, 1));
}

// Head dims 64 and 128 get their own instances (kD), whose loops unroll and keep keys and sums in
// registers; kD = 0 reads the head dim at run time. Every instance sums in the same order.

// a 32-pair slice c of a head vector (D/32 slices; the last one masked when D is not a multiple of 32)
template <int kD>
inline __m512bh pairs(const uint16_t* x, int64_t d, int64_t c) {
  return (__m512bh)_mm512_maskz_loadu_epi32(first((d - c) / 2), x + c);
}

// scores[r][j] = scale * q_r . k_j for rows r < n (q_r at q[r]) and keys j < len (row stride ld),
// four keys at a time through one shuffle tree; the last group repeats its last key, so every score
// is summed in the same order whatever the chunk (a verify row equals that decode row, bit for bit)
template <int kD>
void score_rows(const uint16_t* const* q, int64_t n, const Pools& p, int64_t head,
                const int64_t* slots, int64_t len, float scale, float* scores, int64_t ld) {
  const int64_t d = kD ? kD : p.d;
  constexpr int64_t kSlices = kD ? (kD + 31) / 32 : 1;  // key slices held in registers
  for (int64_t j = 0; j < len; j += 4) {
    const uint16_t* k[4];
    for (int64_t i = 0; i < 4; ++i) k[i] = p.k + slots[std::min(j + i, len - 1)] * p.row + head;
    for (int64_t i = j + kPrefetchKeys; i < std::min(j + kPrefetchKeys + 4, len); ++i) {
      prefetch_head(p.k + slots[i] * p.row + head, d);
    }
    __m512bh kv[4][kSlices];
    if (kD) {
      for (int64_t i = 0; i < 4; ++i) {
        for (int64_t c = 0; c < kSlices; ++c) kv[i][c] = pairs<kD>(k[i], d, 32 * c);
      }
    }
    const __mmask8 keep = static_cast<__mmask8>((1u << std::min<int64_t>(4, len - j)) - 1);
    for (int64_t r = 0; r < n; ++r) {
      __m512 acc[4];
      for (int64_t i = 0; i < 4; ++i) acc[i] = _mm512_setzero_ps();
      for (int64_t c = 0; c < d; c += 32) {  // slice by slice, as for any head dim
        const __m512bh qc = pairs<kD>(q[r], d, c);
        for (int64_t i = 0; i < 4; ++i) {
          acc[i] = _mm512_dpbf16_ps(acc[i], qc, kD ? kv[i][c / 32] : pairs<kD>(k[i], d, c));
        }
      }
      const __m128 s = sum4(acc[0], acc[1], acc[2], acc[3]);
      _mm_mask_storeu_ps(scores + r * ld + j, keep, _mm_mul_ps(s, _mm_set1_ps(scale)));
    }
  }
}

// scores [len] -> e^(s - max) in place, zeros from len to width; returns the sum
float softmax_numerators(float* scores, int64_t len, int64_t width) {
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
  std::fill(scores + len, scores + width, 0.f);  // keys this row may not see weigh nothing
  return _mm512_reduce_add_ps(sum);
}

// out[r] [D] = sum_j w[r][j] v_j / total[r] (bf16), rows r < n (at most kValueRows; kN of them
// when kN > 0), keys j < len: each value is converted to fp32 once for the n rows
template <int kD, int kN>
void weigh_values(const float* w, int64_t ld, const float* total, int64_t n, const Pools& p,
                  int64_t head, const int64_t* slots, int64_t len, uint16_t* const* out) {
  const int64_t d = kD ? kD : p.d, rows = kN ? kN : n;
  const int64_t blocks = (d + kLanes - 1) / kLanes;
  constexpr int64_t kRows = kN ? kN : kValueRows, kBlocks = (kD ? kD : kMaxHeadDim) / kLanes;
  // fully unrolled where kD and kN are known, so the sums stay in registers (a loop the compiler
  // keeps rolled holds them on the stack: a store and a load around every FMA)
  __m512 acc[kRows][kBlocks];
#pragma GCC unroll 16
  for (int64_t r = 0; r < rows; ++r) {
#pragma GCC unroll 16
    for (int64_t c = 0; c < blocks; ++c) acc[r][c] = _mm512_setzero_ps();
  }
  for (int64_t j = 0; j < len; ++j) {
    const uint16_t* vj = p.v + slots[j] * p.row + head;
    if (j + kPrefetchKeys < len) prefetch_head(p.v + slots[j + kPrefetchKeys] * p.row + head, d);
    __m512 wr[kRows];
#pragma GCC unroll 16
    for (int64_t r = 0; r < rows; ++r) wr[r] = _mm512_set1_ps(w[r * ld + j]);
#pragma GCC unroll 16
    for (int64_t c = 0; c < blocks; ++c) {
      const __m512 v = load16(vj + kLanes * c, first(d - kLanes * c));
#pragma GCC unroll 16
      for (int64_t r = 0; r < rows; ++r) acc[r][c] = _mm512_fmadd_ps(v, wr[r], acc[r][c]);
    }
  }
#pragma GCC unroll 16
  for (int64_t r = 0; r < rows; ++r) {
    const __m512 inv = _mm512_set1_ps(1.f / total[r]);
#pragma GCC unroll 16
    for (int64_t c = 0; c < blocks; ++c) {
      store16(out[r] + kLanes * c, first(d - kLanes * c), _mm512_mul_ps(acc[r][c], inv));
    }
  }
}

using ScoreFn = void (*)(const uint16_t* const*, int64_t, const Pools&, int64_t, const int64_t*,
                         int64_t, float, float*, int64_t);
using WeighFn = void (*)(const float*, int64_t, const float*, int64_t, const Pools&, int64_t,
                         const int64_t*, int64_t, uint16_t* const*);

struct HeadFns {  // one head dim's instances; weigh[n] for n rows (weigh[0]: any n)
  ScoreFn score;
  WeighFn weigh[kValueRows + 1];
};

template <int kD>
constexpr HeadFns kHeadFns = {score_rows<kD>,
                              {weigh_values<kD, 0>, weigh_values<kD, 1>, weigh_values<kD, 2>,
                               weigh_values<kD, 3>, weigh_values<kD, 4>}};

const HeadFns& head_fns(int64_t d) {
  return d == 64 ? kHeadFns<64> : d == 128 ? kHeadFns<128> : kHeadFns<0>;
}

}  // namespace

void attend_rows(const uint16_t* const* q, uint16_t* const* out, const int64_t* lens, int64_t n,
                 const Pools& p, int64_t head, const int64_t* slots, int64_t longest, float scale,
                 float* scores, int64_t width, float* totals) {
  const HeadFns& fns = head_fns(p.d);
  fns.score(q, n, p, head, slots, longest, scale, scores, width);
  for (int64_t r = 0; r < n; ++r) {
    totals[r] = softmax_numerators(scores + r * width, lens[r], longest);
  }
  for (int64_t r = 0; r < n; r += kValueRows) {
    const int64_t m = std::min(kValueRows, n - r);
    fns.weigh[m](scores + r * width, width, totals + r, m, p, head, slots, longest, out + r);
  }
}

}  // namespace sparkrelay
