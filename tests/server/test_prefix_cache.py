"""The prefix (radix) cache through the HTTP server: meta_info.cached_tokens, OpenAI usage,
/metrics, /server_info, POST /flush_cache (refused while a request runs), --disable-radix-cache; and
the same tokens and the same DSpark acceptance as without the cache."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from fastapi.testclient import TestClient

from testkit.http import REPO, make_app, use_real_engine, wait_idle

pytestmark = pytest.mark.skipif(not use_real_engine(), reason="needs the real engine")

MODEL, DRAFTER = (
    REPO / "models" / "tiny-qwen3",
    REPO / "models" / "tiny-qwen3-dspark",
)  # the bundled pair
GREEDY = {"temperature": 0, "ignore_eos": True}
PROMPT = list(range(100, 260))  # 160 tokens: 10 pages of 16


def generate(client, ids, n=8):
    r = client.post(
        "/generate", json={"input_ids": ids, "sampling_params": {"max_new_tokens": n, **GREEDY}}
    )
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture(scope="module", params=["cache", "no cache"])
def served(request):
    leaves = {
        "speculative_algorithm": "DSPARK",
        "speculative_draft_model_path": str(DRAFTER),
        "disable_radix_cache": request.param == "no cache",
        "context_length": 1024,
    }
    app, async_engine = make_app(MODEL, **leaves)
    with TestClient(app) as client:
        yield request.param, client, async_engine


def test_a_repeated_prompt_is_served_from_the_cache_with_the_same_tokens_and_acceptance(served):
    mode, client, async_engine = served
    assert client.post("/flush_cache").status_code == 200
    first = generate(client, PROMPT)
    turn2 = PROMPT + first["output_ids"] + list(range(300, 340))
    second, again = generate(client, PROMPT), generate(client, turn2)
    assert second["output_ids"] == first["output_ids"]
    assert second["meta_info"]["spec_accept_length"] == first["meta_info"]["spec_accept_length"]
    if mode == "no cache":
        assert [m["meta_info"]["cached_tokens"] for m in (first, second, again)] == [0, 0, 0]
        return
    assert first["meta_info"]["cached_tokens"] == 0
    # 160 tokens: the page holding the last one is recomputed
    assert second["meta_info"]["cached_tokens"] == 144
    # prompt + 8 outputs: 167 computed -> 10 full pages
    assert again["meta_info"]["cached_tokens"] == 160
    state = wait_idle(async_engine)
    assert (
        state["prefix_cache"] == "on"
        and state["prefix_cache_tokens"] > 0
        and state["kv_used_tokens"] == 0
    )
    info = client.get("/server_info").json()["internal_states"][0]
    assert info["cache_hit_tokens"] == 144 + 160 and 0 < info["cache_hit_rate"] < 1
    metrics = client.get("/metrics").text
    assert (
        "sparkrelay:cache_hit_rate" in metrics and "sparkrelay:cached_tokens_total 304.0" in metrics
    )


def test_openai_usage_reports_cached_tokens(served):
    mode, client, _ = served
    body = {"model": "m", "prompt": PROMPT, "max_tokens": 4, "temperature": 0}
    client.post("/v1/completions", json=body)
    usage = client.post("/v1/completions", json=body).json()["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == (144 if mode == "cache" else 0)


def test_flush_cache_empties_it_and_is_refused_while_a_request_runs(served):
    mode, client, async_engine = served
    generate(client, PROMPT)

    async def flush_while_generating():
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=client.app), base_url="http://t"
        ) as ac:
            body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 400, **GREEDY}}
            gen = asyncio.create_task(ac.post("/generate", json=body))
            while not (
                async_engine.last_stats.get("num_running")
                or async_engine.last_stats.get("num_waiting")
            ):
                await asyncio.sleep(0.002)
            return await ac.post("/flush_cache"), await gen

    # on the TestClient's own loop: the engine thread delivers outputs to the loop that started it
    r, gen = client.portal.call(flush_while_generating)
    assert r.status_code == 400 and "requests are running or waiting" in r.text
    assert gen.status_code == 200 and gen.json()["meta_info"]["completion_tokens"] == 400
    wait_idle(async_engine)
    r = client.get("/flush_cache")  # SGLang answers GET and POST
    assert r.status_code == 200 and r.text == "Cache flushed.\n"
    assert generate(client, PROMPT)["meta_info"]["cached_tokens"] == 0
    assert wait_idle(async_engine)["check_error"] is None


def test_under_memory_pressure_the_server_evicts_serves_everyone_and_is_consistent_when_idle():
    """A KV cache of 48 pages against 16 concurrent requests of 13-20 pages sharing a 160-token
    prefix, a third of them aborted by their clients: every other request completes with the tokens
    it gets alone, the cache gave way (evictions), and when idle no page is in use and the invariant
    check passed."""
    app, async_engine = make_app(
        MODEL,
        speculative_algorithm="DSPARK",
        speculative_draft_model_path=str(DRAFTER),
        context_length=1024,
        max_total_tokens=768,
        max_running_requests=8,
    )
    prompts = [PROMPT + list(range(400 + 7 * i, 440 + 7 * i + 3 * i)) for i in range(16)]
    with TestClient(app) as client:
        alone = [generate(client, p, 24)["output_ids"] for p in prompts[:2]]

        async def load():
            async with httpx.AsyncClient(
                transport=httpx.ASGITransport(app=client.app), base_url="http://t"
            ) as ac:

                async def one(i):
                    body = {
                        "input_ids": prompts[i],
                        "sampling_params": {"max_new_tokens": 24, **GREEDY},
                    }
                    post = ac.post("/generate", json=body)
                    # aborted: the client goes away mid-request (if it has not finished by then)
                    if i % 3 == 2:
                        try:
                            return (await asyncio.wait_for(post, timeout=0.05 * i)).json()
                        except asyncio.TimeoutError:
                            return None
                    return (await post).json()

                return await asyncio.gather(*(one(i) for i in range(16)))

        outs = client.portal.call(load)
        assert [o["output_ids"] for o in outs[:2]] == alone
        done = [o for o in outs if o is not None]
        assert len(done) >= 10 and all(o["meta_info"]["completion_tokens"] == 24 for o in done)
        state = wait_idle(async_engine, timeout=30)
        assert state["kv_used_tokens"] == 0 and state["check_error"] is None, state
        assert state["cache_evicted_tokens"] > 0 and state["cache_hit_tokens"] > 0, state
