"""Offline throughput: sparkrelay's `LLM.generate` against Hugging Face transformers' `generate`, same model,
same prompts, greedy, fixed output length.

Each engine configuration runs the workload (bench_common.load_prompts: N windows of held-out stdlib code) at
each batch size B: the N prompts go in consecutive groups of B, one generate call per group (B = 1: one prompt
at a time; B = N: all together). Every timed repeat runs the workload twice, with `--output-len` new tokens and
with 1 new token; the medians over `--repeats` give
    e2e tok/s    = N * out / t_out
    decode tok/s = N * (out - 1) / (t_out - t_1)   (prefill and the first token taken out)
The greedy outputs of every row are compared token for token with transformers at batch 1, because a fast
engine that answers differently is worthless: any difference ends the run with `Verdict: FAIL` and exit status 1.

Results: `<out-dir>/bench_offline.md` (table), `.png` (decode tok/s bars), `.json` (raw timings, outputs).
Usage: python -m sparkrelay.tools.bench.offline [--model-path models/tiny-qwen3] [--batch-sizes 1,8] [--repeats 3]

More engine configurations (DSpark, issue #3) are one `EngineConfig` each, appended to `ENGINE_CONFIGS`.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Protocol

from tqdm.auto import tqdm

from sparkrelay.tools.bench import common as bc

NAME = "bench_offline"
REFERENCE = "transformers"  # ratios and greedy agreement are taken against this engine


class Runner(Protocol):
    """A loaded engine: greedy-generates exactly `output_len` tokens (EOS ignored) for each prompt of a group
    submitted together, and returns the new token ids in prompt order."""

    def generate(self, prompts: list[list[int]], output_len: int) -> list[list[int]]: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class EngineConfig:
    """One row family of the table: a name and how to load its runner from the parsed arguments."""

    name: str
    load: Callable[[argparse.Namespace], Runner]


# -- sparkrelay ----------------------------------------------------------------------------------------------------

class SparkrelayRunner:
    def __init__(self, args: argparse.Namespace, **settings) -> None:
        from sparkrelay import LLM, SamplingParams

        self._params = SamplingParams
        settings.setdefault("max_running_requests", max(64, max(args.batch_sizes)))
        self.llm = LLM(args.model_path, dtype=args.dtype, device=args.device, **settings)

    def generate(self, prompts: list[list[int]], output_len: int) -> list[list[int]]:
        params = self._params(max_new_tokens=output_len, temperature=0, ignore_eos=True)
        return [list(o["output_ids"]) for o in self.llm.generate(prompts, params)]

    def close(self) -> None:
        del self.llm


    def spec_stats(self) -> Optional[dict]:
        """Acceptance figures since the last call (None without speculative decoding)."""
        engine = self.llm.engine
        if engine.spec_stats is None:
            return None
        summary = engine.spec_stats.summary()
        engine.spec_stats = type(engine.spec_stats)(engine.spec_stats.max_drafts)  # start a fresh count
        return summary


def load_sparkrelay(args: argparse.Namespace) -> Runner:
    return SparkrelayRunner(args)


def load_dspark(args: argparse.Namespace, **settings) -> Runner:
    if not Path(args.draft_model_path).is_dir():
        raise SystemExit(f"--draft-model-path {args.draft_model_path!r} is not a folder")
    return SparkrelayRunner(args, speculative_algorithm="DSPARK", speculative_draft_model_path=args.draft_model_path,
                            speculative_dspark_confidence_threshold=args.confidence_threshold,
                            speculative_num_draft_tokens=args.num_draft_tokens, **settings)


def load_compiled(args: argparse.Namespace) -> Runner:
    return SparkrelayRunner(args, enable_torch_compile=True)


def load_dspark_compiled(args: argparse.Namespace) -> Runner:
    return load_dspark(args, enable_torch_compile=True)


# -- transformers --------------------------------------------------------------------------------------------------

class TransformersRunner:
    """`AutoModelForCausalLM.generate` on left-padded groups, greedy, no EOS (so it never stops early)."""

    def __init__(self, args: argparse.Namespace) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # its weight-loading bar would interleave with the benchmark's
        self.torch = torch
        self.device = args.device
        dtype = getattr(torch, args.dtype)
        self.model = AutoModelForCausalLM.from_pretrained(args.model_path, dtype=dtype).to(args.device).eval()
        tok = AutoTokenizer.from_pretrained(args.model_path)
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
        gc = self.model.generation_config
        gc.eos_token_id = None  # ignore_eos: run to max_new_tokens, and let EOS itself be generated
        gc.pad_token_id = self.pad_id
        gc.do_sample = False
        for name in ("temperature", "top_p", "top_k"):  # silence "sampling flag set but do_sample=False"
            if hasattr(gc, name):
                setattr(gc, name, None)

    def generate(self, prompts: list[list[int]], output_len: int) -> list[list[int]]:
        torch = self.torch
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):  # left padding
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        with torch.inference_mode():
            out = self.model.generate(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                                      do_sample=False, max_new_tokens=output_len, min_new_tokens=output_len)
        return out[:, width:].tolist()

    def close(self) -> None:
        del self.model


def load_transformers(args: argparse.Namespace) -> Runner:
    return TransformersRunner(args)


PLAIN, DSPARK = "sparkrelay", "sparkrelay+dspark"
COMPILED, DSPARK_COMPILED = "sparkrelay+compile", "sparkrelay+dspark+compile"
ENGINE_CONFIGS: list[EngineConfig] = [
    EngineConfig(PLAIN, load_sparkrelay),
    EngineConfig(DSPARK, load_dspark),
    EngineConfig(COMPILED, load_compiled),
    EngineConfig(DSPARK_COMPILED, load_dspark_compiled),
    EngineConfig(REFERENCE, load_transformers),
]
DEFAULT_ENGINES = (PLAIN, DSPARK, REFERENCE)


def plain_of(engine: str) -> str:
    """The non-speculative row a speculative row is compared with (same compile setting)."""
    return engine.replace("+dspark", "")


# -- measurement ---------------------------------------------------------------------------------------------------

def run_workload(runner: Runner, groups: list[list[list[int]]], output_len: int) -> list[list[int]]:
    outs = [ids for group in groups for ids in runner.generate(group, output_len)]
    bad = [len(o) for o in outs if len(o) != output_len]
    if bad:
        raise RuntimeError(f"asked for {output_len} tokens per prompt, got lengths {bad[:5]}")
    return outs


def measure(runner: Runner, prompts: list[list[int]], batch: int, args: argparse.Namespace,
            bar: Optional[tqdm] = None) -> dict:
    """Time the workload at one batch size (see the module docstring); returns the raw and median figures."""
    groups = bc.batches(prompts, batch)
    out_len = args.output_len
    for _ in range(args.warmup):
        runner.generate(groups[0], out_len)
        bar and bar.update(1)
    t_out, t_one, outputs, spec = [], [], None, None
    stats = getattr(runner, "spec_stats", lambda: None)
    for _ in range(args.repeats):
        stats()
        seconds, outputs = bc.timed(lambda: run_workload(runner, groups, out_len), args.device)
        spec = stats()  # the acceptance of this full-length run (every repeat is the same greedy work)
        t_out.append(seconds)
        t_one.append(bc.timed(lambda: run_workload(runner, groups, 1), args.device)[0])
        bar and bar.update(1)
    n = len(prompts)
    t_out_med, t_one_med = bc.median(t_out), bc.median(t_one)
    decode = bc.rate(n * (out_len - 1), t_out_med - t_one_med) if out_len > 1 and t_out_med > t_one_med else None
    return {"batch": batch, "groups": len(groups), "t_out_s": t_out, "t_1_s": t_one, "t_out_median_s": t_out_med,
            "t_1_median_s": t_one_med, "e2e_tok_s": bc.rate(n * out_len, t_out_med), "decode_tok_s": decode,
            "outputs": outputs, "spec": spec}


def first_divergence(a: list[int], b: list[int]) -> Optional[int]:
    """Index of the first differing token, None when equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def add_comparisons(rows: list[dict]) -> None:
    """Ratios vs the reference engine at the same batch and vs the row's own batch 1 (smallest batch), and greedy
    agreement with the reference's smallest batch; filled into each row dict."""
    by_key = {(r["engine"], r["batch"]): r for r in rows}
    ref_rows = sorted((r for r in rows if r["engine"] == REFERENCE), key=lambda r: r["batch"])
    ref_out = ref_rows[0]["outputs"] if ref_rows else None
    for r in rows:
        ref = by_key.get((REFERENCE, r["batch"]))
        own1 = min((x for x in rows if x["engine"] == r["engine"]), key=lambda x: x["batch"])
        r["vs_reference"] = _ratio(r["decode_tok_s"], ref and ref["decode_tok_s"])
        r["vs_own_b1"] = _ratio(r["decode_tok_s"], own1["decode_tok_s"])
        plain = by_key.get((plain_of(r["engine"]), r["batch"]))
        r["vs_plain"] = _ratio(r["decode_tok_s"], plain and plain["decode_tok_s"])
        if ref_out is not None:
            div = [first_divergence(a, b) for a, b in zip(r["outputs"], ref_out)]
            r["first_divergence"] = div
            r["match"] = sum(d is None for d in div)
        else:
            r["first_divergence"], r["match"] = None, None


def verdict(rows: list[dict], num_prompts: int) -> list[str]:
    """Rows whose greedy outputs are not all equal to the reference's at batch 1 (a wrong answer fails the run)."""
    return [f"{r['engine']} batch {r['batch']}: {num_prompts - r['match']} of {num_prompts} outputs differ from "
            f"{REFERENCE} (first differing token per prompt: {r['first_divergence']})"
            for r in rows if r["match"] is not None and r["match"] < num_prompts]


def verdict_line(why: list[str]) -> str:
    if why:
        return "Verdict: FAIL: " + "; ".join(why)
    return f"Verdict: PASS (every row's greedy outputs equal {REFERENCE}'s at batch 1, token for token)"


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return a / b if a is not None and b else None


# -- report --------------------------------------------------------------------------------------------------------

def header_lines(args: argparse.Namespace, machine: dict, prompts: list[bc.Prompt]) -> list[str]:
    files = sorted({p.source for p in prompts})
    gpu = f", GPU {machine['cuda']}" if machine.get("cuda") else ""
    return [
        f"Model `{args.model_path}`, dtype {args.dtype}, device {args.device}; {len(prompts)} prompts x "
        f"{args.prompt_len} tokens of held-out stdlib code ({len(files)} files), {args.output_len} new tokens each, "
        f"greedy, EOS ignored; median of {args.repeats} runs after {args.warmup} warm-up.",
        f"torch {machine['torch']}, torch threads: {machine['torch_threads']}, {machine['cpu_cores']} cores "
        f"({machine['cpu']}{gpu}), Python {machine['python']}, {machine['date']}.",
    ]


def table(rows: list[dict], num_prompts: int) -> str:
    headers = ["engine", "batch", "e2e tok/s", "decode tok/s", f"vs {REFERENCE}", "vs own b1", "vs plain",
               "accept len", f"= {REFERENCE} b1"]
    body = [[r["engine"], r["batch"], r["e2e_tok_s"], r["decode_tok_s"], _x(r["vs_reference"]), _x(r["vs_own_b1"]),
             _x(r["vs_plain"]), "-" if not r.get("spec") else f"{r['spec']['spec_accept_length']:.2f}",
             "-" if r["match"] is None else f"{r['match']}/{num_prompts}"] for r in rows]
    return bc.markdown_table(headers, body)


def accept_table(rows: list[dict]) -> str:
    """Per-position accept rates of the speculative rows (DSPARK.md §2.6 accept_rate@k)."""
    spec_rows = [r for r in rows if r.get("spec")]
    if not spec_rows:
        return ""
    width = max(len(r["spec"]["spec_accept_rate_per_position"]) for r in spec_rows)
    headers = ["engine", "batch", "rounds", "accept len", "verify rate"] + [f"@{k}" for k in range(width)]
    body = [[r["engine"], r["batch"], r["spec"]["spec_rounds"], f"{r['spec']['spec_accept_length']:.2f}",
             f"{r['spec']['spec_verify_rate']:.2f}"] + [f"{a:.2f}" for a in r["spec"]["spec_accept_rate_per_position"]]
            for r in spec_rows]
    return bc.markdown_table(headers, body)


def _x(v: Optional[float]) -> str:
    return "-" if v is None else f"{v:.2f}x"


NOTES = [
    "e2e tok/s = N x out / t(out tokens); decode tok/s = N x (out - 1) / (t(out tokens) - t(1 token)), i.e. with "
    "prefill and the first token taken out. Batch B: the N prompts go in N/B consecutive generate calls of B "
    "prompts. Ratios are of decode tok/s; `vs plain` compares a +dspark row with the same engine without DSpark "
    "(same compile setting). `+compile` rows run with --enable-torch-compile (compiled during the warm-up). "
    "The last column counts prompts whose greedy output equals "
    f"{REFERENCE}'s at batch 1, token for token.",
]


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m sparkrelay.tools.bench.offline",
                                     description="Offline tokens/s of sparkrelay vs transformers on one model and "
                                                 "workload; writes bench_offline.md/.png/.json.")
    bc.add_workload_args(parser)
    parser.add_argument("--batch-sizes", type=bc.int_list, default=None,
                        help="Comma-separated batch sizes (default: 1,N).")
    parser.add_argument("--engines", default=",".join(DEFAULT_ENGINES),
                        help="Comma-separated engine configurations to run, of: "
                             + ", ".join(e.name for e in ENGINE_CONFIGS) + " (+compile: --enable-torch-compile).")
    parser.add_argument("--draft-model-path", default="models/tiny-qwen3-dspark",
                        help=f"DSpark drafter of the {DSPARK} rows.")
    parser.add_argument("--confidence-threshold", type=float, default=0.0,
                        help=f"--speculative-dspark-confidence-threshold of the {DSPARK} rows.")
    parser.add_argument("--num-draft-tokens", type=int, default=None,
                        help=f"--speculative-num-draft-tokens of the {DSPARK} rows (default: the block size).")
    args = parser.parse_args(argv)
    if args.batch_sizes is None:
        args.batch_sizes = sorted({1, args.num_prompts})
    for flag in ("num_prompts", "prompt_len", "output_len", "repeats"):
        if getattr(args, flag) <= 0:
            parser.error(f"--{flag.replace('_', '-')} must be positive")
    if max(args.batch_sizes) > args.num_prompts:
        parser.error(f"--batch-sizes {args.batch_sizes}: a batch cannot exceed --num-prompts {args.num_prompts}")
    if args.warmup < 0:
        parser.error("--warmup must be >= 0")
    known = {e.name for e in ENGINE_CONFIGS}
    args.engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    unknown = set(args.engines) - known
    if unknown or not args.engines:
        parser.error(f"--engines: unknown {sorted(unknown)}; known: {sorted(known)}")
    if not Path(args.model_path).is_dir():
        parser.error(f"--model-path {args.model_path!r} is not a folder")
    return args


def main(argv: Optional[list[str]] = None) -> dict:
    args = parse_args(argv)
    import torch
    from transformers import AutoTokenizer

    if args.threads:
        torch.set_num_threads(args.threads)
    machine = bc.machine_info()
    tokenizer = AutoTokenizer.from_pretrained(args.model_path)
    prompts = bc.load_prompts(tokenizer, args.num_prompts, args.prompt_len)
    ids = [p.ids for p in prompts]
    engines = [e for e in ENGINE_CONFIGS if e.name in args.engines]
    steps_per_engine = 1 + len(args.batch_sizes) * (args.warmup + args.repeats)
    rows: list[dict] = []
    with tqdm(total=len(engines) * steps_per_engine, desc=NAME, unit="run", file=sys.stderr) as bar:
        for engine in engines:
            bar.set_postfix_str(f"{engine.name} load")
            runner = engine.load(args)
            bar.update(1)
            try:
                for batch in args.batch_sizes:
                    bar.set_postfix_str(f"{engine.name} b{batch}")
                    rows.append({"engine": engine.name, **measure(runner, ids, batch, args, bar)})
            finally:
                runner.close()
    add_comparisons(rows)

    out_dir = Path(args.out_dir)
    head = header_lines(args, machine, prompts)
    text = table(rows, len(prompts))
    accepts = accept_table(rows)
    if accepts:
        text += "\n\nPer-position accept rates (rounds whose accepted prefix reached draft slot k / rounds that " \
                "proposed it):\n\n" + accepts
    md = bc.write_markdown(out_dir / f"{NAME}.md", "Offline throughput (sparkrelay vs transformers)", head, text,
                           NOTES)
    groups = [f"batch {b}" for b in args.batch_sizes]
    series = {e.name: [next((r["decode_tok_s"] for r in rows if r["engine"] == e.name and r["batch"] == b), None)
                       for b in args.batch_sizes] for e in engines}
    png = bc.bar_chart(out_dir / f"{NAME}.png", groups, series,
                       title=f"{Path(args.model_path).name} {args.dtype}: decode tok/s "
                             f"({len(prompts)} prompts, {args.prompt_len}+{args.output_len} tokens)",
                       ylabel="decode tokens/s")
    failures = verdict(rows, len(prompts))
    result = {"settings": {k: v for k, v in vars(args).items()}, "machine": machine,
              "prompts": [{"source": p.source, "window": p.window, "ids": p.ids} for p in prompts], "rows": rows,
              "failures": failures}
    js = bc.write_json(out_dir / f"{NAME}.json", result)
    print("\n".join(head) + "\n\n" + text + "\n")
    print(f"wrote {md}, {png}, {js}")
    print(verdict_line(failures))
    return result


if __name__ == "__main__":
    sys.exit(1 if main()["failures"] else 0)
