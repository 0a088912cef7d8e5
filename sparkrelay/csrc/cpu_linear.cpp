// sparkrelay's CPU linears for decoding: a few activation rows times a frozen weight, with AVX-512.
//
// Decoding reads every weight once per step for 1 to 8 rows (8: a DSpark verify), so a step costs
// the weight's bytes over the read bandwidth when the kernel streams the weight at that bandwidth.
// The weight is packed once, at load, into tiles of 32 output columns whose bytes follow the loop:
//
//   bf16: [N/32 tiles][K/2 pairs][2 blocks][16 lanes][2]  -> 128 contiguous bytes per (tile, pair)
//
// One (tile, pair) step loads two 64-byte lines and, per row, broadcasts the row's two activations
// and accumulates both blocks with _mm512_dpbf16_ps (fp32 accumulators, 16 lanes = 16 outputs).
// Tiles are split over threads (at::parallel_for); a thread runs every row group of its tiles, so
// a tile read for the first 8 rows is still in cache for the next 8. Layout, loop order, prefetch
// and threads are described in docs/cpu_kernels.md.

#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace {

constexpr int64_t kLanes = 16;             // fp32 outputs per zmm register
constexpr int64_t kTile = 2 * kLanes;      // output columns per tile (two blocks)
constexpr int64_t kPairStep = 2 * kTile;   // bf16 elements per (tile, pair): 64 = 128 bytes
constexpr int64_t kMaxRows = 8;            // rows per kernel call
constexpr int64_t kPrefetchSteps = 8;      // pairs ahead: 8 x 128 B

// rows M of x [M, K] (K even, ldx elements apart) times one tile of packed weight -> y [M, cols].
template <int M>
void tile_bf16(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t pairs, const float* bias,
               uint16_t* y, int64_t ldy, int64_t cols) {
  __m512 acc0[M], acc1[M];
  for (int m = 0; m < M; ++m) {
    acc0[m] = _mm512_setzero_ps();
    acc1[m] = _mm512_setzero_ps();
  }
  for (int64_t p = 0; p < pairs; ++p) {
    const uint16_t* wp = w + p * kPairStep;
    _mm_prefetch(reinterpret_cast<const char*>(wp + kPrefetchSteps * kPairStep), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(wp + kPrefetchSteps * kPairStep + 32), _MM_HINT_T0);
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wp);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(wp + 32);
    for (int m = 0; m < M; ++m) {
      int32_t two;
      __builtin_memcpy(&two, x + m * ldx + 2 * p, sizeof(two));
      const __m512bh a = (__m512bh)_mm512_set1_epi32(two);
      acc0[m] = _mm512_dpbf16_ps(acc0[m], a, w0);
      acc1[m] = _mm512_dpbf16_ps(acc1[m], a, w1);
    }
  }
  const __mmask16 keep0 = cols >= kLanes ? 0xFFFF : (__mmask16)((1u << cols) - 1);
  const __mmask16 keep1 = cols >= kTile ? 0xFFFF
                          : cols <= kLanes ? 0 : (__mmask16)((1u << (cols - kLanes)) - 1);
  const __m512 b0 = bias ? _mm512_maskz_loadu_ps(keep0, bias) : _mm512_setzero_ps();
  const __m512 b1 = bias ? _mm512_maskz_loadu_ps(keep1, bias + kLanes) : _mm512_setzero_ps();
  for (int m = 0; m < M; ++m) {
    const __m256i r0 = (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(acc0[m], b0));
    const __m256i r1 = (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(acc1[m], b1));
    _mm256_mask_storeu_epi16(y + m * ldy, keep0, r0);
    _mm256_mask_storeu_epi16(y + m * ldy + kLanes, keep1, r1);
  }
}

using TileFn = void (*)(const uint16_t*, int64_t, const uint16_t*, int64_t, const float*, uint16_t*,
                        int64_t, int64_t);
constexpr TileFn kTileFns[kMaxRows + 1] = {nullptr,         tile_bf16<1>, tile_bf16<2>,
                                           tile_bf16<3>,    tile_bf16<4>, tile_bf16<5>,
                                           tile_bf16<6>,    tile_bf16<7>, tile_bf16<8>};

void check_bf16(const torch::Tensor& x, const torch::Tensor& packed, int64_t n,
                const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kBFloat16 && x.dim() == 2,
              "linear_bf16: x must be a 2-D bfloat16 CPU tensor");
  TORCH_CHECK(x.stride(1) == 1 && x.size(1) % 2 == 0, "linear_bf16: x rows must be contiguous, K even");
  const int64_t tiles = (n + kTile - 1) / kTile;
  TORCH_CHECK(packed.is_contiguous() && packed.scalar_type() == torch::kBFloat16 &&
                  packed.numel() == tiles * (x.size(1) / 2) * kPairStep,
              "linear_bf16: packed does not match N = ", n, " and K = ", x.size(1));
  if (bias) {
    TORCH_CHECK(bias->is_contiguous() && bias->scalar_type() == torch::kFloat32 &&
                    bias->numel() == tiles * kTile,
                "linear_bf16: bias must be float32 with N padded to a multiple of 32");
  }
}

// ---- int8 weights (weight-only: per-channel scales), activations quantized per row to uint8 ----
//
//   int8: [N/32 tiles][K/4 quads][2 blocks][16 lanes][4]  -> 128 contiguous bytes per (tile, quad)
//
// A row x is quantized to xq = round(x / sx) + 128 in 0..255 (sx = max |x| / 127), so that
// _mm512_dpbusd_epi32 (unsigned x signed bytes, four products per int32 lane) accumulates
// sum_k xq[k] q[n, k]; then y[n] = sx * s[n] * (acc[n] - 128 * qsum[n]) + bias[n].

constexpr int64_t kQuadStep = 4 * kTile;  // int8 elements per (tile, quad): 128 bytes

template <int M>
void tile_int8(const uint8_t* xq, int64_t ldx, const float* sx, const int8_t* w, int64_t quads,
               const float* scale, const int32_t* qsum, const float* bias, float* y, int64_t ldy,
               int64_t cols) {
  __m512i acc0[M], acc1[M];
  for (int m = 0; m < M; ++m) {
    acc0[m] = _mm512_setzero_si512();
    acc1[m] = _mm512_setzero_si512();
  }
  for (int64_t q = 0; q < quads; ++q) {
    const int8_t* wq = w + q * kQuadStep;
    _mm_prefetch(reinterpret_cast<const char*>(wq + kPrefetchSteps * kQuadStep), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(wq + kPrefetchSteps * kQuadStep + 64), _MM_HINT_T0);
    const __m512i w0 = _mm512_loadu_si512(wq);
    const __m512i w1 = _mm512_loadu_si512(wq + 64);
    for (int m = 0; m < M; ++m) {
      int32_t four;
      __builtin_memcpy(&four, xq + m * ldx + 4 * q, sizeof(four));
      const __m512i a = _mm512_set1_epi32(four);
      acc0[m] = _mm512_dpbusd_epi32(acc0[m], a, w0);
      acc1[m] = _mm512_dpbusd_epi32(acc1[m], a, w1);
    }
  }
  const __mmask16 keep0 = cols >= kLanes ? 0xFFFF : (__mmask16)((1u << cols) - 1);
  const __mmask16 keep1 = cols >= kTile ? 0xFFFF
                          : cols <= kLanes ? 0 : (__mmask16)((1u << (cols - kLanes)) - 1);
  const __m512i z0 = _mm512_slli_epi32(_mm512_loadu_si512(qsum), 7);  // 128 * qsum
  const __m512i z1 = _mm512_slli_epi32(_mm512_loadu_si512(qsum + kLanes), 7);
  const __m512 s0 = _mm512_loadu_ps(scale), s1 = _mm512_loadu_ps(scale + kLanes);
  const __m512 b0 = bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
  const __m512 b1 = bias ? _mm512_loadu_ps(bias + kLanes) : _mm512_setzero_ps();
  for (int m = 0; m < M; ++m) {
    const __m512 r = _mm512_set1_ps(sx[m]);
    const __m512 y0 = _mm512_fmadd_ps(
        _mm512_cvtepi32_ps(_mm512_sub_epi32(acc0[m], z0)), _mm512_mul_ps(r, s0), b0);
    const __m512 y1 = _mm512_fmadd_ps(
        _mm512_cvtepi32_ps(_mm512_sub_epi32(acc1[m], z1)), _mm512_mul_ps(r, s1), b1);
    _mm512_mask_storeu_ps(y + m * ldy, keep0, y0);
    _mm512_mask_storeu_ps(y + m * ldy + kLanes, keep1, y1);
  }
}

using Int8TileFn = void (*)(const uint8_t*, int64_t, const float*, const int8_t*, int64_t,
                            const float*, const int32_t*, const float*, float*, int64_t, int64_t);
constexpr Int8TileFn kInt8TileFns[kMaxRows + 1] = {nullptr,      tile_int8<1>, tile_int8<2>,
                                                   tile_int8<3>, tile_int8<4>, tile_int8<5>,
                                                   tile_int8<6>, tile_int8<7>, tile_int8<8>};

// x [M, K] float -> xq [M, K padded to 4] uint8 (zero point 128), sx [M]
void quantize_rows(const torch::Tensor& x, torch::Tensor& xq, torch::Tensor& sx) {
  const torch::Tensor xf = x.to(torch::kFloat32).contiguous();
  const int64_t rows = xf.size(0), k = xf.size(1), ldq = xq.size(1);
  const float* src = xf.data_ptr<float>();
  uint8_t* dst = xq.data_ptr<uint8_t>();
  float* scales = sx.data_ptr<float>();
  for (int64_t m = 0; m < rows; ++m) {
    const float* row = src + m * k;
    float amax = 0.f;
    for (int64_t i = 0; i < k; ++i) amax = std::max(amax, std::abs(row[i]));
    const float s = amax > 0.f ? amax / 127.f : 1.f;
    scales[m] = s;
    const float inv = 1.f / s;
    uint8_t* out = dst + m * ldq;
    for (int64_t i = 0; i < k; ++i) out[i] = (uint8_t)(std::nearbyint(row[i] * inv) + 128.f);
    for (int64_t i = k; i < ldq; ++i) out[i] = 128;  // padding: zero after the zero point
  }
}

}  // namespace

// x [M, K] (bf16 or fp32), packed int8 (pack order above), scale [N/32*32] fp32, qsum [N/32*32]
// int32, bias [N/32*32] fp32 or None -> [M, N] in x's dtype
torch::Tensor linear_int8(const torch::Tensor& x, const torch::Tensor& packed,
                          const torch::Tensor& scale, const torch::Tensor& qsum, int64_t n,
                          const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2, "linear_int8: x must be a 2-D CPU tensor");
  const int64_t rows = x.size(0), quads = (x.size(1) + 3) / 4, tiles = (n + kTile - 1) / kTile;
  TORCH_CHECK(packed.is_contiguous() && packed.scalar_type() == torch::kInt8 &&
                  packed.numel() == tiles * quads * kQuadStep,
              "linear_int8: packed does not match N = ", n, " and K = ", x.size(1));
  TORCH_CHECK(scale.scalar_type() == torch::kFloat32 && scale.numel() == tiles * kTile &&
                  qsum.scalar_type() == torch::kInt32 && qsum.numel() == tiles * kTile,
              "linear_int8: scale (fp32) and qsum (int32) must have N padded to 32 entries");
  if (bias) {
    TORCH_CHECK(bias->scalar_type() == torch::kFloat32 && bias->numel() == tiles * kTile,
                "linear_int8: bias must be float32 with N padded to a multiple of 32");
  }
  torch::Tensor xq = torch::empty({rows, quads * 4}, x.options().dtype(torch::kUInt8));
  torch::Tensor sx = torch::empty({rows}, x.options().dtype(torch::kFloat32));
  quantize_rows(x, xq, sx);
  torch::Tensor y = torch::empty({rows, n}, x.options().dtype(torch::kFloat32));
  const uint8_t* xp = xq.data_ptr<uint8_t>();
  const int8_t* wp = packed.data_ptr<int8_t>();
  const float* sp = scale.data_ptr<float>();
  const int32_t* qp = qsum.data_ptr<int32_t>();
  const float* bp = bias ? bias->data_ptr<float>() : nullptr;
  const float* sxp = sx.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t ldx = quads * 4;
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int8_t* wt = wp + t * quads * kQuadStep;
      const int64_t cols = std::min(kTile, n - t * kTile), c0 = t * kTile;
      for (int64_t r = 0; r < rows; r += kMaxRows) {
        const int64_t m = std::min(kMaxRows, rows - r);
        kInt8TileFns[m](xp + r * ldx, ldx, sxp + r, wt, quads, sp + c0, qp + c0,
                        bp ? bp + c0 : nullptr, yp + r * n + c0, n, cols);
      }
    }
  });
  return x.scalar_type() == torch::kFloat32 ? y : y.to(x.scalar_type());
}

// x [M, K] bf16 (K even), packed (pack order above), bias [N padded to 32] fp32 or None -> [M, N] bf16
torch::Tensor linear_bf16(const torch::Tensor& x, const torch::Tensor& packed, int64_t n,
                          const c10::optional<torch::Tensor>& bias) {
  check_bf16(x, packed, n, bias);
  const int64_t rows = x.size(0), pairs = x.size(1) / 2, tiles = (n + kTile - 1) / kTile;
  torch::Tensor y = torch::empty({rows, n}, x.options());
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const auto* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  const float* bp = bias ? bias->data_ptr<float>() : nullptr;
  const int64_t ldx = x.stride(0);
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const uint16_t* wt = wp + t * pairs * kPairStep;
      const int64_t cols = std::min(kTile, n - t * kTile);
      for (int64_t r = 0; r < rows; r += kMaxRows) {
        const int64_t m = std::min(kMaxRows, rows - r);
        kTileFns[m](xp + r * ldx, ldx, wt, pairs, bp ? bp + t * kTile : nullptr, yp + r * n + t * kTile,
                    n, cols);
      }
    }
  });
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("linear_bf16", &linear_bf16, "x [M, K] bf16 @ packed bf16 weight -> [M, N] bf16 (+ bias)");
  m.def("linear_int8", &linear_int8,
        "x [M, K] @ packed int8 weight (per-channel scales) -> [M, N] in x's dtype (+ bias)");
}
