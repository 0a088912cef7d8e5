"""What the two training tools share: the work-folder arguments (the result goes to WORK_DIR/model
unless `--out` names another folder, so a bundled model is replaced only when asked), the stdlib
corpus encoded once per work folder, and checkpoints written atomically and resumed."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Optional

import torch

from sparkrelay.tools.corpus import read_texts, stdlib_files


def add_work_args(p: argparse.ArgumentParser, work_dir: str, bundled: str, what: str) -> None:
    """`--out` and `--work-dir`; `bundled` is the committed folder that `--out` replaces only when
    given."""
    p.add_argument(
        "--out",
        default=None,
        help=f"{what} folder to write (default: WORK_DIR/model; "
        f"`--out {bundled}` replaces the bundled {what})",
    )
    p.add_argument("--work-dir", default=work_dir)


def parse_work_args(p: argparse.ArgumentParser, argv: Optional[list[str]]) -> argparse.Namespace:
    args = p.parse_args(argv)
    args.out = args.out or str(Path(args.work_dir) / "model")
    return args


def encode_corpus(texts: list[str], tokenizer_path: Path) -> torch.Tensor:
    """Concatenate every file's tokens, each file ended by <|endoftext|>; returns int16 [N]."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_path))
    eos = tok.token_to_id("<|endoftext|>")
    ids: list[int] = []
    for enc in tok.encode_batch(texts):
        ids.extend(enc.ids)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.int16)


def corpus_ids(work: Path, tokenizer_path: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, held-out) token ids of the stdlib corpus, int16, cached in `work` (train_ids.pt,
    held_ids.pt)."""
    if not (work / "held_ids.pt").exists():
        train_files, held_files = stdlib_files()
        torch.save(encode_corpus(read_texts(train_files), tokenizer_path), work / "train_ids.pt")
        torch.save(encode_corpus(read_texts(held_files), tokenizer_path), work / "held_ids.pt")
    return torch.load(work / "train_ids.pt"), torch.load(work / "held_ids.pt")


def save_state(
    path: Path, model: torch.nn.Module, opt: torch.optim.Optimizer, gen: torch.Generator, **extra
) -> None:
    """Model, optimizer and sampling-generator state plus `extra`, written to a temporary file and
    renamed, so an interruption leaves the previous checkpoint whole."""
    state = {"model": model.state_dict(), "opt": opt.state_dict(), "gen": gen.get_state(), **extra}
    torch.save(state, path.with_suffix(".tmp"))
    os.replace(path.with_suffix(".tmp"), path)


def load_state(
    path: Path, model: torch.nn.Module, opt: torch.optim.Optimizer, gen: torch.Generator
) -> Optional[dict]:
    """Restores what `save_state` wrote into model, opt and gen; returns the whole saved dict (None:
    no file)."""
    if not path.exists():
        return None
    state = torch.load(path)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["opt"])
    gen.set_state(state["gen"])
    return state
