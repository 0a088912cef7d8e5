"""DeepSpec-layout drafter checkpoints, both ways: loading one for a target (`load_dspark`: checked
complete, or dummy weights, sharing the target's embedding and LM head), and writing one (the config
of a drafter for a target, the target's head weights, saving a model, a random-weight checkpoint for
tests); the model itself is models/dspark.py."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Optional

import torch
from safetensors.torch import save_file
from torch import nn

from sparkrelay.models.decoder import DecoderSpec
from sparkrelay.models.dspark import ARCHITECTURE, DSparkSpec, Qwen3DSparkModel
from sparkrelay.models.dummy import dummy_config, fill_dummy, init_std
from sparkrelay.models.kernels import fast_head
from sparkrelay.models.loader import (
    SHAPE_FIELDS,
    CheckpointError,
    checkpoint_tensors,
    is_dummy,
    load_weights,
    materialize,
    on_meta,
    read_config,
)


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


def _fits(own: torch.Tensor, tensor: Optional[torch.Tensor]) -> bool:
    return tensor is not None and (tensor.dtype, tensor.device, tensor.shape) == (
        own.dtype,
        own.device,
        own.shape,
    )


def _share(module: nn.Module, tensor: Optional[torch.Tensor], trust: bool = False) -> bool:
    """Replace module.weight by `tensor` when they are identical (dtype, device, shape, values;
    `trust`: the values are equal by definition, see load_dspark); True if shared."""
    if not _fits(module.weight, tensor) or not (trust or torch.equal(tensor, module.weight)):
        return False
    module.weight = (
        tensor if isinstance(tensor, nn.Parameter) else nn.Parameter(tensor, requires_grad=False)
    )
    return True


def dspark_dummy_key(target_spec: DecoderSpec):
    """Drafter parameter name -> the checkpoint key seeding its dummy values: the embedding and LM head are the
    target's (frozen copies in a released drafter), so they equal the target's dummy tensors and are shared."""
    head = "model.embed_tokens.weight" if target_spec.tie_word_embeddings else "lm_head.weight"
    return lambda name: {
        "embed_tokens.weight": "model.embed_tokens.weight",
        "lm_head.weight": head,
    }.get(name, name)


def load_dspark(
    folder: str | Path,
    target_spec: DecoderSpec,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    share_embedding_from: Optional[torch.Tensor] = None,
    share_lm_head_from: Optional[torch.Tensor] = None,
    fuse: bool = True,
    load_format: str = "auto",
) -> Qwen3DSparkModel:
    """Build the drafter in `folder` for `target_spec` and load it (checked complete), or give it
    dummy weights (`load_format` "dummy"). The embedding / LM head are replaced by the target's
    tensors when those are identical, so the drafter holds no second copy
    (`model.shared_with_target` names the ones shared); a checkpoint that does not store them (they
    are the target's by definition) takes them from the `share_*_from` tensors."""
    dummy = is_dummy(load_format)
    hf = dummy_config(folder, SHAPE_FIELDS) if dummy else read_config(folder, SHAPE_FIELDS)
    archs = hf.get("architectures")
    if archs != [ARCHITECTURE]:
        raise CheckpointError(
            f"{folder}: architectures {archs!r} is not [{ARCHITECTURE!r}] (not a Qwen3 DSpark/DFlash drafter)"
        )
    spec = DSparkSpec.from_hf(hf, target_spec)
    with on_meta():
        model = Qwen3DSparkModel(spec, device="cpu")
    model = materialize(model, dtype, device)  # allocated once, in `dtype`
    model.rotary = spec.body.rotary(device)
    shares = {"embed_tokens": share_embedding_from, "lm_head": share_lm_head_from}
    # dummy: the embedding and LM head are the target's (frozen copies in a released drafter), never
    # drawn twice
    trusted = {n for n, t in shares.items() if dummy and _fits(getattr(model, n).weight, t)}
    if dummy:
        fill_dummy(
            model,
            init_std(hf),
            dspark_dummy_key(target_spec),
            skip={f"{n}.weight" for n in trusted},
        )
    else:
        given = frozenset(f"{n}.weight" for n, t in shares.items() if t is not None)
        loaded = load_weights(model, folder, dtype=dtype, optional=given)
        for name in ("embed_tokens", "lm_head"):
            # not stored: the target's, copied in if its dtype differs
            if f"{name}.weight" not in loaded:
                with torch.no_grad():
                    getattr(model, name).weight.copy_(shares[name].to(dtype))
                trusted.add(name)
    if fuse:
        model.fuse()
    model.eval().requires_grad_(False)  # before sharing: never touch the target's own flags
    shared = [
        name for name, t in shares.items() if _share(getattr(model, name), t, name in trusted)
    ]
    model.shared_with_target = tuple(shared)
    if fuse and "lm_head" not in shared:
        model.head = fast_head(model.lm_head.weight)  # a shared head's fast copy is the target's
    return model
