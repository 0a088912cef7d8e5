"""The drafter's training data (python -m sparkrelay.tools.train.drafter): the frozen target, the mask token, a
pool of the target's own greedy continuations, the training batches, and the target's features and logits."""

from __future__ import annotations

import time
from pathlib import Path

import torch


def load_target(folder: str):
    from transformers import Qwen3ForCausalLM

    return Qwen3ForCausalLM.from_pretrained(folder, dtype=torch.float32).eval().requires_grad_(False)


def unused_byte_token(target_folder: str, ids: torch.Tensor) -> int:
    """The byte-level BPE token of byte 0xFF (never in valid UTF-8), asserted absent from the corpus ids."""
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
        prompts = torch.stack([train[s: s + half] for s in starts]).long()
        torch.save(greedy_continue(target, prompts, args.seq - half).to(torch.int16), path)
        print(f"generated {args.gen_seqs} greedy continuations in {time.time() - t0:.0f}s", flush=True)
    return torch.load(path).long()


@torch.no_grad()
def target_pass(target, x: torch.Tensor, taps: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """x [b, S] -> features [b, S, n_taps*d] (raw layer outputs, before any norm: docs/dspark.md, context
    features), target logits [b, S, V]."""
    out = target(input_ids=x, output_hidden_states=True)
    hs = out.hidden_states  # [0] = embedding output, [i + 1] = output of layer i (the last entry is post-norm)
    return torch.cat([hs[i + 1] for i in taps], dim=-1), out.logits


def sample_batch(train: torch.Tensor, pool: torch.Tensor, args, gen: torch.Generator) -> torch.Tensor:
    rows = []
    for _ in range(args.batch):
        if len(pool) and torch.rand((), generator=gen) < args.gen_frac:
            rows.append(pool[torch.randint(len(pool), (), generator=gen)])
        else:
            s = int(torch.randint(0, train.numel() - args.seq, (), generator=gen))
            rows.append(train[s: s + args.seq].long())
    return torch.stack(rows)  # [batch, S]
