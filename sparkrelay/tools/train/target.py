"""Train the bundled target model `models/tiny-qwen3/` from the running Python's standard library.

Stages, each resumable (rerun the same command to continue after an interruption):
  1. corpus:    every stdlib `*.py` file (tests, idlelib, lib2to3 and site-packages left out); a file goes to
                the held-out split when a hash of its relative path falls in the last 2%.
  2. tokenizer: byte-level BPE (Hugging Face `tokenizers`), special tokens for EOS and a ChatML
  template.
  3. train:     a Qwen3ForCausalLM (transformers) on random 512-token windows, AdamW + cosine schedule;
                a checkpoint every `--ckpt-every` steps under `--work-dir`.
  4. export:    bf16 safetensors + config.json + tokenizer files + generation_config.json, and the held-out
                loss in `train_report.json`.

Usage: python -m sparkrelay.tools.train.target [--out DIR] [--steps 500] The model goes to `--out`,
by default .cache/train_tiny_target/model (the work folder), never over the bundled, committed
models/tiny-qwen3 unless `--out models/tiny-qwen3` says so.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

from sparkrelay.tools.corpus import read_texts, stdlib_files
from sparkrelay.tools.train.common import (
    add_work_args,
    corpus_ids,
    load_state,
    parse_work_args,
    save_state,
)

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def train_tokenizer(texts: list[str], vocab_size: int, out_dir: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    tok_cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
        "bos_token": None,
        "unk_token": None,
        "add_bos_token": False,
        "model_max_length": 4096,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2))
    special = {
        "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
    }
    (out_dir / "special_tokens_map.json").write_text(json.dumps(special, indent=2))


def model_config(vocab_size: int, args: argparse.Namespace):
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // args.head_dim,
        num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim,
        max_position_embeddings=4096,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=0,
        pad_token_id=0,
    )


def batch_windows(data: torch.Tensor, batch: int, seq: int, gen: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, data.numel() - seq - 1, (batch,), generator=gen)
    # [batch, seq + 1]: inputs are [:, :-1], labels [:, 1:] (transformers shifts internally).
    return torch.stack([data[s : s + seq + 1] for s in starts.tolist()]).long()


@torch.no_grad()
def held_out_loss(model, data: torch.Tensor, seq: int, max_windows: int = 64) -> float:
    model.eval()
    n = min(max_windows, (data.numel() - 1) // seq)
    losses = []
    for i in range(n):
        x = data[i * seq : (i + 1) * seq].long().unsqueeze(0)
        losses.append(model(input_ids=x, labels=x).loss.item())
    model.train()
    return sum(losses) / len(losses)


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    frac = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


def train(args: argparse.Namespace, work: Path, data: torch.Tensor, held: torch.Tensor) -> None:
    """The training loop on the corpus ids `data` [N] (int16); resumes from `work/ckpt.pt`, ends
    with the held-out loss in `work/train_report.json` and the model in `work/final`."""
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(model_config(args.vocab_size, args))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    gen = torch.Generator().manual_seed(1)
    step, elapsed = 0, 0.0
    ckpt = work / "ckpt.pt"
    state = load_state(ckpt, model, opt, gen)
    if state is not None:
        step, elapsed = state["step"], state["elapsed"]
        print(f"resumed at step {step} ({elapsed:.0f}s trained)", flush=True)
    model.train()
    t0 = time.time() - elapsed
    while step < args.steps:
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args.steps, args.lr, warmup=30)
        x = batch_windows(data, args.batch, args.seq, gen)
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        if step % 10 == 0:
            print(
                f"step {step}/{args.steps} loss {loss.item():.3f} {time.time() - t0:.0f}s",
                flush=True,
            )
        if step % args.ckpt_every == 0 or step == args.steps:
            save_state(ckpt, model, opt, gen, step=step, elapsed=time.time() - t0)
    loss = held_out_loss(model, held, args.seq)
    print(f"held-out loss {loss:.4f} (ppl {math.exp(loss):.2f})", flush=True)
    model.save_pretrained(work / "final", safe_serialization=True)
    report = {
        "steps": step,
        "batch": args.batch,
        "seq": args.seq,
        "tokens_seen": step * args.batch * args.seq,
        "train_tokens": data.numel(),
        "held_out_tokens": held.numel(),
        "held_out_loss": round(loss, 4),
        "train_seconds": round(time.time() - t0),
        "torch_threads": torch.get_num_threads(),
    }
    (work / "train_report.json").write_text(json.dumps(report, indent=2))


@torch.no_grad()
def evaluate(folder: Path, seq: int) -> dict:
    """Held-out loss of the exported model on every 512-token window of the held-out files, in total
    and split into ordinary code and the `encodings/` codec tables (long, repetitive tables that are
    easy to predict)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    _, held = stdlib_files()
    groups = {
        "held_out_loss": held,
        "held_out_loss_code": [p for p in held if "encodings" not in p.parts],
        "held_out_loss_codec_tables": [p for p in held if "encodings" in p.parts],
    }
    out = {}
    for name, files in groups.items():
        ids = torch.tensor(
            [t for text in read_texts(files) for t in tok.encode(text) + [tok.eos_token_id]]
        )
        losses = [
            model(input_ids=w[None], labels=w[None]).loss.item()
            for w in ids.split(seq)
            if w.numel() == seq
        ]
        out[name] = round(sum(losses) / len(losses), 4)
        out[name.replace("loss", "windows")] = len(losses)
    return out


def export(work: Path, out: Path) -> None:
    """Write the bf16 Hugging Face folder: config.json, model.safetensors, tokenizer files,
    report."""
    from transformers import Qwen3ForCausalLM

    model = Qwen3ForCausalLM.from_pretrained(work / "final", dtype=torch.float32)
    model = model.to(torch.bfloat16)
    model.config.dtype = "bfloat16"
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    gen_cfg = {"eos_token_id": [0, 2], "pad_token_id": 0, "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(gen_cfg, indent=2))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (out / name).write_bytes((work / "tokenizer" / name).read_bytes())
    report = json.loads((work / "train_report.json").read_text())
    # the in-training figure (first windows only) is replaced by the full evaluation
    report.pop("held_out_loss", None)
    report.update(evaluate(out, report["seq"]))
    (out / "train_report.json").write_text(json.dumps(report, indent=2))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_work_args(p, ".cache/train_tiny_target", bundled="models/tiny-qwen3", what="model")
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--intermediate", type=int, default=768)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--ckpt-every", type=int, default=25)
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return parse_work_args(build_parser(), argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    if not (work / "tokenizer" / "tokenizer.json").exists():
        train_files, held_files = stdlib_files()
        print(
            f"corpus: {len(train_files)} train files, {len(held_files)} held-out files", flush=True
        )
        train_tokenizer(read_texts(train_files), args.vocab_size, work / "tokenizer")
    if not (work / "train_report.json").exists():
        train(args, work, *corpus_ids(work, work / "tokenizer" / "tokenizer.json"))
    export(work, Path(args.out))
    print(f"wrote {args.out}", flush=True)


if __name__ == "__main__":
    main()
