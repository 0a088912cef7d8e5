"""Read a GGUF file as a Hugging Face checkpoint: its config, its tensors under HF names, its
tokenizer.

The `gguf` package (llama.cpp's own reader) parses the file and dequantizes every tensor type it
knows (Q4_0, Q4_1, Q8_0, K-quants, F16, BF16, F32); this module only maps names and metadata, as
vLLM's GGUF loader does. llama.cpp's converter permutes the q/k rows of Llama-architecture models
into its own RoPE layout; those rows are permuted back here, so the tensors equal the Hugging Face
checkpoint they were made from.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import torch

# GGUF `general.architecture` -> (HF architectures[0], model_type). Mistral converts as "llama".
ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
}
_PERMUTED_QK = ("llama",)  # architectures whose q/k rows llama.cpp permuted


class GGUFError(ValueError):
    """The file is not a GGUF model this loader can read: names the file and what is wrong."""


def is_gguf(path: str | Path) -> bool:
    """A model path names a GGUF file (rather than a Hugging Face folder)."""
    return str(path).endswith(".gguf") and Path(path).is_file()


@functools.lru_cache(maxsize=4)
def _reader(path: str):
    try:
        import gguf
    except ImportError as e:
        raise GGUFError(f"{path}: reading GGUF needs the `gguf` package (pip install gguf)") from e
    try:
        return gguf.GGUFReader(path)
    except Exception as e:  # the reader raises ValueError, struct.error, ... on a damaged file
        raise GGUFError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from e


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _arch(reader, path: str) -> str:
    arch = _field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise GGUFError(
            f"{path}: GGUF architecture {arch!r} is not supported (supported: {sorted(ARCHITECTURES)})"
        )
    return arch


def _rope_scaling(reader, arch: str, path: str) -> dict | None:
    kind = _field(reader, f"{arch}.rope.scaling.type", "none")
    if any(t.name == "rope_freqs.weight" for t in reader.tensors):
        raise GGUFError(
            f"{path}: per-frequency RoPE factors (rope_freqs, Llama 3.1 scaling) are not read from GGUF; "
            "convert the Hugging Face checkpoint instead"
        )
    if kind in ("none", None):
        return None
    if kind == "linear":
        return {
            "rope_type": "linear",
            "factor": float(_field(reader, f"{arch}.rope.scaling.factor")),
        }
    raise GGUFError(f"{path}: RoPE scaling {kind!r} is not supported (none, linear)")


@functools.lru_cache(maxsize=4)
def gguf_config(path: str) -> dict:
    """The Hugging Face config.json equivalent of the file's metadata."""
    r = _reader(path)
    arch = _arch(r, path)
    names = {t.name for t in r.tensors}
    hidden, heads = (
        int(_field(r, f"{arch}.embedding_length")),
        int(_field(r, f"{arch}.attention.head_count")),
    )
    tokens = r.fields.get("tokenizer.ggml.tokens")
    vocab = _field(r, f"{arch}.vocab_size") or (len(tokens.data) if tokens is not None else None)
    cfg = {
        "architectures": [ARCHITECTURES[arch][0]],
        "model_type": ARCHITECTURES[arch][1],
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(_field(r, f"{arch}.feed_forward_length")),
        "num_hidden_layers": int(_field(r, f"{arch}.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_field(r, f"{arch}.attention.head_count_kv", heads)),
        "head_dim": int(_field(r, f"{arch}.attention.key_length", hidden // heads)),
        "rms_norm_eps": float(_field(r, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(_field(r, f"{arch}.rope.freq_base", 10000.0)),
        "rope_scaling": _rope_scaling(r, arch, path),
        "max_position_embeddings": int(_field(r, f"{arch}.context_length", 4096)),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
        "mlp_bias": "blk.0.ffn_up.bias" in names,
        "hidden_act": "silu",
        "torch_dtype": "float32",
    }
    for hf_key, key in (
        ("bos_token_id", "tokenizer.ggml.bos_token_id"),
        ("eos_token_id", "tokenizer.ggml.eos_token_id"),
    ):
        if key in r.fields:
            cfg[hf_key] = int(_field(r, key))
    return cfg


def _hf_names(cfg: dict) -> list[str]:
    """Every checkpoint key a model of this config may have (weights and biases of every layer)."""
    keys = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
    per_layer = [f"self_attn.{p}_proj.{w}" for p in "qkvo" for w in ("weight", "bias")]
    per_layer += [f"mlp.{p}_proj.{w}" for p in ("gate", "up", "down") for w in ("weight", "bias")]
    per_layer += [
        "input_layernorm.weight",
        "post_attention_layernorm.weight",
        "self_attn.q_norm.weight",
        "self_attn.k_norm.weight",
    ]
    keys += [f"model.layers.{i}.{k}" for i in range(cfg["num_hidden_layers"]) for k in per_layer]
    return keys


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row order [heads, D/2, 2] (interleaved pairs) back to HF's [heads, 2, D/2]
    (halves)."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_tensors(path: str) -> Iterator[tuple[str, Callable[[], torch.Tensor]]]:
    """(HF key, loader) for every tensor of the file; the loader dequantizes to float32 only when
    called, so a pipeline stage reads only its own layers. A tensor with no HF name keeps its GGUF
    name (an unexpected key)."""
    import gguf

    r, cfg = _reader(path), gguf_config(path)
    arch = _arch(r, path)
    model_arch = {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}[arch]
    name_map = gguf.get_tensor_name_map(model_arch, cfg["num_hidden_layers"])
    to_hf = {}
    for key in _hf_names(cfg):
        name = name_map.get_name(key, try_suffixes=(".weight", ".bias"))
        if name is not None:
            to_hf[name] = key
    heads = {"q_proj": cfg["num_attention_heads"], "k_proj": cfg["num_key_value_heads"]}
    for t in r.tensors:
        key = to_hf.get(t.name, t.name)
        proj = key.split(".")[-2] if key.startswith("model.layers.") else ""
        n_heads = heads.get(proj) if arch in _PERMUTED_QK else None
        yield key, functools.partial(_load, t, n_heads)


def _load(t, n_heads: int | None) -> torch.Tensor:
    import gguf

    w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
    w = w.reshape([int(d) for d in reversed(t.shape)]) if w.ndim != len(t.shape) else w
    if n_heads is not None:
        w = _unpermute(w, n_heads)
    return torch.from_numpy(np.array(w, dtype=np.float32, order="C", copy=not w.flags.writeable))


def gguf_tokenizer(path: str):
    """The file's tokenizer (vocabulary, merges, special tokens, chat template) as a transformers
    fast tokenizer."""
    from transformers import AutoTokenizer

    p = Path(path)
    try:
        return AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)
    # transformers raises ValueError / KeyError / OSError for what it cannot convert
    except Exception as e:
        raise GGUFError(f"{path}: its tokenizer could not be read ({type(e).__name__}: {e})") from e
