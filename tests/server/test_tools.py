"""Tool calls on /v1/chat/completions: with a template that has a call format (the bundled ChatML +
tools template, --chat-template), `required` and a named `tool_choice` always yield calls that parse,
with arguments that follow the function's schema, in one call or several (`parallel_tool_calls`);
`auto` parses what the model wrote; `none` parses nothing. Streamed calls arrive as deltas; the OpenAI
SDK's round trip (call, tool result as a `tool` message, answer) works unmodified on the real model.
A template without a call format and a bad `tool_choice` are 400s naming the fix."""

from __future__ import annotations

import json

import jsonschema
import pytest
from fastapi.testclient import TestClient

from sparkrelay.server.protocol.tools import StreamParser, parse
from testkit.http import UvicornThread, make_app
from testkit.models import BUNDLED

TEMPLATE = "sparkrelay/chat_templates/chatml_tools.jinja"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {
                "a": {"type": "integer", "minimum": 0, "maximum": 99},
                "b": {"type": "integer", "minimum": 0, "maximum": 99},
            },
            "required": ["a", "b"],
            "additionalProperties": False,
        },
    },
}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, ADD)}


@pytest.fixture(scope="module")
def tools_client():
    app, _ = make_app(BUNDLED, chat_template=TEMPLATE, context_length=1024, max_total_tokens=16384)
    with TestClient(app) as client:
        yield client


def _ask(**extra) -> dict:
    return {
        "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
        "temperature": 0,
        "max_tokens": 120,
        "tools": [WEATHER, ADD],
        **extra,
    }


def _check_calls(calls: list[dict]) -> None:
    assert calls
    for c in calls:
        assert c["type"] == "function" and c["id"].startswith("call_")
        jsonschema.validate(json.loads(c["function"]["arguments"]), SCHEMAS[c["function"]["name"]])


@pytest.mark.parametrize("parallel", [True, False])
def test_required_always_calls(tools_client, parallel):
    r = tools_client.post(
        "/v1/chat/completions", json=_ask(tool_choice="required", parallel_tool_calls=parallel)
    )
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    calls = choice["message"]["tool_calls"]
    _check_calls(calls)
    if parallel:  # the bundled model keeps calling until max_tokens cuts its last call
        assert choice["finish_reason"] in ("tool_calls", "length"), choice
        assert choice["finish_reason"] == "tool_calls" or choice["message"]["content"].startswith(
            "<tool_call>"
        )
    else:
        assert choice["finish_reason"] == "tool_calls" and len(calls) == 1, choice
        assert choice["message"]["content"] is None


def test_named_function_is_the_one_called(tools_client):
    choice = {"type": "function", "function": {"name": "add"}}
    r = tools_client.post("/v1/chat/completions", json=_ask(tool_choice=choice))
    assert r.status_code == 200, r.text
    calls = r.json()["choices"][0]["message"]["tool_calls"]
    _check_calls(calls)
    assert [c["function"]["name"] for c in calls] == ["add"]


def test_streamed_calls_equal_the_whole_answer(tools_client):
    body = _ask(tool_choice="required", parallel_tool_calls=False)
    whole = tools_client.post("/v1/chat/completions", json=body).json()["choices"][0]
    calls, finish = [], None
    with tools_client.stream("POST", "/v1/chat/completions", json=body | {"stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for c in json.loads(line[6:])["choices"]:
                    calls += c["delta"].get("tool_calls") or []
                    finish = c["finish_reason"] or finish
    assert finish == "tool_calls"
    strip = lambda cs: [(c["function"]["name"], c["function"]["arguments"]) for c in cs]  # noqa: E731
    assert strip(calls) == strip(whole["message"]["tool_calls"])
    assert [c["index"] for c in calls] == list(range(len(calls)))


def test_none_and_auto_answer_with_text_when_the_model_writes_text(tools_client):
    for choice in ("none", "auto"):
        r = tools_client.post("/v1/chat/completions", json=_ask(tool_choice=choice, max_tokens=8))
        assert r.status_code == 200, r.text
        message = r.json()["choices"][0]["message"]
        assert "tool_calls" not in message and isinstance(message["content"], str)


def test_a_tool_result_goes_back_through_the_template(tools_client):
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'},
    }
    messages = [
        {"role": "user", "content": "Add 1 and 2."},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "3"},
    ]
    r = tools_client.post(
        "/v1/chat/completions",
        json={"messages": messages, "tools": [ADD], "max_tokens": 8, "temperature": 0},
    )
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] > 100  # the tools block, the call and the result


@pytest.mark.parametrize(
    "extra, named",
    [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not among `tools`"),
        ({"tool_choice": "sometimes"}, "`tool_choice`"),
        ({"tools": None, "tool_choice": "required"}, "needs `tools`"),
        (
            {"tool_choice": "required", "response_format": {"type": "json_object"}},
            "exclude each other",
        ),
    ],
)
def test_bad_tool_requests_are_400s(tools_client, extra, named):
    r = tools_client.post("/v1/chat/completions", json=_ask(**extra))
    assert r.status_code == 400 and named in r.text, r.text


def test_a_template_without_a_call_format_is_a_400_naming_the_flag(client):
    r = client.post("/v1/chat/completions", json=_ask(tool_choice="auto"))
    assert r.status_code == 400 and "--chat-template" in r.text, r.text


def test_parser_keeps_text_and_splits_calls():
    text = (
        'Sure.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
        "<tool_call>\nnot json\n</tool_call>"
    )
    content, calls = parse(text)
    assert [c["function"]["name"] for c in calls] == ["add"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"a": 1, "b": 2}
    assert content.startswith("Sure.") and "not json" in content
    p, got_text, got_calls = StreamParser(), "", []
    for k in range(0, len(text), 3):  # in 3-character deltas
        t, c = p.feed(text[k : k + 3], final=k + 3 >= len(text))
        got_text, got_calls = got_text + t, got_calls + c
    assert [c["function"]["arguments"] for c in got_calls] == [calls[0]["function"]["arguments"]]
    assert got_text.strip() == content


def test_openai_sdk_round_trip_on_the_real_model(smollm2_dir):
    """SmolLM2 with the tools template: the SDK sends tools, gets a call it can parse, sends the
    result back as a `tool` message, and gets a text answer."""
    from openai import OpenAI

    app, _ = make_app(
        smollm2_dir, context_length=2048, max_total_tokens=8192, chat_template=TEMPLATE
    )
    with UvicornThread(app) as server:
        client = OpenAI(base_url=server.url + "/v1", api_key="none")
        messages = [{"role": "user", "content": "What is the weather in Paris, in celsius?"}]
        first = client.chat.completions.create(
            model="smollm2",
            messages=messages,
            tools=[WEATHER],
            tool_choice="required",
            temperature=0,
            max_tokens=60,
        )
        call = first.choices[0].message.tool_calls[0]
        assert call.function.name == "get_weather"
        args = json.loads(call.function.arguments)
        jsonschema.validate(args, SCHEMAS["get_weather"])
        messages += [
            first.choices[0].message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": "22 degrees and sunny"},
        ]
        second = client.chat.completions.create(
            model="smollm2", messages=messages, tools=[WEATHER], temperature=0, max_tokens=40
        )
    answer = second.choices[0].message
    assert second.choices[0].finish_reason in ("stop", "length") and answer.content, answer


def test_a_broken_chat_template_stops_the_start_naming_the_flag(tmp_path):
    from sparkrelay.config import ConfigError
    from sparkrelay.engine.setup import load_tokenizer

    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}{{ m.content }")
    with pytest.raises(ConfigError, match=r"--chat-template .*broken.jinja: line 1"):
        load_tokenizer(str(BUNDLED), str(broken))
    with pytest.raises(ConfigError, match="--chat-template .*missing.jinja: cannot read"):
        load_tokenizer(str(BUNDLED), str(tmp_path / "missing.jinja"))
    assert "<tool_call>" in load_tokenizer(str(BUNDLED), TEMPLATE).chat_template


def test_tool_call_parser_flag_serves_a_template_without_the_format():
    """--tool-call-parser hermes (SGLang's flag; qwen25 is the same format): the template need not
    show the format; a required call is constrained and parsed."""
    app, _ = make_app(
        BUNDLED, tool_call_parser="qwen25", context_length=1024, max_total_tokens=16384
    )
    with TestClient(app) as client:
        r = client.post(
            "/v1/chat/completions", json=_ask(tool_choice="required", parallel_tool_calls=False)
        )
    assert r.status_code == 200, r.text
    _check_calls(r.json()["choices"][0]["message"]["tool_calls"])
