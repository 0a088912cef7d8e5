"""The architectures the dense decoder (models/decoder.py) serves, and the switches each family
sets.

Qwen3 puts an RMSNorm on every q and k head; Qwen2 a bias on q/k/v only; Llama (and Mistral, its
architecture with another name) has no head norm and optional biases, `attention_bias` on all four
attention projections and `mlp_bias` on the MLP, as in transformers' LlamaAttention / LlamaMLP.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional


@dataclass(frozen=True)
class Family:
    qk_norm: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool


def _qwen3(cfg: dict) -> Family:
    bias = bool(cfg.get("attention_bias", False))
    return Family(qk_norm=True, qkv_bias=bias, o_bias=bias, mlp_bias=False)


def _llama(cfg: dict) -> Family:
    bias = bool(cfg.get("attention_bias", False))
    return Family(
        qk_norm=False, qkv_bias=bias, o_bias=bias, mlp_bias=bool(cfg.get("mlp_bias", False))
    )


def _qwen2(cfg: dict) -> Family:
    return Family(qk_norm=False, qkv_bias=True, o_bias=False, mlp_bias=False)


FAMILIES: dict[str, Callable[[dict], Family]] = {
    "Qwen3ForCausalLM": _qwen3,
    "LlamaForCausalLM": _llama,
    "MistralForCausalLM": _llama,
    "Qwen2ForCausalLM": _qwen2,
}
_DEFAULT_BY_TYPE = {
    "qwen3": "Qwen3ForCausalLM",
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}


def architecture_of(cfg: dict) -> str:
    """architectures[0] of the config, or the one its model_type implies (a config without the
    list)."""
    archs = cfg.get("architectures") or [_DEFAULT_BY_TYPE.get(cfg.get("model_type", "qwen3"), "")]
    return archs[0]


def family_of(cfg: dict, architecture: Optional[str] = None) -> Family:
    """The family's switches; an architecture outside FAMILIES (or a sliding window inside the
    context) is an error that lists what is served."""
    arch = architecture or architecture_of(cfg)
    if arch not in FAMILIES:
        raise ValueError(
            f"architecture {arch!r} (model_type {cfg.get('model_type')!r}) is not served; "
            f"supported: {', '.join(FAMILIES)}"
        )
    window = cfg.get("sliding_window")
    use_window = cfg.get("use_sliding_window", arch == "MistralForCausalLM")
    if use_window and window is not None and window < cfg.get("max_position_embeddings", 0):
        raise ValueError(
            f"sliding_window {window} < max_position_embeddings {cfg.get('max_position_embeddings')}: "
            "sliding-window attention is not implemented"
        )
    return FAMILIES[arch](cfg)
