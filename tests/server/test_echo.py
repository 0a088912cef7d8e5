"""`echo` on /v1/completions, as evaluation harnesses use it: the prompt (as sent, or decoded from
token ids) leads the text; with `logprobs` the prompt's tokens come first with their logprobs (None for
the first token), equal to /generate's `input_token_logprobs`; `max_tokens: 0` scores the prompt alone;
a stream's first chunk carries the prompt."""

from __future__ import annotations

import json

PROMPT = "def add(a, b):"


def test_echo_text_and_prompt_logprobs_equal_generate(client):
    r = client.post(
        "/v1/completions",
        json={"prompt": PROMPT, "max_tokens": 3, "echo": True, "logprobs": 2, "temperature": 0},
    )
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    plain = client.post(
        "/v1/completions", json={"prompt": PROMPT, "max_tokens": 3, "temperature": 0}
    )
    assert choice["text"] == PROMPT + plain.json()["choices"][0]["text"]
    gen = client.post(
        "/generate",
        json={
            "text": PROMPT,
            "sampling_params": {"max_new_tokens": 3, "temperature": 0},
            "return_logprob": True,
            "logprob_start_len": 0,
            "top_logprobs_num": 2,
        },
    ).json()["meta_info"]
    n = len(gen["input_token_logprobs"])
    lp = choice["logprobs"]
    assert lp["token_logprobs"][:n] == [v for v, _, _ in gen["input_token_logprobs"]]
    assert lp["token_logprobs"][n:] == [v for v, _, _ in gen["output_token_logprobs"]]
    assert lp["top_logprobs"][0] is None and len(lp["top_logprobs"][1]) == 2
    assert lp["text_offset"][0] == 0 and lp["text_offset"][n] == len(PROMPT)
    assert "".join(lp["tokens"]) == choice["text"]


def test_max_tokens_zero_scores_the_prompt_from_token_ids(served):
    client, async_engine = served
    tokenizer = async_engine.tokenizer
    ids = tokenizer.encode(PROMPT)
    r = client.post(
        "/v1/completions",
        json={"prompt": [ids, ids[:3]], "max_tokens": 0, "echo": True, "logprobs": 0},
    )
    assert r.status_code == 200, r.text
    first, second = r.json()["choices"]
    assert first["text"] == tokenizer.decode(ids) and first["finish_reason"] == "length"
    assert len(first["logprobs"]["token_logprobs"]) == len(ids)
    assert first["logprobs"]["token_logprobs"][:3] == second["logprobs"]["token_logprobs"]
    assert first["logprobs"]["top_logprobs"][1] is None  # logprobs 0: the chosen token's only


def test_streamed_echo_leads_with_the_prompt(client):
    body = {"prompt": PROMPT, "max_tokens": 4, "echo": True, "temperature": 0, "stream": True}
    texts = []
    with client.stream("POST", "/v1/completions", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                texts += [c["text"] for c in json.loads(line[6:])["choices"]]
    whole = client.post("/v1/completions", json=body | {"stream": False}).json()
    assert texts[0].startswith(PROMPT) and "".join(texts) == whole["choices"][0]["text"]
