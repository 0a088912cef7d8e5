// The extension's Python functions (models/cpu_kernels.py loads them). The AVX2 build
// (SPARKRELAY_AVX2_ONLY) exports all but the int8 product and the AMX switch.
#include "cpu_kernels.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace sparkrelay;
  m.def("linear_bf16", &linear_bf16,
        "x [M, K] bf16 @ packed bf16 weight (+ bias, + base [M, N] bf16) -> out [M, N] fp32 or "
        "bf16, or a new bf16 [M, N]",
        py::arg("x"), py::arg("packed"), py::arg("n"), py::arg("bias") = py::none(),
        py::arg("base") = py::none(), py::arg("out") = py::none());
  py::class_<KernelLinear>(m, "KernelLinear")
      .def(py::init<torch::Tensor, int64_t, int64_t, c10::optional<torch::Tensor>,
                    c10::optional<torch::Tensor>, c10::optional<torch::Tensor>>(),
           "a frozen linear in a kernel's packed layout: bf16 tiles, or int8 tiles with scale "
           "and qsum (each padded to 32 columns)",
           py::arg("packed"), py::arg("n"), py::arg("k"), py::arg("bias") = py::none(),
           py::arg("scale") = py::none(), py::arg("qsum") = py::none())
      .def("__call__", &KernelLinear::operator(), "x [M, K] -> [M, N] in x's dtype")
      .def("add_into", &KernelLinear::add_into,
           "out [M, N] (fp32 or bf16) = base [M, N] bf16 + x [M, K] W^T (kernels.add_linear)");
  m.def("argmax_rows", &argmax_rows,
        "x [R, V] float32 or bf16 (V contiguous) -> int64 [R], as torch.argmax(x, -1)");
  m.def("draw_rows", &draw_rows,
        "weights [R, V] float32 >= 0, u [R] float64 in [0, 1) -> int64 [R]: the first index whose "
        "running sum exceeds u * the row's total (a draw from the weights)");
  m.def("apply_token_bitmask", &apply_token_bitmask,
        "logits [R, V] float32, in place: -inf where bitmask int32 [R, ceil(V / 32)] has a 0 bit");
  m.def("markov_greedy", &markov_greedy,
        "u [R, B, V] bf16, W1 [V_all, r] bf16, W2 as a KernelLinear, vocab [V] int64 or "
        "None, anchors [R] -> [drafts [R, B], Z [R, B, V] fp32]: the vanilla Markov head's greedy "
        "block",
        py::arg("u"), py::arg("w1"), py::arg("w2"), py::arg("vocab"), py::arg("anchors"));
  m.def("decode_attention_bf16", &decode_attention_bf16,
        "q [T, H, D] against paged bf16 K/V pools [S, n_kv, D] through slots [B, Lk], the "
        "sequence seq [T] and visible keys lengths [T] of each query -> [T, H, D] bf16");
  m.def("rms_norm_bf16", &rms_norm_bf16,
        "x [T, G, D] bf16 (D contiguous), weight [G, D] bf16 -> RMSNorm(x) [T, G, D] bf16");
  m.def("silu_mul_bf16", &silu_mul_bf16,
        "gate_up [T, 2I] bf16 -> silu(gate) * up [T, I] bf16, rounded per op as torch does");
  m.def("rope_bf16", &rope_bf16,
        "x [T, G, D] bf16, cos and signed sin [T, 1, D] bf16 -> RoPE(x) [T, G, D] bf16, equal to "
        "layers.apply_rope's torch ops");
  py::class_<DecodeLayer>(m, "DecodeLayer")
      .def(py::init<KernelLinear, KernelLinear, KernelLinear, KernelLinear, torch::Tensor,
                    torch::Tensor, c10::optional<torch::Tensor>, int64_t, int64_t, int64_t, double,
                    double, double>(),
           "a decoder layer's weights for its few-row bf16 forward")
      .def("forward", &DecodeLayer::forward,
           "h [T, d], cos / sin [T, 1, D], the layer's K/V pools, slots [T], kv_index [B, Lk], "
           "seq [T], lengths [T] -> [T, d]; writes the fed tokens' K/V");
#ifndef SPARKRELAY_AVX2_ONLY
  m.def("use_amx", &use_amx, "turn the AMX path on or off; returns whether it is on");
  m.def("linear_int8", &linear_int8,
        "x [M, K] @ packed int8 weight (per-channel scales) -> [M, N] in x's dtype (+ bias)");
#endif  // SPARKRELAY_AVX2_ONLY
}
