"""Writing DeepSpec-layout drafter checkpoints: the config of a drafter for a target, the target's
head weights, saving a model, and a random-weight checkpoint for tests (the reading side is
models/dspark.py)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from sparkrelay.models.decoder import DecoderSpec
from sparkrelay.models.dspark import ARCHITECTURE, DSparkSpec, Qwen3DSparkModel
from sparkrelay.models.loader import checkpoint_tensors, read_config


def draft_config(target_cfg: dict, **fields) -> dict:
    """config.json of a drafter for this target (docs/dspark.md §1.2): a copy of the target's plus
    the DSpark fields."""
    n_t = target_cfg["num_hidden_layers"]
    taps = min(4, max(1, n_t - 2))
    ids = (
        [1 + round(i * (n_t - 3) / (taps - 1)) for i in range(taps)]
        if taps > 1
        else [max(0, n_t - 2)]
    )
    dspark = dict(
        num_hidden_layers=2,
        block_size=7,
        target_layer_ids=ids,
        mask_token_id=target_cfg["vocab_size"] - 1,
        markov_rank=32,
        markov_head_type="vanilla",
        enable_confidence_head=True,
        confidence_head_with_markov=True,
        num_target_layers=n_t,
        num_anchors=64,
    )
    dspark.update(fields)
    if dspark["markov_rank"] == 0:
        dspark.pop("markov_head_type")
    if not dspark["enable_confidence_head"]:
        dspark.pop("confidence_head_with_markov")
    cfg = copy.deepcopy(target_cfg)
    cfg.pop("torch_dtype", None)
    cfg.update(
        dspark,
        architectures=[ARCHITECTURE],
        tie_word_embeddings=False,
        dtype="bfloat16",
        layer_types=["full_attention"] * dspark["num_hidden_layers"],
    )
    return cfg


def target_head_weights(target_folder: str | Path) -> tuple[torch.Tensor, torch.Tensor]:
    """The target checkpoint's (embedding [V, d], LM head [V, d]); a tied target's LM head is its
    embedding."""
    found = {
        key: read()
        for key, read in checkpoint_tensors(target_folder)
        if key in ("model.embed_tokens.weight", "lm_head.weight")
    }
    embed = found["model.embed_tokens.weight"]
    return embed, found.get("lm_head.weight", embed)


FROZEN_COPIES = (
    "embed_tokens.weight",
    "lm_head.weight",
)  # the target's own tensors, frozen in training


def save_checkpoint(
    model: Qwen3DSparkModel,
    cfg: dict,
    folder: str | Path,
    dtype: torch.dtype = torch.bfloat16,
    with_frozen_copies: bool = True,
) -> Path:
    """Write config.json + model.safetensors in the DeepSpec layout (docs/dspark.md §1.3: top-level
    keys, the frozen copies of the target's embedding and LM head included unless
    `with_frozen_copies` is False: the loader then shares the target's)."""
    assert all(layer.self_attn.qkv is None for layer in model.layers), "save an unfused drafter"
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {
        k: v.detach().to(dtype).contiguous().clone()
        for k, v in model.state_dict().items()
        if with_frozen_copies or k not in FROZEN_COPIES
    }
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    cfg = dict(cfg, dtype=str(dtype).removeprefix("torch."))
    (folder / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return folder


def write_random_checkpoint(
    folder: str | Path,
    target_folder: str | Path,
    seed: int = 0,
    weight_dtype: torch.dtype = torch.bfloat16,
    **overrides,
) -> Path:
    """A random-weight drafter for the target in `target_folder` (embedding / LM head copied from
    it); `overrides` are config fields, e.g. markov_head_type="rnn", or markov_rank=0,
    enable_confidence_head=False (DFlash)."""
    target_cfg = read_config(target_folder)
    cfg = draft_config(target_cfg, **overrides)
    spec = DSparkSpec.from_hf(cfg, DecoderSpec.from_hf(target_cfg))
    gen_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    model = Qwen3DSparkModel(spec)
    torch.random.set_rng_state(gen_state)
    embed, lm_head = target_head_weights(target_folder)
    with torch.no_grad():
        model.embed_tokens.weight.copy_(embed)
        model.lm_head.weight.copy_(lm_head)
    return save_checkpoint(model, cfg, folder, weight_dtype)
