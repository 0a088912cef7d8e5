"""Hostile input at the HTTP boundaries: no input gets a 5xx, the process stays up, the engine ends
idle with no KV in use, and a greedy request afterwards gives the same tokens as before.

Three servers, each a real uvicorn in a thread: the tiny-model API server (schemathesis over its
OpenAPI schema, valid and invalid data, plus sparkrelay.tools.fuzz's hand-made hostile requests),
the PD router against stub workers that answer only 200 or 400, and the prefill bootstrap server.
The default tests take under a minute; `-m slow` runs the long schemathesis run and the heavy bodies
(10 MB prompts, 1M-key objects) on every route.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import logging

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from sparkrelay.tools.fuzz import cases as C
from sparkrelay.tools.fuzz import run as F
from testkit.http import UvicornThread, good_generate, make_app, wait_idle

needs_schemathesis = pytest.mark.skipif(
    importlib.util.find_spec("schemathesis") is None,
    reason="schemathesis is not installed (pip install -e .[test])",
)

FUZZ_CONTEXT = 32  # short generations keep the valid fuzz cases cheap


@pytest.fixture(scope="module")
def api(tiny_model_dir):
    """(base URL, client, AsyncEngine, greedy output ids of a fixed request before any fuzzing)."""
    app, async_engine = make_app(tiny_model_dir, context_length=FUZZ_CONTEXT)
    with (
        UvicornThread(app) as server,
        httpx.Client(base_url=server.url, timeout=120, trust_env=False) as client,
    ):
        yield server.url, client, async_engine, good_generate(client)["output_ids"]


def assert_survived(api, report: F.Report) -> None:
    _, client, async_engine, greedy_ids = api
    assert not report.failures, "\n".join(report.failures[:20])
    assert report.count(lambda s: s == 400) > 0 and report.count(lambda s: s == 200) > 0, (
        report.table()
    )
    assert client.get("/health").status_code == 200
    st = wait_idle(async_engine, timeout=30)
    assert st["kv_used_tokens"] == 0 and st.get("check_error") is None, st
    assert async_engine.num_step_failures == 0
    assert good_generate(client)["output_ids"] == greedy_ids


@needs_schemathesis
def test_schemathesis_api(api):
    report = F.Report()
    F.run_schema(api[0], report, max_examples=25)
    assert {
        "POST /generate",
        "POST /v1/completions",
        "POST /v1/chat/completions",
        "GET /health",
    } <= set(report.statuses)
    # the bodies are in the schema: coverage has cases
    assert report.statuses["POST /generate"].total() > 100
    assert_survived(api, report)


def test_hostile_requests_api(api, caplog):
    caplog.set_level(logging.INFO, logger="sparkrelay.server.http_server")
    report = F.Report()
    F.send_hostile(api[1], report, C.hostile_requests(heavy=False))
    for path in C.ROUTES:
        F.stream_and_leave(api[1], report, path, max_tokens=FUZZ_CONTEXT // 2)
    assert_survived(api, report)
    reasons = [r.getMessage() for r in caplog.records if r.getMessage().startswith("rejected POST")]
    # a Content-Type with a DEL byte is refused by uvicorn before the app on some h11 versions (one
    # per route)
    rejected = report.count(lambda s: s == 400)
    assert rejected - len(C.ROUTES) <= len(reasons) <= rejected, (len(reasons), report.table())
    assert any("must fit in a signed 64-bit integer" in m for m in reasons)


def test_openapi_documents_bodies(api):
    schema = api[1].get("/openapi.json").json()
    for path, model in (
        (C.GENERATE, "GenerateRequest"),
        (C.COMPLETIONS, "CompletionRequest"),
        (C.CHAT, "ChatCompletionRequest"),
    ):
        body = schema["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert body == {"$ref": f"#/components/schemas/{model}"}
        assert schema["components"]["schemas"][model]["additionalProperties"] is False
    assert "GenerateSamplingParams" in schema["components"]["schemas"]


@pytest.mark.parametrize(
    "path,body,words",
    [
        (C.GENERATE, b'{"text": "hi", "sampling_params": {"temperature": NaN}}', "finite"),
        (C.COMPLETIONS, b'{"prompt": "hi", "top_k": 18446744073709551616}', "64-bit"),
        (
            C.CHAT,
            b'{"messages": [{"role": "user", "content": "hi"}], "n": 2, "seed": 9223372036854775807}',
            "64-bit",
        ),
        (C.GENERATE, b'{"text": "\\ud800 hi"}', "surrogate"),
        (C.CHAT, b'{"messages": [{"role": "user", "content": "\\udfff"}]}', "surrogate"),
        (C.GENERATE, b'{"text": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nested too deeply"),
    ],
)
def test_fixed_bugs_are_400(api, path, body, words):
    """Each of these was a 500 (and the int64 ones failed the engine step, aborting every request in
    flight)."""
    r = api[1].post(path, content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400 and words in r.json()["error"]["message"], r.text


@pytest.mark.slow
@needs_schemathesis
def test_schemathesis_api_long(api):
    report = F.Report()
    F.run_schema(api[0], report, max_examples=500)
    F.send_hostile(api[1], report, C.hostile_requests(heavy=True))
    assert_survived(api, report)


# ---------------------------------------------------------------- PD router against stub workers


class StubWorker:
    """A prefill/decode worker as the router sees it: 200 for a JSON object (SSE when it asks to
    stream), else 400."""

    def __init__(self, role: str):
        self.role, self.seen = role, 0
        self.app = FastAPI()
        self.app.add_api_route("/{path:path}", self.handle, methods=["GET", "POST"])

    async def handle(self, request: Request) -> Response:
        self.seen += 1
        if request.method == "GET":
            return JSONResponse({"role": self.role})
        try:
            body = json.loads(await request.body())
        except (ValueError, RecursionError):
            return JSONResponse({"error": {"message": f"{self.role}: bad JSON"}}, 400)
        if not isinstance(body, dict):
            return JSONResponse({"error": {"message": f"{self.role}: not an object"}}, 400)
        if body.get("stream") is True and self.role == "decode":
            return StreamingResponse(self.sse(), media_type="text/event-stream")
        return JSONResponse({"role": self.role, "room": body.get("bootstrap_room")})

    async def sse(self):
        for i in range(20):
            yield f'data: {{"text": "{i}"}}\n\n'
            await asyncio.sleep(0.05)
        yield "data: [DONE]\n\n"


@pytest.fixture(scope="module")
def router_url():
    from sparkrelay.router.app import build_app
    from sparkrelay.router.rewrite import PrefillWorker, RouterConfig

    p, d = StubWorker("prefill"), StubWorker("decode")
    with UvicornThread(p.app) as ps, UvicornThread(d.app) as ds:
        config = RouterConfig(
            (PrefillWorker(ps.url, 8998),), (ds.url,), request_timeout_secs=60, max_retries=1
        )
        with UvicornThread(build_app(config)) as router:
            yield router.url


def assert_router_survived(url: str, report: F.Report) -> None:
    assert not report.failures, "\n".join(report.failures[:20])
    with httpx.Client(base_url=url, timeout=30, trust_env=False) as c:
        assert c.get("/health").status_code == 200
        r = c.post("/generate", json={"text": "hi"})
        assert r.status_code == 200 and r.json()["role"] == "decode" and r.json()["room"] > 0


def test_router_hostile_requests(router_url):
    report = F.Report()
    with httpx.Client(base_url=router_url, timeout=60, trust_env=False) as c:
        F.send_hostile(c, report, C.hostile_requests(heavy=False))
        for path in C.ROUTES:
            F.stream_and_leave(c, report, path, max_tokens=8)
        # a chat `n` of 10**12 made the router draw 10**12 rooms (a hang); batches are capped now
        r = c.post(C.CHAT, json={"messages": [{"role": "user", "content": "x"}], "n": 10**12})
        assert r.status_code == 400 and "batch" in r.json()["error"]["message"]
    assert_router_survived(router_url, report)


@needs_schemathesis
def test_router_schemathesis(router_url):
    report = F.Report()
    F.run_schema(router_url, report, max_examples=10)
    assert_router_survived(router_url, report)


# ---------------------------------------------------------------- the PD prefill bootstrap server


@pytest.fixture
def bootstrap_server():
    from sparkrelay.transfer.bootstrap import BootstrapServer

    server = BootstrapServer("127.0.0.1", 0, 1, {"layers": [0, 1]}, None, 16, "bfloat16")
    server.start()
    try:
        yield server
    finally:
        server.stop()


def test_bootstrap_surrogate_rank_ip(bootstrap_server):
    """A rank_ip that is no host name (here a lone surrogate) is refused at registration (it used to
    be stored and make GET /route answer 500); reads afterwards answer 503 (nothing registered),
    never 5xx otherwise."""
    with httpx.Client(base_url=bootstrap_server.url, timeout=30, trust_env=False) as c:
        r = c.put(
            "/route",
            content=C._json({**C.REGISTRATION, "rank_ip": "\ud800"}),
            headers={"content-type": "application/json"},
        )
        assert r.status_code == 400 and "rank_ip" in r.text
        for path in (
            "/route?prefill_dp_rank=-1&prefill_cp_rank=-1&target_tp_rank=-1&target_pp_rank=-1",
            "/route?prefill_dp_rank=0&prefill_cp_rank=0&target_tp_rank=0&target_pp_rank=0",
        ):
            assert c.get(path).status_code == 503


def test_bootstrap_hostile_requests(bootstrap_server):
    """Every hostile request is followed by the two reads a decode server makes; those must keep
    working."""
    import time

    from sparkrelay.transfer.bootstrap import fetch_prefill_info, fetch_rank

    server, reads = bootstrap_server, C.bootstrap_reads()
    with httpx.Client(base_url=server.url, timeout=30, trust_env=False) as c:
        assert c.put("/route", json=C.REGISTRATION).status_code == 200
        report = F.Report()
        for h in C.bootstrap_hostile_requests():
            F.send_hostile(c, report, [h, *reads])
        assert not report.failures, "\n".join(report.failures[:20])
        assert report.count(lambda s: s == 400) > 100 and report.count(lambda s: s == 413) > 0, (
            report.table()
        )
        assert c.get("/health").status_code == 200
        assert c.put("/route", json=C.REGISTRATION).status_code == 200
        deadline = time.monotonic() + 10
        assert fetch_prefill_info(server.url, deadline)["schema"] == {"layers": [0, 1]}
        assert fetch_rank(server.url, 0, deadline) == ("127.0.0.1", C.REGISTRATION["rank_port"])
