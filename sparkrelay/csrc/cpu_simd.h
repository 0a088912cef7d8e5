// What the ISA-level sources share, with nothing of torch (so that they compile in seconds): the
// AVX2 and AVX-512 helpers, the packed bf16 product's operands and the one-row functions. Each
// build links one definition of each function (cpu_linear.cpp and cpu_rows.cpp for AVX-512,
// cpu_linear_avx2.cpp and cpu_rows_avx2.cpp for AVX2); cpu_kernels.h adds the torch entry points.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace sparkrelay {

// e^f for |f| <= ln 2 / 2 (the reduced argument of every vector exp here): Taylor to f^6, error
// < 2e-7, coefficients from f^6 down to f^0 for Horner's rule
constexpr int kExpTerms = 7;
constexpr float kExpTaylor[kExpTerms] = {1.f / 720, 1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f};

// AVX2 and FMA helpers (8 fp32 lanes per ymm register): the AVX2 build's ISA files use them
constexpr int64_t kWide = 8;
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {  // bf16 -> fp32: the high half
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
// v's fp32 bit patterns rounded to bf16 (nearest even; a NaN becomes the quiet 0x7FC0), one per
// 32-bit lane in the low half
inline __m256i bf16_bits8(__m256 v) {
  const __m256i b = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  const __m256i up = _mm256_add_epi32(_mm256_add_epi32(b, _mm256_set1_epi32(0x7FFF)), odd);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  return _mm256_blendv_epi8(_mm256_srli_epi32(up, 16), _mm256_set1_epi32(0x7FC0), nan);
}
inline __m256 round8(__m256 v) {  // v rounded to bf16 and back: one torch bf16 op
  return _mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits8(v), 16));
}
inline void store8(uint16_t* dst, __m256 v) {  // fp32 -> 8 bf16 at dst, nearest even
  const __m256i bits = bf16_bits8(v);  // 8 x 32-bit -> 8 x 16-bit in the low 128 bits
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(bits, bits), 0x08);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm256_castsi256_si128(packed));
}
inline void store_bf16(uint16_t* dst, __m256 v, int64_t count) {  // the first `count` of 8 only
  alignas(16) uint16_t tmp[kWide];
  store8(tmp, v);
  std::memcpy(dst, tmp, sizeof(uint16_t) * count);
}
// count < 8 bf16 values at p as fp32 lanes, zeros past them
inline __m256 load_tail8(const uint16_t* p, int64_t count) {
  alignas(16) uint16_t tmp[kWide] = {};
  std::memcpy(tmp, p, sizeof(uint16_t) * count);
  return load8(tmp);
}
// e^x, 8 lanes, as exp16 computes it: 2^n * p(f), x = n ln 2 + f, 0 below -87 and inf past
// ~88.72; 2^n is applied as two exact halves so that n = 128 does not overflow the exponent field
inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.f)), _mm256_set1_ps(89.f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693147181f), x);
  __m256 p = _mm256_set1_ps(kExpTaylor[0]);
  for (int i = 1; i < kExpTerms; ++i) p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(kExpTaylor[i]));
  const __m256i ni = _mm256_cvtps_epi32(n), half = _mm256_srai_epi32(ni, 1);
  const __m256i bias = _mm256_set1_epi32(127);
  const __m256 a = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(half, bias), 23));
  const __m256 b = _mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_sub_epi32(ni, half), bias), 23));
  return _mm256_mul_ps(_mm256_mul_ps(p, a), b);
}

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
// a decoder layer's element-wise rows in bf16, each op rounded to bf16 as torch's ops are
// (cpu_elementwise.cpp checks and splits the work)
void row_norm(const uint16_t* x, const uint16_t* w, float eps, int64_t d, uint16_t* y);  // RMSNorm
void row_silu_mul(const uint16_t* gate, const uint16_t* up, int64_t n, uint16_t* y);     // SwiGLU
void row_rope(const uint16_t* x, const uint16_t* cos, const uint16_t* sin, int64_t d,  // D % 32 = 0
              uint16_t* y);
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
