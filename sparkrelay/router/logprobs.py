"""Prompt logprobs through PD: the prefill scores the prompt (logprob_start_len >= 0), the decode
only the output.

With `return_logprob: true` on /generate the router waits for the prefill's answer too (it always
does) and puts the prefill's `input_token_logprobs` / `input_top_logprobs` in front of the decode's
(empty) ones, as SGLang's PD router merges them:
    plain:    one JSON object (or a list, one per batch item, in order) -> the same with the lists merged
    streamed: every `data: {...}` event of the decode's SSE stream (item `index` when batched) gets the prefill's
              lists, so every chunk carries all prompt logprobs, as the aggregated server's cumulative chunks do
With `echo: true` and `logprobs` on /v1/completions the same holds for the echoed prompt: the
decode's answer leads with the prompt's tokens but cannot score them (null logprobs), so the router
puts the prefill's `token_logprobs` / `top_logprobs` of those positions in their place, in the plain
answer or in each choice's first streamed chunk (the prefill answered the prompt and, unless
max_tokens is 0, one token).
Plain JSON and SSE bytes only; an answer that cannot be parsed is relayed unchanged.
"""

from __future__ import annotations

import json
from typing import AsyncIterator, Optional

INPUT_FIELDS = ("input_token_logprobs", "input_top_logprobs")
Inputs = dict[
    int, dict[str, list]
]  # batch item index (0 when not batched) -> the prefill's input fields


ECHO_FIELDS = ("token_logprobs", "top_logprobs")


def wants_merge(path: str, body: dict) -> bool:
    if path == "/v1/completions":
        return body.get("echo") is True and body.get("logprobs") is not None
    return path == "/generate" and body.get("return_logprob") is True


def _events(data: bytes) -> list[dict]:
    """The JSON objects of an SSE body's `data:` events ([DONE] and anything unparsable left
    out)."""
    out = []
    for event in data.decode("utf-8", "replace").split("\n\n"):
        line = event.strip()
        if line.startswith("data:") and line[5:].strip() != "[DONE]":
            try:
                obj = json.loads(line[5:])
            except ValueError:
                continue
            if isinstance(obj, dict):
                out.append(obj)
    return out


def prefill_inputs(body: bytes, stream: bool, request: Optional[dict] = None) -> Inputs:
    """The prefill's prompt logprobs per batch item: its JSON answer, or the last event of each item
    of its SSE answer (meta_info is cumulative, so the last one has them all). `request`: a
    /v1/completions body (echo): per choice, the prompt positions' logprob lists instead."""
    if request is not None:
        return _echo_inputs(body, stream, request)
    if stream:
        items = {obj.get("index", 0): obj for obj in _events(body)}
    else:
        try:
            parsed = json.loads(body)
        except ValueError:
            return {}
        items = dict(enumerate(parsed)) if isinstance(parsed, list) else {0: parsed}
    out: Inputs = {}
    for index, obj in items.items():
        meta = obj.get("meta_info") if isinstance(obj, dict) else None
        if isinstance(meta, dict) and isinstance(index, int):
            out[index] = {k: meta[k] for k in INPUT_FIELDS if isinstance(meta.get(k), list)}
    return out


def _echo_inputs(body: bytes, stream: bool, request: dict) -> Inputs:
    """Per choice index, the prefill's logprob lists of the prompt positions (its answer's lists
    less its one output token)."""
    if stream:
        objs = _events(body)
    else:
        try:
            objs = [json.loads(body)]
        except ValueError:
            return {}
    lists: Inputs = {}
    for obj in objs:
        for c in obj.get("choices") or [] if isinstance(obj, dict) else []:
            lp = c.get("logprobs") if isinstance(c, dict) else None
            if isinstance(lp, dict) and isinstance(c.get("index"), int):
                got = lists.setdefault(c["index"], {k: [] for k in ECHO_FIELDS})
                for k in ECHO_FIELDS:
                    got[k] += lp.get(k) or []
    outputs = 0 if request.get("max_tokens") == 0 else 1
    return {
        i: {k: v[: max(len(v) - outputs, 0)] for k, v in got.items()} for i, got in lists.items()
    }


def _merge_echo(obj: dict, inputs: Inputs) -> dict:
    """Each choice's leading prompt entries := the prefill's; a choice's lists are used once (its
    first streamed chunk carries the whole prompt)."""
    for c in obj.get("choices") or []:
        lp = c.get("logprobs") if isinstance(c, dict) else None
        index = c.get("index") if isinstance(c, dict) else None
        if isinstance(lp, dict) and isinstance(index, int) and index in inputs:
            prefill = inputs.pop(index)
            for k in ECHO_FIELDS:
                own = lp.get(k) if isinstance(lp.get(k), list) else []
                lp[k] = prefill[k] + own[len(prefill[k]) :]
    return obj


def _merge(obj: dict, inputs: Optional[dict[str, list]]) -> dict:
    """obj's meta_info input lists := the prefill's, then the decode's own (empty: the decode scores
    no prompt)."""
    meta = obj.get("meta_info")
    if inputs and isinstance(meta, dict):
        for k, v in inputs.items():
            own = meta.get(k)
            meta[k] = v + (own if isinstance(own, list) else [])
    return obj


def merge_json(body: bytes, inputs: Inputs) -> bytes:
    """The decode's plain answer (an object, or a list of them) with the prefill's prompt
    logprobs."""
    try:
        parsed = json.loads(body)
    except ValueError:
        return body
    if isinstance(parsed, dict) and "choices" in parsed:
        parsed = _merge_echo(parsed, inputs)
    elif isinstance(parsed, list):
        parsed = [
            _merge(o, inputs.get(i)) if isinstance(o, dict) else o for i, o in enumerate(parsed)
        ]
    elif isinstance(parsed, dict):
        parsed = _merge(parsed, inputs.get(0))
    return json.dumps(parsed).encode()


def _merge_event(event: bytes, inputs: Inputs) -> bytes:
    line = event.strip()
    if not line.startswith(b"data:") or line[5:].strip() == b"[DONE]":
        return event
    try:
        obj = json.loads(line[5:])
    except ValueError:
        return event
    if not isinstance(obj, dict):
        return event
    if "choices" in obj:
        return b"data: " + json.dumps(_merge_echo(obj, inputs)).encode()
    index = obj.get("index", 0)
    return (
        b"data: "
        + json.dumps(_merge(obj, inputs.get(index) if isinstance(index, int) else None)).encode()
    )


async def merge_stream(chunks: AsyncIterator[bytes], inputs: Inputs) -> AsyncIterator[bytes]:
    """The decode's SSE bytes, event by event (events end with a blank line), each with the
    prefill's lists."""
    pending = b""
    async for chunk in chunks:
        pending += chunk
        *events, pending = pending.split(b"\n\n")
        for event in events:
            yield _merge_event(event, inputs) + b"\n\n"
    if pending:
        yield _merge_event(pending, inputs)
