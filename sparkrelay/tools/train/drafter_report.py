"""The drafter tool's record of a run (python -m sparkrelay.tools.train.drafter): progress lines,
learning-curve points in WORK_DIR/curve.jsonl, and train_report.json beside the exported drafter
(data, steps, wall and CPU time counted over the runs it continues, losses, the curve)."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch


def log_line(st: dict, keys, n: int) -> None:
    mean = {k: sum(r[k] for r in st["recent"][-n:]) / n for k in keys}
    total = totals(st)
    print(
        f"step {total['step']} {st['elapsed']:.0f}s cpu {total['cpu'] / 3600:.2f}h lr {mean['lr']:.2e} "
        f"loss {mean['loss']:.3f} ce {mean['ce']:.3f} l1 {mean['l1']:.3f} bce {mean['bce']:.3f} "
        f"slot0-match {mean['hit0']:.3f}",
        flush=True,
    )


def totals(st: dict) -> dict:
    """Steps, wall seconds and CPU seconds over this run and the runs it continues
    (`--init-from`)."""
    b = st.get("before", {"step": 0, "seconds": 0.0, "cpu": 0.0})
    return {
        "step": b["step"] + st["step"],
        "seconds": b["seconds"] + st["elapsed"],
        "cpu": b["cpu"] + st["cpu"],
    }


def curve_point(work: Path, st: dict, result: dict) -> None:
    """One learning-curve point: step, wall and CPU hours, and the evaluation's figures, appended to
    curve.jsonl."""
    total = totals(st)
    point = {
        "step": total["step"],
        "train_hours": round(total["seconds"] / 3600, 3),
        "cpu_hours": round(total["cpu"] / 3600, 3),
        **result,
    }
    with (work / "curve.jsonl").open("a") as f:
        f.write(json.dumps(point) + "\n")
    print(
        f"eval at step {st['step']}: "
        + " ".join(f"{k} {v}" for k, v in result.items() if k != "per_set"),
        flush=True,
    )


def write_report(
    args: argparse.Namespace, st: dict, evals: dict, eval_what: str, t_start: float
) -> None:
    """train_report.json in the drafter folder: the run's data, size, time, final losses and offline
    acceptance."""
    last = st["recent"][-args.log_every :] or [{}]
    losses = {
        k: round(sum(r.get(k, 0.0) for r in last) / len(last), 4)
        for k in ("loss", "ce", "l1", "bce", "hit0")
    }
    total = totals(st)
    report = {
        "data": data_description(args),
        "steps": total["step"],
        "sequences": total["step"] * args.batch,
        "block_slots_this_run": st["slots"],
        "train_seconds": round(total["seconds"]),
        "cpu_hours": round(total["cpu"] / 3600, 3),
        "this_run": {"from_step": totals(st)["step"] - st["step"], "init_from": args.init_from},
        "total_seconds_this_run": round(time.time() - t_start),
        "final_losses": losses,
        "offline_greedy_acceptance": {"eval": eval_what, **evals},
        "hyper_parameters": {
            k: v for k, v in vars(args).items() if k not in ("target", "out", "work_dir")
        },
        "torch_threads": torch.get_num_threads(),
    }
    if args.data == "stdlib":
        report["tokens"] = st["step"] * args.batch * args.seq
    curve = Path(args.work_dir) / "curve.jsonl"
    if curve.is_file():
        report["learning_curve"] = [json.loads(line) for line in curve.read_text().splitlines()]
    (Path(args.out) / "train_report.json").write_text(json.dumps(report, indent=2) + "\n")


def data_description(args: argparse.Namespace) -> dict:
    if args.data == "stdlib":
        return {
            "kind": "stdlib",
            "what": "windows of the stdlib train split and the target's greedy continuations",
        }
    rows = sum(len(Path(a).read_text().splitlines()) for a in args.answers)
    return {
        "kind": "chat",
        "answers": args.answers,
        "rows": rows,
        "what": "training-split prompts of the six DSpark evaluation sets (tools/corpus.py prompt_split) under "
        "the chat template, answered by the target (tools/train/chat_data.py)",
    }
