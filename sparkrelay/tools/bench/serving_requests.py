"""One streamed request of the serving benchmark: its body for each API, and its SSE chunks folded
into a `Record` (TTFT, inter-token latencies, token counts, acceptance) with every failure counted
by type."""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from typing import Any

import aiohttp

from sparkrelay.tools.bench.serving_report import Record
from sparkrelay.tools.bench.serving_workload import Item


def payload(item: Item, args: argparse.Namespace) -> dict:
    if args.backend == "sglang":
        body: dict[str, Any] = (
            {"input_ids": item.ids} if item.ids is not None else {"text": item.text}
        )
        sp = {
            "max_new_tokens": item.output_len,
            "temperature": args.temperature,
            "ignore_eos": not args.no_ignore_eos,
        }
        return body | {"sampling_params": sp, "stream": True}
    body = {
        "model": args.model,
        "max_tokens": item.output_len,
        "temperature": args.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if not args.no_ignore_eos:
        body["ignore_eos"] = True
    if args.backend == "openai-chat":
        return body | {"messages": [{"role": "user", "content": item.text}]}
    return body | {"prompt": item.ids if item.ids is not None else item.text}


def error_message(status: int, raw: bytes) -> str:
    try:
        obj = json.loads(raw)
        msg = (
            obj["error"]["message"]
            if isinstance(obj.get("error"), dict)
            else obj.get("detail") or obj
        )
    except (ValueError, AttributeError, KeyError, TypeError):
        msg = raw.decode("utf-8", "replace")
    return f"HTTP {status}: {str(msg)[:300]}"


def on_chunk(rec: Record, obj: dict, backend: str, now: float, start: float, state: dict) -> None:
    """Folds one SSE chunk into the record; `state` keeps the cumulative token count and the last
    chunk time."""
    if "error" in obj:
        err = obj["error"]
        raise RuntimeError(err.get("message", err) if isinstance(err, dict) else err)
    if backend == "sglang":
        meta = obj.get("meta_info", {})
        total = meta.get("completion_tokens", len(obj.get("output_ids", ())))
        new = total - state["tokens"]
        rec.text, rec.prompt_tokens = (
            obj.get("text", rec.text),
            meta.get("prompt_tokens", rec.prompt_tokens),
        )
        rec.spec_verify_ct = meta.get("spec_verify_ct", rec.spec_verify_ct)
        rec.spec_accept_length = meta.get("spec_accept_length", rec.spec_accept_length)
        rec.cached_tokens = meta.get("cached_tokens", rec.cached_tokens)
        rec.handoff_bytes = meta.get("handoff_bytes", rec.handoff_bytes)
        rec.output_ids = obj.get("output_ids", rec.output_ids)
    else:
        if obj.get("usage"):
            rec.prompt_tokens = obj["usage"].get("prompt_tokens")
            rec.cached_tokens = (obj["usage"].get("prompt_tokens_details") or {}).get(
                "cached_tokens"
            )
            state["usage_tokens"] = obj["usage"].get("completion_tokens")
        choice = (obj.get("choices") or [{}])[0]
        piece = (
            choice.get("text") if "text" in choice else (choice.get("delta") or {}).get("content")
        )
        new = 1 if piece else 0  # token count unknown: re-spread over the chunks at the end
        rec.text += piece or ""
    if new <= 0:
        return
    state["tokens"] += new
    if rec.ttft is None:
        rec.ttft = now - start
    else:
        rec.itl.append((now - state["last"]) / new)
    rec.chunk_tokens.append(new)
    state["last"] = now


def finish_openai(rec: Record, state: dict) -> None:
    """OpenAI chunks carry no token counts: spread the usage's completion tokens evenly over the
    chunks."""
    chunks = len(rec.chunk_tokens)
    tokens = state.get("usage_tokens") or chunks
    per = tokens / chunks if chunks else 1.0
    rec.output_tokens, rec.itl, rec.chunk_tokens = (
        tokens,
        [g / per for g in rec.itl],
        [per] * chunks,
    )


class HTTPStatusError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


async def send(
    client: aiohttp.ClientSession, url: str, item: Item, args: argparse.Namespace, t0: float
) -> Record:
    rec, state = (
        Record(item.index, conversation=item.conversation, turn=item.turn),
        {"tokens": 0, "last": 0.0},
    )
    start = time.perf_counter()
    rec.start = start - t0
    try:
        async with asyncio.timeout(args.request_timeout):
            async with client.post(url, json=payload(item, args)) as resp:
                if resp.status != 200:
                    raise HTTPStatusError(
                        resp.status, error_message(resp.status, await resp.read())
                    )
                done = False
                async for line in resp.content:  # one line at a time
                    if not line.startswith(b"data:"):
                        continue
                    data = line[len(b"data:") :].strip()
                    if data == b"[DONE]":
                        done = True
                        break
                    on_chunk(rec, json.loads(data), args.backend, time.perf_counter(), start, state)
        if not done:
            raise ConnectionError("stream ended without `data: [DONE]`")
        rec.e2e = time.perf_counter() - start
        if args.backend == "sglang":
            rec.output_tokens = state["tokens"]
        else:
            finish_openai(rec, state)
        rec.success = rec.ttft is not None or rec.output_tokens == 0
        if not rec.success:
            rec.error_type, rec.error = "empty stream", "no chunk carried a token"
    except Exception as e:  # noqa: BLE001 (every failure is counted by type, none stops the benchmark)
        rec.error_type, rec.error = error_kind(e, args.request_timeout)
    return rec


def error_kind(e: Exception, timeout: float) -> tuple[str, str]:
    if isinstance(e, HTTPStatusError):
        return f"HTTP {e.status}", str(e)
    if isinstance(e, TimeoutError):
        return "timeout", f"no complete answer within --request-timeout {timeout:g} s"
    if isinstance(e, RuntimeError):
        return "stream error", str(e)[:300]
    return type(e).__name__, f"{type(e).__name__}: {e}"[:300]
