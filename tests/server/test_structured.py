"""Structured outputs over HTTP, on the bundled model: SGLang's `json_schema` / `regex` / `ebnf` on
/generate, OpenAI's `response_format` and vLLM's `guided_*` / `structured_outputs` on the /v1 routes,
streamed and not; every answer follows its grammar. A bad grammar, two grammar fields, or a grammar on
a server started with --grammar-backend none is a 400 that names the field."""

from __future__ import annotations

import json

import jsonschema
import pytest

from sparkrelay.tools.bench.schemas import SCHEMAS
from testkit.http import make_app

WHAT, SCHEMA = SCHEMAS[12]  # a calendar event: enums, an optional field, bounds


def _chat(**extra) -> dict:
    return {
        "messages": [{"role": "user", "content": f"Describe {WHAT} as JSON."}],
        "temperature": 0,
        "max_tokens": 120,
        **extra,
    }


def _valid(text: str) -> dict:
    obj = json.loads(text)
    jsonschema.validate(obj, SCHEMA)
    return obj


def test_generate_json_schema(client):
    body = {
        "text": "An event:",
        "sampling_params": {
            "max_new_tokens": 120,
            "temperature": 0,
            "json_schema": json.dumps(SCHEMA),
        },
    }
    r = client.post("/generate", json=body)
    assert r.status_code == 200, r.text
    _valid(r.json()["text"])


def test_generate_regex_and_ebnf(client):
    r = client.post(
        "/generate",
        json={
            "text": "x",
            "sampling_params": {"max_new_tokens": 16, "temperature": 0, "regex": "(red|green)!"},
        },
    )
    assert r.status_code == 200, r.text
    assert r.json()["text"] in ("red!", "green!")
    ebnf = 'root ::= "[" num ("," num)* "]"\nnum ::= [0-9] | [1-9] [0-9]'
    r = client.post(
        "/generate",
        json={
            "text": "x",
            "sampling_params": {"max_new_tokens": 40, "temperature": 0, "ebnf": ebnf},
        },
    )
    assert r.status_code == 200, r.text
    out = r.json()
    if out["meta_info"]["finish_reason"]["type"] == "stop":
        assert all(0 <= v < 100 for v in json.loads(out["text"]))


@pytest.mark.parametrize(
    "extra",
    [
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "event", "schema": SCHEMA, "strict": True},
            }
        },
        {"guided_json": SCHEMA},
        {"guided_json": json.dumps(SCHEMA)},
        {"structured_outputs": {"json": SCHEMA}},
    ],
    ids=["response_format", "guided_json", "guided_json_text", "structured_outputs"],
)
def test_chat_json_schema_spellings(client, extra):
    r = client.post("/v1/chat/completions", json=_chat(**extra))
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    _valid(choice["message"]["content"])


def test_json_object_mode(client):
    r = client.post("/v1/chat/completions", json=_chat(response_format={"type": "json_object"}))
    assert r.status_code == 200, r.text
    assert isinstance(json.loads(r.json()["choices"][0]["message"]["content"]), dict)


def test_choice_and_regex_on_completions(client):
    body = {"prompt": "The light is", "max_tokens": 8, "temperature": 0}
    r = client.post("/v1/completions", json=body | {"guided_choice": ["red", "amber", "green"]})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] in ("red", "amber", "green")
    r = client.post("/v1/completions", json=body | {"structured_outputs": {"regex": "[0-9]{3}"}})
    assert r.status_code == 200, r.text
    text = r.json()["choices"][0]["text"]
    assert len(text) == 3 and text.isdigit()


def test_streamed_structured_output_equals_the_whole_answer(client):
    extra = {
        "response_format": {"type": "json_schema", "json_schema": {"name": "e", "schema": SCHEMA}}
    }
    whole = client.post("/v1/chat/completions", json=_chat(**extra)).json()
    with client.stream("POST", "/v1/chat/completions", json=_chat(stream=True, **extra)) as r:
        assert r.status_code == 200
        parts = []
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for c in json.loads(line[6:])["choices"]:
                    parts.append(c["delta"].get("content") or "")
    assert "".join(parts) == whole["choices"][0]["message"]["content"]
    _valid("".join(parts))


@pytest.mark.parametrize(
    "route, body, named",
    [
        (
            "/v1/chat/completions",
            _chat(
                response_format={
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "objec"}},
                }
            ),
            "json_schema",
        ),
        (
            "/v1/chat/completions",
            _chat(response_format={"type": "json_schema", "json_schema": {"name": "x"}}),
            "response_format.json_schema",
        ),
        ("/v1/chat/completions", _chat(response_format={"type": "yaml"}), "response_format.type"),
        ("/v1/chat/completions", _chat(guided_regex="(ab"), "regex"),
        (
            "/v1/chat/completions",
            _chat(guided_regex="a", guided_choice=["a"]),
            "guided_regex, guided_choice",
        ),
        ("/v1/chat/completions", _chat(guided_choice=[]), "guided_choice"),
        (
            "/v1/completions",
            {"prompt": "x", "structured_outputs": {"yaml": "x"}},
            "structured_outputs.yaml",
        ),
        ("/generate", {"text": "x", "sampling_params": {"ebnf": "root ::= nowhere"}}, "ebnf"),
        (
            "/generate",
            {"text": "x", "sampling_params": {"regex": "a", "ebnf": 'root ::= "a"'}},
            "regex, ebnf",
        ),
    ],
)
def test_bad_grammar_is_a_400_naming_the_field(client, route, body, named):
    r = client.post(route, json=body)
    assert r.status_code == 400, r.text
    assert named in r.text, r.text


def test_grammar_backend_none_refuses_structured_outputs(tiny_model_dir):
    from fastapi.testclient import TestClient

    app, _ = make_app(tiny_model_dir, grammar_backend="none")
    with TestClient(app) as client:
        r = client.post("/v1/chat/completions", json=_chat(response_format={"type": "json_object"}))
        assert r.status_code == 400 and "--grammar-backend none" in r.text, r.text
        r = client.post("/v1/chat/completions", json=_chat())
        assert r.status_code == 200, r.text
