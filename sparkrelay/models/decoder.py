"""Qwen3 dense decoder (CausalLM), owning a layer range, with DSpark tap capture.

Module names mirror the Hugging Face checkpoint keys (`model.layers.{i}...`, `lm_head`) so that
weights load as they are. A stage owns layers [start, end): the embedding when start == 0, the final
norm and LM head when end == num_layers. Taps: id -1 is the embedding output, id i the raw
residual-stream output of layer i (= transformers' `hidden_states[i + 1]`).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Optional

import torch
from torch import nn

from sparkrelay.models import cpu_kernels
from sparkrelay.models.attention import AttnMeta, paged_attention
from sparkrelay.models.dummy import dummy_config, fill_dummy, init_std
from sparkrelay.models.families import family_of
from sparkrelay.models.kernels import KERNEL_ROWS, fast_head
from sparkrelay.models.layers import (
    RMSNorm,
    Rotary,
    SwiGLU,
    apply_rope,
    fuse_linears,
    rms_norm,
    rope_scaling,
    rope_theta,
    transposed,
)
from sparkrelay.models.loader import (
    SHAPE_FIELDS,
    CheckpointError,
    decoder_dummy_key,
    decoder_key_owner,
    is_dummy,
    load_weights,
    materialize,
    on_meta,
    read_config,
)


@dataclass(frozen=True)
class DecoderSpec:
    """The fields of a config.json that the forward uses; `qk_norm` and the biases are the family's
    switches."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # bias on q/k/v
    qk_norm: bool = True  # per-head RMSNorm on q and k (Qwen3)
    o_bias: bool = False  # bias on o_proj
    mlp_bias: bool = False  # bias on gate/up/down
    rope_scaling: Optional[tuple] = None  # layers.rope_scaling's (kind, params) or None

    @classmethod
    def from_hf(cls, cfg: dict, architecture: Optional[str] = None) -> "DecoderSpec":
        """`architecture` (default: the config's architectures[0]) picks the family's switches."""
        heads = cfg["num_attention_heads"]
        fam = family_of(cfg, architecture)
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta(cfg),
            max_position_embeddings=cfg.get("max_position_embeddings", 32768),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=fam.qkv_bias,
            qk_norm=fam.qk_norm,
            o_bias=fam.o_bias,
            mlp_bias=fam.mlp_bias,
            rope_scaling=rope_scaling(cfg),
        )

    def rotary(self, device: torch.device | str) -> Rotary:
        return Rotary(
            self.head_dim,
            self.rope_theta,
            self.max_position_embeddings,
            torch.device(device),
            self.rope_scaling,
        )


class Attention(nn.Module):
    def __init__(self, spec: DecoderSpec) -> None:
        super().__init__()
        d, hd, bias = spec.hidden_size, spec.head_dim, spec.attention_bias
        self.n_heads, self.n_kv, self.head_dim = spec.num_heads, spec.num_kv_heads, hd
        self.q_proj = nn.Linear(d, self.n_heads * hd, bias=bias)
        self.k_proj = nn.Linear(d, self.n_kv * hd, bias=bias)
        self.v_proj = nn.Linear(d, self.n_kv * hd, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * hd, d, bias=spec.o_bias)
        self.qk_norm = spec.qk_norm
        if spec.qk_norm:
            self.q_norm = RMSNorm(hd, spec.rms_norm_eps)
            self.k_norm = RMSNorm(hd, spec.rms_norm_eps)
        self.scale = hd**-0.5
        self.qkv: nn.Module | None = None

    def fuse(self) -> None:
        """After loading: one q/k/v matmul, and the q and k head norms as one norm with a per-head
        weight."""
        self.qkv = fuse_linears(self.q_proj, self.k_proj, self.v_proj)
        self.o_proj = transposed(self.o_proj)
        if self.qk_norm:
            qk_w = torch.cat(
                [
                    self.q_norm.weight.detach().expand(self.n_heads, -1),
                    self.k_norm.weight.detach().expand(self.n_kv, -1),
                ]
            )  # [H + n_kv, D]
            self.register_buffer("qk_norm_weight", qk_w.contiguous(), persistent=False)
        del self.q_proj, self.k_proj, self.v_proj

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, d] -> q [T, H, D], k [T, n_kv, D], v [T, n_kv, D] (before norms and RoPE)."""
        t, hd = x.shape[0], self.head_dim
        if self.qkv is None:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        else:
            q, k, v = self.qkv(x).split([self.n_heads * hd, self.n_kv * hd, self.n_kv * hd], dim=-1)
        return q.view(t, self.n_heads, hd), k.view(t, self.n_kv, hd), v.view(t, self.n_kv, hd)

    def qk_rope(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        """x [T, d] -> q [T, H, D], k [T, n_kv, D] (normed, rotated), v [T, n_kv, D]."""
        if self.qkv is None:
            q, k, v = self.project(x)
            if self.qk_norm:
                q, k = self.q_norm(q), self.k_norm(k)
            return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v
        t, hd, h, n_kv = x.shape[0], self.head_dim, self.n_heads, self.n_kv
        qkv = self.qkv.forward(x)  # [T, (H + 2 n_kv) * D]
        # q heads then k heads, normed and rotated together
        qk = qkv[:, : (h + n_kv) * hd].view(t, h + n_kv, hd)
        if self.qk_norm:
            qk = rms_norm(qk, self.qk_norm_weight, self.q_norm.eps)
        q, k = apply_rope(qk, cos, sin).split([h, n_kv], dim=1)
        return q, k, qkv[:, (h + n_kv) * hd :].view(t, n_kv, hd)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv: tuple[torch.Tensor, torch.Tensor],
        meta: AttnMeta,
    ) -> torch.Tensor:
        q, k, v = self.qk_rope(x, cos, sin)
        out = paged_attention(q, k, v, kv[0], kv[1], meta, self.scale)  # [T, H, D]
        return self.o_proj.forward(out.reshape(x.shape[0], self.n_heads * self.head_dim))


class DecoderLayer(nn.Module):
    def __init__(self, spec: DecoderSpec) -> None:
        super().__init__()
        self.self_attn = Attention(spec)
        self.mlp = SwiGLU(spec.hidden_size, spec.intermediate_size, spec.mlp_bias)
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        # (the C++ layer or None, the products it was built from): `few_rows`
        self._few_rows: tuple = (None, ())

    def forward(
        self,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv: tuple[torch.Tensor, torch.Tensor],
        meta: AttnMeta,
    ) -> torch.Tensor:
        """h [T, d] residual stream in -> out; the returned value is the layer's raw residual-stream output."""
        fused = self.few_rows(h, kv[0])
        if fused is not None:  # the same kernels in one call (csrc/cpu_decode_layer.cpp)
            return fused.forward(
                h,
                cos,
                sin,
                kv[0],
                kv[1],
                meta.slot_mapping,
                meta.kv_index,
                meta.query_seq(),
                meta.query_lengths(),
            )
        # `.forward` directly: the hot decode loop skips nn.Module.__call__'s hook handling
        # (docs/architecture.md)
        h = h + self.self_attn.forward(self.input_layernorm.forward(h), cos, sin, kv, meta)
        return h + self.mlp.forward(self.post_attention_layernorm.forward(h))

    def products(self) -> tuple:
        """The layer's four fused products (None before `fuse`)."""
        attn, mlp = self.self_attn, self.mlp
        return attn.qkv, attn.o_proj, mlp.gate_up, mlp.down_proj

    def few_rows(self, h: torch.Tensor, k_pool: torch.Tensor):
        """The layer as one C++ call where it serves h [T, d]: at most KERNEL_ROWS bf16 rows, a bf16
        pool, every product on the CPU kernels; else None. Why: a decode step's ~15 Python-level
        calls a layer cost more than their arithmetic. Rebuilt when the products change
        (`--torchao-config` replaces them after `fuse`)."""
        if h.shape[0] > KERNEL_ROWS or h.dtype != torch.bfloat16 or k_pool.dtype != h.dtype:
            return None
        if torch.compiler.is_compiling():
            return None
        fused, built_from = self._few_rows
        products = self.products()
        if len(built_from) != 4 or any(a is not b for a, b in zip(products, built_from)):
            fused = kernel_layer(self)
            self._few_rows = (fused, products)
        return fused


def kernel_layer(layer: DecoderLayer):
    """csrc/cpu_decode_layer.cpp's DecodeLayer over `layer`'s weights, or None where a product is not
    on the kernels (float32, kernels off, not fused yet) or the heads do not suit the RoPE kernel."""
    ext = cpu_kernels.portable()
    kernels = [getattr(p, "kernel", None) for p in layer.products()]
    attn, norms = layer.self_attn, (layer.input_layernorm, layer.post_attention_layernorm)
    if ext is None or None in kernels or attn.head_dim % 32 or attn.head_dim > 256:
        return None
    if any(n.weight.dtype != torch.bfloat16 for n in norms):
        return None
    qk = attn.qk_norm_weight if attn.qk_norm else None
    eps = attn.q_norm.eps if attn.qk_norm else 0.0
    w_in, w_post = (n.weight.detach() for n in norms)
    return ext.DecodeLayer(
        *kernels,
        w_in,
        w_post,
        qk,
        attn.n_heads,
        attn.n_kv,
        attn.head_dim,
        norms[0].eps,
        eps,
        attn.scale,
    )


@contextmanager
def unfused(model: nn.Module) -> Iterator[None]:
    """Inside, every DecoderLayer of `model` runs its Python forward (each call's `few_rows` answers
    None). Why: a profiler that times the linear modules one by one needs them called from Python;
    the fused layer calls their kernels from C++."""
    layers = [m for m in model.modules() if isinstance(m, DecoderLayer)]
    for layer in layers:
        layer.few_rows = lambda h, k_pool: None  # an instance attribute shadowing the method
    try:
        yield
    finally:
        for layer in layers:
            del layer.few_rows


class DecoderBody(nn.Module):
    """`model.*` of the checkpoint, restricted to the owned layer range."""

    def __init__(self, spec: DecoderSpec, start: int, end: int) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size) if start == 0 else None
        self.layers = nn.ModuleDict({str(i): DecoderLayer(spec) for i in range(start, end)})
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps) if end == spec.num_layers else None


@dataclass
class StageOutput:
    """hidden: [T, d] residual stream after the stage's last layer; logits: [R, V] at the rows asked
    for (last stage only); taps: {layer_id: [T, d]} for the tap ids this stage owns."""

    hidden: torch.Tensor
    logits: Optional[torch.Tensor]
    taps: dict[int, torch.Tensor]


class CausalLM(nn.Module):
    def __init__(
        self,
        spec: DecoderSpec,
        start: int = 0,
        end: Optional[int] = None,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__()
        end = spec.num_layers if end is None else end
        if not 0 <= start < end <= spec.num_layers:
            raise ValueError(f"layer range [{start}, {end}) is not inside [0, {spec.num_layers})")
        self.spec, self.start, self.end = spec, start, end
        self.model = DecoderBody(spec, start, end)
        self.is_last = end == spec.num_layers
        self.lm_head = (
            nn.Linear(spec.hidden_size, spec.vocab_size, bias=False) if self.is_last else None
        )
        self.head: nn.Module | None = None  # the LM head's fast copy, set by `fuse`
        self.rotary = spec.rotary(device)

    def fuse(self) -> None:
        """After loading: merge each layer's q/k/v and gate/up projections, every product in its
        fast layout."""
        for layer in self.model.layers.values():
            layer.self_attn.fuse()
            layer.mlp.fuse()
        # The LM head stays an nn.Linear (tied, it is the embedding itself, and the drafter shares
        # it by identity); `head` is its fast copy for the logits where one pays
        # (kernels.fast_head), else None.
        self.head = fast_head(self.lm_head.weight) if self.lm_head is not None else None

    def owns_tap(self, layer_id: int) -> bool:
        return (layer_id == -1 and self.start == 0) or self.start <= layer_id < self.end

    def forward(
        self,
        meta: AttnMeta,
        kv_caches: dict[int, tuple[torch.Tensor, torch.Tensor]],
        input_ids: Optional[torch.Tensor] = None,
        hidden: Optional[torch.Tensor] = None,
        logits_index: Optional[torch.Tensor] = None,
        taps: tuple[int, ...] = (),
    ) -> StageOutput:
        """input_ids [T] (first stage) or hidden [T, d] (later stages); logits only at rows
        `logits_index` [R]."""
        h = self.model.embed_tokens(input_ids) if self.start == 0 else hidden
        owned = tuple(i for i in taps if self.owns_tap(i))
        h, tapped = self.body(h, meta, kv_caches, owned)
        logits = None
        if self.is_last:
            rows = self.model.norm(h if logits_index is None else h[logits_index])
            logits = self.lm_head(rows) if self.head is None else self.head.forward(rows)
        return StageOutput(hidden=h, logits=logits, taps=dict(zip(owned, tapped)))

    def body(
        self,
        h: torch.Tensor,
        meta: AttnMeta,
        kv_caches: dict[int, tuple[torch.Tensor, torch.Tensor]],
        taps: tuple[int, ...],
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """The owned layers: h [T, d] -> (h [T, d], the residual stream at each of `taps`, in that order).
        Plain tensors in and out, so that it compiles cleanly (`--enable-torch-compile`)."""
        captured = {-1: h}
        cos, sin = self.rotary.table(meta.positions, h.dtype)
        for i in range(self.start, self.end):
            h = self.model.layers[str(i)].forward(h, cos, sin, kv_caches[i], meta)
            if i in taps:
                captured[i] = h
        return h, tuple(captured[i] for i in taps)


def load_causal_lm(
    path: str,
    start: int = 0,
    end: Optional[int] = None,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    load_format: str = "auto",
) -> CausalLM:
    """Build the stage [start, end) of the checkpoint at `path` (a Hugging Face folder or a GGUF
    file) and load its weights (checked complete), or give it the dummy weights of its config's
    shapes (`load_format` "dummy": the same values in every stage and process)."""
    if torch.device(device).type == "cpu":
        # the kernels' build check (~0.5 s of ninja) at load, never inside a first request's TTFT
        cpu_kernels.portable()
    dummy = is_dummy(load_format)
    hf = dummy_config(path, SHAPE_FIELDS) if dummy else read_config(path, SHAPE_FIELDS)
    try:
        spec = DecoderSpec.from_hf(hf)
    # an unserved architecture; an unsupported RoPE kind stays NotImplementedError
    except ValueError as e:
        raise CheckpointError(f"{path}: {e}") from None
    with on_meta():
        model = CausalLM(spec, start, end, device=device)
    model = materialize(model, dtype, device)  # allocated once, in `dtype`
    model.rotary = spec.rotary(device)
    if spec.tie_word_embeddings and model.is_last and model.model.embed_tokens is not None:
        model.lm_head.weight = model.model.embed_tokens.weight
    if dummy:
        fill_dummy(model, init_std(hf), decoder_dummy_key(spec.tie_word_embeddings))
    else:
        rename, elsewhere = decoder_key_owner(
            spec.num_layers, model.start, model.end, spec.tie_word_embeddings
        )
        load_weights(model, path, rename, elsewhere, dtype, load_format)
    model.fuse()
    return model.eval()
