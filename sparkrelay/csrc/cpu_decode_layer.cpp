// A decoder layer's few-row forward (a decode step, a DSpark verify) in one call from Python.
//
// At 0.6B shapes a decode step's own arithmetic outside the linears is tens of microseconds a layer,
// but it ran as ~15 Python-level calls (wrappers, views, checks, the dispatcher), about a fifth of
// an int8 step (figures: docs/cpu_kernels.md). Here the same kernels run in the same order on the
// same operands, so the output is bit-equal to models/decoder.py's layer on the kernels:
//
//   x = norm(h); qkv = x W_qkv; q, k = rope(qk_norm(q, k)); pools[slots] = k, v;
//   a = attention(q, pools); h = h + a W_o; g = silu_mul(norm(h) W_gate_up); h = h + g W_down
//
// Its linears are KernelLinears (cpu_kernel_linear.cpp).

#include "cpu_kernels.h"

namespace sparkrelay {

DecodeLayer::DecodeLayer(KernelLinear qkv, KernelLinear o, KernelLinear gate_up,
                         KernelLinear down, torch::Tensor input_norm, torch::Tensor post_norm,
                         c10::optional<torch::Tensor> qk_norm, int64_t heads, int64_t kv_heads,
                         int64_t head_dim, double eps, double qk_eps, double scale)
    : qkv_(std::move(qkv)), o_(std::move(o)), gate_up_(std::move(gate_up)),
      down_(std::move(down)), input_norm_(input_norm.reshape({1, -1})),
      post_norm_(post_norm.reshape({1, -1})), qk_norm_(std::move(qk_norm)), heads_(heads),
      kv_heads_(kv_heads), head_dim_(head_dim), eps_(eps), qk_eps_(qk_eps), scale_(scale) {
  TORCH_CHECK(head_dim % 32 == 0 && head_dim <= 256,
              "DecodeLayer: the head dim must be a multiple of 32 up to 256");
}

// h [T, d] bf16, cos / sin [T, 1, D] bf16, pools [S, n_kv, D] bf16, slots [T], kv_index [B, Lk],
// seq [T], lengths [T] (attention.AttnMeta's) -> the layer's output [T, d]; writes k, v to the pools
torch::Tensor DecodeLayer::forward(const torch::Tensor& h, const torch::Tensor& cos,
                                   const torch::Tensor& sin, torch::Tensor& k_pool,
                                   torch::Tensor& v_pool, const torch::Tensor& slots,
                                   const torch::Tensor& kv_index, const torch::Tensor& seq,
                                   const torch::Tensor& lengths) const {
  const int64_t t = h.size(0), d = h.size(1), hd = head_dim_, qk_heads = heads_ + kv_heads_;
  const torch::Tensor x = rms_norm_bf16(h.view({t, 1, d}), input_norm_, eps_).view({t, d});
  const torch::Tensor qkv = qkv_(x);  // [T, (H + 2 n_kv) D]
  torch::Tensor qk = qkv.narrow(1, 0, qk_heads * hd).view({t, qk_heads, hd});
  if (qk_norm_) qk = rms_norm_bf16(qk, *qk_norm_, qk_eps_);
  const torch::Tensor rotated = rope_bf16(qk, cos, sin);  // [T, H + n_kv, D]
  const torch::Tensor q = rotated.narrow(1, 0, heads_);
  const torch::Tensor v = qkv.narrow(1, qk_heads * hd, kv_heads_ * hd).view({t, kv_heads_, hd});
  k_pool.index_copy_(0, slots, rotated.narrow(1, heads_, kv_heads_));
  v_pool.index_copy_(0, slots, v);
  const torch::Tensor a =
      decode_attention_bf16(q.contiguous(), k_pool, v_pool, kv_index, seq, lengths, scale_);
  const torch::Tensor mid = h + o_(a.view({t, heads_ * hd}));
  const torch::Tensor y = rms_norm_bf16(mid.view({t, 1, d}), post_norm_, eps_).view({t, d});
  return mid + down_(silu_mul_bf16(gate_up_(y)));
}

}  // namespace sparkrelay
