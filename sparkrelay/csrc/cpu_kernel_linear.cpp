// One frozen linear in a kernel's packed layout (KernelLinear): what the Python modules that own
// the weights (models/kernels.py AvxLinear, models/quant.py Int8Linear) and the fused decoder layer
// call. Both builds compile it: the AVX-512 one over cpu_linear.cpp's bf16 and int8 products, the
// AVX2 one (SPARKRELAY_AVX2_ONLY) over cpu_linear_avx2.cpp's bf16 product alone.

#include "cpu_kernels.h"

namespace sparkrelay {
namespace {

void check_bf16(const torch::Tensor& x, const torch::Tensor& packed, int64_t n,
                const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kBFloat16 && x.dim() == 2,
              "linear_bf16: x must be a 2-D bfloat16 CPU tensor");
  TORCH_CHECK(x.stride(1) == 1 && x.size(1) % 2 == 0,
              "linear_bf16: x rows must be contiguous, K even");
  const int64_t tiles = (n + kPackedCols - 1) / kPackedCols;
  TORCH_CHECK(packed.is_contiguous() && packed.scalar_type() == torch::kBFloat16 &&
                  packed.numel() == tiles * (x.size(1) / 2) * kPackedPair,
              "linear_bf16: packed does not match N = ", n, " and K = ", x.size(1));
  if (bias) {
    TORCH_CHECK(bias->is_contiguous() && bias->scalar_type() == torch::kFloat32 &&
                    bias->numel() == tiles * kPackedCols,
                "linear_bf16: bias must be float32 with N padded to a multiple of 32");
  }
}

}  // namespace

// x [M, K] bf16 (K even), packed (cpu_linear.cpp's order), bias [N padded to 32] fp32 or None,
// base [M, N] bf16 or None (added, N contiguous), out [M, N] fp32 or bf16 (N contiguous) or None
// -> out, or a new [M, N] bf16, = x @ W^T + bias + base (the sums rounded once, to out's dtype)
torch::Tensor linear_bf16(const torch::Tensor& x, const torch::Tensor& packed, int64_t n,
                          const c10::optional<torch::Tensor>& bias,
                          const c10::optional<torch::Tensor>& base,
                          const c10::optional<torch::Tensor>& out) {
  check_bf16(x, packed, n, bias);
  const int64_t rows = x.size(0);
  if (base) {
    TORCH_CHECK(base->scalar_type() == torch::kBFloat16 && base->dim() == 2 &&
                    base->size(0) == rows && base->size(1) == n && base->stride(1) == 1,
                "linear_bf16: base must be bf16 [M, N] with N contiguous");
  }
  torch::Tensor y = out ? *out : torch::empty({rows, n}, x.options());
  TORCH_CHECK(y.dim() == 2 && y.size(0) == rows && y.size(1) == n && y.stride(1) == 1 &&
                  (y.scalar_type() == torch::kFloat32 || y.scalar_type() == torch::kBFloat16),
              "linear_bf16: out must be a float32 or bf16 [M, N] with N contiguous");
  const Bf16Operands o{reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()),
                       x.stride(0),
                       reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>()),
                       bias ? bias->data_ptr<float>() : nullptr,
                       base ? reinterpret_cast<const uint16_t*>(base->data_ptr<at::BFloat16>())
                            : nullptr,
                       base ? base->stride(0) : 0,
                       rows,
                       x.size(1) / 2,
                       n,
                       y.stride(0)};
  if (y.scalar_type() == torch::kFloat32) {
    bf16_product(o, y.data_ptr<float>());
  } else {
    bf16_product(o, reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>()));
  }
  return y;
}

KernelLinear::KernelLinear(torch::Tensor packed, int64_t n, int64_t k,
                           c10::optional<torch::Tensor> bias, c10::optional<torch::Tensor> scale,
                           c10::optional<torch::Tensor> qsum)
    : packed_(std::move(packed)), bias_(std::move(bias)), scale_(std::move(scale)),
      qsum_(std::move(qsum)), n_(n), k_(k) {
  TORCH_CHECK(scale_.has_value() == qsum_.has_value(),
              "KernelLinear: an int8 weight needs both scale and qsum");
  TORCH_CHECK(packed_.scalar_type() == (scale_ ? torch::kInt8 : torch::kBFloat16),
              "KernelLinear: packed must be int8 (with scale and qsum) or bfloat16");
#ifdef SPARKRELAY_AVX2_ONLY
  TORCH_CHECK(!scale_, "KernelLinear: the AVX2 build has no int8 kernel (it needs avx512_vnni)");
#endif
}

torch::Tensor KernelLinear::operator()(const torch::Tensor& x) const {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == k_, "KernelLinear: x must be [M, ", k_, "]");
  const torch::Tensor rows = x.contiguous();
#ifndef SPARKRELAY_AVX2_ONLY
  if (scale_) return linear_int8(rows, packed_, *scale_, *qsum_, n_, bias_);
#endif
  // the bf16 kernel reads activations in pairs: an odd K gets a zero column
  const torch::Tensor even = k_ % 2 ? at::constant_pad_nd(rows, {0, 1}) : rows;
  return linear_bf16(even, packed_, n_, bias_, c10::nullopt, c10::nullopt);
}

void KernelLinear::add_into(const torch::Tensor& x, const torch::Tensor& base,
                            torch::Tensor& out) const {
  if (scale_ || k_ % 2) {  // as kernels.add_linear's other path: out = base, out += x W^T
    out.copy_(base);
    out.add_((*this)(x));
    return;
  }
  TORCH_CHECK(x.dim() == 2 && x.size(1) == k_, "KernelLinear.add_into: x must be [M, ", k_, "]");
  linear_bf16(x.contiguous(), packed_, n_, bias_, base, out);
}

}  // namespace sparkrelay
