"""Train the bundled DSpark drafter `models/tiny-qwen3-dspark/` against the bundled target `models/tiny-qwen3/`.

The DeepSpec recipe (docs/dspark.md, training), shrunk to a 2-core CPU and a one-hour budget:

* Data. DeepSpec trains on the target's own regenerated answers; here there are no prompts to regenerate, so a
  training sequence (512 tokens) is, with probability `--gen-frac` (0.5), a 256-token window of the stdlib train
  split followed by the target's 256-token greedy continuation (a pool of `--gen-seqs` = 256 of them, generated
  once and cached: 2-4 minutes of KV-cached decoding on 2 cores, which is what bounds the pool), and otherwise a
  plain 512-token window of the corpus (sparkrelay/tools/corpus.py train split, the same token stream as the
  target's). The generated half is what the drafter meets at inference (greedy decoding of this target quickly
  settles into its own idioms and loops); the corpus half keeps the contexts varied.
  Anchors may sit anywhere in a sequence (the corpus prefix is real text too, so no loss mask).
* Target features on the fly (frozen target, transformers `output_hidden_states`): taps = raw outputs of layers
  `--taps` (hidden_states[i + 1]), and the target distribution of every slot = softmax of the target's own logits
  (its LM head on its final, normed hidden state) at the slot's position. Caching would not pay: one run sees
  < 1 epoch of the corpus.
* Per sequence `--anchors` anchors a ~ U[0, S-2] without replacement; block = [x_a, mask x (B-1)] at positions
  a..a+B-1, labels x_{a+1..a+B} (slots past the sequence end are masked); the block sees context features at
  positions < a only (`block_forward` with ctx_len = a, as at inference) and its own B tokens; the Markov bias and the
  confidence input are teacher-forced (previous token = anchor, then the labels).
* Loss 0.1 CE + 0.9 L1(p_d, p_t) + 1.0 BCE(confidence, 1 - 0.5 |p_d - p_t|_1 detached), slot weights exp(-k/4).
* Embedding and LM head are copies of the target's (tied: one matrix) and frozen. Everything else starts at
  N(0, 0.02) (biases 0, norms 1), like transformers' initializer_range.
* AdamW lr 1.5e-3 (DeepSpec: 6e-4 at 512 sequences x 512 anchors per step; a 4-sequence batch and a ~1000-step
  run want a larger step), betas (0.9, 0.95), no weight decay, clip 1.0, warm-up 4 % then cosine to 0, driven by
  the fraction of the time budget spent (`--train-minutes`), so the schedule ends when the budget does.

Hyper-parameters: B = 7 (as released); 2 draft layers (the paper's Fig. 3: a 2-layer DSpark already beats a
5-layer DFlash; 2 of the target's 8 layers keeps the drafter ~1/4 of the target's per-token cost); taps
[1, 3, 5, 6] (spread like DeepSpec's [1, 9, 17, 25, 33] over 36 layers, never the last layer 7); markov_rank 64
(r/V = 1/64, the released 256/151936 is smaller, but the vocabulary here is tiny); num_anchors 64 per 512-token
sequence (DeepSpec: 512 per up-to-4096, same density); mask_token_id = the byte-level token of byte 0xFF, which
valid UTF-8 never contains, so the encoder never emits it (checked: count 0 in the corpus), the analogue of
Qwen3's unused row 151669.

Stages, each resumable (rerun the same command): corpus ids -> generated pool -> training (checkpoint every
`--ckpt-minutes` under `--work-dir`) -> export (bf16 DeepSpec folder) -> offline greedy acceptance length on
held-out prompts (the greedy acceptance rule, simulated along the target's greedy trajectory) -> train_report.json.

Usage: python -m sparkrelay.tools.train.drafter [--target models/tiny-qwen3] [--out DIR]
The drafter goes to `--out`, by default .cache/train_tiny_dspark/model (the work folder), never over the bundled,
committed models/tiny-qwen3-dspark unless `--out models/tiny-qwen3-dspark` says so.

This module holds the model, the loss and the loop; drafter_data.py the target, its continuations and the batches,
drafter_eval.py the offline acceptance; common.py what it shares with the target's training (target.py).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from sparkrelay.models.dspark import DSparkSpec, Qwen3DSparkModel, load_dspark
from sparkrelay.models.dspark_checkpoint import draft_config, save_checkpoint, target_head_weights
from sparkrelay.models.loader import read_config
from sparkrelay.models.qwen3 import Qwen3Spec
from sparkrelay.tools.train.common import add_work_args, corpus_ids, load_state, parse_work_args, save_state
from sparkrelay.tools.train.drafter_data import (
    generated_pool, load_target, sample_batch, target_pass, unused_byte_token)
from sparkrelay.tools.train.drafter_eval import acceptance, eval_set

LOSS_WEIGHTS = {"ce": 0.1, "l1": 0.9, "bce": 1.0}
DECAY = 4.0  # slot weight exp(-k / 4), k = 0..B-1 (DeepSpec loss_decay_gamma)


def new_drafter(target_folder: str, args) -> tuple[Qwen3DSparkModel, dict]:
    target_cfg = read_config(target_folder)
    cfg = draft_config(target_cfg, num_hidden_layers=args.layers, block_size=args.block, target_layer_ids=args.taps,
                       mask_token_id=args.mask_token_id, markov_rank=args.markov_rank, markov_head_type="vanilla",
                       enable_confidence_head=True, confidence_head_with_markov=True, num_anchors=args.anchors)
    model = Qwen3DSparkModel(DSparkSpec.from_hf(cfg, Qwen3Spec.from_hf(target_cfg)))
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
    return model, cfg


def block_loss(model: Qwen3DSparkModel, feats: torch.Tensor, tlogits: torch.Tensor, x: torch.Tensor,
               anchors: torch.Tensor) -> dict[str, torch.Tensor]:
    """One sequence: feats [S, n_taps*d], tlogits [S, V], x [S], anchors [A] -> weighted loss sums and counts."""
    s, a, b = x.shape[0], anchors.shape[0], model.spec.block_size
    c = model.project_context(feats)  # [S, d]
    kv = model.context_kv(c, torch.arange(s))
    ks = [k.expand(a, *k.shape) for k, _ in kv]  # [A, S, n_kv, hd] views: every block of the sequence shares them
    vs = [v.expand(a, *v.shape) for _, v in kv]
    pos = anchors[:, None] + torch.arange(b)  # [A, B]: slot k sits at a+k and predicts a+k+1
    ids = torch.full((a, b), model.spec.mask_token_id)
    ids[:, 0] = x[anchors]
    h = model.block_forward(ids, pos, ks, vs, ctx_len=anchors)  # context strictly < anchor, as at inference
    valid = pos + 1 < s
    labels = x[(pos + 1).clamp(max=s - 1)]  # [A, B]
    prev = torch.cat([x[anchors, None], labels[:, :-1]], dim=1)  # teacher forcing
    z = model.base_logits(h) + model.markov_bias(h, prev)  # [A, B, V]
    logp = z.float().log_softmax(-1)
    p_t = tlogits[pos.clamp(max=s - 1)].float().softmax(-1)  # [A, B, V]
    l1 = (logp.exp() - p_t).abs().sum(-1)  # [A, B]
    ce = -logp.gather(-1, labels[..., None]).squeeze(-1)
    bce = F.binary_cross_entropy_with_logits(model.confidence(h, prev).float(), (1 - 0.5 * l1).detach(),
                                             reduction="none")
    w = torch.exp(-torch.arange(b) / DECAY) * valid  # [A, B]
    hit0 = (z[:, 0].argmax(-1) == p_t[:, 0].argmax(-1)).float()
    return {"ce": (w * ce).sum(), "l1": (w * l1).sum(), "bce": (w * bce).sum(), "w": w.sum(),
            "hit0": hit0.sum(), "n0": torch.tensor(float(a)), "slots": valid.sum()}


def lr_at(progress: float, peak: float, warmup: float = 0.04) -> float:
    if progress < warmup:
        return peak * max(progress, 1e-3) / warmup
    return peak * 0.5 * (1 + math.cos(math.pi * min(1.0, (progress - warmup) / (1 - warmup))))


def train(args, work: Path, target, train_ids: torch.Tensor, pool: torch.Tensor):
    """The training loop; returns (drafter, its config, stats). Resumes from `work/ckpt.pt`."""
    model, cfg = new_drafter(args.target, args)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr, betas=(0.9, 0.95),
                            weight_decay=0.0)
    gen = torch.Generator().manual_seed(1)
    st = {"step": 0, "elapsed": 0.0, "slots": 0, "done": False, "recent": []}
    ckpt = work / "ckpt.pt"
    saved = load_state(ckpt, model, opt, gen)
    if saved is not None:
        st = saved["stats"]
        print(f"resumed at step {st['step']} ({st['elapsed']:.0f}s trained)", flush=True)
    model.train()
    budget, t0, last_save = args.train_minutes * 60, time.time() - st["elapsed"], time.time()
    while not st["done"]:
        st["elapsed"] = time.time() - t0
        progress = max(st["elapsed"] / budget, st["step"] / args.max_steps if args.max_steps else 0.0)
        st["done"] = progress >= 1
        if not st["done"]:
            batch = sample_batch(train_ids, pool, args, gen)
            stats = train_step(model, opt, target, batch, lr_at(progress, args.lr), args, gen)
            st["step"] += 1
            st["slots"] += stats.pop("slots")
            st["recent"] = (st["recent"] + [stats])[-args.log_every * 2:]
            if st["step"] % args.log_every == 0:
                mean = {k: sum(r[k] for r in st["recent"][-args.log_every:]) / args.log_every for k in stats}
                print(f"step {st['step']} {st['elapsed']:.0f}s lr {mean['lr']:.2e} loss {mean['loss']:.3f} "
                      f"ce {mean['ce']:.3f} l1 {mean['l1']:.3f} bce {mean['bce']:.3f} slot0-match {mean['hit0']:.3f}",
                      flush=True)
        if st["done"] or time.time() - last_save > args.ckpt_minutes * 60:
            save_state(ckpt, model, opt, gen, stats=st)
            last_save = time.time()
    return model.eval(), cfg, st


def train_step(model, opt, target, x: torch.Tensor, lr: float, args, gen: torch.Generator) -> dict:
    feats, tlogits = target_pass(target, x, args.taps)
    sums: dict[str, torch.Tensor] = {}
    for b in range(x.shape[0]):
        anchors = torch.randperm(args.seq - 1, generator=gen)[: args.anchors].sort().values  # a in [0, S-2]
        for k, v in block_loss(model, feats[b], tlogits[b], x[b], anchors).items():
            sums[k] = sums[k] + v if k in sums else v
    terms = {k: sums[k] / sums["w"] for k in LOSS_WEIGHTS}
    loss = sum(LOSS_WEIGHTS[k] * terms[k] for k in LOSS_WEIGHTS)
    for group in opt.param_groups:
        group["lr"] = lr
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 1.0)
    opt.step()
    out = {k: float(v.detach()) for k, v in terms.items()}
    return {**out, "loss": float(loss.detach()), "lr": lr, "hit0": float(sums["hit0"] / sums["n0"]),
            "slots": int(sums["slots"])}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="models/tiny-qwen3")
    add_work_args(p, ".cache/train_tiny_dspark", bundled="models/tiny-qwen3-dspark", what="drafter")
    p.add_argument("--train-minutes", type=float, default=45.0,
                   help="training-loop budget (the lr schedule spans it)")
    p.add_argument("--max-steps", type=int, default=0, help="also stop after this many steps (0: time budget only)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--block", type=int, default=7)
    p.add_argument("--taps", type=int, nargs="+", default=[1, 3, 5, 6])
    p.add_argument("--markov-rank", type=int, default=64)
    p.add_argument("--anchors", type=int, default=64)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--lr", type=float, default=1.5e-3)
    p.add_argument("--gen-seqs", type=int, default=256, help="target greedy continuations in the data pool")
    p.add_argument("--gen-frac", type=float, default=0.5)
    p.add_argument("--eval-prompts", type=int, default=48)
    p.add_argument("--eval-prompt-len", type=int, default=128)
    p.add_argument("--eval-new", type=int, default=128)
    p.add_argument("--ckpt-minutes", type=float, default=3.0)
    p.add_argument("--log-every", type=int, default=10)
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return parse_work_args(build_parser(), argv)


def write_report(args: argparse.Namespace, st: dict, evals: dict, t_start: float) -> None:
    """train_report.json in the drafter folder: the run's size, its final losses and the offline acceptance."""
    last = st["recent"][-args.log_every:] or [{}]
    losses = {k: round(sum(r.get(k, 0.0) for r in last) / len(last), 4) for k in ("loss", "ce", "l1", "bce", "hit0")}
    report = {
        "steps": st["step"], "sequences": st["step"] * args.batch, "tokens": st["step"] * args.batch * args.seq,
        "block_slots": st["slots"], "train_seconds": round(st["elapsed"]),
        "total_seconds_this_run": round(time.time() - t_start), "final_losses": losses,
        "offline_greedy_acceptance": {"eval": f"{args.eval_prompts} held-out stdlib prompts x "
                                              f"{args.eval_prompt_len} tokens, target greedy continuation of "
                                              f"{args.eval_new} tokens", **evals},
        "hyper_parameters": {k: v for k, v in vars(args).items() if k not in ("target", "out", "work_dir")},
        "torch_threads": torch.get_num_threads(),
    }
    (Path(args.out) / "train_report.json").write_text(json.dumps(report, indent=2) + "\n")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    t_start = time.time()
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    train_ids, held = corpus_ids(work, Path(args.target) / "tokenizer.json")
    args.mask_token_id = unused_byte_token(args.target, torch.cat([train_ids, held]))
    target = load_target(args.target)
    pool = generated_pool(work, target, train_ids, args)
    model, cfg, st = train(args, work, target, train_ids, pool)
    save_checkpoint(model, cfg, args.out)
    drafter = load_dspark(args.out, Qwen3Spec.from_hf(read_config(args.target)))  # the export loads, complete
    seqs, ends = eval_set(target, held, args)
    p = args.eval_prompt_len
    evals = {"markov": acceptance(drafter, target, seqs, ends, p),
             "no_markov": acceptance(drafter, target, seqs, ends, p, False)}
    print(f"greedy acceptance length tau {evals['markov']['tau']} (Markov head off: {evals['no_markov']['tau']})",
          flush=True)
    write_report(args, st, evals, t_start)
    print(f"wrote {args.out}", flush=True)

if __name__ == "__main__":
    main()
