"""Soak the PD deployment: router + PP prefill (no drafter) + DSpark decode on 127.0.0.1, under mixed load.

    python -m sparkrelay.tools.soak [--minutes 11] [--max-requests N] [--concurrency 8] [--pp-size 2]
                              [--handoff hidden] [--abort-fraction 0.1] [--stream-fraction 0.5]
                              [--out benchmarks/results/soak.json] [--router sparkrelay|sglang]
                              [--inject-transfer-failures P]

A fixed pool of prompts cut from held-out stdlib text (mostly 8-64 tokens, some 500-1500), each with its own
max_new_tokens (8-64), greedy, ignore_eos. Their aggregated DSpark outputs are computed first, in process, one
prompt at a time: those are the references. Then `--concurrency` workers loop until time or count runs out,
each sending a random prompt as /generate or /v1/completions, streamed or not, and aborting some of them (closing
the connection after the first chunk or after a short random delay). Every completed answer must equal its
reference exactly (streamed chunks must be prefixes of it); anything else is `corrupted`. A non-2xx or a broken
body is an error, counted by type; a request that got no answer at all is `lost`; an abort is neither.
/v1/completions gets token ids as its prompt, or the prompt's text where the router takes only text there
(sglang-router); /generate always gets token ids.

Process memory (VmRSS, each server and its pipeline stage children) is sampled every `--sample-every` seconds;
growth is the last window's mean against the first window's (window: a minute, or a third of a short run).
After the load, the servers must drain to kv_used_tokens == 0. Exit status 0 (`Verdict: PASS`) only if no
request, in the warm-up or the load, ended in an error, was lost or corrupted, every process grew less than
`--max-growth-pct`, both servers drained (and their idle block-manager check passed), and every server is still
alive. `--inject-transfer-failures P` makes the prefill fail rooms (router retries off) to see the run fail.
Writes the JSON (`--out`) and a markdown table next to it (.md).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import httpx

from sparkrelay.tools.cluster import PDCluster, PDSettings, start_pd
from sparkrelay.tools.corpus import read_texts, stdlib_files
from sparkrelay.tools.soak.report import (  # noqa: F401  (percentile: re-exported for the tests)
    Result, error_type, http_error_message, latencies, markdown, memory_growth, percentile, tally, verdict)

MODEL, DRAFTER = "models/tiny-qwen3", "models/tiny-qwen3-dspark"
NO_RETRIES = {"sparkrelay": ["--max-retries", "0"], "sglang": ["--disable-retries"]}


@dataclass
class Prompt:
    index: int
    ids: list[int]
    max_new: int
    long: bool
    text: str = ""  # encodes to exactly `ids`: the same prompt, for routes that take only text
    ref_ids: Optional[list[int]] = None
    ref_text: Optional[str] = None


# -- processes -----------------------------------------------------------------------------------------------------

def _children(pid: int) -> list[int]:
    kids = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                kids += [int(x) for x in f.read().split()]
    except OSError:
        pass
    return kids


def _proc_status(pid: int) -> Optional[dict]:
    try:
        with open(f"/proc/{pid}/status") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None
    if "VmRSS" not in fields:  # a zombie: it exited and its parent has not reaped it yet
        return None
    return {"rss_kib": int(fields["VmRSS"].split()[0]), "threads": int(fields["Threads"]), "fds": fds}


def _label(server: str, pid: int, root: int) -> str:
    if pid == root:
        return server
    try:
        argv = open(f"/proc/{pid}/cmdline").read().split("\0")
    except OSError:
        argv = []
    return f"{server}/stage{argv[argv.index('--rank') + 1]}" if "--rank" in argv[:-1] else f"{server}/child{pid}"


def snapshot(cluster: PDCluster) -> dict[str, dict]:
    """{label: {rss_kib, threads, fds}} for every server process and all its descendants."""
    out = {}
    for s in cluster.servers():
        todo = [s.proc.pid]
        while todo:
            pid = todo.pop()
            st = _proc_status(pid)
            if st is not None:
                out[_label(s.name, pid, s.proc.pid)] = st
            todo += _children(pid)
    return out


# -- workload and references ---------------------------------------------------------------------------------------

def build_pool(n: int, long_fraction: float, seed: int) -> list[Prompt]:
    from transformers import AutoTokenizer

    rng = random.Random(seed)
    text = "\n".join(read_texts(stdlib_files()[1]))[:400_000]
    tok = AutoTokenizer.from_pretrained(MODEL)
    tok.model_max_length = 10**9  # one long text, cut into prompts below (silences the length warning)
    ids = tok.encode(text)
    n_long = round(n * long_fraction)
    pool, offset = [], 0
    for i in range(n):
        long = i % max(1, n // max(1, n_long)) == 0 and sum(p.long for p in pool) < n_long
        length = rng.randint(500, 1500) if long else rng.randint(8, 64)
        assert offset + length <= len(ids), "not enough held-out text for the prompt pool"
        text = tok.decode(ids[offset : offset + length])
        # A cut may split a merge: the prompt is what the text encodes to, so text and ids prompts are the same.
        pool.append(Prompt(i, tok.encode(text), rng.randint(8, 64), long, text))
        offset += length
    return pool


def compute_references(pool: list[Prompt]) -> None:
    """Aggregated DSpark, greedy, one prompt at a time (what every PD answer must equal)."""
    from sparkrelay.scheduler.request import SamplingParams
    from sparkrelay.llm import LLM

    llm = LLM(MODEL, speculative_algorithm="DSPARK", speculative_draft_model_path=DRAFTER)
    try:
        for p in pool:
            out = llm.generate(p.ids, SamplingParams(max_new_tokens=p.max_new, temperature=0.0, ignore_eos=True))
            p.ref_ids, p.ref_text = list(out["output_ids"]), out["text"]
    finally:
        llm.engine.close()


# -- one request ---------------------------------------------------------------------------------------------------

# Routes a router cannot take token-id prompts on (sglang-router 0.3.2 answers 422 to `prompt: [ids]` on
# /v1/completions): the soak sends the prompt's text there instead.
TEXT_ONLY = {("sglang", "openai")}


def prompt_form(router: str, api: str) -> str:
    """'ids' where (router, api) takes token ids, else 'text'."""
    return "text" if (router, api) in TEXT_ONLY else "ids"


def _body(p: Prompt, api: str, stream: bool, form: str = "ids") -> tuple[str, dict]:
    if api == "generate":
        sp = {"max_new_tokens": p.max_new, "temperature": 0.0, "ignore_eos": True}
        return "/generate", {"input_ids": p.ids, "sampling_params": sp, "stream": stream}
    return "/v1/completions", {"model": MODEL, "prompt": p.text if form == "text" else p.ids,
                               "max_tokens": p.max_new, "temperature": 0.0, "ignore_eos": True, "stream": stream}


def _check(p: Prompt, api: str, got) -> Optional[str]:
    """None if `got` (output ids or text) equals the reference, else what differs."""
    want = p.ref_ids if api == "generate" else p.ref_text
    return None if got == want else f"prompt {p.index}: got {str(got)[:120]} want {str(want)[:120]}"


class _Corrupt(Exception):
    pass


class _BadBody(Exception):
    pass


async def _read_stream(resp: httpx.Response, p: Prompt, api: str, r: Result, t0: float, abort_first: bool):
    """The reassembled answer (ids or text), or None when aborted after the first chunk."""
    last, text, done = None, "", False
    async for line in resp.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            done = True
            break
        obj = json.loads(data)
        if "error" in obj:
            raise _BadBody(f"stream error: {http_error_message(data.encode())}")
        r.ttft = time.perf_counter() - t0 if r.ttft is None else r.ttft
        if abort_first:
            return None
        if api == "generate":
            last = obj["output_ids"]
            if last != p.ref_ids[: len(last)]:
                raise _Corrupt(f"chunk is not a prefix: {_check(p, api, last)}")
        else:
            text += "".join(c.get("text", "") for c in obj.get("choices", []))
    if not done:
        raise _BadBody("stream ended without data: [DONE]")
    return last if api == "generate" else text


async def send(client: httpx.AsyncClient, url: str, p: Prompt, api: str, stream: bool, abort: Optional[str],
               abort_after: float, timeout: float, t_origin: float, form: str = "ids") -> Result:
    """abort: None, 'first-chunk' (streams only) or 'deadline' (give up after `abort_after` s); form: the prompt
    as 'ids' or 'text' (/v1/completions only)."""
    kind = f"{api}{'-text' if api == 'openai' and form == 'text' else ''}/{'stream' if stream else 'plain'}"
    r = Result(kind, p.index, p.long, time.perf_counter() - t_origin)
    path, body = _body(p, api, stream, form)
    t0, answered = time.perf_counter(), False
    try:
        async with asyncio.timeout(abort_after if abort == "deadline" else timeout):
            async with client.stream("POST", url + path, json=body) as resp:
                answered = True
                if resp.status_code != 200:
                    r.outcome, r.error_type = "error", error_type(resp.status_code,
                                                                   http_error_message(await resp.aread()))
                    return r
                if stream:
                    got = await _read_stream(resp, p, api, r, t0, abort == "first-chunk")
                    if got is None:
                        r.outcome = "aborted"
                        return r
                else:
                    obj = json.loads(await resp.aread())
                    got = obj["output_ids"] if api == "generate" else obj["choices"][0]["text"]
        r.e2e = time.perf_counter() - t0
        r.detail = _check(p, api, got) or ""
        r.outcome = "corrupted" if r.detail else "ok"
    except _Corrupt as e:
        r.outcome, r.detail = "corrupted", str(e)
    except TimeoutError:
        if abort == "deadline":
            r.outcome = "aborted"
        else:
            r.outcome = "error" if answered else "lost"
            r.error_type = f"no complete answer within {timeout:g} s"
    except (_BadBody, ValueError, KeyError, IndexError, TypeError) as e:
        r.outcome, r.error_type = "error", error_type(200, f"bad body: {type(e).__name__}: {e}")
    except httpx.HTTPError as e:
        r.outcome, r.error_type = ("error" if answered else "lost"), type(e).__name__
        r.detail = str(e)[:200]
    return r


# -- the load ------------------------------------------------------------------------------------------------------

def draw(rng: random.Random, pool: list[Prompt], args) -> dict:
    stream = rng.random() < args.stream_fraction
    abort = None
    if rng.random() < args.abort_fraction:
        abort = "first-chunk" if stream and rng.random() < 0.5 else "deadline"
    return {"p": rng.choice(pool), "api": "openai" if rng.random() < args.openai_fraction else "generate",
            "stream": stream, "abort": abort, "abort_after": rng.uniform(0.02, 1.5)}


async def run_load(url: str, pool: list[Prompt], args, seconds: float, max_requests: int,
                   sampler=None) -> tuple[list[Result], float]:
    """`concurrency` workers until `seconds` pass or `max_requests` are sent; waits for the requests in flight."""
    results: list[Result] = []
    sent = 0
    limits = httpx.Limits(max_connections=args.concurrency * 2, max_keepalive_connections=args.concurrency)
    t_origin = time.perf_counter()
    deadline = t_origin + seconds

    async def worker(wid: int) -> None:
        nonlocal sent
        rng = random.Random(args.seed * 1000 + wid + (0 if sampler else 500))
        while time.perf_counter() < deadline and sent < max_requests:
            sent += 1
            d = draw(rng, pool, args)
            results.append(await send(client, url, d["p"], d["api"], d["stream"], d["abort"], d["abort_after"],
                                      args.request_timeout, t_origin, prompt_form(args.router, d["api"])))

    async with httpx.AsyncClient(timeout=None, limits=limits, trust_env=False) as client:
        tasks = [asyncio.create_task(worker(i)) for i in range(args.concurrency)]
        side = asyncio.create_task(sampler(t_origin, tasks, results)) if sampler else None
        await asyncio.gather(*tasks)
        if side:
            await side
    return results, time.perf_counter() - t_origin


async def sample_memory(cluster: PDCluster, every: float, samples: list, t_origin: float, tasks: list,
                        results: list) -> None:
    """Appends (t, {process: RSS KiB}) every `every` s while the workers run; prints progress every 30 s."""
    next_print = 30.0
    await asyncio.sleep(min(1.0, every))
    while not all(t.done() for t in tasks):
        t = time.perf_counter() - t_origin
        samples.append((t, {k: v["rss_kib"] for k, v in snapshot(cluster).items()}))
        if t >= next_print:
            counts = {k: sum(r.outcome == k for r in results) for k in ("ok", "aborted", "error", "corrupted", "lost")}
            print(f"[soak] {t:5.0f} s {counts} RSS MiB: "
                  + ", ".join(f"{k} {v / 1024:.0f}" for k, v in samples[-1][1].items()), flush=True)
            next_print += 30.0
        await asyncio.sleep(every)


def server_state(url: str) -> dict:
    try:
        with httpx.Client(timeout=10, trust_env=False) as c:
            return c.get(url + "/server_info").json()["internal_states"][0]
    except (httpx.HTTPError, ValueError, KeyError, IndexError) as e:
        return {"error": f"{type(e).__name__}: {e}"}


def drain(cluster: PDCluster, timeout: float = 60.0) -> dict[str, dict]:
    """Poll prefill and decode until idle with no KV in use (or `timeout`); their final internal states."""
    busy = ("num_running", "num_waiting", "kv_used_tokens", "num_transfers_inflight", "num_prealloc")
    end = time.monotonic() + timeout
    while True:
        states = {s.name: server_state(s.url) for s in (cluster.prefill, cluster.decode)}
        if all(not any(st.get(k, 0) for k in busy) and "error" not in st for st in states.values()) \
                or time.monotonic() > end:
            return states
        time.sleep(0.5)


# -- report --------------------------------------------------------------------------------------------------------

def log_findings(cluster: PDCluster, keep: int = 8) -> dict[str, dict]:
    pat = re.compile(r"ERROR|CRITICAL|Traceback|WARNING|Exception|exception")
    out = {}
    for s in cluster.servers():
        try:
            lines = [ln.rstrip() for ln in open(s.log_path, errors="replace") if pat.search(ln)]
        except OSError:
            lines = []
        out[s.name] = {"matching_lines": len(lines), "examples": list(dict.fromkeys(lines))[:keep]}
    return out


# -- main ----------------------------------------------------------------------------------------------------------

def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m sparkrelay.tools.soak", description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=11.0, help="Load duration (the count may end it sooner).")
    p.add_argument("--max-requests", type=int, default=100_000, help="Most requests sent during the load.")
    p.add_argument("--concurrency", type=int, default=8, help="Workers, each with one request in flight.")
    p.add_argument("--pp-size", type=int, default=2)
    p.add_argument("--handoff", default="hidden", choices=("hidden", "draft-kv", "tail"))
    p.add_argument("--router", default="sparkrelay", choices=("sparkrelay", "sglang"))
    p.add_argument("--abort-fraction", type=float, default=0.1)
    p.add_argument("--stream-fraction", type=float, default=0.5)
    p.add_argument("--openai-fraction", type=float, default=0.2, help="Share sent to /v1/completions.")
    p.add_argument("--pool-size", type=int, default=32)
    p.add_argument("--long-fraction", type=float, default=0.2, help="Share of pool prompts of 500-1500 tokens.")
    p.add_argument("--warmup-requests", type=int, default=None, help="Before the load (default: the pool size).")
    p.add_argument("--request-timeout", type=float, default=300.0)
    p.add_argument("--sample-every", type=float, default=30.0, help="Memory sampling period, seconds.")
    p.add_argument("--max-growth-pct", type=float, default=10.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--keep-logs", action="store_true", help="Keep the server logs even when the run passes.")
    p.add_argument("--inject-transfer-failures", type=float, default=0.0, metavar="P",
                   help="Check the checker: the prefill fails this share of rooms just before sending "
                        "(SPARKRELAY_TEST_DISAGG_FAILURE_PROB) and the router's retries are off, so clients get "
                        "errors and the run must end in FAIL.")
    p.add_argument("--out", default="benchmarks/results/soak.json")
    args = p.parse_args(argv)
    for name in ("abort_fraction", "stream_fraction", "openai_fraction", "long_fraction", "inject_transfer_failures"):
        if not 0 <= getattr(args, name) <= 1:
            p.error(f"--{name.replace('_', '-')} must be in [0, 1]")
    if args.minutes <= 0 or args.max_requests <= 0 or args.concurrency <= 0 or args.pool_size <= 0:
        p.error("--minutes, --max-requests, --concurrency and --pool-size must be positive")
    return args


async def warm_up(url: str, pool: list[Prompt], args) -> list[Result]:
    """Every pool prompt once (non-streamed /generate, no aborts), after the router answers."""
    async with httpx.AsyncClient(timeout=None, trust_env=False) as c:  # send() bounds the time
        for _ in range(120):  # the router may still be registering its workers
            r = await send(c, url, pool[0], "generate", False, None, 0, args.request_timeout, time.perf_counter())
            if not r.error_type.startswith("HTTP 503"):
                break
            await asyncio.sleep(0.5)
    n = len(pool) if args.warmup_requests is None else args.warmup_requests
    plain = argparse.Namespace(**{**vars(args), "abort_fraction": 0.0, "stream_fraction": 0.0, "openai_fraction": 0.0})
    results, _ = await run_load(url, pool, plain, 1e9, n) if n else ([], 0.0)
    return [r] + results


def soak(args, pool: list[Prompt], cluster: PDCluster) -> dict:
    url = cluster.url
    assert url.startswith("http://127.0.0.1:"), url  # loopback only
    warm = asyncio.run(warm_up(url, pool, args))
    print(f"[soak] warm-up: {tally(warm)}", flush=True)
    start_mem = snapshot(cluster)
    seconds = args.minutes * 60
    every = min(args.sample_every, max(0.5, seconds / 12))
    samples: list = []
    sampler = lambda t0, tasks, res: sample_memory(cluster, every, samples, t0, tasks, res)  # noqa: E731
    print(f"[soak] load: {args.concurrency} workers for {seconds:.0f} s or {args.max_requests} requests", flush=True)
    results, duration = asyncio.run(run_load(url, pool, args, seconds, args.max_requests, sampler))
    drained = drain(cluster)
    end_mem = snapshot(cluster)
    window = min(60.0, duration / 3)
    return {"duration_s": duration, "warmup": tally(warm), "load": tally(results),
            "throughput_rps": sum(r.outcome == "ok" for r in results) / duration,
            "output_tokens_per_s": sum(len(pool[r.prompt].ref_ids) for r in results if r.outcome == "ok") / duration,
            "latency": latencies(results), "drained": drained,
            "memory": {"sample_every_s": every, "window_s": window, "start": start_mem, "end": end_mem,
                       "growth": memory_growth(samples, window), "samples": samples},
            "alive": {s.name: s.proc.poll() is None for s in cluster.servers()},
            "records": [asdict(r) for r in results]}


def print_log_tails(cluster: PDCluster) -> None:
    for s in cluster.servers():
        print(f"---- {s.name} log tail ({s.log_path}, kept) ----\n{s.log_tail(30)}", flush=True)


def cluster_settings(args) -> PDSettings:
    s = PDSettings(model=MODEL, drafter=DRAFTER, pp_size=args.pp_size, handoff=args.handoff, router=args.router)
    if args.inject_transfer_failures:
        s.prefill_env["SPARKRELAY_TEST_DISAGG_FAILURE_PROB"] = str(args.inject_transfer_failures)
        s.router_args += NO_RETRIES[args.router]
    return s


def start_with_references(args, pool: list[Prompt], log_dir: str) -> PDCluster:
    """Starts the deployment while this process computes the references (each takes tens of seconds)."""
    t = time.perf_counter()
    print(f"[soak] starting the {args.router} router + PP={args.pp_size} prefill + DSpark decode, and computing "
          f"the references of {len(pool)} prompts ({sum(p.long for p in pool)} long) meanwhile ...", flush=True)
    with ThreadPoolExecutor(1) as pool_thread:
        refs = pool_thread.submit(compute_references, pool)
        cluster = start_pd(cluster_settings(args), log_dir)
        try:
            refs.result()
        except BaseException:
            cluster.stop()
            raise
    print(f"[soak] deployment up and references ready in {time.perf_counter() - t:.0f} s", flush=True)
    return cluster


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    pool = build_pool(args.pool_size, args.long_fraction, args.seed)
    log_dir = tempfile.mkdtemp(prefix="sparkrelay-soak-")
    cluster = start_with_references(args, pool, log_dir)
    try:
        report = soak(args, pool, cluster)
    except BaseException:
        cluster.stop()
        print_log_tails(cluster)
        raise
    cluster.stop()
    report |= {"args": vars(args), "argv": sys.argv[1:] if argv is None else list(argv), "logs": log_findings(cluster),
               "pool": [{"prompt_tokens": len(p.ids), "max_new_tokens": p.max_new} for p in pool]}
    report["failures"] = verdict(report, args.max_growth_pct)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    out.with_suffix(".md").write_text(markdown(report))
    print(markdown(report) + f"wrote {out} and {out.with_suffix('.md')}")
    for name, found in report["logs"].items():
        if found["matching_lines"]:
            print(f"[soak] {name} log: {found['matching_lines']} warning/error lines, e.g.:\n  " +
                  "\n  ".join(found["examples"]))
    if report["failures"] or args.keep_logs:
        print_log_tails(cluster)
    else:
        shutil.rmtree(log_dir, ignore_errors=True)
    return 1 if report["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
