"""The soak's load: one request checked against its reference (`send`), and the workers that send
them (`run_load`, `warm_up`) while `sample_memory` records each process's memory."""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from typing import Optional

import httpx

from sparkrelay.tools.cluster import PDCluster
from sparkrelay.tools.soak.probe import snapshot
from sparkrelay.tools.soak.report import Result, error_type, http_error_message
from sparkrelay.tools.soak.workload import MODEL, Prompt

# Routes a router cannot take token-id prompts on (sglang-router 0.3.2 answers 422 to `prompt:
# [ids]` on /v1/completions): the soak sends the prompt's text there instead.
TEXT_ONLY = {("sglang", "openai")}


def prompt_form(router: str, api: str) -> str:
    """'ids' where (router, api) takes token ids, else 'text'."""
    return "text" if (router, api) in TEXT_ONLY else "ids"


# -- one request -----------------------------------------------------------------------------------


def _body(p: Prompt, api: str, stream: bool, form: str = "ids") -> tuple[str, dict]:
    if api == "generate":
        sp = {"max_new_tokens": p.max_new, "temperature": 0.0, "ignore_eos": True}
        return "/generate", {"input_ids": p.ids, "sampling_params": sp, "stream": stream}
    return "/v1/completions", {
        "model": MODEL,
        "prompt": p.text if form == "text" else p.ids,
        "max_tokens": p.max_new,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": stream,
    }


def _check(p: Prompt, api: str, got) -> Optional[str]:
    """None if `got` (output ids or text) equals the reference, else what differs."""
    want = p.ref_ids if api == "generate" else p.ref_text
    return None if got == want else f"prompt {p.index}: got {str(got)[:120]} want {str(want)[:120]}"


class _Corrupt(Exception):
    pass


class _BadBody(Exception):
    pass


async def _read_stream(
    resp: httpx.Response, p: Prompt, api: str, r: Result, t0: float, abort_first: bool
):
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


async def send(
    client: httpx.AsyncClient,
    url: str,
    p: Prompt,
    api: str,
    stream: bool,
    abort: Optional[str],
    abort_after: float,
    timeout: float,
    t_origin: float,
    form: str = "ids",
) -> Result:
    """abort: None, 'first-chunk' (streams only) or 'deadline' (give up after `abort_after` s);
    form: the prompt as 'ids' or 'text' (/v1/completions only)."""
    kind = f"{api}{'-text' if api == 'openai' and form == 'text' else ''}/{'stream' if stream else 'plain'}"
    r = Result(kind, p.index, p.long, time.perf_counter() - t_origin)
    path, body = _body(p, api, stream, form)
    t0, answered = time.perf_counter(), False
    try:
        async with asyncio.timeout(abort_after if abort == "deadline" else timeout):
            async with client.stream("POST", url + path, json=body) as resp:
                answered = True
                if resp.status_code != 200:
                    r.outcome, r.error_type = (
                        "error",
                        error_type(resp.status_code, http_error_message(await resp.aread())),
                    )
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


# -- the load --------------------------------------------------------------------------------------


def draw(rng: random.Random, pool: list[Prompt], args) -> dict:
    stream = rng.random() < args.stream_fraction
    abort = None
    if rng.random() < args.abort_fraction:
        abort = "first-chunk" if stream and rng.random() < 0.5 else "deadline"
    return {
        "p": rng.choice(pool),
        "api": "openai" if rng.random() < args.openai_fraction else "generate",
        "stream": stream,
        "abort": abort,
        "abort_after": rng.uniform(0.02, 1.5),
    }


async def run_load(
    url: str, pool: list[Prompt], args, seconds: float, max_requests: int, sampler=None
) -> tuple[list[Result], float]:
    """`concurrency` workers until `seconds` pass or `max_requests` are sent; waits for the requests
    in flight."""
    results: list[Result] = []
    sent = 0
    limits = httpx.Limits(
        max_connections=args.concurrency * 2, max_keepalive_connections=args.concurrency
    )
    t_origin = time.perf_counter()
    deadline = t_origin + seconds

    async def worker(wid: int) -> None:
        nonlocal sent
        rng = random.Random(args.seed * 1000 + wid + (0 if sampler else 500))
        while time.perf_counter() < deadline and sent < max_requests:
            sent += 1
            d = draw(rng, pool, args)
            results.append(
                await send(
                    client,
                    url,
                    d["p"],
                    d["api"],
                    d["stream"],
                    d["abort"],
                    d["abort_after"],
                    args.request_timeout,
                    t_origin,
                    prompt_form(args.router, d["api"]),
                )
            )

    async with httpx.AsyncClient(timeout=None, limits=limits, trust_env=False) as client:
        tasks = [asyncio.create_task(worker(i)) for i in range(args.concurrency)]
        side = asyncio.create_task(sampler(t_origin, tasks, results)) if sampler else None
        await asyncio.gather(*tasks)
        if side:
            await side
    return results, time.perf_counter() - t_origin


async def warm_up(url: str, pool: list[Prompt], args) -> list[Result]:
    """Every pool prompt once (non-streamed /generate, no aborts), after the router answers."""
    async with httpx.AsyncClient(timeout=None, trust_env=False) as c:  # send() bounds the time
        for _ in range(120):  # the router may still be registering its workers
            r = await send(
                c,
                url,
                pool[0],
                "generate",
                False,
                None,
                0,
                args.request_timeout,
                time.perf_counter(),
            )
            if not r.error_type.startswith("HTTP 503"):
                break
            await asyncio.sleep(0.5)
    n = len(pool) if args.warmup_requests is None else args.warmup_requests
    plain = argparse.Namespace(
        **{**vars(args), "abort_fraction": 0.0, "stream_fraction": 0.0, "openai_fraction": 0.0}
    )
    results, _ = await run_load(url, pool, plain, 1e9, n) if n else ([], 0.0)
    return [r] + results


async def sample_memory(
    cluster: PDCluster, every: float, samples: list, t_origin: float, tasks: list, results: list
) -> None:
    """Appends (t, {process: RSS KiB}) every `every` s while the workers run; prints progress every
    30 s."""
    next_print = 30.0
    await asyncio.sleep(min(1.0, every))
    while not all(t.done() for t in tasks):
        t = time.perf_counter() - t_origin
        samples.append((t, {k: v["rss_kib"] for k, v in snapshot(cluster).items()}))
        if t >= next_print:
            counts = {
                k: sum(r.outcome == k for r in results)
                for k in ("ok", "aborted", "error", "corrupted", "lost")
            }
            print(
                f"[soak] {t:5.0f} s {counts} RSS MiB: "
                + ", ".join(f"{k} {v / 1024:.0f}" for k, v in samples[-1][1].items()),
                flush=True,
            )
            next_print += 30.0
        await asyncio.sleep(every)
