"""Structured outputs on the OpenAI routes, in the spellings clients send, mapped onto SGLang's
three sampling fields (`json_schema`, `regex`, `ebnf`): OpenAI's `response_format` (json_object,
json_schema), vLLM's `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar` and its
`structured_outputs` object, SGLang's `regex` / `ebnf` extensions. At most one may be given. Every
grammar is parsed by the server's backend before it reaches the engine, so a bad one is a 400 naming
it."""

from __future__ import annotations

import functools
import json
from typing import Any, Optional

from sparkrelay.grammar.backends import Grammar, GrammarError, check
from sparkrelay.scheduler.request import RequestError, SamplingParams

ANY_OBJECT = '{"type": "object"}'  # OpenAI's JSON mode: some JSON object


def _schema_text(schema: Any, where: str) -> str:
    if isinstance(schema, str):
        return schema
    if isinstance(schema, dict):
        return json.dumps(schema)
    raise RequestError(f"`{where}` must be a JSON schema object")


def choice_ebnf(choices: Any, where: str) -> str:
    """vLLM's choice list -> an EBNF grammar of exactly those strings."""
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) for c in choices):
        raise RequestError(f"`{where}` must be a non-empty list of strings")
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _response_format(rf: dict) -> Optional[tuple[str, str]]:
    kind = rf.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return "json_schema", ANY_OBJECT
    if kind == "json_schema":
        spec = rf.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise RequestError(
                "`response_format.json_schema` must be an object with a `schema` (and a `name`)"
            )
        return "json_schema", _schema_text(spec["schema"], "response_format.json_schema.schema")
    raise RequestError(
        f"`response_format.type` {kind!r} is not one of text, json_object, json_schema"
    )


def _structured_outputs(so: dict) -> list[tuple[str, tuple[str, str]]]:
    out = []
    for key, value in so.items():
        where = f"structured_outputs.{key}"
        if value is None or value is False:
            continue
        if key == "json":
            out.append((where, ("json_schema", _schema_text(value, where))))
        elif key == "json_object":
            out.append((where, ("json_schema", ANY_OBJECT)))
        elif key == "regex":
            out.append((where, ("regex", str(value))))
        elif key == "choice":
            out.append((where, ("ebnf", choice_ebnf(value, where))))
        elif key == "grammar":
            out.append((where, ("ebnf", str(value))))
        else:
            raise RequestError(f"`{where}` is not supported by this server")
    return out


def grammar_fields(req) -> dict[str, str]:
    """The SamplingParams grammar field an OpenAI request asks for ({} for none); more than one
    source is a 400 naming them."""
    found: list[tuple[str, tuple[str, str]]] = []
    rf = getattr(req, "response_format", None)
    if rf:
        g = _response_format(rf)
        if g:
            found.append(("response_format", g))
    if req.guided_json is not None:
        found.append(("guided_json", ("json_schema", _schema_text(req.guided_json, "guided_json"))))
    if req.guided_regex is not None:
        found.append(("guided_regex", ("regex", req.guided_regex)))
    if req.guided_choice is not None:
        found.append(("guided_choice", ("ebnf", choice_ebnf(req.guided_choice, "guided_choice"))))
    if req.guided_grammar is not None:
        found.append(("guided_grammar", ("ebnf", req.guided_grammar)))
    if req.structured_outputs:
        found += _structured_outputs(req.structured_outputs)
    for name in ("regex", "ebnf"):  # SGLang's extensions, already SamplingParams' names
        if getattr(req, name, None) is not None:
            found.append((name, (name, getattr(req, name))))
    if len(found) > 1:
        raise RequestError(
            f"give one structured-output field, got {', '.join(n for n, _ in found)}"
        )
    return {found[0][1][0]: found[0][1][1]} if found else {}


@functools.lru_cache(maxsize=64)
def _checked(backend: str, kind: str, text: str) -> Optional[str]:
    try:
        check(Grammar(kind, text), backend)
    except GrammarError as e:
        return str(e)
    return None


def check_grammar(params: SamplingParams, backend: str) -> None:
    """A 400 for a grammar the server's backend cannot parse, or when it has none."""
    if params.grammar is None:
        return
    kind, text = params.grammar
    if backend == "none":
        raise RequestError(
            f"`{kind}`: this server runs with --grammar-backend none (no structured outputs)"
        )
    error = _checked(backend, kind, text)
    if error:
        raise RequestError(error)
