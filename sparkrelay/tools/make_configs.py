"""Write the real-shape model folders of models/configs/ (for `--load-format dummy`): the released
Qwen3 configs, a DSpark drafter config for each, and a tokenizer whose vocabulary covers every id.

    python -m sparkrelay.tools.make_configs [--out models/configs]

Each target folder `qwen3-{0.6b,1.7b,4b}/` holds config.json (the released values),
generation_config.json (its stop ids) and the tokenizer: the bundled tiny tokenizer (ids 3..4095 as
they are) with Qwen3's special tokens at their released ids (<|endoftext|> 151643, <|im_start|>
151644, <|im_end|> 151645) and a filler token `<fN>` at every other id up to vocab_size, so that any
output of random weights detokenizes. Each drafter folder `qwen3-*-dspark/` holds config.json with
the released drafters' choices: 5 draft layers, block 7, the taps DFlash spreads over the target's
layers ([1, 9, 17, 25, 33] of 36), a vanilla Markov head of rank 256, a confidence head with the
Markov input, and 151669 as the mask token. `write_target` / `write_drafter` also serve tests that
need a reduced real-ish shape (fewer layers).
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

TINY = Path("models/tiny-qwen3")
SPECIALS = {151643: "<|endoftext|>", 151644: "<|im_start|>", 151645: "<|im_end|>"}
QWEN3_COMMON = {
    "architectures": ["Qwen3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "max_position_embeddings": 40960,
    "model_type": "qwen3",
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": None,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}
SHAPES = {  # the released Qwen3 dense configs: (layers, hidden, q heads, MLP width)
    "qwen3-0.6b": (28, 1024, 16, 3072),
    "qwen3-1.7b": (28, 2048, 16, 6144),
    "qwen3-4b": (36, 2560, 32, 9728),
}
DRAFT = {"num_draft_layers": 5, "block_size": 7, "mask_token_id": 151669, "markov_rank": 256}


def target_config(name: str, **overrides) -> dict:
    layers, hidden, heads, inter = SHAPES[name]
    cfg = {
        **QWEN3_COMMON,
        "hidden_size": hidden,
        "intermediate_size": inter,
        "max_window_layers": layers,
        "num_attention_heads": heads,
        "num_hidden_layers": layers,
        **overrides,
    }
    return dict(sorted(cfg.items()))


def tap_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """DFlash's spread: from layer 1 to layer L-3, evenly ([1, 9, 17, 25, 33] for 36 layers and 5
    taps)."""
    start, end = 1, num_target_layers - 3
    if num_draft_layers == 1:
        return [(start + end) // 2]
    return [
        round(start + i * (end - start) / (num_draft_layers - 1)) for i in range(num_draft_layers)
    ]


def drafter_config(
    target: dict,
    num_draft_layers: int = DRAFT["num_draft_layers"],
    target_layer_ids: list[int] | None = None,
) -> dict:
    """A drafter config is its target's with the DSpark fields (docs/dspark.md, the config
    fields)."""
    n = target["num_hidden_layers"]
    taps = target_layer_ids or tap_ids(n, num_draft_layers)
    cfg = {
        **target,
        "architectures": ["Qwen3DSparkModel"],
        "num_hidden_layers": num_draft_layers,
        "max_window_layers": num_draft_layers,
        "tie_word_embeddings": False,
        "layer_types": ["full_attention"] * num_draft_layers,
    }
    return {
        **cfg,
        "block_size": DRAFT["block_size"],
        "target_layer_ids": taps,
        "mask_token_id": DRAFT["mask_token_id"],
        "markov_rank": DRAFT["markov_rank"],
        "markov_head_type": "vanilla",
        "enable_confidence_head": True,
        "confidence_head_with_markov": True,
        "num_target_layers": n,
    }


def tokenizer_json(vocab_size: int, tiny: Path = TINY) -> dict:
    """The tiny tokenizer's BPE with Qwen3's special ids and a filler at every other id below
    vocab_size."""
    tok = json.loads((tiny / "tokenizer.json").read_text())
    moved = {
        t["content"] for t in tok["added_tokens"]
    }  # the tiny specials (ids 0..2) go to Qwen3's ids
    assert moved == set(SPECIALS.values()), moved
    vocab = {k: i for k, i in tok["model"]["vocab"].items() if k not in moved}
    free = sorted(set(range(vocab_size)) - set(vocab.values()) - set(SPECIALS))
    # printable ASCII: the byte-level decoder maps it to itself
    vocab.update({f"<f{i}>": i for i in free})
    vocab.update({content: i for i, content in SPECIALS.items()})
    tok["model"]["vocab"] = dict(sorted(vocab.items(), key=lambda kv: kv[1]))
    by_content = {t["content"]: t for t in tok["added_tokens"]}
    tok["added_tokens"] = [{**by_content[c], "id": i} for i, c in SPECIALS.items()]
    assert len(tok["model"]["vocab"]) == vocab_size
    return tok


def write_tokenizer(folder: Path, vocab_size: int, tiny: Path = TINY) -> None:
    (folder / "tokenizer.json").write_text(
        json.dumps(tokenizer_json(vocab_size, tiny), ensure_ascii=False, separators=(",", ":"))
    )
    cfg = json.loads((tiny / "tokenizer_config.json").read_text())
    cfg.update(eos_token="<|im_end|>", pad_token="<|endoftext|>", model_max_length=131072)
    _write(folder / "tokenizer_config.json", cfg)
    _write(
        folder / "special_tokens_map.json",
        {
            "eos_token": "<|im_end|>",
            "pad_token": "<|endoftext|>",
            "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        },
    )


def _write(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n")


def write_target(folder: Path, cfg: dict, tokenizer_from: Path | None = None) -> None:
    """config.json, generation_config.json and the tokenizer (copied from `tokenizer_from` when
    given)."""
    folder.mkdir(parents=True, exist_ok=True)
    _write(folder / "config.json", cfg)
    _write(
        folder / "generation_config.json",
        {"bos_token_id": 151643, "eos_token_id": [151645, 151643], "pad_token_id": 151643},
    )
    if tokenizer_from is None:
        write_tokenizer(folder, cfg["vocab_size"])
        return
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copyfile(tokenizer_from / name, folder / name)


def write_drafter(folder: Path, cfg: dict) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    _write(folder / "config.json", cfg)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--out", default="models/configs", help="Folder to write the model folders into."
    )
    args = ap.parse_args(argv)
    out, first = Path(args.out), None
    for name in SHAPES:
        cfg = target_config(name)
        write_target(out / name, cfg, first)
        # one tokenizer, written once, copied byte for byte (git stores one blob)
        first = first or out / name
        write_drafter(out / f"{name}-dspark", drafter_config(cfg))
        print(f"wrote {out / name} and {out / name}-dspark")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
