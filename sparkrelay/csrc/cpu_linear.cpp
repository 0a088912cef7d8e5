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
//
// On a CPU with AMX (amx_bf16, amx_int8), bf16 and int8 products go through the
// tile unit instead: the same packed bytes are its B operand (16 pairs or quads of one 16-column block = 16 rows of 64
// bytes, 128 bytes apart), so 8 rows cost about what 1 costs, where on the vector path the dot
// products, not memory, bound an 8-row product. The vector loop finishes the leftover K and the
// epilogue.

#include "cpu_kernels.h"

#include <ATen/Parallel.h>

#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>

namespace sparkrelay {
namespace {

constexpr int64_t kTile = 2 * kLanes;      // output columns per tile (two blocks)
constexpr int64_t kPairStep = 2 * kTile;   // bf16 elements per (tile, pair): 64 = 128 bytes
constexpr int64_t kMaxRows = 8;            // rows per kernel call
constexpr int64_t kPrefetchSteps = 8;      // pairs ahead: 8 x 128 B

// rows M of x [M, K] (K even, ldx elements apart) times one tile of packed weight -> y [M, cols];
// pairs from p0 on, added to init [M][32] (the tile unit's sums of the pairs before p0) if given;
// plus bias [32] and base [M, cols] (bf16, ldb apart) where given; y fp32 or bf16 (Out).
template <int M, typename Out>
void tile_bf16(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t p0, int64_t pairs,
               const float* init, const float* bias, const uint16_t* base, int64_t ldb, Out* y,
               int64_t ldy, int64_t cols) {
  __m512 acc0[M], acc1[M];
  for (int m = 0; m < M; ++m) {
    acc0[m] = init ? _mm512_loadu_ps(init + m * kTile) : _mm512_setzero_ps();
    acc1[m] = init ? _mm512_loadu_ps(init + m * kTile + kLanes) : _mm512_setzero_ps();
  }
  for (int64_t p = p0; p < pairs; ++p) {
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
  const __mmask16 keep0 = first(cols), keep1 = first(cols - kLanes);
  const __m512 b0 = bias ? load16(bias, keep0) : _mm512_setzero_ps();
  const __m512 b1 = bias ? load16(bias + kLanes, keep1) : _mm512_setzero_ps();
  for (int m = 0; m < M; ++m) {
    __m512 s0 = _mm512_add_ps(acc0[m], b0), s1 = _mm512_add_ps(acc1[m], b1);
    if (base) {
      s0 = _mm512_add_ps(s0, load16(base + m * ldb, keep0));
      s1 = _mm512_add_ps(s1, load16(base + m * ldb + kLanes, keep1));
    }
    store16(y + m * ldy, keep0, s0);
    store16(y + m * ldy + kLanes, keep1, s1);
  }
}

template <typename Out>
using TileFn = void (*)(const uint16_t*, int64_t, const uint16_t*, int64_t, int64_t, const float*,
                        const float*, const uint16_t*, int64_t, Out*, int64_t, int64_t);
template <typename Out>
constexpr TileFn<Out> kTileFns[kMaxRows + 1] = {
    nullptr,           tile_bf16<1, Out>, tile_bf16<2, Out>, tile_bf16<3, Out>, tile_bf16<4, Out>,
    tile_bf16<5, Out>, tile_bf16<6, Out>, tile_bf16<7, Out>, tile_bf16<8, Out>};

// ---- int8 weights (weight-only: per-channel scales), activations as 16-bit integers per row ----
//
//   int8: [N/32 tiles][K/4 quads][2 blocks][16 lanes][4]  -> 128 contiguous bytes per (tile, quad)
//
// A row x is quantized to x16 = round(x / sx) in -32767..32767 (sx = max |x| / 32767: finer than
// bf16's own 8-bit mantissa, so the product is weight-only in effect; 8-bit activations cost a
// real model 2% of held-out loss, docs/cpu_kernels.md), written as two byte rows that
// _mm512_dpbusd_epi32 (unsigned x signed bytes, four products per int32 lane) takes like any other:
//
//   u = x16 + 32768 = 256 * hi + lo,  hi = (x16 >> 8) + 128 (zero point 128),  lo = u & 255
//   sum_k x16[k] q[n, k] = 256 * (acc_hi[n] - 128 * qsum[n]) + acc_lo[n]
//
// so a row is two "byte rows" (hi, then lo) to the loops below, and
// y[n] = sx * s[n] * (256 * (acc_hi[n] - 128 * qsum[n]) + acc_lo[n]) + bias[n].

constexpr int64_t kQuadStep = 4 * kTile;  // int8 elements per (tile, quad): 128 bytes

// M byte rows (M / 2 rows of x, M even) -> y [M / 2, cols]; y is fp32 or bf16 (uint16_t), the
// input's dtype
template <int M, typename Out>
void tile_int8(const uint8_t* xq, int64_t ldx, const float* sx, const int8_t* w, int64_t q0,
               int64_t quads, const int32_t* init, const float* scale, const int32_t* qsum,
               const float* bias, Out* y, int64_t ldy, int64_t cols) {
  __m512i acc0[M], acc1[M];
  for (int m = 0; m < M; ++m) {
    acc0[m] = init ? _mm512_loadu_si512(init + m * kTile) : _mm512_setzero_si512();
    acc1[m] = init ? _mm512_loadu_si512(init + m * kTile + kLanes) : _mm512_setzero_si512();
  }
  for (int64_t q = q0; q < quads; ++q) {
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
  const __m512 hi = _mm512_set1_ps(256.f);
  for (int m = 0; m + 1 < M; m += 2) {
    const __m512 r = _mm512_set1_ps(sx[m / 2]);
    const __m512 d0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(acc0[m], z0)), hi,
                                      _mm512_cvtepi32_ps(acc0[m + 1]));
    const __m512 d1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(acc1[m], z1)), hi,
                                      _mm512_cvtepi32_ps(acc1[m + 1]));
    store16(y + m / 2 * ldy, keep0, _mm512_fmadd_ps(d0, _mm512_mul_ps(r, s0), b0));
    store16(y + m / 2 * ldy + kLanes, keep1, _mm512_fmadd_ps(d1, _mm512_mul_ps(r, s1), b1));
  }
}

template <typename Out>
using Int8TileFn = void (*)(const uint8_t*, int64_t, const float*, const int8_t*, int64_t, int64_t,
                            const int32_t*, const float*, const int32_t*, const float*, Out*,
                            int64_t, int64_t);
template <typename Out>
constexpr Int8TileFn<Out> kInt8TileFns[kMaxRows + 1] = {
    nullptr, nullptr, tile_int8<2, Out>, nullptr, tile_int8<4, Out>,
    nullptr, tile_int8<6, Out>, nullptr, tile_int8<8, Out>};  // byte rows: two per row of x

// one row of K values -> x16 = round(x / s), s = max |x| / 32767 (1 if 0), as the byte rows hi
// (zero point 128) and lo, ldq bytes each (x16 = 0 past K: hi 128, lo 0)
template <typename T>
void quantize_row(const T* row, int64_t k, uint8_t* hi, uint8_t* lo, int64_t ldq, float* scale) {
  __m512 amax = _mm512_setzero_ps();
  for (int64_t i = 0; i < k; i += kLanes) {
    amax = _mm512_max_ps(amax, _mm512_abs_ps(load16(row + i, first(k - i))));
  }
  const float top = _mm512_reduce_max_ps(amax);
  const float s = top > 0.f ? top / 32767.f : 1.f;
  *scale = s;
  const __m512 inv = _mm512_set1_ps(1.f / s);
  const __m512i offset = _mm512_set1_epi32(32768), low = _mm512_set1_epi32(255);
  for (int64_t i = 0; i < ldq; i += kLanes) {
    const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(load16(row + i, first(k - i)), inv));
    const __m512i u = _mm512_add_epi32(q, offset);  // 1..65535
    _mm_mask_storeu_epi8(hi + i, first(ldq - i), _mm512_cvtepi32_epi8(_mm512_srli_epi32(u, 8)));
    _mm_mask_storeu_epi8(lo + i, first(ldq - i), _mm512_cvtepi32_epi8(_mm512_and_si512(u, low)));
  }
}

// x [M, K] (rows contiguous) -> xq [2M, K padded to 4] uint8 (row m: byte rows 2m = hi, 2m + 1 =
// lo), sx [M]
void quantize_rows(const torch::Tensor& x, torch::Tensor& xq, torch::Tensor& sx) {
  const bool bf16 = x.scalar_type() == torch::kBFloat16;
  const torch::Tensor src = bf16 ? x.contiguous() : x.to(torch::kFloat32).contiguous();
  const int64_t rows = src.size(0), k = src.size(1), ldq = xq.size(1);
  for (int64_t m = 0; m < rows; ++m) {
    uint8_t* out = xq.data_ptr<uint8_t>() + 2 * m * ldq;
    float* scale = sx.data_ptr<float>() + m;
    if (bf16) {
      quantize_row(reinterpret_cast<const uint16_t*>(src.data_ptr<at::BFloat16>()) + m * k, k, out,
                   out + ldq, ldq, scale);
    } else {
      quantize_row(src.data_ptr<float>() + m * k, k, out, out + ldq, ldq, scale);
    }
  }
}

// ---- the tile unit (AMX): groups of 1 to 8 rows (int8: 2 to 16 byte rows) on CPUs that have it ----
//
// Tiles 0 and 1 hold activations (rows x 64 bytes: 16 pairs or quads), 2, 3, 6 and 7 weights (16
// rows of 64 bytes, 128 bytes apart: one block of 16 packed steps), 4 and 5 the two blocks' sums
// (rows x 16). A loop runs two steps on separate tiles so the next loads issue while the products
// run; software prefetch measured slower here (the streams are sequential).

constexpr int64_t kAmxSteps = 16;   // pairs (bf16) or quads (int8) per tile product
// every product of 16 steps or more goes to the tile unit where it is on: a bf16 row streams ~10%
// faster through its tile loads than through the vector loop, and an int8 row (two byte rows)
// ~7% faster (benchmarks/results/linears/)
constexpr int64_t kAmxRows = 16;  // rows of one activation tile: an int8 group's byte rows
constexpr int64_t kStepBytes = 128; // packed bytes per (tile, pair) or (tile, quad)

std::atomic<bool> g_amx{false};

struct TileConfig {  // the LDTILECFG operand: palette 1, bytes per row and rows of each tile
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

void configure_tiles(int64_t rows) {
  TileConfig c;
  for (int t = 0; t < 8; ++t) {
    const bool weight = t == 2 || t == 3 || t == 6 || t == 7;
    c.colsb[t] = 64;
    c.rows[t] = static_cast<uint8_t>(weight ? kAmxSteps : rows);
  }
  _tile_loadconfig(&c);
}

#define SR_TILE_DOT(c, a, b)   \
  do {                         \
    if constexpr (kInt8) {     \
      _tile_dpbusd(c, a, b);   \
    } else {                   \
      _tile_dpbf16ps(c, a, b); \
    }                          \
  } while (0)

// the configured rows of x (4 bytes per step, ldx bytes apart) times steps [0, done) of one packed
// tile -> sums [rows][32] (fp32 for bf16, int32 for int8); done = steps rounded down to 16.
template <bool kInt8>
int64_t amx_tile(const uint8_t* x, int64_t ldx, const uint8_t* w, int64_t steps, void* sums) {
  const int64_t done = steps / kAmxSteps * kAmxSteps;
  _tile_zero(4);
  _tile_zero(5);
  int64_t s = 0;
  for (; s + 2 * kAmxSteps <= done; s += 2 * kAmxSteps) {
    const uint8_t* ws = w + s * kStepBytes;
    _tile_loadd(0, x + 4 * s, ldx);
    _tile_loadd(2, ws, kStepBytes);
    _tile_loadd(3, ws + 64, kStepBytes);
    _tile_loadd(1, x + 4 * (s + kAmxSteps), ldx);
    _tile_loadd(6, ws + kAmxSteps * kStepBytes, kStepBytes);
    _tile_loadd(7, ws + kAmxSteps * kStepBytes + 64, kStepBytes);
    SR_TILE_DOT(4, 0, 2);
    SR_TILE_DOT(5, 0, 3);
    SR_TILE_DOT(4, 1, 6);
    SR_TILE_DOT(5, 1, 7);
  }
  if (s < done) {
    const uint8_t* ws = w + s * kStepBytes;
    _tile_loadd(0, x + 4 * s, ldx);
    _tile_loadd(2, ws, kStepBytes);
    _tile_loadd(3, ws + 64, kStepBytes);
    SR_TILE_DOT(4, 0, 2);
    SR_TILE_DOT(5, 0, 3);
  }
  _tile_stored(4, sums, kTile * 4);
  _tile_stored(5, static_cast<uint8_t*>(sums) + 64, kTile * 4);
  return done;
}

bool cpu_has_amx() {  // CPUID.(7,0):EDX bits 22 (amx-bf16), 24 (amx-tile), 25 (amx-int8)
  unsigned a, b, c, d;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  return ((d >> 22) & 1) && ((d >> 24) & 1) && ((d >> 25) & 1);
}

// Linux lends the tile state only to a process that asks (arch_prctl ARCH_REQ_XCOMP_PERM for
// XTILEDATA); asking is idempotent.
bool request_tile_state() { return syscall(SYS_arch_prctl, 0x1023, 18) == 0; }

// A thread's use of the tile unit over its share of tiles: start() runs a row group's whole
// steps on it (configuring the tiles for m rows when that changes) and says where the vector loop
// goes on.
struct TileRun {
  bool amx;
  int64_t configured = 0;
  alignas(64) int32_t sums[kAmxRows * kTile];

  template <bool kInt8>
  int64_t start(const uint8_t* x, int64_t ldx, const uint8_t* w, int64_t steps, int64_t m) {
    if (!amx) return 0;
    if (configured != m) configure_tiles(m);
    configured = m;
    return amx_tile<kInt8>(x, ldx, w, steps, sums);
  }
  ~TileRun() {
    if (configured) _tile_release();
  }
};

struct Int8Operands {  // linear_int8's checked inputs, as pointers
  const uint8_t* xq;
  const float* sx;
  const int8_t* w;
  const float* scale;
  const int32_t* qsum;
  const float* bias;
  int64_t rows, quads, n;
};

// every tile and row group of y [rows, n] (fp32 or bf16), tiles split over threads; a group is
// 16 byte rows (8 rows of x) on the tile unit, 8 on the vector loop, whose epilogue takes 8 at a time
template <typename Out>
void run_int8(const Int8Operands& o, Out* y) {
  const int64_t ldx = o.quads * 4, tiles = (o.n + kTile - 1) / kTile, bytes = 2 * o.rows;
  const bool amx = g_amx && o.quads >= kAmxSteps;
  const int64_t group = amx ? kAmxRows : kMaxRows;
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    TileRun run{amx};
    for (int64_t t = begin; t < end; ++t) {
      const int8_t* wt = o.w + t * o.quads * kQuadStep;
      const int64_t cols = std::min(kTile, o.n - t * kTile), c0 = t * kTile;
      for (int64_t r = 0; r < bytes; r += group) {
        const int64_t m = std::min(group, bytes - r);
        const uint8_t* xr = o.xq + r * ldx;
        const int64_t q0 = run.start<true>(xr, ldx, reinterpret_cast<const uint8_t*>(wt), o.quads, m);
        for (int64_t h = 0; h < m; h += kMaxRows) {
          kInt8TileFns<Out>[std::min(kMaxRows, m - h)](
              xr + h * ldx, ldx, o.sx + (r + h) / 2, wt, q0, o.quads,
              amx ? run.sums + h * kTile : nullptr, o.scale + c0, o.qsum + c0,
              o.bias ? o.bias + c0 : nullptr, y + (r + h) / 2 * o.n + c0, o.n, cols);
        }
      }
    }
  });
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
  torch::Tensor xq = torch::empty({2 * rows, quads * 4}, x.options().dtype(torch::kUInt8));
  torch::Tensor sx = torch::empty({rows}, x.options().dtype(torch::kFloat32));
  quantize_rows(x, xq, sx);
  const bool bf16 = x.scalar_type() == torch::kBFloat16;
  const auto out_dtype = bf16 ? torch::kBFloat16 : torch::kFloat32;
  torch::Tensor y = torch::empty({rows, n}, x.options().dtype(out_dtype));
  const Int8Operands ops{xq.data_ptr<uint8_t>(), sx.data_ptr<float>(), packed.data_ptr<int8_t>(),
                         scale.data_ptr<float>(), qsum.data_ptr<int32_t>(),
                         bias ? bias->data_ptr<float>() : nullptr, rows, quads, n};
  if (bf16) {
    run_int8(ops, reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>()));
  } else {
    run_int8(ops, y.data_ptr<float>());
  }
  return x.scalar_type() == y.scalar_type() ? y : y.to(x.scalar_type());
}

namespace {

// the rows of y [rows, n] (fp32 or bf16) = x @ W + bias + base, tiles split over threads
template <typename Out>
void run_bf16(const Bf16Operands& o, Out* yp) {
  const int64_t tiles = (o.n + kTile - 1) / kTile, pairs = o.pairs, ldx = o.ldx;
  const bool amx = g_amx && pairs >= kAmxSteps;
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    TileRun run{amx};
    for (int64_t t = begin; t < end; ++t) {
      const uint16_t* wt = o.w + t * pairs * kPairStep;
      const int64_t cols = std::min(kTile, o.n - t * kTile), c0 = t * kTile;
      for (int64_t r = 0; r < o.rows; r += kMaxRows) {
        const int64_t m = std::min(kMaxRows, o.rows - r);
        const int64_t p0 = run.start<false>(reinterpret_cast<const uint8_t*>(o.x + r * ldx),
                                            2 * ldx, reinterpret_cast<const uint8_t*>(wt), pairs, m);
        kTileFns<Out>[m](o.x + r * ldx, ldx, wt, p0, pairs,
                         amx ? reinterpret_cast<const float*>(run.sums) : nullptr,
                         o.bias ? o.bias + c0 : nullptr, o.base ? o.base + r * o.ldb + c0 : nullptr,
                         o.ldb, yp + r * o.ldy + c0, o.ldy, cols);
      }
    }
  });
}

}  // namespace

void bf16_product(const Bf16Operands& o, float* y) { run_bf16(o, y); }
void bf16_product(const Bf16Operands& o, uint16_t* y) { run_bf16(o, y); }

// Turns the tile unit on (where the CPU has AMX and the OS lends its state) or off; returns whether
// it is on. Off until asked: models/cpu_kernels.py asks at load unless SPARKRELAY_CPU_AMX=0.
bool use_amx(bool on) {
  g_amx = on && cpu_has_amx() && request_tile_state();
  return g_amx;
}

}  // namespace sparkrelay
