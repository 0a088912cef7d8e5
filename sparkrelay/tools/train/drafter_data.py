"""The drafter's training data (python -m sparkrelay.tools.train.drafter): the frozen target, the
mask token, a pool of the target's own greedy continuations or its chat answers (chat_data.py), the
training batches, and the target's features and final hidden states."""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def load_target(folder: str, dtype: str = "float32"):
    """The frozen target (transformers, any family it reads) in `dtype`."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=DTYPES[dtype])
    return model.eval().requires_grad_(False)


def chat_sequences(paths: list[str], max_len: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(ids [S] long, loss_mask [S] bool) per answer row of chat_data.py's JSONL files: prompt +
    answer, cut to `max_len` tokens; the loss mask covers the answer tokens. Rows with fewer than 14
    answer tokens are dropped (DeepSpec's rule)."""
    out = []
    for path in paths:
        for line in Path(path).read_text().splitlines():
            row = json.loads(line)
            prompt, answer = row["prompt_ids"], row["answer_ids"]
            ids = torch.tensor((prompt + answer)[:max_len])
            mask = torch.arange(len(ids)) >= len(prompt)
            if int(mask.sum()) >= 14:
                out.append((ids, mask))
    return out


def special_token(
    target_folder: str, name: str, seqs: list[tuple[torch.Tensor, torch.Tensor]]
) -> int:
    """The id of special token `name`, asserted absent from every training sequence (the mask
    token's row)."""
    from tokenizers import Tokenizer

    token = Tokenizer.from_file(str(Path(target_folder) / "tokenizer.json")).token_to_id(name)
    assert token is not None, f"{name} is not a token of {target_folder}"
    assert all(int((ids == token).sum()) == 0 for ids, _ in seqs), (
        f"{name} occurs in the training data"
    )
    return token


def unused_byte_token(target_folder: str, ids: torch.Tensor) -> int:
    """The byte-level BPE token of byte 0xFF (never in valid UTF-8), asserted absent from the corpus
    ids."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(target_folder) / "tokenizer.json"))
    token = tok.token_to_id("ÿ")  # GPT-2 bytes_to_unicode maps byte 0xFF to U+00FF
    assert token is not None and int((ids == token).sum()) == 0, token
    return token


@torch.no_grad()
def greedy_continue(target, prompts: torch.Tensor, new: int, batch: int = 64) -> torch.Tensor:
    """prompts [n, P] -> [n, P + new]: the target's greedy continuation (transformers' KV cache)."""
    out = []
    for chunk in prompts.split(batch):
        res = target(input_ids=chunk, use_cache=True, logits_to_keep=1)
        toks = []
        for _ in range(new):
            toks.append(res.logits[:, -1].argmax(-1))
            res = target(input_ids=toks[-1][:, None], cache=res.cache, use_cache=True)
        out.append(torch.cat([chunk, torch.stack(toks, 1)], 1))
    return torch.cat(out)


def generated_pool(work: Path, target, train: torch.Tensor, args) -> torch.Tensor:
    path = work / f"gen_{args.gen_seqs}x{args.seq}.pt"
    if args.gen_seqs == 0:
        return torch.empty(0, args.seq, dtype=torch.long)
    if not path.exists():
        t0 = time.time()
        gen = torch.Generator().manual_seed(2)
        half = args.seq // 2
        starts = torch.randint(0, train.numel() - half, (args.gen_seqs,), generator=gen).tolist()
        prompts = torch.stack([train[s : s + half] for s in starts]).long()
        torch.save(greedy_continue(target, prompts, args.seq - half).to(torch.int16), path)
        print(
            f"generated {args.gen_seqs} greedy continuations in {time.time() - t0:.0f}s", flush=True
        )
    return torch.load(path).long()


@torch.no_grad()
def target_pass(target, x: torch.Tensor, taps: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """x [b, S] -> features [b, S, n_taps*d] (raw layer outputs, before any norm: docs/dspark.md, context
    features), final hidden states [b, S, d] (after the final norm: `target.lm_head` of a row is its logits, taken
    only where a loss needs them)."""
    out = target.model(input_ids=x, output_hidden_states=True)
    # [0] = embedding output, [i + 1] = output of layer i (the last entry is post-norm)
    hs = out.hidden_states
    return torch.cat([hs[i + 1] for i in taps], dim=-1), out.last_hidden_state


def target_features(
    target, ids: torch.Tensor, taps: list[int], cache: Path | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [S] -> target_pass's (features [S, n_taps*d], final hidden states [S, d]) for one sequence, kept in
    `cache` (one file per sequence, named by a digest of its ids, the taps and the target's dtype) and read back
    on later draws: the target is frozen, so every epoch after the first is drafter-only work."""
    if cache is None:
        feats, final = target_pass(target, ids[None], taps)
        return feats[0], final[0]
    key = hashlib.sha1(
        ids.numpy().astype("int64").tobytes() + repr((taps, str(target.dtype))).encode()
    )
    path = Path(cache) / f"{key.hexdigest()}.pt"
    if path.exists():
        saved = torch.load(path)
        return saved["feats"], saved["final"]
    feats, final = target_pass(target, ids[None], taps)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"feats": feats[0].clone(), "final": final[0].clone()}, path.with_suffix(".tmp"))
    os.replace(path.with_suffix(".tmp"), path)  # whole or absent, if the run is stopped mid-write
    return feats[0], final[0]


def sample_chat_batch(
    seqs: list[tuple[torch.Tensor, torch.Tensor]], args, gen: torch.Generator
) -> list:
    """`args.batch` (ids, loss_mask) pairs drawn uniformly (with replacement) by `gen`."""
    return [seqs[int(i)] for i in torch.randint(len(seqs), (args.batch,), generator=gen)]


def sample_batch(
    train: torch.Tensor, pool: torch.Tensor, args, gen: torch.Generator
) -> torch.Tensor:
    rows = []
    for _ in range(args.batch):
        if len(pool) and torch.rand((), generator=gen) < args.gen_frac:
            rows.append(pool[torch.randint(len(pool), (), generator=gen)])
        else:
            s = int(torch.randint(0, train.numel() - args.seq, (), generator=gen))
            rows.append(train[s : s + args.seq].long())
    return torch.stack(rows)  # [batch, S]
