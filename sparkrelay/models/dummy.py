"""`--load-format dummy`: random weights at the shapes of a folder's config.json, with no weight
files.

Every process that loads the same tensor gets the same values: a PD prefill and its decode, each
pipeline stage, the prefill's draft-kv context projection and the full drafter are separate
processes (or separate modules), and their outputs must equal the aggregated engine's. So a tensor's
values depend only on its checkpoint key (the name it would have in the safetensors files) and the
flat element index, never on process RNG state, the stage split, the dtype or the device:

    flat tensor [n] = chunks of CHUNK elements; chunk c = normal(0, std) float32 from
    torch.Generator seeded with blake2b(f"{key}#{c}") -> cast into the parameter (bf16 = the float32 value rounded)

Init (the usual one, activations stay finite in bf16 over dozens of layers): matrices and embeddings
normal(0, initializer_range), norm weights ones, biases zeros. Chunks fill in parallel threads (the
generator runs single-threaded; each chunk has its own seed, so the split among threads changes
nothing).
"""

from __future__ import annotations

import hashlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from sparkrelay.models.loader import CheckpointError, read_config

CHUNK = 1 << 20  # elements per independently seeded chunk
DEFAULT_STD = 0.02  # transformers' default initializer_range


def dummy_config(folder: str | Path, require: tuple[str, ...] = ()) -> dict:
    """The folder's config.json, the only file dummy weights need (checked for `require`); errors
    name the flag."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise CheckpointError(
            f"--load-format dummy: {path} not found; dummy weights take their shapes from the "
            "folder's config.json (no *.safetensors needed, but the config is)"
        )
    return read_config(folder, require)


def init_std(hf_config: dict) -> float:
    return float(hf_config.get("initializer_range") or DEFAULT_STD)


def chunk_seed(key: str, chunk: int) -> int:
    """A stable 63-bit seed of (checkpoint key, chunk index): the same in every process and Python
    version."""
    digest = hashlib.blake2b(f"{key}#{chunk}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def _fill_chunk(flat: torch.Tensor, key: str, chunk: int, std: float) -> None:
    lo = chunk * CHUNK
    n = min(CHUNK, flat.numel() - lo)
    gen = torch.Generator().manual_seed(chunk_seed(key, chunk))
    values = torch.empty(n, dtype=torch.float32).normal_(0.0, std, generator=gen)  # [n] on CPU
    with torch.inference_mode(flat.is_inference()):  # grad modes are per thread: match the tensor's
        flat[lo : lo + n].copy_(values)  # cast to the parameter's dtype, moved to its device


def fill_tensor(tensor: torch.Tensor, key: str, std: float, pool: ThreadPoolExecutor) -> None:
    """Fill `tensor` (any shape, dtype, device; contiguous) with the dummy values of checkpoint key
    `key`."""
    flat = tensor.view(-1)  # [n]
    chunks = (flat.numel() + CHUNK - 1) // CHUNK
    for f in [pool.submit(_fill_chunk, flat, key, c, std) for c in range(chunks)]:
        f.result()


def _kind(name: str, param: torch.Tensor) -> str:
    if name.endswith(".bias"):
        return "zeros"
    if param.dim() == 1 and name.endswith("norm.weight"):
        return "ones"
    return "normal"


def fill_dummy(
    module: nn.Module,
    std: float,
    key_of: Callable[[str], str] = lambda name: name,
    skip: set[str] = frozenset(),
) -> None:
    """Give every parameter of `module` but those named in `skip` its dummy values; key_of(parameter
    name) is the checkpoint key that seeds it (a tied LM head seeds from the embedding's key, a
    drafter's frozen embedding from the target's)."""
    threads = max(1, torch.get_num_threads())
    with torch.no_grad(), ThreadPoolExecutor(threads) as pool:
        for name, param in module.named_parameters():  # a tied parameter is listed once
            if name in skip:
                continue
            kind = _kind(name, param)
            if kind == "zeros":
                param.zero_()
            elif kind == "ones":
                param.fill_(1.0)
            else:
                fill_tensor(param.data, key_of(name), std, pool)
