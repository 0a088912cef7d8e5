"""Read Hugging Face safetensors checkpoints as they are (or a GGUF file, as the same keys), with a
completeness check.

Every parameter of the module must be found with the right shape, and every tensor in the files must
be either loaded or explicitly owned by another pipeline stage (`elsewhere(key)`); anything else is
an error that names the keys.
"""

from __future__ import annotations

import contextlib
import functools
import json
import re
from pathlib import Path
from typing import Callable, Iterator, Optional

import torch
from safetensors import safe_open
from torch import nn

# auto = a folder's safetensors or a .gguf file, by the path
from sparkrelay.config import (
    LOAD_FORMATS,
)
from sparkrelay.models.gguf_file import GGUFError, gguf_config, gguf_tensors, is_gguf

# The config.json fields every Qwen3-shaped model (target or drafter) needs; the rest have defaults.
SHAPE_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
)


INITIALIZERS = ("uniform_", "normal_", "kaiming_uniform_", "ones_", "zeros_", "constant_")


@contextlib.contextmanager
def on_meta() -> Iterator[None]:
    """Build modules on the meta device with their initializers skipped (the weights are loaded
    after): initializing a meta tensor imports torch._dynamo, a large part of a server's start (figure:
    docs/architecture.md)."""
    saved = {name: getattr(nn.init, name) for name in INITIALIZERS}
    for name in INITIALIZERS:
        setattr(nn.init, name, lambda tensor, *args, **kwargs: tensor)
    try:
        with torch.device("meta"):
            yield
    finally:
        for name, fn in saved.items():
            setattr(nn.init, name, fn)


def materialize(model: nn.Module, dtype: torch.dtype, device: torch.device | str) -> nn.Module:
    """Give a meta-built module uninitialized storage on `device`, floating-point tensors in `dtype`
    (as `.to(dtype).to_empty(device)`): to_empty's empty_like of a meta tensor imports sympy, a large
    part of a model-loading process's start (figure: docs/reliability.md)."""

    def empty(t: torch.Tensor) -> torch.Tensor:
        return torch.empty(
            t.shape, dtype=dtype if t.is_floating_point() else t.dtype, device=device
        )

    return model._apply(empty)


class CheckpointError(ValueError):
    """The checkpoint does not match the model: names the missing, unexpected or mis-shaped
    tensors."""


def read_config(folder: str | Path, require: tuple[str, ...] = ()) -> dict:
    """The folder's config.json (a GGUF file's metadata as one); a field of `require` that it lacks
    is an error naming the file and the fields."""
    if is_gguf(folder):
        try:
            return dict(gguf_config(str(folder)))
        except GGUFError as e:
            raise CheckpointError(str(e)) from None
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{path} not found")
    cfg = json.loads(path.read_text())
    missing = [k for k in require if cfg.get(k) is None]
    if missing:
        raise CheckpointError(f"{path} lacks the field(s) {missing}, needed for the model's shapes")
    return cfg


def is_dummy(load_format: str) -> bool:
    """True for `--load-format dummy` (random weights, no files read); the safetensors formats give
    False."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"--load-format {load_format!r} is not one of {LOAD_FORMATS}")
    return load_format == "dummy"


def checkpoint_tensors(
    path: str | Path, load_format: str = "auto"
) -> Iterator[tuple[str, Callable[[], torch.Tensor]]]:
    """(key, loader) for every tensor at `path`: a folder's *.safetensors, or a GGUF file's tensors
    under their Hugging Face keys (`--load-format gguf` insists on the latter). A loader reads its
    tensor only when called."""
    if load_format == "gguf" and not is_gguf(path):
        raise CheckpointError(f"--load-format gguf: {path} is not a .gguf file")
    if is_gguf(path):
        try:
            yield from gguf_tensors(str(path))
        except GGUFError as e:
            raise CheckpointError(str(e)) from None
        return
    for file in safetensors_files(path):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                yield key, functools.partial(f.get_tensor, key)


def safetensors_files(folder: str | Path) -> list[Path]:
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise CheckpointError(
            f"no *.safetensors files in {folder} (--load-format dummy runs random weights at the "
            "shapes of its config.json)"
        )
    return files


def _summary(keys: list[str], limit: int = 8) -> str:
    keys = sorted(keys)
    more = f" (+{len(keys) - limit} more)" if len(keys) > limit else ""
    return ", ".join(keys[:limit]) + more


def load_weights(
    module: nn.Module,
    folder: str | Path,
    rename: Callable[[str], Optional[str]] = lambda k: k,
    elsewhere: Callable[[str], bool] = lambda k: False,
    dtype: torch.dtype = torch.float32,
    load_format: str = "auto",
    optional: frozenset[str] = frozenset(),
) -> set[str]:
    """Copy the checkpoint's tensors (checkpoint_tensors) into `module`'s parameters; returns the
    names loaded.

    rename(key) maps a checkpoint key to a parameter name, or None to skip a key on purpose (e.g. a
    tied lm_head); elsewhere(key) is True for keys another pipeline stage loads; a parameter in
    `optional` may be absent (the caller fills it, e.g. a drafter's embedding shared with the
    target).
    """
    params = dict(module.named_parameters())
    loaded: set[str] = set()
    unexpected, bad_shape = [], []
    for key, read in checkpoint_tensors(folder, load_format):
        name = rename(key)
        if name is None or (name not in params and elsewhere(key)):
            continue
        if name not in params:
            unexpected.append(key)
            continue
        tensor = read()
        if tuple(tensor.shape) != tuple(params[name].shape):
            bad_shape.append(f"{key} {tuple(tensor.shape)} != expected {tuple(params[name].shape)}")
            continue
        with torch.no_grad():
            params[name].copy_(tensor.to(dtype))
        loaded.add(name)
    missing = [n for n in params if n not in loaded and n not in optional]
    problems = []
    if missing:
        problems.append(f"missing tensors: {_summary(missing)}")
    if unexpected:
        problems.append(f"unexpected tensors: {_summary(unexpected)}")
    if bad_shape:
        problems.append(f"shape mismatch: {_summary(bad_shape)}")
    if problems:
        raise CheckpointError(
            f"checkpoint {folder} does not match the model: " + "; ".join(problems)
        )
    return loaded


_LAYER_KEY = re.compile(r"^model\.layers\.(\d+)\.")


def decoder_key_owner(
    num_layers: int, start: int, end: int, tied: bool
) -> tuple[Callable, Callable]:
    """(rename, elsewhere) for a decoder stage owning layers [start, end)."""
    is_last = end == num_layers

    def rename(key: str) -> Optional[str]:
        if key == "lm_head.weight" and tied:
            return None  # tied: the LM head is the embedding matrix
        if key == "model.embed_tokens.weight" and tied and is_last and start != 0:
            return (
                "lm_head.weight"  # a last stage without the embedding still needs it as its LM head
            )
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


def decoder_dummy_key(tied: bool) -> Callable[[str], str]:
    """Parameter name -> the checkpoint key whose dummy values it gets (rename's inverse): a tied LM head on a last
    stage without the embedding is the embedding."""
    return lambda name: "model.embed_tokens.weight" if tied and name == "lm_head.weight" else name
