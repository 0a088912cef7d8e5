"""Online serving benchmark against a running server, like `python -m sglang.bench_serving`.

Every request is streamed (SSE) with asyncio + aiohttp (as SGLang's bench_serving; httpx cost the
client 2-3x the CPU per streamed token, taken from the cores the server under test runs on), so each
one yields its time to first token (TTFT), its inter-token latencies (ITL) and its end-to-end
latency. Requests arrive as a Poisson process of `--request-rate` per second (inf: all at once), at
most `--max-concurrency` in flight.

Backends: `sglang` (POST /generate, `sampling_params`), `openai` (/v1/completions), `openai-chat`
(/v1/chat/completions); any server speaking one of them, sparkrelay or not.
Workloads: `--dataset-path FILE.jsonl` (`turns[0]` of each line), `--dataset random` (random token
ids of exactly `--random-input-len`, sent as ids where the API takes ids; random words when no
tokenizer is at hand), `--dataset code` (common.load_prompts' held-out stdlib code windows, the
workload of bench.offline), `--dataset multiturn` (sglang backend: conversations sharing a
`--shared-prefix-len` system part, each turn extending the previous turn's prompt and answer;
conversations run side by side, the turns of one in order).

Figures (SGLang's definitions):
  token counts  the server's: `meta_info.prompt_tokens/completion_tokens`, or OpenAI `usage` (include_usage)
  TTFT          first chunk with new tokens (sglang) or non-empty text (OpenAI) minus the send time
  ITL           gap between consecutive such chunks / the tokens in the later chunk. sglang: exact (cumulative
                completion_tokens); OpenAI chunks carry text only, so each gets completion_tokens / chunks
  TPOT          (E2E - TTFT) / (output tokens - 1), per request
  accept length committed tokens per speculative verify round when the server reports them: sglang: each
                request's `meta_info.spec_accept_length` weighted by its `spec_verify_ct`; OpenAI: the change of
                `GET /server_info` internal_states[0] (spec_rounds, avg_spec_accept_length) over the run.
`--output-file X.json` writes all figures and per-request records, plus X.md (table) and X.png (latency bars).

Usage: python -m sparkrelay.tools.bench.serving --backend sglang --port 30000 --dataset random
--num-prompts 64

This module runs the benchmark and asks the server for its facts; serving_workload.py builds the
prompts, serving_requests.py sends one streamed request and times it, serving_report.py holds the
records and the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import sys
import time
import urllib.parse
from dataclasses import asdict
from pathlib import Path
from typing import Any, Optional

import aiohttp
import httpx
from tqdm.auto import tqdm

from sparkrelay.tools.bench import common as bc
from sparkrelay.tools.bench.serving_report import (
    Record,
    accept_length,
    report_lines,
    summarize,
    verdict_line,
    write_outputs,
)
from sparkrelay.tools.bench.serving_requests import send
from sparkrelay.tools.bench.serving_workload import BenchError, Item, build_workload, load_tokenizer

NAME = "bench_serving"
BACKENDS = {
    "sglang": "/generate",
    "openai": "/v1/completions",
    "openai-chat": "/v1/chat/completions",
}


# -- the run ---------------------------------------------------------------------------------------


async def run_requests(
    items: list[Item], url: str, args: argparse.Namespace, headers: dict
) -> tuple[list, float]:
    """All records (workload order) and the duration from the first send to the last answer."""
    sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    rng = random.Random(args.seed + 1)
    connector = aiohttp.TCPConnector(limit=args.max_concurrency or 0)  # 0: no limit
    timeout = aiohttp.ClientTimeout(total=args.request_timeout)
    # an SSE line over twice read_bufsize (64 KiB by default) fails; sglang chunks carry every
    # output id so far
    async with aiohttp.ClientSession(
        headers=headers, timeout=timeout, connector=connector, read_bufsize=1 << 22
    ) as client:
        if args.warmup_requests:
            # multiturn: the last user message alone, a prompt no conversation starts with (nothing
            # to reuse)
            first = items[-1] if items[0].conversation >= 0 else items[0]
            warm = Item(-1, first.text, first.ids, min(first.output_len, 16))
            recs = await asyncio.gather(
                *(send(client, url, warm, args, 0.0) for _ in range(args.warmup_requests))
            )
            if not recs[0].success:
                raise BenchError(f"warmup request to {url} failed: {recs[0].error}")
        bar = tqdm(
            total=len(items), desc=NAME, unit="req", file=sys.stderr, disable=args.disable_tqdm
        )

        async def one(item: Item) -> Record:
            if sem is None:
                rec = await send(client, url, item, args, t0)
            else:
                async with sem:
                    rec = await send(client, url, item, args, t0)
            bar.update(1)
            return rec

        t0 = time.perf_counter()
        if items[0].conversation >= 0:
            records = await asyncio.gather(
                *(conversation(turns, one) for turns in by_conversation(items))
            )
            bar.close()
            return sorted(
                (r for recs in records for r in recs), key=lambda r: r.index
            ), time.perf_counter() - t0
        tasks = []
        for item in items:
            tasks.append(asyncio.create_task(one(item)))
            if math.isfinite(args.request_rate) and item is not items[-1]:
                await asyncio.sleep(rng.expovariate(args.request_rate))  # Poisson arrivals
        records = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
        bar.close()
    return list(records), duration


def by_conversation(items: list[Item]) -> list[list[Item]]:
    out: dict[int, list[Item]] = {}
    for item in items:
        out.setdefault(item.conversation, []).append(item)
    return [sorted(turns, key=lambda it: it.turn) for turns in out.values()]


async def conversation(turns: list[Item], one) -> list:
    """The turns of one conversation in order: turn t + 1's prompt is turn t's prompt, its answer
    (the server's output ids) and turn t + 1's user message. A failed turn fails the turns after
    it."""
    records, history = [], []
    for item in turns:
        if records and not records[-1].success:
            records.append(
                Record(
                    item.index,
                    error_type="previous turn failed",
                    error="previous turn failed",
                    conversation=item.conversation,
                    turn=item.turn,
                )
            )
            continue
        prompt = history + item.ids
        rec = await one(
            Item(item.index, None, prompt, item.output_len, item.conversation, item.turn)
        )
        history = prompt + rec.output_ids
        records.append(rec)
    return records


# -- the server ------------------------------------------------------------------------------------


def base_url(args: argparse.Namespace) -> str:
    url = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    url = url[:-3] if url.endswith("/v1") else url
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise BenchError(f"bad server URL {url!r}: expected http(s)://HOST[:PORT]")
    return url


def get_json(client: httpx.Client, url: str) -> tuple[int, Any]:
    """(status, JSON or None) of a GET; a server that cannot be reached is a BenchError."""
    try:
        resp = client.get(url)
    except httpx.HTTPError as e:
        raise BenchError(f"cannot reach the server at {url}: {type(e).__name__}: {e}")
    try:
        return resp.status_code, resp.json()
    except ValueError:
        return resp.status_code, None


def server_facts(client: httpx.Client, url: str, args: argparse.Namespace) -> dict:
    """Model name (--model or GET /v1/models), model info and speculative counters; checks the
    server answers."""
    status, models = get_json(client, url + "/v1/models")
    if status in (401, 403):
        raise BenchError(f"the server refused GET /v1/models with HTTP {status}: check --api-key")
    if args.model is None:
        try:
            args.model = models["data"][0]["id"]
        except (TypeError, KeyError, IndexError):
            if args.backend != "sglang":
                raise BenchError(
                    f"GET {url}/v1/models gave HTTP {status} and no model id: pass --model"
                )
    status, info = get_json(client, url + "/model_info")
    return {
        "model_info": info if status == 200 and isinstance(info, dict) else {},
        "spec": spec_counters(client, url),
    }


def spec_counters(client: httpx.Client, url: str) -> Optional[dict]:
    """Server-wide (spec_rounds, avg_spec_accept_length) from GET /server_info, None if not
    reported."""
    try:
        status, info = get_json(client, url + "/server_info")
        state = info["internal_states"][0] if status == 200 else {}
    except (BenchError, TypeError, KeyError, IndexError):
        return None
    tau = state.get("avg_spec_accept_length", state.get("spec_accept_length"))
    return (
        None if tau is None else {"rounds": state.get("spec_rounds"), "accept_length": float(tau)}
    )


# -- command line ----------------------------------------------------------------------------------


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m sparkrelay.tools.bench.serving",
        description="Online serving benchmark (TTFT, ITL, TPOT, throughput, acceptance "
        "length) against an SGLang-native or OpenAI-compatible server.",
    )
    _server_args(p)
    _workload_args(p)
    _pacing_args(p)
    args = p.parse_args(argv)
    bc.require_positive(
        p,
        args,
        (
            "num_prompts",
            "random_input_len",
            "random_output_len",
            "max_new_tokens",
            "max_concurrency",
            "multiturn_turns",
            "shared_prefix_len",
        ),
    )
    if args.dataset == "multiturn" and (args.backend != "sglang" or args.dataset_path):
        p.error(
            "--dataset multiturn needs --backend sglang (each turn extends the previous one's token ids) and "
            "no --dataset-path"
        )
    if (
        not args.request_rate > 0
        or not args.request_timeout > 0
        or args.temperature < 0
        or args.warmup_requests < 0
    ):
        p.error(
            "--request-rate and --request-timeout must be > 0, --temperature and --warmup-requests >= 0"
        )
    return args


def _server_args(p: argparse.ArgumentParser) -> None:
    """Where the server is and how to talk to it."""
    p.add_argument("--backend", default="sglang", choices=sorted(BACKENDS))
    p.add_argument(
        "--base-url",
        default=None,
        help="Server URL, e.g. http://127.0.0.1:30000 (default: host/port).",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument(
        "--model", default=None, help="Model name sent to OpenAI routes (default: GET /v1/models)."
    )
    p.add_argument("--api-key", default=None, help="Sent as `Authorization: Bearer KEY`.")


def _workload_args(p: argparse.ArgumentParser) -> None:
    """The prompts and their lengths."""
    p.add_argument(
        "--tokenizer",
        default=None,
        help="Client tokenizer for random ids, --dataset code and --apply-chat-template "
        "(default: the server's tokenizer folder when it is local).",
    )
    p.add_argument(
        "--dataset",
        default="random",
        choices=("random", "code", "multiturn"),
        help="Workload when no --dataset-path: random tokens, held-out stdlib code windows, or multi-turn "
        "conversations over a shared system part (sglang backend).",
    )
    p.add_argument(
        "--multiturn-turns",
        type=int,
        default=3,
        help="Turns per conversation (--dataset multiturn).",
    )
    p.add_argument(
        "--shared-prefix-len",
        type=int,
        default=1024,
        help="Tokens of the system part every conversation starts with (--dataset multiturn).",
    )
    p.add_argument(
        "--dataset-path", default=None, help='JSONL of {"turns": [...]}; turns[0] is the prompt.'
    )
    p.add_argument(
        "--apply-chat-template",
        action="store_true",
        help="Format dataset prompts with the tokenizer's chat template (sglang/openai backends).",
    )
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument(
        "--random-input-len", type=int, default=256, help="Prompt tokens of random/code prompts."
    )
    p.add_argument(
        "--random-output-len", type=int, default=128, help="Output tokens unless --max-new-tokens."
    )
    p.add_argument(
        "--max-new-tokens", type=int, default=None, help="Output tokens of every request."
    )
    p.add_argument(
        "--no-ignore-eos",
        action="store_true",
        help="Let requests stop at EOS (default: ignore_eos).",
    )


def _pacing_args(p: argparse.ArgumentParser) -> None:
    """Sampling, request rate and concurrency, timeouts, and where the figures go."""
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="Requests/s, Poisson (inf: at once).",
    )
    p.add_argument(
        "--max-concurrency",
        type=int,
        default=None,
        help="Most requests in flight (default: no cap).",
    )
    p.add_argument(
        "--request-timeout", type=float, default=600.0, help="Seconds one request may take in all."
    )
    p.add_argument(
        "--warmup-requests", type=int, default=1, help="Untimed requests first (0: none)."
    )
    p.add_argument("--seed", type=int, default=1)
    p.add_argument(
        "--output-file",
        default=None,
        help="Write figures and per-request records (JSON), .md, .png.",
    )
    p.add_argument("--disable-tqdm", action="store_true")


def clean(obj: Any) -> Any:
    """JSON-safe: nan -> null, inf -> "inf"."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None if math.isnan(obj) else str(obj)
    if isinstance(obj, dict):
        return {k: clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [clean(v) for v in obj]
    return obj


def benchmark(args: argparse.Namespace, record: dict) -> dict:
    """The summary and per-request records of one run, with `record` (common.provenance) beside
    them."""
    url = base_url(args)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    rng = random.Random(args.seed)
    with httpx.Client(headers=headers, timeout=min(args.request_timeout, 30.0)) as client:
        facts = server_facts(client, url, args)
        needs = (
            bool(args.apply_chat_template)
            if args.dataset_path
            else args.dataset in ("code", "multiturn")
        )
        tokenizer = (
            None
            if args.dataset_path and not needs
            else load_tokenizer(args, facts["model_info"], needs)
        )
        items = build_workload(args, tokenizer, rng)
        before = spec_counters(client, url) if args.backend != "sglang" else None
        records, duration = asyncio.run(
            run_requests(items, url + BACKENDS[args.backend], args, headers)
        )
        after = spec_counters(client, url) if args.backend != "sglang" else None
    summary = summarize(records, duration, accept_length(records, before, after))
    settings = {k: v for k, v in vars(args).items() if k != "api_key"}
    return {
        "summary": summary,
        "settings": settings,
        "url": url,
        "model": args.model,
        **record,
        "records": [asdict(r) for r in records],
    }


def main(argv: Optional[list[str]] = None) -> dict:
    """Runs the benchmark and prints the report and its verdict; exits 1 on a fatal error or when
    any request failed (the figures are then printed and written all the same)."""
    args = parse_args(argv)
    try:
        result = benchmark(args, bc.provenance("sparkrelay.tools.bench.serving", argv))
    except BenchError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(1)
    result = clean(result)
    lines = report_lines(result["summary"], args)
    print("\n".join(lines))
    if args.output_file:
        header = [
            *bc.header_lines(result),
            f"Server {result['url']}, model {result['model']} (the host above is the client's).",
        ]
        paths = write_outputs(Path(args.output_file), result, header)
        print("wrote " + ", ".join(map(str, paths)))
    print(verdict_line(result["summary"]), flush=True)
    if result["summary"]["failed"] or not result["summary"]["completed"]:
        print("error: not every request completed (see the errors above)", file=sys.stderr)
        raise SystemExit(1)
    return result


if __name__ == "__main__":
    main()
