// What the ISA-level sources share, with nothing of torch (so that they compile in seconds): the
// AVX-512 helpers, the packed bf16 product's operands and the row kernels' one-row functions. Each
// build links one definition of each function (cpu_linear.cpp and cpu_rows.cpp for AVX-512,
// cpu_linear_avx2.cpp and cpu_rows_avx2.cpp for AVX2); cpu_kernels.h adds the torch entry points.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

namespace sparkrelay {

// e^f for |f| <= ln 2 / 2 (the reduced argument of every vector exp here): Taylor to f^6, error
// < 2e-7, coefficients from f^6 down to f^0 for Horner's rule
constexpr int kExpTerms = 7;
constexpr float kExpTaylor[kExpTerms] = {1.f / 720, 1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f};

#ifndef SPARKRELAY_AVX2_ONLY
constexpr int64_t kLanes = 16;  // fp32 values per zmm register

inline __mmask16 first(int64_t count) {  // the first min(count, 16) lanes, none when count <= 0
  return count >= kLanes ? (__mmask16)0xFFFF : count <= 0 ? 0 : (__mmask16)((1u << count) - 1);
}
inline __m512 load16(const float* p, __mmask16 keep) { return _mm512_maskz_loadu_ps(keep, p); }
inline __m512 load16(const uint16_t* p, __mmask16 keep) {  // bf16 -> fp32: the high half
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(keep, p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
inline void store16(float* p, __mmask16 keep, __m512 v) { _mm512_mask_storeu_ps(p, keep, v); }
inline void store16(uint16_t* p, __mmask16 keep, __m512 v) {  // fp32 -> bf16, round to nearest even
  _mm256_mask_storeu_epi16(p, keep, (__m256i)_mm512_cvtneps_pbh(v));
}

// e^x, 16 lanes: 2^n * p(f), x = n ln 2 + f, |f| <= ln2 / 2 (0 below -87, inf past ~88.7)
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));  // below: e^x underflows to 0 anyway
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693147181f), x);
  __m512 p = _mm512_set1_ps(kExpTaylor[0]);
  for (int i = 1; i < kExpTerms; ++i) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(kExpTaylor[i]));
  return _mm512_scalef_ps(p, n);
}
inline __m512 round_bf16(__m512 v) {  // v rounded to bf16 (nearest even) and back: one torch bf16 op
  const __m256i h = (__m256i)_mm512_cvtneps_pbh(v);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
#endif  // SPARKRELAY_AVX2_ONLY

// the packed bf16 layout (models/cpu_kernels.py pack_bf16) and one build's product over it
constexpr int64_t kPackedCols = 32;  // output columns per packed tile (models/cpu_kernels.py TILE)
constexpr int64_t kPackedPair = 64;  // bf16 elements per (tile, pair of K)
// y [rows, n] (N contiguous, ldy apart) = x [rows, 2 pairs] W^T + bias + base, as checked there
struct Bf16Operands {
  const uint16_t* x;     // [rows, 2 pairs] bf16, ldx apart
  int64_t ldx;
  const uint16_t* w;     // packed (cpu_linear.cpp's order)
  const float* bias;     // [n padded to 32] or null
  const uint16_t* base;  // [rows, n] bf16, ldb apart, or null
  int64_t ldb, rows, pairs, n, ldy;
};
// cpu_linear.cpp (AVX-512, AMX) or cpu_linear_avx2.cpp (AVX2): one of them per build
void bf16_product(const Bf16Operands& o, float* y);
void bf16_product(const Bf16Operands& o, uint16_t* y);
// cpu_rows.cpp (AVX-512) or cpu_rows_avx2.cpp (AVX2): one row's work, one of them per build
int64_t row_argmax(const float* row, int64_t n);     // torch.argmax's answer over row [n]
int64_t row_argmax(const uint16_t* row, int64_t n);  // the same over bf16 values
int64_t row_draw(const float* w, int64_t n, double u);  // first index whose running sum > u * total
void row_ban(float* row, const int32_t* bits, int64_t vocab);  // -inf where a token's bit is 0
// row_draw's second pass, both builds: the first index of w [n] whose running sum (in double)
// passes target, blocks of kBlock values skipped whole while their sum (`block_sum(i)`, +inf to
// walk a block value by value) keeps the running sum at or below it; a zero weight is never the
// answer, and a target that rounding put past every sum takes the last positive weight
template <int64_t kBlock, typename BlockSum>
int64_t walk_past(const float* w, int64_t n, double target, BlockSum block_sum) {
  double run = 0.0;
  for (int64_t i = 0; i < n; i += kBlock) {
    const double block = block_sum(i);
    if (run + block <= target) {
      run += block;
      continue;
    }
    for (int64_t j = i; j < std::min(n, i + kBlock); ++j) {
      run += w[j];
      if (run > target) return j;  // w[j] > 0: a zero weight leaves run where it was
    }
  }
  for (int64_t j = n - 1; j > 0; --j) {
    if (w[j] > 0.f) return j;
  }
  return 0;
}

// decode attention (cpu_attention.cpp's tasks over cpu_attention_heads.cpp or its AVX2 twin)
constexpr int64_t kMaxHeadDim = 256;  // D at most (16 fp32 accumulators of 16 lanes)
constexpr int64_t kChunkQueries = 4;  // queries of one sequence per task (K, V read once for them)
constexpr int64_t kScoreLanes = 16;   // a score row's width, rounded up to a multiple of this
struct Pools {                        // the layer's pools and how to find a key of one KV head
  const uint16_t* k;
  const uint16_t* v;
  int64_t row;  // elements per slot: n_kv * D
  int64_t d;
};
// one task: rows r < n (query q[r] [D] bf16, output out[r]) of the KV head whose values start at
// element `head` of a slot, against keys 0..lens[r]-1 of slots [longest]; scratch: scores [n, width]
// and totals [n]. A row's sums run in the same order whatever rows share its task, so a verify
// row equals the decode row of the same query, bit for bit
void attend_rows(const uint16_t* const* q, uint16_t* const* out, const int64_t* lens, int64_t n,
                 const Pools& p, int64_t head, const int64_t* slots, int64_t longest, float scale,
                 float* scores, int64_t width, float* totals);

}  // namespace sparkrelay
