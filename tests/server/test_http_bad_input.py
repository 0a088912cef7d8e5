"""Every kind of bad request gets a 4xx with a readable OpenAI-style error, and the next good
request works."""

from __future__ import annotations

import pytest

from testkit.http import CONTEXT_LENGTH, MAX_N, good_generate, make_app, wait_idle

CHAT = "/v1/chat/completions"
MSGS = [{"role": "user", "content": "hi"}]
VOCAB = 4096

# (route, JSON body or raw bytes, words the error message must contain)
BAD = {
    "malformed_json": ("/generate", b'{"text": "hi", ', "malformed JSON"),
    "body_not_object": ("/v1/completions", b"[1, 2]", "invalid request"),
    "wrong_type_max_tokens": (
        "/v1/completions",
        {"prompt": "hi", "max_tokens": "many"},
        "max_tokens",
    ),
    "wrong_type_text": ("/generate", {"text": 123}, "text"),
    "wrong_type_messages": (CHAT, {"messages": "hi"}, "messages"),
    "missing_prompt": ("/v1/completions", {"max_tokens": 3}, "prompt"),
    "text_and_ids": ("/generate", {"text": "a", "input_ids": [1]}, "exactly one"),
    "empty_text": ("/generate", {"text": ""}, "empty"),
    "empty_ids": ("/generate", {"input_ids": []}, "empty"),
    "empty_completion_prompt": ("/v1/completions", {"prompt": ""}, "empty"),
    "empty_messages": (CHAT, {"messages": []}, "messages"),
    "negative_max_tokens": ("/v1/completions", {"prompt": "hi", "max_tokens": -1}, "max_tokens"),
    "negative_max_new_tokens": (
        "/generate",
        {"text": "hi", "sampling_params": {"max_new_tokens": -5}},
        "max_new_tokens",
    ),
    "huge_max_tokens": ("/v1/completions", {"prompt": "hi", "max_tokens": 10**9}, "context length"),
    "huge_max_completion_tokens": (
        CHAT,
        {"messages": MSGS, "max_completion_tokens": CONTEXT_LENGTH + 1},
        "context length",
    ),
    "prompt_longer_than_context": (
        "/generate",
        {"input_ids": [20] * (CONTEXT_LENGTH + 10)},
        "context",
    ),
    "prompt_plus_max_over_context": (
        "/generate",
        {"input_ids": [20] * (CONTEXT_LENGTH - 10), "sampling_params": {"max_new_tokens": 50}},
        "context",
    ),
    "out_of_vocab_id": ("/generate", {"input_ids": [5, VOCAB + 7]}, "vocab"),
    "negative_token_id": ("/v1/completions", {"prompt": [5, -1]}, "vocab"),
    "n_too_large": ("/v1/completions", {"prompt": "hi", "n": MAX_N + 1}, "max-n"),
    "n_zero": (CHAT, {"messages": MSGS, "n": 0}, "`n`"),
    "negative_temperature": (CHAT, {"messages": MSGS, "temperature": -0.5}, "temperature"),
    "negative_temperature_native": (
        "/generate",
        {"text": "a", "sampling_params": {"temperature": -1}},
        "temperature",
    ),
    "bad_top_p": ("/v1/completions", {"prompt": "hi", "top_p": 0}, "top_p"),
    "empty_stop_string": ("/v1/completions", {"prompt": "hi", "stop": [""]}, "stop"),
    "unknown_field": (
        "/generate",
        {"text": "a", "sampling_params": {"no_such_penalty": 1.0}},
        "unsupported field",
    ),
    "too_many_top_logprobs_native": (
        "/generate",
        {"text": "a", "return_logprob": True, "top_logprobs_num": 21},
        "top_logprobs_num",
    ),
    "bad_logprob_start_len": (
        "/generate",
        {"text": "a", "return_logprob": True, "logprob_start_len": -2},
        "logprob_start_len",
    ),
    "too_many_top_logprobs": (
        CHAT,
        {"messages": MSGS, "logprobs": True, "top_logprobs": 21},
        "top_logprobs",
    ),
    "top_logprobs_without_logprobs": (
        CHAT,
        {"messages": MSGS, "top_logprobs": 2},
        "logprobs: true",
    ),
    "negative_logprobs": ("/v1/completions", {"prompt": "hi", "logprobs": -1}, "`logprobs`"),
    "too_many_logprobs": ("/v1/completions", {"prompt": "hi", "logprobs": 21}, "`logprobs`"),
    "out_of_range_penalty": (
        "/v1/completions",
        {"prompt": "hi", "presence_penalty": 2.5},
        "presence_penalty",
    ),
    "batch_length_mismatch": ("/generate", {"text": ["a", "b"], "rid": ["only-one"]}, "batch"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_request_then_good(served, case):
    client, async_engine = served
    path, body, words = BAD[case]
    if isinstance(body, bytes):
        r = client.post(path, content=body, headers={"content-type": "application/json"})
    else:
        r = client.post(path, json=body)
    assert r.status_code == 400, (case, r.status_code, r.text)
    err = r.json()["error"]
    assert err["type"] == "BadRequestError" and err["code"] == 400
    assert words.lower() in err["message"].lower(), (case, err["message"])
    good_generate(client)
    st = wait_idle(async_engine)
    assert st["kv_used_tokens"] == 0


def test_duplicate_rid_in_flight_is_400(served):
    client, _ = served
    r = client.post("/generate", json={"text": ["a", "b"], "rid": ["same", "same"]})
    assert r.status_code == 400 and "already in use" in r.json()["error"]["message"]
    good_generate(client)


def test_unknown_route_is_404_json(client):
    r = client.get("/nope")
    assert r.status_code == 404 and r.json()["error"]["code"] == 404
    good_generate(client)


def test_api_key(tiny_model_dir):
    from fastapi.testclient import TestClient

    app, _ = make_app(tiny_model_dir, api_key="k1")
    with TestClient(app) as c:
        assert c.get("/health").status_code == 200
        assert c.get("/metrics").status_code == 200
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "k1"}):
            r = c.post("/generate", json={"text": "a"}, headers=headers)
            assert r.status_code == 401 and "API key" in r.json()["error"]["message"]
            assert c.get("/server_info", headers=headers).status_code == 401
        c.headers["Authorization"] = "Bearer k1"
        good_generate(c)
        assert c.get("/server_info").json()["api_key"] == "<redacted>"


@pytest.mark.parametrize(
    "argv,words",
    [
        (["--no-such-flag"], "--no-such-flag"),
        (["--port", "abc"], "--port"),
        (["--port", "0"], "--port"),
        (["--max-n", "0"], "--max-n"),
        (["--dtype", "int3"], "--dtype"),
        (["--model-path", "/definitely/not/here"], "--model-path"),
    ],
)
def test_launch_server_bad_flags(argv, words, capsys):
    from sparkrelay.launch_server import main

    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code != 0
    assert words in capsys.readouterr().err
