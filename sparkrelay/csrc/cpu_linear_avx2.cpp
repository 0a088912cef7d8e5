// sparkrelay's bf16 product for a few rows on CPUs with AVX2 and FMA but not AVX-512 bf16 (AMD Zen
// 2 and 3, Intel before Cooper Lake): built alone with SPARKRELAY_AVX2_ONLY, it reads the packed
// layout of cpu_linear.cpp as it is,
//
//   [N/32 tiles][K/2 pairs][2 blocks][16 lanes][2]  -> per (tile, pair) 4 groups of 8 columns,
//                                                      32 bytes each: 8 x (k even, k odd)
//
// One 256-bit load of a group is 8 32-bit words whose low half is the even k's bf16 and whose high
// half is the odd k's: `w << 16` and `w & 0xFFFF0000` are the two fp32 weights, so a row costs two
// FMAs per group per pair on activations widened to fp32 once per call. Without it such a CPU
// multiplies a bf16 model through a float32 copy (oneDNN has no bf16 product there), reading twice
// the bytes per step. A pass takes G of the 4 groups so that its M x G accumulators stay in the 16
// ymm registers; the next pass reads the same tile again from cache (a tile is K x 64 bytes).
// Tiles are split over threads as in cpu_linear.cpp. docs/cpu_kernels.md has the design.

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstring>

#include "cpu_simd.h"

namespace sparkrelay {
namespace {

constexpr int64_t kGroup = 8;       // columns per ymm register
constexpr int64_t kGroups = 4;      // groups per tile (kPackedCols / kGroup)
constexpr int64_t kMaxRows = 8;     // rows per pass
constexpr int64_t kPrefetch = 8;    // pairs ahead

// groups per pass for M rows: M x G accumulators, one weight and one broadcast in registers
constexpr int groups_for(int m) { return m <= 3 ? 4 : m <= 6 ? 2 : 1; }

// sums [M][32] = x [2 pairs][8] (a row group's activations, k-major) times groups [g0, g0 + G)
// of one tile
template <int M, int G>
void pass(const float* x, const uint16_t* w, int64_t pairs, int g0, float (*sums)[kPackedCols]) {
  __m256 acc[M][G];
  for (int m = 0; m < M; ++m)
    for (int g = 0; g < G; ++g) acc[m][g] = _mm256_setzero_ps();
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int64_t p = 0; p < pairs; ++p) {
    const uint16_t* wp = w + p * kPackedPair + g0 * 2 * kGroup;
    if (g0 == 0) {  // later passes find the tile in cache
      _mm_prefetch(reinterpret_cast<const char*>(wp + kPrefetch * kPackedPair), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(wp + kPrefetch * kPackedPair + 32), _MM_HINT_T0);
    }
    for (int g = 0; g < G; ++g) {
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp + g * 2 * kGroup));
      const __m256 even = _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16));
      const __m256 odd = _mm256_castsi256_ps(_mm256_and_si256(raw, high));
      for (int m = 0; m < M; ++m) {
        const float* xm = x + 2 * p * kMaxRows + m;
        acc[m][g] = _mm256_fmadd_ps(even, _mm256_broadcast_ss(xm), acc[m][g]);
        acc[m][g] = _mm256_fmadd_ps(odd, _mm256_broadcast_ss(xm + kMaxRows), acc[m][g]);
      }
    }
  }
  for (int m = 0; m < M; ++m)
    for (int g = 0; g < G; ++g) _mm256_storeu_ps(sums[m] + (g0 + g) * kGroup, acc[m][g]);
}

template <int M>
void tile(const float* x, const uint16_t* w, int64_t pairs, float (*sums)[kPackedCols]) {
  constexpr int G = groups_for(M);
  for (int g0 = 0; g0 < kGroups; g0 += G) pass<M, G>(x, w, pairs, g0, sums);
}

using TileFn = void (*)(const float*, const uint16_t*, int64_t, float (*)[kPackedCols]);
constexpr TileFn kTileFns[kMaxRows + 1] = {nullptr, tile<1>, tile<2>, tile<3>, tile<4>,
                                           tile<5>, tile<6>, tile<7>, tile<8>};

inline float from_bf16(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

inline void put(float* y, float v) { *y = v; }
inline void put(uint16_t* y, float v) {  // fp32 -> bf16, round to nearest even (a NaN stays one)
  uint32_t u;
  std::memcpy(&u, &v, sizeof(u));
  *y = (u & 0x7FFFFFFFu) > 0x7F800000u ? static_cast<uint16_t>((u >> 16) | 0x40)
                                       : static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1)) >> 16);
}

// y [m rows, cols] (ldy apart) = sums + bias + base: the rounding to y's dtype happens once, here
template <typename Out>
void epilogue(float (*sums)[kPackedCols], int64_t m, int64_t cols, const float* bias,
              const uint16_t* base, int64_t ldb, Out* y, int64_t ldy) {
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      float v = sums[r][c];
      if (bias) v += bias[c];
      if (base) v += from_bf16(base[r * ldb + c]);
      put(y + r * ldy + c, v);
    }
  }
}

template <typename Out>
void run_bf16(const Bf16Operands& o, Out* y) {
  // the activations widened once, k-major per group of 8 rows: [groups][2 pairs][8] fp32, so a
  // pair's broadcasts read one or two lines (row-major, rows K x 4 bytes apart alias in L1 at
  // K = 1,024 and the kernel ran at a third of its speed)
  const int64_t k = 2 * o.pairs, groups = (o.rows + kMaxRows - 1) / kMaxRows;
  std::vector<float> x(static_cast<size_t>(groups * k * kMaxRows));
  for (int64_t r = 0; r < o.rows; ++r)
    for (int64_t i = 0; i < k; ++i)
      x[(r / kMaxRows * k + i) * kMaxRows + r % kMaxRows] = from_bf16(o.x[r * o.ldx + i]);
  const int64_t tiles = (o.n + kPackedCols - 1) / kPackedCols;
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    alignas(32) float sums[kMaxRows][kPackedCols];
    for (int64_t t = begin; t < end; ++t) {
      const uint16_t* wt = o.w + t * o.pairs * kPackedPair;
      const int64_t c0 = t * kPackedCols, cols = std::min(kPackedCols, o.n - c0);
      for (int64_t r = 0; r < o.rows; r += kMaxRows) {  // a tile read for 8 rows serves the next
        const int64_t m = std::min(kMaxRows, o.rows - r);
        kTileFns[m](x.data() + r * k, wt, o.pairs, sums);
        epilogue<Out>(sums, m, cols, o.bias ? o.bias + c0 : nullptr,
                      o.base ? o.base + r * o.ldb + c0 : nullptr, o.ldb, y + r * o.ldy + c0,
                      o.ldy);
      }
    }
  });
}

}  // namespace

void bf16_product(const Bf16Operands& o, float* y) { run_bf16(o, y); }
void bf16_product(const Bf16Operands& o, uint16_t* y) { run_bf16(o, y); }

}  // namespace sparkrelay
