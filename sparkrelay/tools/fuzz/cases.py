"""The hostile requests of the HTTP fuzzer (sparkrelay/tools/fuzz/run.py): hand-made cases for the
generation routes (huge and non-finite numbers in every numeric field, odd strings, bad token ids,
bad bootstrap fields, raw bodies that are no JSON, wrong methods and paths) and for the PD bootstrap
server's routes. Pure data: nothing is sent."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Iterator, Optional

GENERATE, COMPLETIONS, CHAT = "/generate", "/v1/completions", "/v1/chat/completions"
ROUTES = (GENERATE, COMPLETIONS, CHAT)
GET_ROUTES = (
    "/health",
    "/health_generate",
    "/server_info",
    "/get_server_info",
    "/model_info",
    "/get_model_info",
    "/metrics",
    "/v1/models",
)
BOOTSTRAP_ROUTES = ("/route", "/register_dp_rank", "/query_dp_ranks")
KNOWN_PATHS = frozenset(ROUTES + GET_ROUTES + BOOTSTRAP_ROUTES)
HOLE = "@@HOSTILE@@"  # stands for a raw JSON literal (NaN, 1e308, ...) that json.dumps cannot write
TEN_MB = 10 * 1024 * 1024


def base_body(path: str, max_tokens: int = 2) -> dict:
    """A valid request for `path` that generates `max_tokens` tokens."""
    if path == GENERATE:
        return {"text": "Hello", "sampling_params": {"max_new_tokens": max_tokens}}
    if path == COMPLETIONS:
        return {"prompt": "Hello", "max_tokens": max_tokens}
    return {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": max_tokens}


PROMPT_FIELD = {GENERATE: "text", COMPLETIONS: "prompt", CHAT: "messages.0.content"}
_OPENAI_NUMBERS = [
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "n",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "bootstrap_room",
    "bootstrap_port",
    "stream_options.include_usage",
]
NUMERIC_FIELDS = {
    GENERATE: [
        "sampling_params." + f
        for f in (
            "max_new_tokens",
            "temperature",
            "top_p",
            "top_k",
            "min_p",
            "seed",
            "sampling_seed",
            "n",
            "stop_token_ids.0",
            "repetition_penalty",
            "frequency_penalty",
            "presence_penalty",
        )
    ]
    + ["bootstrap_room", "bootstrap_port", "input_ids.0"],
    COMPLETIONS: _OPENAI_NUMBERS + ["best_of", "logprobs", "logit_bias.5", "stop_token_ids.0"],
    CHAT: _OPENAI_NUMBERS + ["max_completion_tokens", "top_logprobs", "logit_bias.5"],
}
# raw JSON literals for numeric fields: huge, tiny, out of int64, non-finite (Python's json reads
# NaN/Infinity), more digits than Python's int() accepts, and values of other types
HOSTILE_NUMBERS = [
    "1e308",
    "-1e308",
    "1e-320",
    "1e400",
    str(2**63 - 1),
    str(2**63),
    str(2**64),
    str(-(2**64)),
    str(-(2**63) - 1),
    "-1",
    "0",
    "1.5",
    "-0.0",
    "NaN",
    "Infinity",
    "-Infinity",
    "9" * 5000,
    '"7"',
    "true",
    "null",
    "[]",
    "{}",
    "[1e308]",
]


@dataclass(frozen=True)
class Hostile:
    name: str
    method: str
    path: str
    content: bytes = b""
    content_type: Optional[str] = "application/json"


def _set(body: dict, dotted: str, value) -> dict:
    """A deep copy of `body` with the field at `dotted` (a.b.0.c) set to `value`, containers made as
    needed."""
    body = json.loads(json.dumps(body))
    keys = dotted.split(".")
    node = body
    for k, nxt in zip(keys, keys[1:] + [None]):
        if isinstance(node, list):
            k = int(k)
            while len(node) <= k:
                node.append(None)
        if nxt is None:
            node[k] = value
        else:
            if not isinstance(node[k] if isinstance(node, list) else node.get(k), (dict, list)):
                node[k] = [] if nxt == "0" else {}
            node = node[k]
    return body


def _with_literal(body: dict, dotted: str, literal: str) -> bytes:
    return json.dumps(_set(body, dotted, HOLE)).replace(f'"{HOLE}"', literal).encode()


def _json(body) -> bytes:
    return json.dumps(body).encode()  # ensure_ascii: a lone surrogate goes out as the escape \ud800


def _numbers(path: str) -> Iterator[Hostile]:
    base = base_body(path)
    if path == GENERATE:
        base = {
            "input_ids": [5, 6],
            "sampling_params": {"max_new_tokens": 2},
        }  # input_ids.0 needs ids, not text
    for f in NUMERIC_FIELDS[path]:
        for lit in HOSTILE_NUMBERS:
            yield Hostile(f"{f}={lit[:12]}", "POST", path, _with_literal(base, f, lit))


def _strings(path: str) -> Iterator[Hostile]:
    base, prompt = base_body(path), PROMPT_FIELD[path]
    stop = "sampling_params.stop" if path == GENERATE else "stop"
    cases = {
        "empty prompt": _set(base, prompt, ""),
        "surrogate prompt": _set(base, prompt, "\ud800 hi"),
        "low surrogate prompt": _set(base, prompt, "hi \udfff"),
        "surrogate pair prompt": _set(base, prompt, "\U0001f600 ok"),
        "nul prompt": _set(base, prompt, "a\x00b"),
        "control chars prompt": _set(base, prompt, "".join(map(chr, range(32)))),
        "rtl and combining prompt": _set(base, prompt, "\u202e\u0301\u0301\u0301x\ufeff\uffff"),
        "empty stop": _set(base, stop, ""),
        "empty stop entry": _set(base, stop, ["ok", ""]),
        "non-string stops": _set(base, stop, [1, None, {}, [], True]),
        "numeric stop": _set(base, stop, 5),
        "surrogate stop": _set(base, stop, ["\udc00"]),
        "many stops": _set(base, stop, [f"s{i}" for i in range(10000)]),
        "huge stop": _set(base, stop, "x" * 1_000_000),
        "surrogate key": {**base, "\ud800": 1},
        "empty key": {**base, "": 1},
        "unknown field": {**base, "frobnicate": True},
        "model surrogate": {**base, "model": "\udbff"},
        "model empty": {**base, "model": ""},
    }
    if path == GENERATE:
        cases |= {
            "rid empty": {**base, "rid": ""},
            "rid surrogate": {**base, "rid": "\ud800"},
            "rid list": {**base, "rid": ["a", "b"]},
            "rid int": {**base, "rid": 5},
            "text batch empty": {"text": []},
            "text batch with empty": {"text": ["a", ""]},
            "text batch non-strings": {"text": ["a", 1, None]},
        }
    if path == CHAT:
        msg = base["messages"][0]
        cases |= {
            "role empty": _set(base, "messages.0.role", ""),
            "role surrogate": _set(base, "messages.0.role", "\ud800"),
            "role unknown": _set(base, "messages.0.role", "tool"),
            "no role": {**base, "messages": [{"content": "x"}]},
            "content parts": _set(base, "messages.0.content", [{"type": "text", "text": "a"}]),
            "content part bad type": _set(
                base, "messages.0.content", [{"type": "image_url", "text": 1}]
            ),
            "content part surrogate": _set(
                base, "messages.0.content", [{"type": "text", "text": "\ud800"}]
            ),
            "content number": _set(base, "messages.0.content", 5),
            "messages empty": {**base, "messages": []},
            "messages object": {**base, "messages": {"role": "user"}},
            "message null": {**base, "messages": [None]},
            "extra message field surrogate": {**base, "messages": [{**msg, "name": "\ud800"}]},
            "assistant last": {**base, "messages": [{"role": "assistant", "content": "x"}]},
            "10k messages": {**base, "messages": [msg] * 10000},
            "tools": {**base, "tools": [{"type": "function"}]},
            "response_format weird": {**base, "response_format": {"type": {"a": 1}}},
        }
    for name, body in cases.items():
        yield Hostile(name, "POST", path, _json(body))


def _token_ids(path: str) -> Iterator[Hostile]:
    field_ = "input_ids" if path == GENERATE else "prompt"
    base = {k: v for k, v in base_body(path).items() if k != "text"}
    for name, ids in {
        "negative id": [5, -1],
        "huge id": [5, 2**64],
        "int64 max id": [2**63 - 1],
        "vocab-sized id": [10**9],
        "float id": [1.5],
        "string id": ["a"],
        "bool id": [True],
        "null id": [None],
        "nested empty": [[]],
        "batch with bad": [[1], [-5]],
        "ragged nesting": [1, [2]],
        "too deep": [[[1]]],
        "long prompt": [5] * 100_000,
    }.items():
        yield Hostile(name, "POST", path, _json({**base, field_: ids}))


def _bootstrap(path: str) -> Iterator[Hostile]:
    base = base_body(path)
    rooms = {
        "room str": "x",
        "room 0": 0,
        "room -1": -1,
        "room 2^63": 2**63,
        "room 2^64": 2**64,
        "room float": 1.5,
        "room bool": True,
        "room object": {"a": 1},
        "room empty list": [],
        "room repeated": [7, 7],
        "room list of str": ["a"],
        "room 2^63-1": 2**63 - 1,
    }
    for name, room in rooms.items():
        yield Hostile(
            name,
            "POST",
            path,
            _json({**base, "bootstrap_host": "127.0.0.1", "bootstrap_room": room}),
        )
    for name, extra in {
        "host int": {"bootstrap_host": 5, "bootstrap_room": 9},
        "host list mismatch": {"bootstrap_host": ["a", "b"], "bootstrap_room": 9},
        "port huge": {"bootstrap_host": "h", "bootstrap_port": 2**64, "bootstrap_room": 9},
        "port negative": {"bootstrap_host": "h", "bootstrap_port": -1, "bootstrap_room": 9},
        "port str": {"bootstrap_host": "h", "bootstrap_port": "80", "bootstrap_room": 9},
        "batch rooms short": {"bootstrap_host": ["h"], "bootstrap_room": [1]},
    }.items():
        body = {**base, **extra}
        if "batch" in name:
            body = _set(body, PROMPT_FIELD[path], ["a", "b"]) if path != CHAT else {**body, "n": 2}
        yield Hostile(name, "POST", path, _json(body))


def _raw(path: str, heavy: bool) -> Iterator[Hostile]:
    prompt = PROMPT_FIELD[path].split(".")[0]
    good = _json(base_body(path))
    deep = 100_000
    cases = {
        "empty body": b"",
        "null": b"null",
        "array": b"[]",
        "string": b'"s"',
        "number": b"1",
        "true": b"true",
        "truncated": good[:-3],
        "trailing garbage": good + b"xyz",
        "two objects": good + good,
        "single quotes": b"{'text': 'hi'}",
        "comment": b'{/* c */ "text": "hi"}',
        "invalid utf-8": b'{"%s": "\xff\xfe hi"}' % prompt.encode(),
        "overlong utf-8": b'{"%s": "\xc0\xaf"}' % prompt.encode(),
        "cesu surrogate bytes": b'{"%s": "\xed\xa0\x80"}' % prompt.encode(),
        "truncated utf-8": b'{"%s": "\xe2\x82' % prompt.encode(),
        "utf-8 bom": b"\xef\xbb\xbf" + good,
        "utf-16 body": json.dumps(base_body(path)).encode("utf-16"),
        "nul bytes": b"\x00" * 1000,
        "deep arrays": b"[" * deep + b"]" * deep,
        "deep objects": b'{"a":' * deep + b"1" + b"}" * deep,
        "deep in prompt": b'{"%s": ' % prompt.encode() + b"[" * deep + b"]" * deep + b"}",
        "depth 900 in prompt": b'{"%s": ' % prompt.encode() + b"[" * 900 + b"]" * 900 + b"}",
        "depth 990 in a field": b'{"tool_choice": ' + b"[" * 990 + b"]" * 990 + b"}",
        "10 MB of digits": b'{"n": ' + b"1" * TEN_MB + b"}",
        "10 MB of garbage": bytes(range(256)) * (TEN_MB // 256),
        "10 MB of whitespace": b" " * TEN_MB + good,
        "duplicate keys": good[:-1] + b', "%s": 5}' % prompt.encode(),
    }
    # each costs seconds of tokenizer or validation CPU (on the event loop)
    if heavy or path == GENERATE:
        cases["10 MB prompt"] = _json(_set(base_body(path), PROMPT_FIELD[path], "a" * TEN_MB))
    if heavy:
        cases["1M-key object"] = b"{" + b",".join(b'"k%d": 1' % i for i in range(1_000_000)) + b"}"
        if path != CHAT:
            cases["1M-entry batch"] = _json(
                _set(base_body(path), PROMPT_FIELD[path], ["", "a"] * 500_000)
            )
    if path == CHAT:
        msg = b'{"role": "user", "content": "hi", "x": ' + b"[" * 990 + b"]" * 990 + b"}"
        cases["depth 990 in a message"] = b'{"messages": [' + msg + b"]}"
    for name, content in cases.items():
        yield Hostile(name, "POST", path, content)
    for ctype in (
        "text/plain",
        "application/x-www-form-urlencoded",
        "application/xml",
        None,
        "application/json; charset=utf-16",
        "multipart/form-data; boundary=x",
        "application/json\x7f",
    ):
        yield Hostile(f"content-type {ctype!r} with JSON", "POST", path, good, ctype)
    yield Hostile(
        "form body", "POST", path, b"text=hi&max_new_tokens=3", "application/x-www-form-urlencoded"
    )
    yield Hostile(
        "multipart body",
        "POST",
        path,
        b'--x\r\nContent-Disposition: form-data; name="text"\r\n\r\nhi\r\n--x--\r\n',
        "multipart/form-data; boundary=x",
    )
    yield Hostile("xml body", "POST", path, b"<text>hi</text>", "application/xml")
    for method in ("GET", "PUT", "DELETE", "PATCH", "OPTIONS"):
        yield Hostile(f"{method} on a POST route", method, path, good)


def _other_routes() -> Iterator[Hostile]:
    for path in GET_ROUTES:
        yield Hostile("POST on a GET route", "POST", path, b"{}")
        yield Hostile("junk query", "GET", path + "?x=%ff%fe&y=%00&" + "z=1&" * 1000, b"", None)
    for path in (
        "/nope",
        "/" + "a" * 8000,
        "/generate/../health",
        "/%00",
        "/v1/completions%2F..",
        "/v1//models",
    ):
        yield Hostile("odd path", "GET", path, b"", None)
        yield Hostile("odd path", "POST", path, b"{}")


def hostile_requests(paths: tuple[str, ...] = ROUTES, heavy: bool = True) -> Iterator[Hostile]:
    """The hand-made hostile requests for the generation routes `paths` and the info routes; `heavy`
    adds the 10 MB prompts, 1M-key objects and 1M-prompt batches of every route (a few seconds of
    server CPU each)."""
    for path in paths:
        for gen in (_numbers, _strings, _token_ids, _bootstrap):
            yield from gen(path)
        yield from _raw(path, heavy)
    yield from _other_routes()


# ---------------------------------------------------------------- the PD bootstrap server (no
# OpenAPI schema)

REGISTRATION = {
    "attn_tp_size": 1,
    "attn_tp_rank": 0,
    "attn_cp_size": 1,
    "attn_cp_rank": 0,
    "attn_dp_size": 1,
    "attn_dp_rank": 0,
    "pp_size": 1,
    "pp_rank": 0,
    "system_dp_size": 1,
    "system_dp_rank": 0,
    "rank_ip": "127.0.0.1",
    "rank_port": 5757,
}
ROUTE_QUERY = ("prefill_dp_rank", "prefill_cp_rank", "target_tp_rank", "target_pp_rank")


def _bootstrap_bodies(
    method: str, path: str, base: dict, fields: list[str], strings: dict
) -> Iterator[Hostile]:
    for f in fields:
        for lit in HOSTILE_NUMBERS:
            yield Hostile(f"{f}={lit[:12]}", method, path, _with_literal(base, f, lit))
    for name, body in strings.items():
        yield Hostile(name, method, path, _json(body))
    good, deep = _json(base), 100_000
    raw = {
        "empty body": b"",
        "null": b"null",
        "array": b"[]",
        "truncated": good[:-3],
        "invalid utf-8": b'{"x": "\xff\xfe"}',
        "utf-16 body": json.dumps(base).encode("utf-16"),
        "deep arrays": b"[" * deep + b"]" * deep,
        "deep objects": b'{"a":' * deep + b"1" + b"}" * deep,
        "depth 900 in a field": b'{"x": ' + b"[" * 900 + b"]" * 900 + b"}",
        "10 MB body": b'{"x": "' + b"a" * TEN_MB + b'"}',
        "10 MB of digits": b'{"x": ' + b"1" * TEN_MB + b"}",
        "just over 64 KiB": _json({**base, "pad": "a" * (64 << 10)}),
    }
    for name, content in raw.items():
        yield Hostile(name, method, path, content)
    for ctype in ("text/plain", None, "application/x-www-form-urlencoded"):
        yield Hostile(f"content-type {ctype!r}", method, path, good, ctype)


def bootstrap_hostile_requests() -> Iterator[Hostile]:
    """Hostile requests for the prefill bootstrap server's routes (PUT/GET /route,
    /register_dp_rank, /query_dp_ranks, /health)."""
    reg_strings = {
        f"rank_ip {v!r}"[:40]: {**REGISTRATION, "rank_ip": v}
        for v in ("", "\ud800", "x" * 300, 5, None, "[::1]", "a b", "\x00", "h:1:2:3")
    }
    reg_strings |= {
        "surrogate key": {**REGISTRATION, "\ud800": 1},
        "dtype int": {**REGISTRATION, "kv_cache_dtype": 5},
        "dtype surrogate": {**REGISTRATION, "kv_cache_dtype": "\udfff"},
        "lbm int": {**REGISTRATION, "load_balance_method": 5},
        "split str": {**REGISTRATION, "enable_dsa_cache_layer_split": "yes"},
        "missing all": {},
    }
    yield from _bootstrap_bodies(
        "PUT",
        "/route",
        REGISTRATION,
        list(REGISTRATION)[:-2] + ["rank_port", "page_size", "prefill_http_port"],
        reg_strings,
    )
    yield from _bootstrap_bodies(
        "POST",
        "/register_dp_rank",
        {"bootstrap_room": 7, "dp_rank": 0},
        ["bootstrap_room", "dp_rank"],
        {"room str": {"bootstrap_room": "7", "dp_rank": 0}},
    )
    rooms = {
        "rooms " + k: {"bootstrap_rooms": v}
        for k, v in {
            "str": "7",
            "null": None,
            "nested": [[1]],
            "huge": [2**64, -(2**64)],
            "mixed": [1, "a", None, 1.5, True],
            "65537": [1] * 65537,
            "65536": [1] * 65536,
        }.items()
    }
    yield from _bootstrap_bodies(
        "POST", "/query_dp_ranks", {"bootstrap_rooms": [7]}, ["bootstrap_rooms.0"], rooms
    )
    for vals in (
        ["-1"] * 4,
        ["0"] * 4,
        ["0", "0", "0", "-1"],
        ["a"] * 4,
        ["9" * 5000] * 4,
        [str(2**64)] * 4,
        ["\u0661"] * 4,
        [""] * 4,
        ["%ff%fe"] * 4,
        ["1e3"] * 4,
        ["0x10"] * 4,
        [" 0 "] * 4,
    ):
        query = "&".join(f"{k}={v}" for k, v in zip(ROUTE_QUERY, vals))
        yield Hostile(f"GET /route?{vals[0][:8]}", "GET", f"/route?{query}", b"", None)
    for query in (
        "",
        "prefill_dp_rank=0",
        "&".join(f"{k}=0&{k}=1" for k in ROUTE_QUERY),
        "x=%00" * 1000,
    ):
        yield Hostile("GET /route odd query", "GET", f"/route?{query}", b"", None)
    for method, path in (
        ("POST", "/route"),
        ("DELETE", "/route"),
        ("GET", "/register_dp_rank"),
        ("PUT", "/health"),
        ("GET", "/nope"),
        ("POST", "/health"),
    ):
        yield Hostile(f"{method} {path}", method, path, b"{}")


def bootstrap_reads() -> list[Hostile]:
    """The two GETs a decode server makes (server info: all ranks -1; pp rank 0's endpoint); the
    fuzzer sends them after every hostile request, so a registration that poisons the table shows
    up."""
    return [
        Hostile(
            f"read back {v}",
            "GET",
            "/route?" + "&".join(f"{k}={v}" for k in ROUTE_QUERY),
            b"",
            None,
        )
        for v in (-1, 0)
    ]
