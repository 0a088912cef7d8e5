"""HTTP server: native and OpenAI routes, streaming, metrics, auth, engine failure, disconnects,
real uvicorn."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from testkit.http import (
    CONTEXT_LENGTH,
    UvicornThread,
    good_generate,
    make_app,
    use_real_engine,
    wait_idle,
)

GREEDY = {"temperature": 0, "ignore_eos": True}


def sse_events(text: str) -> list:
    lines = [ln for ln in text.split("\n\n") if ln.strip()]
    assert all(ln.startswith("data: ") for ln in lines), lines
    assert lines[-1] == "data: [DONE]"
    return [json.loads(ln[len("data: ") :]) for ln in lines[:-1]]


# ---------------------------------------------------------------- info routes


def test_health_and_info(client):
    assert client.get("/health").status_code == 200
    assert client.get("/health_generate").status_code == 200
    for path in ("/server_info", "/get_server_info"):
        info = client.get(path).json()
        assert info["context_length"] == CONTEXT_LENGTH and info["max_n"] >= 1 and "version" in info
    for path in ("/model_info", "/get_model_info"):
        assert client.get(path).json()["is_generation"] is True
    models = client.get("/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["object"] == "model"


# ---------------------------------------------------------------- /generate


def test_generate_text(client):
    r = client.post(
        "/generate", json={"text": "Hello", "sampling_params": {"max_new_tokens": 5, **GREEDY}}
    )
    assert r.status_code == 200, r.text
    body = r.json()
    meta = body["meta_info"]
    assert len(body["output_ids"]) == meta["completion_tokens"] == 5
    assert meta["finish_reason"] == {"type": "length", "length": 5}
    assert meta["prompt_tokens"] > 0 and meta["e2e_latency"] > 0 and meta["id"]
    assert isinstance(body["text"], str)


def test_generate_batch_ids_rid_and_bootstrap(client):
    r = client.post(
        "/generate",
        json={
            "input_ids": [[20, 21, 22], [30, 31]],
            "rid": ["a1", "a2"],
            "sampling_params": {"max_new_tokens": 3, **GREEDY},
            "bootstrap_host": "h",
            "bootstrap_port": 1,
            "bootstrap_room": [5, 6],
        },
    )
    assert r.status_code == 200, r.text
    out = r.json()
    assert [o["meta_info"]["id"] for o in out] == ["a1", "a2"]
    assert [o["meta_info"]["prompt_tokens"] for o in out] == [3, 2]


def test_generate_greedy_deterministic_and_stop_token(client):
    body = {"input_ids": [40, 41, 42], "sampling_params": {"max_new_tokens": 8, **GREEDY}}
    a, b = client.post("/generate", json=body).json(), client.post("/generate", json=body).json()
    assert a["output_ids"] == b["output_ids"]
    stop_id = a["output_ids"][2]
    first = a["output_ids"].index(stop_id)
    body["sampling_params"] |= {"stop_token_ids": [stop_id]}
    c = client.post("/generate", json=body).json()
    assert c["meta_info"]["finish_reason"]["type"] == "stop"
    assert c["output_ids"][:first] == a["output_ids"][:first] and len(c["output_ids"]) <= first + 1


def test_generate_seeded_sampling_reproducible(client):
    body = {
        "input_ids": [7, 8, 9],
        "sampling_params": {
            "max_new_tokens": 6,
            "temperature": 1.0,
            "sampling_seed": 123,
            "ignore_eos": True,
        },
    }
    a, b = client.post("/generate", json=body).json(), client.post("/generate", json=body).json()
    assert a["output_ids"] == b["output_ids"]


def test_generate_stream(client):
    body = {"text": "Once upon", "sampling_params": {"max_new_tokens": 6, **GREEDY}}
    plain = client.post("/generate", json=body).json()
    r = client.post("/generate", json=body | {"stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    assert events[-1]["text"] == plain["text"] and events[-1]["output_ids"] == plain["output_ids"]
    assert events[-1]["meta_info"]["finish_reason"]["type"] == "length"
    lens = [len(e["output_ids"]) for e in events]
    assert lens == sorted(lens)  # cumulative


# ---------------------------------------------------------------- OpenAI routes (TestClient)


def test_completions_n_seed_and_batch(client):
    r = client.post(
        "/v1/completions",
        json={
            "model": "x",
            "prompt": ["Hi", "Bye"],
            "max_tokens": 4,
            "n": 2,
            "seed": 5,
            "temperature": 0.8,
            "ignore_eos": True,
        },
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert all(c["finish_reason"] == "length" for c in body["choices"])
    assert body["usage"]["completion_tokens"] == 16
    assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + 16


def test_chat_completion_max_completion_tokens(client):
    r = client.post(
        "/v1/chat/completions",
        json={
            "model": "x",
            "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
            "max_completion_tokens": 3,
            **GREEDY,
        },
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"]["role"] == "assistant"
    assert body["usage"]["completion_tokens"] == 3


def test_completion_stream_matches_plain(client):
    body = {"prompt": "abc", "max_tokens": 7, **GREEDY}
    plain = client.post("/v1/completions", json=body).json()
    r = client.post(
        "/v1/completions", json=body | {"stream": True, "stream_options": {"include_usage": True}}
    )
    events = sse_events(r.text)
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 7
    text = "".join(c["text"] for e in events[:-1] for c in e["choices"])
    assert text == plain["choices"][0]["text"]
    assert events[-2]["choices"][0]["finish_reason"] == "length"


def test_stop_string_trimmed_in_stream(client):
    body = {"prompt": "abc", "max_tokens": 12, **GREEDY}
    full = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    if len(stop) < 2 or not stop.strip():
        pytest.skip("greedy text too short to pick a stop string")
    plain = client.post("/v1/completions", json=body | {"stop": stop}).json()["choices"][0]
    assert plain["finish_reason"] == "stop" and stop not in plain["text"]
    events = sse_events(
        client.post("/v1/completions", json=body | {"stop": [stop], "stream": True}).text
    )
    assert "".join(c["text"] for e in events for c in e["choices"]) == plain["text"]


def test_metrics(client):
    good_generate(client)
    text = client.get("/metrics").text
    for name in (
        "sparkrelay:num_requests_total",
        "sparkrelay:prompt_tokens_total",
        "sparkrelay:generation_tokens_total",
        "sparkrelay:time_to_first_token_seconds_bucket",
        "sparkrelay:inter_token_latency_seconds_bucket",
        "sparkrelay:num_running_reqs",
        "sparkrelay:num_queue_reqs",
        "sparkrelay:token_usage",
    ):
        assert name in text, name


def test_concurrent_requests_all_finish(served):
    client, async_engine = served

    async def run():
        transport = httpx.ASGITransport(app=client.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as ac:
            rs = await asyncio.gather(
                *[
                    ac.post(
                        "/generate",
                        json={
                            "input_ids": [10 + i, 11],
                            "sampling_params": {"max_new_tokens": 5, **GREEDY},
                        },
                    )
                    for i in range(8)
                ]
            )
        return rs

    # run on the TestClient's own loop: the engine thread delivers outputs to the loop that started
    # it
    rs = client.portal.call(run)
    assert all(r.status_code == 200 for r in rs)
    assert all(r.json()["meta_info"]["completion_tokens"] == 5 for r in rs)
    wait_idle(async_engine)


# ---------------------------------------------------------------- failures and aborts


def test_engine_step_failure_is_500_then_recovers(tiny_model_dir):
    from fastapi.testclient import TestClient

    app, async_engine = make_app(tiny_model_dir)
    real_step = async_engine.engine.step
    calls = {"n": 0}

    def flaky_step():
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("injected failure")
        return real_step()

    async_engine.engine.step = flaky_step
    with TestClient(app) as c:
        r = c.post(
            "/generate", json={"text": "x", "sampling_params": {"max_new_tokens": 5, **GREEDY}}
        )
        assert r.status_code == 500 and "injected failure" in r.json()["error"]["message"]
        good_generate(c)
        assert wait_idle(async_engine)["kv_used_tokens"] == 0
        assert async_engine.num_step_failures == 1


def _slow_app(tiny_model_dir, delay=0.01):
    app, async_engine = make_app(tiny_model_dir)
    real_step, aborted = async_engine.engine.step, []
    real_abort = async_engine.engine.abort

    def slow_step():
        time.sleep(delay)
        return real_step()

    def spy_abort(rid):
        aborted.append(rid)
        real_abort(rid)

    async_engine.engine.step, async_engine.engine.abort = slow_step, spy_abort
    return app, async_engine, aborted


def test_client_disconnect_aborts(tiny_model_dir):
    app, async_engine, aborted = _slow_app(tiny_model_dir)
    long = {"max_new_tokens": CONTEXT_LENGTH - 20, **GREEDY}
    with UvicornThread(app) as srv:
        with httpx.Client(base_url=srv.url) as hc:
            with hc.stream(
                "POST",
                "/generate",
                json={"text": "s", "rid": "streamer", "stream": True, "sampling_params": long},
            ) as r:
                next(r.iter_lines())
            time.sleep(0.3)
            with pytest.raises(httpx.ReadTimeout):
                hc.post(
                    "/generate",
                    json={"text": "p", "rid": "plain", "sampling_params": long},
                    timeout=0.3,
                )
            st = wait_idle(async_engine, timeout=5)
            assert {"streamer", "plain"} <= set(aborted), aborted
            assert st["kv_used_tokens"] == 0
            assert (
                hc.post(
                    "/generate",
                    json={"text": "ok", "sampling_params": {"max_new_tokens": 2, **GREEDY}},
                ).status_code
                == 200
            )


def test_async_engine_generate_cancel_aborts(tiny_model_dir):
    from sparkrelay.manager.client import AsyncEngine
    from sparkrelay.scheduler.request import SamplingParams
    from testkit.http import make_config, make_engine

    ae = AsyncEngine(make_engine(make_config(tiny_model_dir)))

    async def run():
        await ae.start()
        params = SamplingParams(max_new_tokens=100, temperature=0, ignore_eos=True)
        got = []
        gen = ae.generate("g1", [5, 6, 7], params)
        async for out in gen:
            got.append(out)
            if len(out.output_ids) >= 2:
                break
        await gen.aclose()
        full = [
            o
            async for o in ae.generate(
                "g2", [5, 6, 7], params.__class__(max_new_tokens=3, temperature=0)
            )
        ]
        return got, full

    try:
        got, full = asyncio.run(run())
        assert got and not got[-1].finished
        assert full[-1].finished and len(full[-1].output_ids) == 3
        wait_idle(ae)
    finally:
        ae.stop()


# ---------------------------------------------------------------- real uvicorn + official openai
# client


def test_openai_client_against_uvicorn(tiny_model_dir):
    import openai

    app, async_engine = make_app(tiny_model_dir, api_key="sekrit")
    with UvicornThread(app) as srv:
        oc = openai.OpenAI(base_url=srv.url + "/v1", api_key="sekrit", max_retries=0)
        model = oc.models.list().data[0].id
        msgs = [{"role": "user", "content": "Say hi"}]
        chat = oc.chat.completions.create(
            model=model, messages=msgs, max_tokens=5, n=2, seed=1, extra_body=GREEDY
        )
        assert len(chat.choices) == 2 and chat.choices[0].message.role == "assistant"
        assert chat.choices[0].finish_reason == "length" and chat.usage.completion_tokens == 10
        chunks = list(
            oc.chat.completions.create(
                model=model,
                messages=msgs,
                max_tokens=5,
                stream=True,
                stream_options={"include_usage": True},
                extra_body=GREEDY,
            )
        )
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        one = oc.chat.completions.create(
            model=model, messages=msgs, max_tokens=5, extra_body=GREEDY
        )
        assert streamed == one.choices[0].message.content
        assert chunks[-1].usage.completion_tokens == 5
        comp = oc.completions.create(
            model=model, prompt="Hello", max_tokens=4, temperature=0, stop=["\n\n\n"]
        )
        assert comp.choices[0].text is not None and comp.usage.completion_tokens <= 4
        sc = list(
            oc.completions.create(
                model=model, prompt="Hello", max_tokens=4, temperature=0, stream=True
            )
        )
        assert "".join(c.choices[0].text for c in sc if c.choices) == comp.choices[0].text
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=srv.url + "/v1", api_key="wrong", max_retries=0).models.list()
        with pytest.raises(openai.BadRequestError):
            oc.completions.create(model=model, prompt="Hello", max_tokens=-1)
        assert (
            oc.completions.create(model=model, prompt="Hello", max_tokens=2).usage.completion_tokens
            <= 2
        )
        wait_idle(async_engine)


def test_generate_accepts_form_content_type(client):
    """`curl -d '{...}'` sends application/x-www-form-urlencoded; the body is still parsed as
    JSON."""
    body = json.dumps({"text": "Hi", "sampling_params": {"max_new_tokens": 2, **GREEDY}})
    r = client.post(
        "/generate", content=body, headers={"content-type": "application/x-www-form-urlencoded"}
    )
    assert r.status_code == 200, r.text
    assert r.json()["meta_info"]["completion_tokens"] == 2


@pytest.mark.skipif(not use_real_engine(), reason="needs sparkrelay.engine.engine.Engine")
def test_launch_server_subprocess(tiny_model_dir):
    import subprocess
    import sys

    from testkit.http import REPO, free_port

    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "sparkrelay.launch_server",
        "--model-path",
        str(tiny_model_dir),
        "--port",
        str(port),
        "--context-length",
        str(CONTEXT_LENGTH),
        "--log-level",
        "warning",
    ]
    proc = subprocess.Popen(
        cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        url, deadline = f"http://127.0.0.1:{port}", time.time() + 60
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.time() < deadline, "server did not come up"
            time.sleep(0.2)
        r = httpx.post(
            url + "/generate",
            json={"text": "Hi", "sampling_params": {"max_new_tokens": 3, **GREEDY}},
        )
        assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 3
        assert httpx.get(url + "/health_generate", timeout=30).status_code == 200
    finally:
        proc.terminate()
        assert proc.wait(20) is not None


def test_openai_routes_accept_router_bootstrap_fields(client):
    """The SGLang router adds bootstrap_host/port/room to OpenAI bodies too; aggregated mode ignores
    them."""
    extra = {"bootstrap_host": "127.0.0.1", "bootstrap_port": 8998, "bootstrap_room": 12345}
    r = client.post(
        "/v1/completions", json={"prompt": "def f(x):", "max_tokens": 4, "temperature": 0, **extra}
    )
    assert r.status_code == 200, r.text
    r = client.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **extra},
    )
    assert r.status_code == 200, r.text
