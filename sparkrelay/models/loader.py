"""Read Hugging Face safetensors checkpoints as they are, with a completeness check.

Every parameter of the module must be found with the right shape, and every tensor in the files must be
either loaded or explicitly owned by another pipeline stage (`elsewhere(key)`); anything else is an error that
names the keys.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Callable, Optional

import torch
from safetensors import safe_open
from torch import nn

from sparkrelay.config import LOAD_FORMATS  # auto = safetensors, the only weight files read


# The config.json fields every Qwen3-shaped model (target or drafter) needs; the rest have defaults.
SHAPE_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


class CheckpointError(ValueError):
    """The checkpoint does not match the model: names the missing, unexpected or mis-shaped tensors."""


def read_config(folder: str | Path, require: tuple[str, ...] = ()) -> dict:
    """The folder's config.json; a field of `require` that it lacks is an error naming the file and the fields."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{path} not found")
    cfg = json.loads(path.read_text())
    missing = [k for k in require if cfg.get(k) is None]
    if missing:
        raise CheckpointError(f"{path} lacks the field(s) {missing}, needed for the model's shapes")
    return cfg


def is_dummy(load_format: str) -> bool:
    """True for `--load-format dummy` (random weights, no files read); the safetensors formats give False."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"--load-format {load_format!r} is not one of {LOAD_FORMATS}")
    return load_format == "dummy"


def safetensors_files(folder: str | Path) -> list[Path]:
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors files in {folder} (--load-format dummy runs random weights at the "
                              "shapes of its config.json)")
    return files


def _summary(keys: list[str], limit: int = 8) -> str:
    keys = sorted(keys)
    more = f" (+{len(keys) - limit} more)" if len(keys) > limit else ""
    return ", ".join(keys[:limit]) + more


def load_weights(module: nn.Module, folder: str | Path, rename: Callable[[str], Optional[str]] = lambda k: k,
                 elsewhere: Callable[[str], bool] = lambda k: False, dtype: torch.dtype = torch.float32) -> None:
    """Copy the folder's tensors into `module`'s parameters.

    rename(key) maps a checkpoint key to a parameter name, or None to skip a key on purpose (e.g. a tied
    lm_head); elsewhere(key) is True for keys another pipeline stage loads.
    """
    params = dict(module.named_parameters())
    loaded: set[str] = set()
    unexpected, bad_shape = [], []
    for path in safetensors_files(folder):
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                name = rename(key)
                if name is None or (name not in params and elsewhere(key)):
                    continue
                if name not in params:
                    unexpected.append(key)
                    continue
                tensor = f.get_tensor(key)
                if tuple(tensor.shape) != tuple(params[name].shape):
                    bad_shape.append(f"{key} {tuple(tensor.shape)} != expected {tuple(params[name].shape)}")
                    continue
                with torch.no_grad():
                    params[name].copy_(tensor.to(dtype))
                loaded.add(name)
    missing = [n for n in params if n not in loaded]
    problems = []
    if missing:
        problems.append(f"missing tensors: {_summary(missing)}")
    if unexpected:
        problems.append(f"unexpected tensors: {_summary(unexpected)}")
    if bad_shape:
        problems.append(f"shape mismatch: {_summary(bad_shape)}")
    if problems:
        raise CheckpointError(f"checkpoint {folder} does not match the model: " + "; ".join(problems))


_LAYER_KEY = re.compile(r"^model\.layers\.(\d+)\.")


def qwen3_key_owner(num_layers: int, start: int, end: int, tied: bool) -> tuple[Callable, Callable]:
    """(rename, elsewhere) for a Qwen3 stage owning layers [start, end)."""
    is_last = end == num_layers

    def rename(key: str) -> Optional[str]:
        if key == "lm_head.weight" and tied:
            return None  # tied: the LM head is the embedding matrix
        if key == "model.embed_tokens.weight" and tied and is_last and start != 0:
            return "lm_head.weight"  # a last stage without the embedding still needs it as its LM head
        return key

    def elsewhere(key: str) -> bool:
        m = _LAYER_KEY.match(key)
        if m:
            layer = int(m.group(1))
            return 0 <= layer < num_layers and not start <= layer < end
        if key == "model.embed_tokens.weight":
            return start != 0
        if key in ("model.norm.weight", "lm_head.weight"):
            return not is_last
        return False

    return rename, elsewhere


def qwen3_dummy_key(tied: bool) -> Callable[[str], str]:
    """Parameter name -> the checkpoint key whose dummy values it gets (rename's inverse): a tied LM head on a last
    stage without the embedding is the embedding."""
    return lambda name: "model.embed_tokens.weight" if tied and name == "lm_head.weight" else name
