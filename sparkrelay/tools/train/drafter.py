"""Train the bundled DSpark drafter `models/tiny-qwen3-dspark/` against the bundled target
`models/tiny-qwen3/`.

The DeepSpec recipe (docs/dspark.md, training), shrunk to a 2-core CPU and a one-hour budget:

* Data. DeepSpec trains on the target's own regenerated answers; here there are no prompts to
  regenerate, so a training sequence (512 tokens) is, with probability `--gen-frac` (0.5), a
  256-token window of the stdlib train split followed by the target's 256-token greedy continuation
  (a pool of `--gen-seqs` = 256 of them, generated once and cached: 2-4 minutes of KV-cached
  decoding on 2 cores, which is what bounds the pool), and otherwise a plain 512-token window of the
  corpus (sparkrelay/tools/corpus.py train split, the same token stream as the target's). The
  generated half is what the drafter meets at inference (greedy decoding of this target quickly
  settles into its own idioms and loops); the corpus half keeps the contexts varied. Anchors may sit
  anywhere in a sequence (the corpus prefix is real text too, so no loss mask).
* Target features on the fly (frozen target, transformers `output_hidden_states`): taps = raw
  outputs of layers `--taps` (hidden_states[i + 1]), and the target distribution of every slot =
  softmax of the target's own logits (its LM head on its final, normed hidden state) at the slot's
  position. Caching would not pay: one run sees < 1 epoch of the corpus.
* Per sequence `--anchors` anchors a ~ U[0, S-2] without replacement; block = [x_a, mask x (B-1)] at
  positions a..a+B-1, labels x_{a+1..a+B} (slots past the sequence end are masked); the block sees
  context features at positions < a only (`block_forward` with ctx_len = a, as at inference) and its
  own B tokens; the Markov bias and the confidence input are teacher-forced (previous token =
  anchor, then the labels).
* Loss 0.1 CE + 0.9 L1(p_d, p_t) + 1.0 BCE(confidence, 1 - 0.5 |p_d - p_t|_1 detached), slot weights
exp(-k/4).
* Embedding and LM head are copies of the target's (tied: one matrix) and frozen. Everything else
  starts at N(0, 0.02) (biases 0, norms 1), like transformers' initializer_range.
* AdamW lr 1.5e-3 (DeepSpec: 6e-4 at 512 sequences x 512 anchors per step; a 4-sequence batch and a
  ~1000-step run want a larger step), betas (0.9, 0.95), no weight decay, clip 1.0, warm-up 4 % then
  cosine to 0, driven by the fraction of the time budget spent (`--train-minutes`), so the schedule
  ends when the budget does.

Hyper-parameters: B = 7 (as released); 2 draft layers (the paper's Fig. 3: a 2-layer DSpark already
beats a 5-layer DFlash; 2 of the target's 8 layers keeps the drafter ~1/4 of the target's per-token
cost); taps [1, 3, 5, 6] (spread like DeepSpec's [1, 9, 17, 25, 33] over 36 layers, never the last
layer 7); markov_rank 64 (r/V = 1/64, the released 256/151936 is smaller, but the vocabulary here is
tiny); num_anchors 64 per 512-token sequence (DeepSpec: 512 per up-to-4096, same density);
mask_token_id = the byte-level token of byte 0xFF, which valid UTF-8 never contains, so the encoder
never emits it (checked: count 0 in the corpus), the analogue of Qwen3's unused row 151669.

Stages, each resumable (rerun the same command): corpus ids -> generated pool -> training (checkpoint every
`--ckpt-minutes` under `--work-dir`) -> export (bf16 DeepSpec folder) -> offline greedy acceptance length on
held-out prompts (the greedy acceptance rule, simulated along the target's greedy trajectory) -> train_report.json.

Usage: python -m sparkrelay.tools.train.drafter [--target models/tiny-qwen3] [--out DIR] The drafter
goes to `--out`, by default .cache/train_tiny_dspark/model (the work folder), never over the
bundled, committed models/tiny-qwen3-dspark unless `--out models/tiny-qwen3-dspark` says so.

This module holds the model, the loss and the loop; drafter_data.py the target, its continuations
and the batches, drafter_eval.py the offline acceptance; common.py what it shares with the target's
training (target.py).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

from sparkrelay.models.decoder import DecoderSpec
from sparkrelay.models.dspark import DSparkSpec, Qwen3DSparkModel
from sparkrelay.models.dspark_checkpoint import (
    draft_config,
    load_dspark,
    save_checkpoint,
    target_head_weights,
)
from sparkrelay.models.loader import read_config
from sparkrelay.tools.train.common import (
    add_work_args,
    corpus_ids,
    load_state,
    parse_work_args,
    save_state,
)
from sparkrelay.tools.train.drafter_data import (
    chat_sequences,
    generated_pool,
    load_target,
    sample_batch,
    sample_chat_batch,
    special_token,
    target_features,
    unused_byte_token,
)
from sparkrelay.tools.train.drafter_eval import acceptance, chat_eval_set, eval_set
from sparkrelay.tools.train.drafter_loss import LOSS_WEIGHTS, block_loss, pick_anchors
from sparkrelay.tools.train.drafter_report import curve_point, log_line, write_report


def new_drafter(target_folder: str, args) -> tuple[Qwen3DSparkModel, dict]:
    target_cfg = read_config(target_folder)
    cfg = draft_config(
        target_cfg,
        num_hidden_layers=args.layers,
        block_size=args.block,
        target_layer_ids=args.taps,
        mask_token_id=args.mask_token_id,
        markov_rank=args.markov_rank,
        markov_head_type="vanilla",
        enable_confidence_head=True,
        confidence_head_with_markov=True,
        num_anchors=args.anchors,
    )
    model = Qwen3DSparkModel(DSparkSpec.from_hf(cfg, DecoderSpec.from_hf(target_cfg)))
    for name, p in model.named_parameters():
        if name.endswith("bias"):
            torch.nn.init.zeros_(p)
        elif p.dim() > 1:
            torch.nn.init.normal_(p, std=0.02)
    embed, lm_head = target_head_weights(target_folder)
    with torch.no_grad():
        model.embed_tokens.weight.copy_(embed)
        model.lm_head.weight.copy_(lm_head)
    model.embed_tokens.weight.requires_grad_(False)
    model.lm_head.weight.requires_grad_(False)
    # frozen: kept in bfloat16, so autocast does not cast the [V, d] head at every call
    if args.autocast:
        model.lm_head.to(torch.bfloat16)
    return model, cfg


def lr_at(progress: float, peak: float, warmup: float = 0.04) -> float:
    if progress < warmup:
        return peak * max(progress, 1e-3) / warmup
    return peak * 0.5 * (1 + math.cos(math.pi * min(1.0, (progress - warmup) / (1 - warmup))))


def train(args, work: Path, target, draw, evaluate=None, snapshot=None):
    """The training loop; `draw(gen)` gives a batch of (ids [S], loss_mask [S]) pairs,
    `evaluate(model)` (every `--eval-every` steps) a dict for the learning curve (work/curve.jsonl),
    after which `snapshot(model, cfg, st)` may export the drafter as it is. Returns (drafter, its
    config, stats). Resumes from `work/ckpt.pt`."""
    model, cfg = new_drafter(args.target, args)
    opt = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad],
        lr=args.lr,
        betas=(0.9, 0.95),
        weight_decay=0.0,
    )
    gen = torch.Generator().manual_seed(1)
    st = {
        "step": 0,
        "elapsed": 0.0,
        "cpu": 0.0,
        "slots": 0,
        "done": False,
        "recent": [],
        "before": {"step": 0, "seconds": 0.0, "cpu": 0.0},
    }
    ckpt = work / "ckpt.pt"
    saved = load_state(ckpt, model, opt, gen)
    if saved is not None:
        st = {"cpu": 0.0, **saved["stats"]}
        print(f"resumed at step {st['step']} ({st['elapsed']:.0f}s trained)", flush=True)
    elif args.init_from:
        st["before"] = warm_start(model, args.init_from, work)
        print(
            f"warm start from {args.init_from} (after {st['before']['step']} steps, "
            f"{st['before']['cpu'] / 3600:.2f} CPU hours): a fresh optimizer and lr schedule",
            flush=True,
        )
    model.train()
    budget, t0, last_save = args.train_minutes * 60, time.time() - st["elapsed"], time.time()
    cpu0 = time.process_time() - st["cpu"]
    while not st["done"]:
        st["elapsed"], st["cpu"] = time.time() - t0, time.process_time() - cpu0
        progress = max(
            st["elapsed"] / budget, st["step"] / args.max_steps if args.max_steps else 0.0
        )
        st["done"] = progress >= 1
        if not st["done"]:
            stats = train_step(model, opt, target, draw(gen), lr_at(progress, args.lr), args, gen)
            st["step"] += 1
            st["slots"] += stats.pop("slots")
            st["recent"] = (st["recent"] + [stats])[-args.log_every * 2 :]
            if st["step"] % args.log_every == 0:
                log_line(st, stats.keys(), args.log_every)
            if evaluate is not None and args.eval_every and st["step"] % args.eval_every == 0:
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.autocast):
                    curve_point(work, st, evaluate(model.eval()))
                if snapshot is not None:
                    snapshot(model, cfg, st)
                model.train()
        if st["done"] or time.time() - last_save > args.ckpt_minutes * 60:
            save_state(ckpt, model, opt, gen, stats=st)
            last_save = time.time()
    return model.eval(), cfg, st


def warm_start(model: Qwen3DSparkModel, folder: str, work: Path) -> dict:
    """Load an exported drafter's trained weights into `model` (every trainable tensor must be
    there; the frozen embedding and head stay the target's) and carry its learning curve into
    work/curve.jsonl: a run continued from a committed drafter (its optimizer state is not
    committed) keeps counting steps and hours from that one. Returns the totals it continues from:
    {"step", "seconds", "cpu"} (seconds of wall and CPU time)."""
    from safetensors.torch import load_file

    stored = load_file(str(Path(folder) / "model.safetensors"))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    missing = sorted(trainable - stored.keys())
    if missing:
        raise SystemExit(
            f"--init-from {folder}: the checkpoint lacks {missing[:4]} (another drafter shape?)"
        )
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in trainable:
                p.copy_(stored[name].to(p.dtype))
    report = json.loads((Path(folder) / "train_report.json").read_text())
    if not (work / "curve.jsonl").exists():
        curve = report.get("learning_curve", [])
        (work / "curve.jsonl").write_text("".join(json.dumps(pt) + "\n" for pt in curve))
    return {
        "step": report["steps"],
        "seconds": report["train_seconds"],
        "cpu": report["cpu_hours"] * 3600,
    }


def train_step(
    model,
    opt,
    target,
    batch: list[tuple[torch.Tensor, torch.Tensor]],
    lr: float,
    args,
    gen: torch.Generator,
) -> dict:
    """One optimizer step over `batch` (ids [S], loss_mask [S]) pairs, one target pass per
    sequence."""
    sums: dict[str, torch.Tensor] = {}
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.autocast)
    for ids, loss_mask in batch:
        feats, final = target_features(target, ids, args.taps, args.feature_cache)
        with autocast:
            out = block_loss(
                model,
                feats,
                final,
                target.lm_head,
                ids,
                pick_anchors(loss_mask, args.anchors, gen),
                loss_mask,
            )
        for k, v in out.items():
            sums[k] = sums[k] + v if k in sums else v
    terms = {k: sums[k] / sums["w"].clamp(min=1e-6) for k in LOSS_WEIGHTS}
    loss = sum(LOSS_WEIGHTS[k] * terms[k] for k in LOSS_WEIGHTS)
    for group in opt.param_groups:
        group["lr"] = lr
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 1.0)
    opt.step()
    out = {k: float(v.detach()) for k, v in terms.items()}
    return {
        **out,
        "loss": float(loss.detach()),
        "lr": lr,
        "hit0": float(sums["hit0"] / sums["n0"].clamp(min=1)),
        "slots": int(sums["slots"]),
    }


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--target", default="models/tiny-qwen3")
    add_work_args(p, ".cache/train_tiny_dspark", bundled="models/tiny-qwen3-dspark", what="drafter")
    p.add_argument(
        "--train-minutes",
        type=float,
        default=45.0,
        help="training-loop budget (the lr schedule spans it)",
    )
    p.add_argument(
        "--max-steps",
        type=int,
        default=0,
        help="also stop after this many steps (0: time budget only)",
    )
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--block", type=int, default=7)
    p.add_argument("--taps", type=int, nargs="+", default=[1, 3, 5, 6])
    p.add_argument("--markov-rank", type=int, default=64)
    p.add_argument("--anchors", type=int, default=64)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--lr", type=float, default=1.5e-3)
    p.add_argument(
        "--gen-seqs", type=int, default=256, help="target greedy continuations in the data pool"
    )
    p.add_argument("--gen-frac", type=float, default=0.5)
    p.add_argument("--eval-prompts", type=int, default=48)
    p.add_argument("--eval-prompt-len", type=int, default=128)
    p.add_argument("--eval-new", type=int, default=128)
    p.add_argument("--ckpt-minutes", type=float, default=3.0)
    p.add_argument("--log-every", type=int, default=10)
    chat = p.add_argument_group("chat data (--data chat: the target's answers from chat_data.py)")
    chat.add_argument("--data", choices=("stdlib", "chat"), default="stdlib")
    chat.add_argument(
        "--answers",
        nargs="+",
        default=None,
        help="training JSONL files (default: WORK_DIR/answers/greedy.jsonl)",
    )
    chat.add_argument(
        "--eval-answers",
        default=None,
        help="evaluation JSONL (default: WORK_DIR/answers/eval_greedy.jsonl)",
    )
    chat.add_argument(
        "--eval-every", type=int, default=0, help="learning-curve point every N steps (0: none)"
    )
    chat.add_argument("--max-len", type=int, default=1024, help="tokens kept of prompt + answer")
    chat.add_argument(
        "--mask-token", default="<empty_output>", help="special token whose row is the mask"
    )
    chat.add_argument("--target-dtype", choices=("float32", "bfloat16"), default="float32")
    chat.add_argument(
        "--autocast", action="store_true", help="the drafter's forward and backward in bfloat16"
    )
    chat.add_argument(
        "--feature-cache",
        default=None,
        help="folder keeping the target's features per training sequence ((taps + 1) x hidden "
        "values per token, in the target's dtype), so later epochs skip the target",
    )
    chat.add_argument(
        "--init-from",
        default=None,
        help="start from this exported drafter's weights (a committed one: its optimizer state is "
        "not kept) with a fresh optimizer and lr schedule; ignored when WORK_DIR has a ckpt.pt",
    )
    chat.add_argument(
        "--no-frozen-copies",
        action="store_true",
        help="do not store the target's embedding and LM head in the drafter (the loader shares them)",
    )
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return parse_work_args(build_parser(), argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    t_start = time.time()
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    run = run_chat if args.data == "chat" else run_stdlib
    model, cfg, st, evals, eval_what = run(args, work)
    print(f"greedy acceptance length tau {evals['markov']['tau']}", flush=True)
    write_report(args, st, evals, eval_what, t_start)
    print(f"wrote {args.out}", flush=True)


def export(model, cfg: dict, args: argparse.Namespace, target) -> Qwen3DSparkModel:
    """Write the drafter to `--out` and load it back (complete) for the final evaluation."""
    save_checkpoint(model, cfg, args.out, with_frozen_copies=not args.no_frozen_copies)
    spec = DecoderSpec.from_hf(read_config(args.target))
    embed, head = target_head_weights(args.target)
    return load_dspark(args.out, spec, share_embedding_from=embed, share_lm_head_from=head)


def run_stdlib(args: argparse.Namespace, work: Path):
    train_ids, held = corpus_ids(work, Path(args.target) / "tokenizer.json")
    args.mask_token_id = unused_byte_token(args.target, torch.cat([train_ids, held]))
    target = load_target(args.target, args.target_dtype)
    pool = generated_pool(work, target, train_ids, args)
    ones = torch.ones(args.seq, dtype=torch.bool)
    draw = lambda gen: [(row, ones) for row in sample_batch(train_ids, pool, args, gen)]
    model, cfg, st = train(args, work, target, draw)
    drafter = export(model, cfg, args, target)
    seqs, ends = eval_set(target, held, args)
    p = args.eval_prompt_len
    evals = {
        "markov": acceptance(drafter, target, seqs, ends, p),
        "no_markov": acceptance(drafter, target, seqs, ends, p, False),
    }
    what = (
        f"{args.eval_prompts} held-out stdlib prompts x {args.eval_prompt_len} tokens, target greedy "
        f"continuation of {args.eval_new} tokens"
    )
    return model, cfg, st, evals, what


def run_chat(args: argparse.Namespace, work: Path):
    args.answers = args.answers or [str(work / "answers" / "greedy.jsonl")]
    args.eval_answers = args.eval_answers or str(work / "answers" / "eval_greedy.jsonl")
    seqs = chat_sequences(args.answers, args.max_len)
    args.mask_token_id = special_token(args.target, args.mask_token, seqs)
    print(
        f"{len(seqs)} training sequences, {sum(int(m.sum()) for _, m in seqs)} answer tokens",
        flush=True,
    )
    target = load_target(args.target, args.target_dtype)
    eval_sets = chat_eval_set(args.eval_answers, args.max_len)
    evaluate = lambda model: chat_acceptance(model, target, eval_sets)
    what = "evaluation-split prompts, the target's greedy answers (the learning curve's last point)"

    # the drafter as it is, so an interrupted run leaves a usable one in --out
    def snapshot(model, cfg, st):
        save_checkpoint(model, cfg, args.out, with_frozen_copies=not args.no_frozen_copies)
        last = json.loads((work / "curve.jsonl").read_text().splitlines()[-1])
        write_report(args, st, {"markov": last}, what, time.time())

    model, cfg, st = train(
        args, work, target, lambda gen: sample_chat_batch(seqs, args, gen), evaluate, snapshot
    )
    drafter = export(model, cfg, args, target)
    evals = {"markov": chat_acceptance(drafter, target, eval_sets)}
    rows = sum(len(v[0]) for v in eval_sets.values())
    return (
        model,
        cfg,
        st,
        evals,
        f"{rows} evaluation-split prompts ({args.eval_answers}), the target's greedy answers",
    )


def chat_acceptance(model, target, eval_sets: dict) -> dict:
    """τ per prompt set and over all of them (the mean of the sets' τ, as the paper averages
    benchmarks)."""
    per_set = {
        name: acceptance(model, target, seqs, ends, starts)
        for name, (seqs, ends, starts) in eval_sets.items()
    }
    taus = {name: r["tau"] for name, r in per_set.items()}
    return {
        "tau": round(sum(taus.values()) / len(taus), 3),
        **{f"tau_{k}": v for k, v in taus.items()},
        "per_set": per_set,
    }


if __name__ == "__main__":
    main()
