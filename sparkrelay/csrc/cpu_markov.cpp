// The DSpark vanilla Markov head's greedy draft loop over a block in one call from Python.
//
// The B slots of a block are sequential (slot k's bias depends on the draft of slot k-1), and each
// slot ran as about ten Python-level calls around two small kernels (a rank-r product over the draft
// vocabulary and an argmax), several times the kernels' own time. Here the same kernels run in the
// same order on the same operands, so drafts and Z are bit-equal to models/dspark.py's
// markov_sample for an all-greedy batch:
//
//   prev_0 = anchor;  Z_k = U_k + W2 W1[prev_k]  (fp32: kernels.add_linear's sum, bf16 or int8 W2);
//   pick = argmax Z_k;  prev_{k+1} = vocab[pick] (the draft vocabulary's token ids) or pick

#include "cpu_kernels.h"

namespace sparkrelay {

// u [R, B, V] bf16 (V contiguous), w1 [V_all, r] bf16, w2 [V, r] as a KernelLinear, vocab [V]
// int64 or None, anchors [R] int64 -> {drafts [R, B] int64 (token ids), Z [R, B, V] fp32}
std::vector<torch::Tensor> markov_greedy(const torch::Tensor& u, const torch::Tensor& w1,
                                         const KernelLinear& w2,
                                         const c10::optional<torch::Tensor>& vocab,
                                         const torch::Tensor& anchors) {
  TORCH_CHECK(u.dim() == 3 && u.scalar_type() == torch::kBFloat16 && u.stride(2) == 1,
              "markov_greedy: u must be bf16 [R, B, V] with V contiguous");
  const int64_t rows = u.size(0), slots = u.size(1), v = u.size(2);
  TORCH_CHECK(w1.dim() == 2 && w1.scalar_type() == torch::kBFloat16 && w1.size(1) == w2.k(),
              "markov_greedy: w1 must be bf16 [V, r] with r = W2's input width");
  TORCH_CHECK(w2.n() == v, "markov_greedy: W2 has ", w2.n(), " outputs, u has V = ", v);
  TORCH_CHECK(anchors.dim() == 1 && anchors.size(0) == rows &&
                  anchors.scalar_type() == torch::kLong,
              "markov_greedy: anchors must be int64 [R]");
  if (vocab) {
    TORCH_CHECK(vocab->dim() == 1 && vocab->size(0) == v && vocab->scalar_type() == torch::kLong,
                "markov_greedy: vocab must be int64 [V]");
  }
  torch::Tensor z = torch::empty({rows, slots, v}, u.options().dtype(torch::kFloat32));
  torch::Tensor drafts = torch::empty({rows, slots}, anchors.options());
  torch::Tensor prev = anchors;
  for (int64_t k = 0; k < slots; ++k) {
    torch::Tensor zk = z.select(1, k);                   // [R, V], rows B * V apart
    w2.add_into(w1.index_select(0, prev), u.select(1, k), zk);  // Z_k = U_k + W2 W1[prev]
    const torch::Tensor pick = argmax_rows(zk);            // [R]
    prev = vocab ? vocab->index_select(0, pick) : pick;
    drafts.select(1, k).copy_(prev);
  }
  return {drafts, z};
}

}  // namespace sparkrelay
