"""OpenAI-compatible /v1/completions and /v1/chat/completions: responses and stream chunks in
OpenAI's schema."""

from __future__ import annotations

import functools
import itertools
import time
import uuid
from typing import Callable, Optional

from fastapi import Request
from fastapi.responses import StreamingResponse

from sparkrelay.manager.client import OutputStream
from sparkrelay.manager.messages import GenerationItem
from sparkrelay.scheduler.request import Logprobs, RequestOutput
from sparkrelay.server import protocol as P
from sparkrelay.server.common import ServerState


class _Stable:
    """Text deltas for OpenAI streams: holds back a trailing partial stop string or partial UTF-8
    char."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops = stops
        self.sent = 0

    def delta(self, out: RequestOutput) -> str:
        text = out.text if out.finished else self._stable(out.text)
        d = text[self.sent :]
        self.sent = max(self.sent, len(text))
        return d

    def _stable(self, text: str) -> str:
        text = text.rstrip("\ufffd")
        hold = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(text)), hold, -1):
                if text.endswith(s[:k]):
                    hold = k
                    break
        return text[: len(text) - hold]


def _finish(out: RequestOutput) -> Optional[str]:
    if not out.finished:
        return None
    kind = (out.finish_reason or {}).get("type")
    return kind if kind in ("stop", "length") else (kind or "stop")


def _usage(finals: list[RequestOutput], n: int) -> dict:
    # once per prompt, not per sample
    prompt = sum(o.prompt_tokens for i, o in enumerate(finals) if i % n == 0)
    completion = sum(len(o.output_ids) for o in finals)
    cached = sum(o.cached_tokens for i, o in enumerate(finals) if i % n == 0)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def _openai_head(kind: str, oid: str, s: ServerState) -> dict:
    return {"id": oid, "object": kind, "created": int(time.time()), "model": s.model_name}


def token_text(tokenizer) -> Callable[[int], str]:
    """Token id -> its text alone (cached: the same ids recur in every position's top list)."""
    return functools.lru_cache(maxsize=1 << 14)(lambda t: tokenizer.decode([t]))


def _completion_logprobs(
    lp: Logprobs, ids: list[int], a: int, b: int, text_of, offset: int
) -> dict:
    """OpenAI's legacy completion logprobs of output tokens [a, b); text offsets from `offset` (the text already
    sent). top_logprobs: per token a dict text -> logprob of the top `logprobs` tokens (None when 0), as vLLM."""
    tokens = [text_of(t) for t in ids[a:b]]
    offsets = list(itertools.accumulate((len(x) for x in tokens[:-1]), initial=offset))[
        : len(tokens)
    ]
    tops = [({text_of(t): v for v, t in top} if lp.top else None) for top in lp.output_top[a:b]]
    return {
        "tokens": tokens,
        "token_logprobs": lp.output[a:b],
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def _echo_logprobs(lp: Logprobs, prompt_ids: list[int], text_of) -> dict:
    """The prompt's part of `echo` logprobs: every prompt token, its logprob (None for the first,
    which has none, as vLLM and OpenAI report it) and its top list."""
    tokens = [text_of(t) for t in prompt_ids]
    values = list(lp.input) + [None] * (len(tokens) - len(lp.input))
    tops = list(lp.input_top) + [None] * (len(tokens) - len(lp.input_top))
    return {
        "tokens": tokens,
        "token_logprobs": values,
        "top_logprobs": [
            ({text_of(t): v for v, t in top} if top is not None and lp.top else None)
            for top in tops
        ],
        "text_offset": list(itertools.accumulate((len(x) for x in tokens[:-1]), initial=0))[
            : len(tokens)
        ],
    }


def _joined(first: dict, second: dict) -> dict:
    return {k: first[k] + second[k] for k in first}


def _chat_logprobs(lp: Logprobs, ids: list[int], a: int, b: int, text_of) -> dict:
    """OpenAI's chat logprobs of output tokens [a, b): {content: [{token, logprob, bytes,
    top_logprobs}]}."""

    def entry(v: float, t: int) -> dict:
        text = text_of(t)
        return {"token": text, "logprob": v, "bytes": list(text.encode("utf-8"))}

    content = [
        entry(v, t) | {"top_logprobs": [entry(tv, tt) for tv, tt in top]}
        for v, t, top in zip(lp.output[a:b], ids[a:b], lp.output_top[a:b])
    ]
    return {"content": content}


def _choice(
    chat: bool,
    index: int,
    text: Optional[str],
    finish: Optional[str],
    stream: bool,
    first: bool = False,
    logprobs: Optional[dict] = None,
    calls: Optional[list[dict]] = None,
) -> dict:
    """calls: the tool calls this message (or delta) carries."""
    c: dict = {"index": index, "logprobs": logprobs, "finish_reason": finish}
    if not chat:
        c["text"] = text
    elif not stream:
        c["message"] = {"role": "assistant", "content": text} | (
            {"tool_calls": calls} if calls else {}
        )
    else:
        delta = ({"role": "assistant"} if first else {}) | (
            {"content": text} if text or first else {}
        )
        c["delta"] = delta | ({"tool_calls": calls} if calls else {})
    return c


async def openai_response(s: ServerState, req, request: Request, chat: bool):
    oid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    items, tools, echo = await _translate(s, req, chat, oid)
    parse_tools = tools is not None and tools.parse
    stream = await s.engine.submit(items)
    index = {it.rid: i for i, it in enumerate(items)}
    if req.stream:
        return _openai_stream(s, req, stream, items, index, oid, chat, echo, parse_tools)
    finals = await s.collect(stream, request)
    outs = [finals[it.rid] for it in items]
    return await s.answer(
        lambda: _openai_answer(s, outs, req.n, oid, chat, items, echo, parse_tools)
    )


async def _translate(
    s: ServerState, req, chat: bool, oid: str
) -> tuple[list[GenerationItem], Optional[P.ToolPlan], Optional[list[str]]]:
    """The engine items (tokenized, chat template rendered), the tool plan of a chat request with
    tools, and the echoed prompts of an `echo` completion; all off the event loop."""
    if not chat:
        items = await s.off_loop(P.completion_items, req, s.tokenizer, s.limits, oid)
        echo = await s.off_loop(P.echo_texts, req, items, s.tokenizer) if req.echo else None
        return P.with_bootstrap(req, items), None, echo
    tools = None
    if req.tools or req.tool_choice is not None:
        limits = s.limits
        tools = await s.off_loop(
            P.tool_plan,
            req,
            s.tokenizer.chat_template,
            limits.grammar_backend,
            limits.tool_call_parser,
        )
    items = await s.off_loop(
        functools.partial(P.chat_items, tools=tools), req, s.tokenizer, s.limits, oid
    )
    return P.with_bootstrap(req, items), tools, None


def _openai_answer(
    s: ServerState,
    outs: list[RequestOutput],
    n: int,
    oid: str,
    chat: bool,
    items: list[GenerationItem],
    echo: Optional[list[str]],
    parse_tools: bool = False,
) -> dict:
    resp = _openai_head("chat.completion" if chat else "text_completion", oid, s)
    text_of = token_text(s.tokenizer)
    resp["choices"] = []
    for i, o in enumerate(outs):
        head = echo[i] if echo else ""
        lp = _logprobs(chat, o, 0, text_of, len(head))
        if echo and lp is not None:
            lp = _joined(_echo_logprobs(o.logprobs, items[i].prompt_ids, text_of), lp)
        text, calls, finish = head + o.text, None, _finish(o)
        if parse_tools:
            text, calls = P.parse_tool_calls(o.text)
            finish = "tool_calls" if calls and finish == "stop" else finish
        resp["choices"].append(_choice(chat, i, text, finish, False, logprobs=lp, calls=calls))
    resp["usage"] = _usage(outs, n)
    return resp


def _logprobs(chat: bool, out: RequestOutput, a: int, text_of, offset: int) -> Optional[dict]:
    """The choice's logprobs for output tokens [a, end) (None unless the request asked)."""
    if out.logprobs is None:
        return None
    ids = list(out.output_ids)
    if chat:
        return _chat_logprobs(out.logprobs, ids, a, len(ids), text_of)
    return _completion_logprobs(out.logprobs, ids, a, len(ids), text_of, offset)


def _openai_stream(
    s: ServerState,
    req,
    stream: OutputStream,
    items: list[GenerationItem],
    index: dict,
    oid: str,
    chat: bool,
    echo: Optional[list[str]] = None,
    parse_tools: bool = False,
) -> StreamingResponse:
    kind = "chat.completion.chunk" if chat else "text_completion"
    usage = bool(req.stream_options and req.stream_options.include_usage)
    deltas = {it.rid: _Stable(it.params.stop) for it in items}
    started: set[str] = set()
    finals: dict[str, RequestOutput] = {}
    text_of = token_text(s.tokenizer)
    scored: dict[
        str, tuple[int, int]
    ] = {}  # rid -> (output tokens whose logprobs were sent, their text length)

    def chunk(choices: list, with_usage=None) -> dict:
        c = _openai_head(kind, oid, s) | {"choices": choices}
        return c | {"usage": with_usage} if usage else c

    parsers = {it.rid: P.ToolStreamParser() for it in items} if parse_tools else {}

    def chunks(out: RequestOutput) -> list:
        text, finish, first = deltas[out.rid].delta(out), _finish(out), out.rid not in started
        started.add(out.rid)
        if out.finished:
            finals[out.rid] = out
        head = echo[index[out.rid]] if echo and first else ""  # `echo`: the prompt leads
        calls = None
        if parse_tools:
            parser = parsers[out.rid]
            text, calls = parser.feed(text, out.finished)
            finish = "tool_calls" if parser.calls and finish == "stop" else finish
        if not (head or text or calls or finish or (chat and first)):
            return []
        lp = stream_logprobs(out, len(head))
        if head and lp is not None:
            prompt_ids = items[index[out.rid]].prompt_ids
            lp = _joined(_echo_logprobs(out.logprobs, prompt_ids, text_of), lp)
        choice = _choice(chat, index[out.rid], head + text, finish, True, first, lp, calls)
        return [chunk([choice])]

    def stream_logprobs(out: RequestOutput, head: int) -> Optional[dict]:
        """Logprobs of the tokens not yet sent in an earlier chunk (text offsets continue across
        chunks, after the `head` characters of an echoed prompt)."""
        sent, offset = scored.get(out.rid, (0, head))
        lp = _logprobs(chat, out, sent, text_of, offset)
        if lp is not None:
            scored[out.rid] = (
                len(out.output_ids),
                offset + sum(len(text_of(t)) for t in out.output_ids[sent:]),
            )
        return lp

    def tail() -> list:
        outs = [finals[it.rid] for it in items if it.rid in finals]
        return [chunk([], _usage(outs, req.n))] if usage and len(outs) == len(items) else []

    return s.streaming(stream, chunks, tail)
