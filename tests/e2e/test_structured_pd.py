"""Structured outputs through PD: a PP = 2 prefill without a drafter, a DSpark decode (`draft-kv`) and
sparkrelay's router, on the bundled pair. The prefill samples the first token under the grammar, the
decode resumes the matcher from it; chat completions with `response_format` give exactly the
aggregated DSpark server's tokens, and every answer validates against its schema. The OpenAI SDK's
`parse` and a required tool call work unmodified through the router, and `echo` with `logprobs` on
/v1/completions carries the prefill's prompt logprobs (the router merges them into the decode's
answer, plain and streamed)."""

from __future__ import annotations

import json
import time

import jsonschema
import pytest

from sparkrelay import LLM, SamplingParams
from sparkrelay.tools.bench.schemas import SCHEMAS, request_text
from sparkrelay.tools.cluster import PDSettings, start_pd
from testkit.pd import DRAFTER, MODEL, post

PICKED = [SCHEMAS[i] for i in (0, 3, 9, 13, 19)]
MAX_TOKENS = 160


def _body(what: str, schema: dict) -> dict:
    return {
        "messages": [{"role": "user", "content": request_text(what)}],
        "temperature": 0,
        "max_tokens": MAX_TOKENS,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
    }


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    llm = LLM(MODEL, speculative_algorithm="DSPARK", speculative_draft_model_path=DRAFTER)
    out = []
    for what, schema in PICKED:
        ids = llm.tokenizer.apply_chat_template(
            [{"role": "user", "content": request_text(what)}], add_generation_prompt=True
        )
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        params = SamplingParams(
            max_new_tokens=MAX_TOKENS, temperature=0, json_schema=json.dumps(schema)
        )
        out.append(llm.generate(ids, params)["output_ids"])
    llm.engine.close()
    return out


def test_pd_pp2_draft_kv_structured_outputs_equal_aggregated(tmp_path, reference):
    template = ["--chat-template", "sparkrelay/chat_templates/chatml_tools.jinja"]
    settings = PDSettings(
        model=MODEL,
        drafter=DRAFTER,
        handoff="draft-kv",
        prefill_args=template,
        decode_args=template,
    )
    cluster = start_pd(settings, str(tmp_path))
    try:
        deadline = time.monotonic() + 30
        for (what, schema), want in zip(PICKED, reference):
            while True:
                status, out = post(cluster.url + "/v1/chat/completions", _body(what, schema))
                if status != 503 or time.monotonic() > deadline:
                    break
                time.sleep(0.5)
            assert status == 200, (status, out, cluster.decode.log_tail())
            text = out["choices"][0]["message"]["content"]
            jsonschema.validate(json.loads(text), schema)
            assert out["choices"][0]["finish_reason"] == "stop"
            assert text == LLMText.decode(want), (what, text)
        _sdk_parse(cluster.url)
        _sdk_tool_call(cluster.url)
        _echo_scores(cluster.url)
    finally:
        cluster.stop()


class LLMText:
    """The reference tokens as text (the router's answer carries text, not ids)."""

    _tok = None

    @classmethod
    def decode(cls, ids: list[int]) -> str:
        if cls._tok is None:
            from transformers import AutoTokenizer

            cls._tok = AutoTokenizer.from_pretrained(MODEL)
        return cls._tok.decode(ids, skip_special_tokens=True)


def _sdk_parse(url: str) -> None:
    from openai import OpenAI
    from pydantic import BaseModel, Field

    class Light(BaseModel):
        color: str = Field(pattern="^(red|yellow|green)$")
        seconds: int = Field(ge=1, le=120)

    client = OpenAI(base_url=url + "/v1", api_key="none")
    done = client.chat.completions.parse(
        model=MODEL,
        messages=[{"role": "user", "content": "A traffic light as JSON."}],
        response_format=Light,
        temperature=0,
        max_tokens=60,
    )
    assert isinstance(done.choices[0].message.parsed, Light), done.choices[0].message.content


def _sdk_tool_call(url: str) -> None:
    """A required tool call through the router: the prefill samples the call's first token under
    the tool grammar, the decode the rest; the SDK gets a call whose arguments follow the schema."""
    from openai import OpenAI

    params = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 10}},
        "required": ["city"],
        "additionalProperties": False,
    }
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": params}}
    client = OpenAI(base_url=url + "/v1", api_key="none")
    done = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Weather in Oslo?"}],
        tools=[tool],
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
        max_tokens=60,
    )
    (call,) = done.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and done.choices[0].finish_reason == "tool_calls"
    jsonschema.validate(json.loads(call.function.arguments), params)


ECHO_PROMPT = "def add(a, b):"


def _echo_scores(url: str) -> None:
    llm = LLM(MODEL)
    ids = llm.tokenizer.encode(ECHO_PROMPT)
    params = SamplingParams(
        max_new_tokens=3, temperature=0, return_logprob=True, logprob_start_len=0
    )
    ref = llm.generate(ids, params)["meta_info"]
    want = [v for v, _, _ in ref["input_token_logprobs"]] + [
        v for v, _, _ in ref["output_token_logprobs"]
    ]
    llm.engine.close()
    body = {"prompt": ECHO_PROMPT, "max_tokens": 3, "echo": True, "logprobs": 1, "temperature": 0}
    status, out = post(url + "/v1/completions", body)
    assert status == 200, out
    _close(out["choices"][0]["logprobs"]["token_logprobs"], want)
    import httpx

    got = []
    with httpx.stream(
        "POST", url + "/v1/completions", json=body | {"stream": True}, timeout=60
    ) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for c in json.loads(line[6:])["choices"]:
                    got += (c.get("logprobs") or {}).get("token_logprobs") or []
    _close(got, want)


def _close(got: list, want: list) -> None:
    assert len(got) == len(want) and got[0] is None and want[0] is None, (got, want)
    assert all(abs(a - b) < 1e-4 for a, b in zip(got[1:], want[1:])), (got, want)
