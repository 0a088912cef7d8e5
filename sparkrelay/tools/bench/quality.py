"""What bfloat16 and int8 weight-only cost in quality on a trained checkpoint (the bundled model by
default).

    python -m sparkrelay.tools.bench.quality [--model models/tiny-qwen3] [--windows 17]
        [--window-len 512] [--prompts 16] [--prompt-len 64] [--new-tokens 64] [--out
        benchmarks/results/quality]

For each variant (float32, bfloat16, bfloat16 + `--torchao-config int8wo`), on held-out stdlib code
(common.load_prompts: files the bundled model never trained on):
  loss           mean next-token cross-entropy over `--windows` windows of `--window-len` tokens, teacher-forced
                 (one forward per window, through the engine's own model and kernels)
  top-1 vs fp32  share of those positions whose argmax token equals float32's (and vs bf16 for int8wo)
  greedy         `--prompts` prompts of `--prompt-len` tokens, `--new-tokens` greedy tokens each through `LLM`
                 (EOS ignored): the share of output positions holding float32's token, the mean length of the
                 prefix equal to float32's output, and how many outputs are equal to it whole
Writes <out>/quality.md and .json. Deterministic for one Python install; nothing is timed.
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional

import torch
import torch.nn.functional as F

from sparkrelay.tools.bench import common as bc

NAME = "quality"
VARIANTS = (
    ("float32", "float32", ""),
    ("bfloat16", "bfloat16", ""),
    ("int8wo", "bfloat16", "int8wo"),
)
PAGE = 16


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m sparkrelay.tools.bench.quality", description=__doc__.split("\n")[0]
    )
    p.add_argument(
        "--model", default=bc.DEFAULT_MODEL, help="A trained checkpoint folder with its tokenizer."
    )
    p.add_argument("--windows", type=int, default=17, help="Held-out windows for the loss.")
    p.add_argument("--window-len", type=int, default=512, help="Tokens per loss window.")
    p.add_argument(
        "--prompts", type=int, default=16, help="Held-out prompts for the greedy comparison."
    )
    p.add_argument("--prompt-len", type=int, default=64, help="Tokens per greedy prompt.")
    p.add_argument("--new-tokens", type=int, default=64, help="Greedy tokens per prompt.")
    p.add_argument(
        "--out", default="benchmarks/results/quality", help="Folder for quality.md/.json."
    )
    args = p.parse_args(argv)
    bc.require_positive(p, args, ("windows", "window_len", "prompts", "prompt_len", "new_tokens"))
    return args


@torch.inference_mode()
def teacher_forced(
    folder: str, dtype: str, tao: str, windows: list[list[int]]
) -> tuple[float, torch.Tensor]:
    """(mean loss over the windows, argmax token at every position [windows * (len - 1)]) of one
    variant."""
    from sparkrelay.kvcache.pool import KVPool
    from sparkrelay.models.attention import AttnMeta
    from sparkrelay.models.decoder import load_causal_lm
    from sparkrelay.models.quant import apply_torchao_config

    torch_dtype = getattr(torch, dtype)
    model = load_causal_lm(folder, dtype=torch_dtype)
    apply_torchao_config(model, tao)
    losses, top = [], []
    for ids in windows:
        n, pages = len(ids), -(-len(ids) // PAGE)
        pool = KVPool(
            range(model.spec.num_layers),
            pages,
            PAGE,
            model.spec.num_kv_heads,
            model.spec.head_dim,
            torch_dtype,
            "cpu",
        )
        window = torch.tensor(ids)
        meta = AttnMeta.build([0], [n], [list(range(pages))], PAGE, "cpu")
        logits = model(meta, pool.layers, input_ids=window).logits.float()[:-1]  # [n - 1, V]
        losses.append(F.cross_entropy(logits, window[1:]).item())
        top.append(logits.argmax(-1))
    return sum(losses) / len(losses), torch.cat(top)


def greedy(
    folder: str, dtype: str, tao: str, prompts: list[list[int]], new_tokens: int
) -> list[list[int]]:
    from sparkrelay import LLM, SamplingParams

    llm = LLM(folder, dtype=dtype, torchao_config=tao)
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0, ignore_eos=True)
    return [list(o["output_ids"]) for o in llm.generate(prompts, params)]


def compare(outs: list[list[int]], ref: list[list[int]]) -> dict:
    """Positions equal to `ref`, the mean equal prefix and whole outputs equal."""
    same = [sum(x == y for x, y in zip(a, b)) for a, b in zip(outs, ref)]
    prefix = [
        next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a)) for a, b in zip(outs, ref)
    ]
    total = sum(len(a) for a in outs)
    return {
        "positions_equal": sum(same) / max(total, 1),
        "mean_equal_prefix": sum(prefix) / max(len(prefix), 1),
        "outputs_equal": sum(a == b for a, b in zip(outs, ref)),
        "outputs": len(outs),
    }


def measure(args: argparse.Namespace, record: dict) -> dict:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.model)
    windows = [p.ids for p in bc.load_prompts(tok, args.windows, args.window_len)]
    prompts = [p.ids for p in bc.load_prompts(tok, args.prompts, args.prompt_len, stride=5)]
    rows, tops, outs = [], {}, {}
    for name, dtype, tao in VARIANTS:
        print(f"{name}: teacher-forced loss, greedy outputs", file=sys.stderr)
        loss, tops[name] = teacher_forced(args.model, dtype, tao, windows)
        outs[name] = greedy(args.model, dtype, tao, prompts, args.new_tokens)
        rows.append({"variant": name, "dtype": dtype, "torchao_config": tao, "loss": loss})
    for row in rows:
        name = row["variant"]
        row["top1_vs_float32"] = (tops[name] == tops["float32"]).float().mean().item()
        row["top1_vs_bfloat16"] = (tops[name] == tops["bfloat16"]).float().mean().item()
        row["greedy_vs_float32"] = compare(outs[name], outs["float32"])
        row["greedy_vs_bfloat16"] = compare(outs[name], outs["bfloat16"])
    return {"settings": vars(args), **record, "rows": rows}


def table(result: dict) -> str:
    heads = [
        "variant",
        "held-out loss",
        "top-1 = fp32",
        "top-1 = bf16",
        "greedy positions = fp32",
        "equal prefix (mean)",
        "outputs = fp32",
        "greedy positions = bf16",
    ]
    body = []
    for r in result["rows"]:
        g32, g16 = r["greedy_vs_float32"], r["greedy_vs_bfloat16"]
        body.append(
            [
                r["variant"],
                f"{r['loss']:.4f}",
                f"{100 * r['top1_vs_float32']:.1f}%",
                f"{100 * r['top1_vs_bfloat16']:.1f}%",
                f"{100 * g32['positions_equal']:.1f}%",
                f"{g32['mean_equal_prefix']:.1f}",
                f"{g32['outputs_equal']}/{g32['outputs']}",
                f"{100 * g16['positions_equal']:.1f}%",
            ]
        )
    return bc.markdown_table(heads, body)


def main(argv: Optional[list[str]] = None) -> dict:
    args = parse_args(argv)
    result = measure(args, bc.provenance("sparkrelay.tools.bench.quality", argv))
    s = result["settings"]
    head = [
        *bc.header_lines(result),
        f"Model `{s['model']}`; loss over {s['windows']} held-out windows of {s['window_len']} tokens "
        f"(teacher-forced); greedy: {s['prompts']} held-out prompts of {s['prompt_len']} tokens, "
        f"{s['new_tokens']} new tokens each, EOS ignored.",
    ]
    notes = [
        "int8wo: `--torchao-config int8wo` on bfloat16 activations (int8 weights, one scale per output channel; "
        "the LM head too; the embedding bfloat16). top-1: teacher-forced argmax agreement over the loss windows. "
        "Greedy: free-running, so one early difference changes the rest of an output."
    ]
    text = table(result)
    md = bc.write_markdown(
        f"{args.out}/{NAME}.md", "Quality of bfloat16 and int8 weight-only", head, text, notes
    )
    js = bc.write_json(f"{args.out}/{NAME}.json", result)
    print("\n".join(head) + "\n\n" + text + f"\n\nwrote {md}, {js}")
    return result


if __name__ == "__main__":
    main()
