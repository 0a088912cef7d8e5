"""The grammar of a constrained tool call (`tool_choice` `required` or a named function): the
template's call markers around a JSON object `{"name": ..., "arguments": ...}` whose arguments follow
that function's parameter schema, once or (parallel calls) several times. The text is written for
the server's backend, in the `ebnf` field: a Lark grammar with `%json` for llguidance, xgrammar's
EBNF composed from its own JSON-schema grammar for xgrammar."""

from __future__ import annotations

import json

from sparkrelay.grammar.backends import JSON_LAYOUT, Grammar, GrammarError, _xg


def call_schema(name: str, parameters: dict) -> dict:
    """One call of function `name` as the JSON object the model writes between the markers."""
    return {
        "type": "object",
        "properties": {"name": {"const": name}, "arguments": parameters},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def tool_call_grammar(
    backend: str, functions: dict[str, dict], begin: str, end: str, parallel: bool
) -> Grammar:
    """functions: name -> parameter schema (one of them is called per call). -> an `ebnf` Grammar
    for `backend` of one call (or, `parallel`, one or more), each `begin` JSON `end`."""
    schemas = [call_schema(n, p) for n, p in functions.items()]
    if backend == "llguidance":
        return Grammar("ebnf", _lark(schemas, begin, end, parallel))
    if backend == "xgrammar":
        return Grammar("ebnf", _xgrammar_ebnf(schemas, begin, end, parallel))
    raise GrammarError(f"--grammar-backend {backend!r} cannot constrain tool calls")


def _lark(schemas: list[dict], begin: str, end: str, parallel: bool) -> str:
    options = {"x-guidance": {**JSON_LAYOUT, "lenient": False}}
    body = " | ".join(f"%json {json.dumps({**s, **options})}" for s in schemas)
    return (
        f"start: call{'+' if parallel else ''}\n"
        f"call: {json.dumps(begin)} ({body}) {json.dumps(end)}\n"
    )


def _xgrammar_ebnf(schemas: list[dict], begin: str, end: str, parallel: bool) -> str:
    try:
        return _compose_xgrammar(schemas, begin, end, parallel)
    except (RuntimeError, ValueError, TypeError) as e:  # xgrammar's own parse errors
        raise GrammarError(f"a function's `parameters`: {str(e).strip()}") from None


def _compose_xgrammar(schemas: list[dict], begin: str, end: str, parallel: bool) -> str:
    xg = _xg()
    one = xg.Grammar.union(
        *[
            xg.Grammar.from_json_schema(
                json.dumps(s), any_whitespace=False, separators=(", ", ": ")
            )
            for s in schemas
        ]
    )
    call = xg.Grammar.concat(
        xg.Grammar.from_ebnf(f"root ::= {json.dumps(begin)}"),
        one,
        xg.Grammar.from_ebnf(f"root ::= {json.dumps(end)}"),
    )
    text = str(call)
    if "root ::=" not in text:
        raise GrammarError("xgrammar's composed tool-call grammar has no root rule")
    return f"root ::= tool_call{'+' if parallel else ''}\n" + text.replace(
        "root ::=", "tool_call ::=", 1
    )
