"""The serving benchmark's workload (python -m sparkrelay.tools.bench.serving): prompts from a JSONL
file, random token ids (or random words without a tokenizer) or held-out stdlib code windows, each
with its output length; or multi-turn conversations (`--dataset multiturn`): every conversation
starts with the same shared part (a system prompt of `--shared-prefix-len` tokens), and each turn's
prompt is the previous turn's prompt, its answer and a new user message of `--random-input-len`
tokens (held-out code windows), so turn t + 1 extends turn t exactly."""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from sparkrelay.tools.bench import common as bc

WORDS = (
    "the of and to in is for on that by with as at from this it be are was or an which data value list "
    "return function class import model server token cache layer request"
).split()


class BenchError(Exception):
    """A fatal problem (bad URL, unreachable server, bad workload): printed as one line, exit status
    1."""


@dataclass
class Item:
    """One request of the workload: a text or token ids, and its output length."""

    index: int
    text: Optional[str]
    ids: Optional[list[int]]  # multiturn: the user message only (turn 0: the shared part first)
    output_len: int
    conversation: int = -1  # multiturn only: which conversation, which turn
    turn: int = 0


def load_tokenizer(args: argparse.Namespace, model_info: dict, required: bool):
    """The client-side tokenizer: --tokenizer, else the server's tokenizer folder or model if it is
    local."""
    from transformers import AutoTokenizer

    names = (
        [args.tokenizer]
        if args.tokenizer
        else [
            p
            for p in (model_info.get("tokenizer_path"), model_info.get("model_path"), args.model)
            if p and Path(p).is_dir()
        ]
    )
    for name in names:
        try:
            return AutoTokenizer.from_pretrained(name)
        except Exception as e:  # noqa: BLE001 (any loading failure means: no tokenizer here)
            if args.tokenizer:
                raise BenchError(f"cannot load --tokenizer {name!r}: {type(e).__name__}: {e}")
    if required:
        raise BenchError(
            f"--dataset {args.dataset} / --apply-chat-template need a tokenizer: pass --tokenizer"
        )
    return None


def jsonl_texts(path: str, n: int) -> list[str]:
    try:
        lines = [ln for ln in Path(path).read_text(encoding="utf-8").splitlines() if ln.strip()]
    except OSError as e:
        raise BenchError(f"cannot read --dataset-path: {e}")
    texts = []
    for no, ln in enumerate(lines, 1):
        try:
            turns = json.loads(ln)["turns"]
        except (ValueError, KeyError, TypeError) as e:
            raise BenchError(
                f"{path}:{no}: expected a JSON object with `turns` ({type(e).__name__}: {e})"
            )
        if turns and isinstance(turns[0], str) and turns[0]:
            texts.append(turns[0])
    if not texts:
        raise BenchError(f"{path}: no line with a non-empty turns[0]")
    return [texts[i % len(texts)] for i in range(n)]  # cycled when the file has fewer prompts


def random_ids(rng: random.Random, tokenizer, n: int, length: int) -> list[list[int]]:
    special = set(tokenizer.all_special_ids)
    vocab = [i for i in range(min(len(tokenizer), tokenizer.vocab_size)) if i not in special]
    return [[rng.choice(vocab) for _ in range(length)] for _ in range(n)]


def multiturn(args: argparse.Namespace, tokenizer) -> list[Item]:
    """--num-prompts conversations of --multiturn-turns turns, in conversation order; turn 0 holds
    the shared part."""
    n, turns, out_len = (
        args.num_prompts,
        args.multiturn_turns,
        args.max_new_tokens or args.random_output_len,
    )
    shared = bc.load_prompts(tokenizer, 1, args.shared_prefix_len, stride=7)[0].ids
    users = [p.ids for p in bc.load_prompts(tokenizer, n * turns + 1, args.random_input_len)][1:]
    return [
        Item(c * turns + t, None, (shared if t == 0 else []) + users[c * turns + t], out_len, c, t)
        for c in range(n)
        for t in range(turns)
    ]


def build_workload(args: argparse.Namespace, tokenizer, rng: random.Random) -> list[Item]:
    if args.dataset == "multiturn" and not args.dataset_path:
        return multiturn(args, tokenizer)
    n, out_len = args.num_prompts, args.max_new_tokens or args.random_output_len
    texts: list[Optional[str]] = [None] * n
    ids: list[Optional[list[int]]] = [None] * n
    if args.dataset_path:
        texts = jsonl_texts(args.dataset_path, n)
        if args.apply_chat_template and args.backend != "openai-chat":
            texts = [
                tokenizer.apply_chat_template(
                    [{"role": "user", "content": t}], tokenize=False, add_generation_prompt=True
                )
                for t in texts
            ]
    elif args.dataset == "code":
        ids = [p.ids for p in bc.load_prompts(tokenizer, n, args.random_input_len)]
    elif tokenizer is not None:
        ids = random_ids(rng, tokenizer, n, args.random_input_len)
    else:
        texts = [
            " ".join(rng.choice(WORDS) for _ in range(args.random_input_len)) for _ in range(n)
        ]
    if args.backend == "openai-chat" and ids[0] is not None:  # chat messages are text
        texts, ids = [tokenizer.decode(x) for x in ids], [None] * n
    return [Item(i, texts[i], ids[i], out_len) for i in range(n)]
