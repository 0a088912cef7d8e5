"""Every generation route through both PD routers equals the aggregated server, on one deployment.

One PP=2 prefill (no drafter) + one DSpark decode, with sglang-router (`python -m
sglang_router.launch_router`, when installed) and sparkrelay's router (`python -m
sparkrelay.launch_router`) in front of the same pair, and an aggregated DSpark server beside them:
`/generate`, `/v1/completions` and `/v1/chat/completions`, streamed and not, single and with two
sequences (`n = 2`, or a batch of two on `/generate`), greedy, must give exactly the aggregated
answer. sglang-router adds SGLang's own fields to every body (`return_hidden_states`,
`continue_final_message`, `separate_reasoning`, `stream_reasoning`, ...) and decides the rooms
itself (one room for `n = 2` on /v1/completions, a list for chat); the servers must accept both.
Also here: the SGLang extra fields at a value this server does not serve are refused by name, and
the sparkrelay router's /server_info and /metrics.
"""

from __future__ import annotations

import importlib.util
import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from sparkrelay.tools.cluster import (
    PDSettings,
    free_port,
    server_argv,
    start,
    start_pd,
    start_router,
)

MODEL, DRAFTER = "models/tiny-qwen3", "models/tiny-qwen3-dspark"
MAX_NEW = 12
HAVE_SGLANG_ROUTER = importlib.util.find_spec("sglang_router") is not None
ROUTERS = [
    "sparkrelay",
    pytest.param(
        "sglang",
        marks=pytest.mark.skipif(not HAVE_SGLANG_ROUTER, reason="sglang-router is not installed"),
    ),
]
# what sglang-router 0.3.2 adds to each body it forwards (captured from its requests), at those
# defaults
SGLANG_DEFAULTS = {
    "/generate": {
        "return_text_in_logprobs": False,
        "log_metrics": True,
        "return_hidden_states": False,
        "background": False,
        "no_logs": False,
        "return_bytes": False,
        "return_entropy": False,
        "model": None,
    },
    "/v1/completions": {
        "echo": False,
        "no_stop_trim": False,
        "ignore_eos": False,
        "skip_special_tokens": True,
        "return_hidden_states": False,
    },
    "/v1/chat/completions": {
        "logprobs": False,
        "no_stop_trim": False,
        "ignore_eos": False,
        "continue_final_message": False,
        "skip_special_tokens": True,
        "separate_reasoning": True,
        "stream_reasoning": True,
        "return_hidden_states": False,
    },
}
CHAT = [{"role": "user", "content": "Write a function that adds two numbers."}]


def cases() -> dict[str, tuple[str, dict]]:
    """name -> (path, body); sglang-router 0.3.2 needs `model` on /v1/completions."""
    g = {"sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0.0}}
    c = {"model": MODEL, "max_tokens": MAX_NEW, "temperature": 0.0}
    return {
        "generate": ("/generate", {"text": "def parse(self, line):", **g}),
        "generate-batch2": (
            "/generate",
            {"input_ids": [[755, 420, 7], [474, 2515, 198, 1499]], **g},
        ),
        "completions": ("/v1/completions", {"prompt": "class Scheduler:", **c}),
        "completions-n2": ("/v1/completions", {"prompt": "import os\nimport", "n": 2, **c}),
        "chat": ("/v1/chat/completions", {"messages": CHAT, **c}),
        "chat-n2": ("/v1/chat/completions", {"messages": CHAT, "n": 2, **c}),
    }


def post(client: httpx.Client, url: str, body: dict) -> httpx.Response:
    return client.post(url, json=body)


def sse_events(text: str) -> list:
    """The JSON events of an SSE body, which must end with `data: [DONE]`."""
    frames = [f for f in text.split("\n\n") if f.strip()]
    assert frames and frames[-1] == "data: [DONE]", text[-500:]
    return [json.loads(f.removeprefix("data: ")) for f in frames[:-1]]


def plain_texts(path: str, answer) -> list[str]:
    if path == "/generate":
        return [a["text"] for a in answer] if isinstance(answer, list) else [answer["text"]]
    return [
        c["message"]["content"] if "message" in c else c["text"]
        for c in sorted(answer["choices"], key=lambda c: c["index"])
    ]


def streamed_texts(path: str, events: list) -> list[str]:
    """Per sequence: /generate chunks carry the text so far (the last wins); OpenAI chunks carry
    deltas."""
    texts: dict[int, str] = {}
    for e in events:
        assert "error" not in e, e
        if path == "/generate":
            texts[e.get("index", 0)] = e["text"]
        for c in e.get("choices", []):
            piece = c["delta"].get("content") if "delta" in c else c.get("text")
            texts[c["index"]] = texts.get(c["index"], "") + (piece or "")
    return [texts[i] for i in sorted(texts)]


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    """{"aggregated": url, "sparkrelay": url, "sglang": url (when installed)} over one PD pair."""
    logs = str(tmp_path_factory.mktemp("routes"))
    port = free_port()
    argv = server_argv(
        MODEL,
        port,
        ["--speculative-algorithm", "DSPARK", "--speculative-draft-model-path", DRAFTER],
    )
    with ThreadPoolExecutor(1) as pool:  # the aggregated server starts while the PD pair does
        aggregated = pool.submit(start, "aggregated", argv, port, logs)
        try:
            cluster = start_pd(
                PDSettings(
                    model=MODEL, drafter=DRAFTER, pp_size=2, handoff="hidden", router="sparkrelay"
                ),
                logs,
            )
        except BaseException:
            aggregated.result().stop()
            raise
    servers = [aggregated.result()]
    try:
        urls = {"sparkrelay": cluster.router.url, "aggregated": servers[0].url}
        if HAVE_SGLANG_ROUTER:
            servers.append(
                start_router(
                    "sglang", cluster.prefill.url, cluster.bootstrap_port, cluster.decode.url, logs
                )
            )
            urls["sglang"] = servers[-1].url
        with httpx.Client(timeout=120, trust_env=False) as client:
            wait_ready(client, urls)
            yield client, urls, cluster
    finally:
        for s in servers:
            s.stop()
        cluster.stop()


def wait_ready(client: httpx.Client, urls: dict) -> None:
    """sglang-router answers 503 until its workers pass its health checks."""
    body = {"text": "x", "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}}
    for url in urls.values():
        deadline = time.monotonic() + 60
        while (
            r := post(client, url + "/generate", body)
        ).status_code == 503 and time.monotonic() < deadline:
            time.sleep(0.5)
        assert r.status_code == 200, (url, r.status_code, r.text)


@pytest.fixture(scope="module")
def reference(deployment) -> dict[str, list[str]]:
    client, urls, _ = deployment
    out = {}
    for name, (path, body) in cases().items():
        r = post(client, urls["aggregated"] + path, body)
        assert r.status_code == 200, (name, r.text)
        out[name] = plain_texts(path, r.json())
        assert len(out[name]) == (2 if name.endswith("2") else 1) and all(out[name]), (name, r.text)
    return out


@pytest.mark.parametrize("router", ROUTERS)
def test_every_route_equals_aggregated(deployment, reference, router):
    client, urls, cluster = deployment
    for name, (path, body) in cases().items():
        r = post(client, urls[router] + path, body)
        assert r.status_code == 200, (
            router,
            name,
            r.status_code,
            r.text,
            cluster.decode.log_tail(8),
        )
        assert plain_texts(path, r.json()) == reference[name], (router, name)
        s = post(client, urls[router] + path, {**body, "stream": True})
        assert s.status_code == 200 and s.headers["content-type"].startswith("text/event-stream"), (
            name,
            s.text,
        )
        assert streamed_texts(path, sse_events(s.text)) == reference[name], (router, name, "stream")


@pytest.mark.parametrize("router", ["aggregated", *ROUTERS])
def test_sglang_extra_fields(deployment, reference, router):
    """At sglang-router's defaults: served as without them. At a value this server does not serve: a
    400 naming the field (through sglang-router its own error wrapper, with our message inside)."""
    client, urls, _ = deployment
    for name, (path, body) in cases().items():
        if name.endswith("2"):
            continue
        r = post(client, urls[router] + path, {**body, **SGLANG_DEFAULTS[path]})
        assert r.status_code == 200 and plain_texts(path, r.json()) == reference[name], (
            name,
            r.text,
        )
        r = post(client, urls[router] + path, {**body, "return_hidden_states": True})
        assert (
            r.status_code == 400 and "`return_hidden_states` = True is not supported" in r.text
        ), (name, r.text)
    chat = cases()["chat"][1]
    r = post(
        client,
        urls[router] + "/v1/chat/completions",
        {**chat, "separate_reasoning": False, "stream_reasoning": False},
    )
    assert (
        r.status_code == 200 and plain_texts("/v1/chat/completions", r.json()) == reference["chat"]
    )


def test_continue_final_message(deployment):
    """The reply extends the last assistant message: equal to /generate on the same templated
    text."""
    client, urls, _ = deployment
    msgs = CHAT + [{"role": "assistant", "content": "def add(a, b):"}]
    body = {
        "messages": msgs,
        "max_tokens": MAX_NEW,
        "temperature": 0.0,
        "continue_final_message": True,
    }
    r = post(client, urls["sparkrelay"] + "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(MODEL)
    text = tok.apply_chat_template(msgs, tokenize=False, continue_final_message=True)
    assert text.rstrip().endswith("def add(a, b):")
    g = post(
        client,
        urls["aggregated"] + "/generate",
        {
            "input_ids": tok.encode(text, add_special_tokens=False),
            "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0.0},
        },
    )
    assert r.json()["choices"][0]["message"]["content"] == g.json()["text"]
    bad = post(client, urls["aggregated"] + "/v1/chat/completions", {**body, "messages": CHAT})
    assert bad.status_code == 400 and "continue_final_message" in bad.text


def test_router_info_and_metrics(deployment):
    """The sparkrelay router's /server_info shows both sides (DSpark figures from the decode);
    /metrics is its own."""
    client, urls, cluster = deployment
    path, body = cases()["generate"]
    # at least one DSpark round
    assert post(client, urls["sparkrelay"] + path, body).status_code == 200
    info = client.get(urls["sparkrelay"] + "/server_info").json()
    assert info["role"] == "router" and [w["url"] for w in info["prefill"]] == [cluster.prefill.url]
    assert [w["url"] for w in info["decode"]] == [cluster.decode.url]
    assert [info[side][0]["disaggregation_mode"] for side in ("prefill", "decode")] == [
        "prefill",
        "decode",
    ]
    assert info["internal_states"] == info["decode"][0]["internal_states"]
    assert info["internal_states"][0]["avg_spec_accept_length"] >= 1.0
    text = client.get(urls["sparkrelay"] + "/metrics").text
    assert 'sparkrelay_router:requests_total{route="/v1/chat/completions",status="200"}' in text
    assert 'sparkrelay_router:request_latency_seconds_bucket{le="+Inf",route="/generate"}' in text


@pytest.mark.parametrize("router", ROUTERS)
def test_streamed_error_is_well_formed(deployment, router):
    """A streamed request that fails comes back as one parseable error (SSE event or JSON) naming
    the cause, never as sglang-router's rewrite of a non-2xx stream (`data: {'error': ...` cut
    short): the decode answers a streamed request's error as a 200 SSE error event, with the real
    status as its code."""
    client, urls, cluster = deployment
    for name in ("generate", "completions", "chat"):
        path, body = cases()[name]
        r = post(
            client, urls[router] + path, {**body, "stream": True, "return_hidden_states": True}
        )
        if r.headers["content-type"].startswith("text/event-stream"):
            events = sse_events(r.text)
            assert len(events) == 1 and r.status_code in (200, 400), (name, r.status_code, r.text)
            error = events[0]["error"]
        else:
            assert r.status_code == 400, (name, r.text)
            error = r.json()["error"]
        assert "`return_hidden_states` = True is not supported" in error["message"], (name, r.text)
    bad = {"text": "x", "stream": True, "sampling_params": {"top_k": 0}}
    direct = post(client, cluster.decode.url + "/generate", bad)
    assert direct.status_code == 200 and sse_events(direct.text)[0]["error"]["code"] == 400
    aggregated = post(client, urls["aggregated"] + "/generate", bad)
    # direct clients: a 4xx
    assert aggregated.status_code == 400 and aggregated.json()["error"]["code"] == 400


def test_rooms_for_n_samples():
    """One room for n samples of one prompt, or one per prompt: sample j takes room + j (SGLang's
    rule), kept in 1..2^63-1; both servers derive the same rooms from the same body."""
    from sparkrelay.manager.messages import GenerationItem
    from sparkrelay.server import protocol as P

    def rooms(req, n_items):
        items = [GenerationItem(f"r{i}", [1], P.SamplingParams()) for i in range(n_items)]
        return [it.bootstrap.room for it in P.with_bootstrap(req, items)]

    boot = {"bootstrap_host": "127.0.0.1", "bootstrap_port": 8998}
    assert rooms(P.CompletionRequest(prompt="x", n=2, bootstrap_room=7, **boot), 2) == [7, 8]
    assert rooms(
        P.CompletionRequest(prompt=["x", "y"], n=2, bootstrap_room=[7, 70], **boot), 4
    ) == [7, 8, 70, 71]
    assert rooms(P.CompletionRequest(prompt="x", n=3, bootstrap_room=2**63 - 2, **boot), 3) == [
        2**63 - 2,
        2**63 - 1,
        1,
    ]
    # sglang-router's chat n
    chat = P.ChatCompletionRequest(messages=CHAT, n=2, bootstrap_room=[5, 9], **boot)
    assert rooms(chat, 2) == [5, 9]
    with pytest.raises(P.RequestError, match="one room per"):
        rooms(P.CompletionRequest(prompt=["x", "y"], n=2, bootstrap_room=7, **boot), 4)
    with pytest.raises(P.RequestError, match="entries"):
        rooms(P.CompletionRequest(prompt=["x", "y"], n=2, bootstrap_room=[1, 2, 3], **boot), 4)
