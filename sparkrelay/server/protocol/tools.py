"""Tool calls on /v1/chat/completions: OpenAI's `tools`, `tool_choice` (none, auto, required, a named
function) and `parallel_tool_calls`.

The tools reach the model through its chat template; the template's call format picks the parser
(Hermes / Qwen: `<tool_call>` + JSON + `</tool_call>`), and a template without one is a 400 naming
`--chat-template`. `required` and a named function constrain the output with the grammar of the
allowed calls (grammar/tools.py), so the call always parses; `auto` lets the model choose and parses
what it wrote; `none` parses nothing. The answer carries `tool_calls` and finish_reason `tool_calls`;
a stream carries each call as one delta once its closing marker has been generated."""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel

from sparkrelay.grammar.backends import GrammarError
from sparkrelay.grammar.tools import tool_call_grammar
from sparkrelay.scheduler.request import RequestError

HERMES = ("<tool_call>", "</tool_call>")  # Hermes / Qwen 2.5+ / Qwen 3 templates
PARSERS = {"hermes": HERMES, "qwen25": HERMES}  # --tool-call-parser


class FunctionDef(BaseModel):
    name: str
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[bool] = None


class Tool(BaseModel):
    type: Literal["function"]
    function: FunctionDef


class CalledFunction(BaseModel):
    name: str
    arguments: Union[str, dict[str, Any]]  # OpenAI sends JSON text


class ToolCall(BaseModel):
    """A call in an assistant message sent back with the conversation."""

    id: Optional[str] = None
    type: Literal["function"] = "function"
    function: CalledFunction


@dataclass(frozen=True)
class ToolPlan:
    """What a chat request's tools ask of the engine and of the answer."""

    tools: list[dict]  # as the template takes them
    parse: bool  # look for calls in the output (auto, required, named)
    grammar: Optional[tuple[str, str]]  # (field, text) when the calls are constrained


def call_format(template: Optional[str], parser: Optional[str] = None) -> Optional[tuple[str, str]]:
    """The call markers of --tool-call-parser, else those the chat template renders; None when the
    template has no tool-call format."""
    if parser is not None:
        return PARSERS[parser]
    return HERMES if template and HERMES[0] in template else None


def _chosen(tool_choice: Any, names: list[str]) -> Optional[str]:
    """A named function's name (checked against the tools), else None."""
    if not isinstance(tool_choice, dict):
        return None
    fn = tool_choice.get("function") if tool_choice.get("type") == "function" else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise RequestError(
            '`tool_choice` must be "none", "auto", "required" or '
            '{"type": "function", "function": {"name": ...}}'
        )
    if name not in names:
        raise RequestError(f"`tool_choice` names {name!r}, which is not among `tools`")
    return name


def plan(
    req, template: Optional[str], backend: str, parser: Optional[str] = None
) -> Optional[ToolPlan]:
    """The request's tool plan (None without tools); 400s for a bad choice, a template without a
    call format (and no --tool-call-parser), or a grammar the backend cannot build."""
    if req.tool_choice not in (None, "none", "auto", "required") and not isinstance(
        req.tool_choice, dict
    ):
        raise RequestError(
            f"`tool_choice` {req.tool_choice!r} is not none, auto, required or a function"
        )
    if not req.tools:
        if req.tool_choice not in (None, "none"):
            raise RequestError("`tool_choice` needs `tools`")
        return None
    tools = list(req.tools)
    names = [t.function.name for t in tools]
    named = _chosen(req.tool_choice, names)
    choice = req.tool_choice or "auto"
    if choice == "none":
        return ToolPlan([t.model_dump(exclude_none=True) for t in tools], False, None)
    markers = call_format(template, parser)
    if markers is None:
        raise RequestError(
            "`tools`: this model's chat template has no tool-call format; start the server with "
            "--tool-call-parser hermes if the model writes <tool_call> blocks anyway, or with "
            "--chat-template pointing at one that has (e.g. sparkrelay/chat_templates/chatml_tools.jinja)"
        )
    grammar = None
    if choice == "required" or named:
        params = {t.function.name: t.function.parameters or {"type": "object"} for t in tools}
        if named:
            params = {named: params[named]}
        if backend == "none":
            raise RequestError("`tool_choice`: this server runs with --grammar-backend none")
        try:
            g = tool_call_grammar(
                backend,
                params,
                markers[0] + "\n",
                "\n" + markers[1],
                bool(req.parallel_tool_calls and not named),
            )
        except GrammarError as e:
            raise RequestError(f"`tools`: {e}") from None
        grammar = (g.kind, g.text)
    return ToolPlan([t.model_dump(exclude_none=True) for t in tools], True, grammar)


_CALL = re.compile(re.escape(HERMES[0]) + r"\s*(.*?)\s*" + re.escape(HERMES[1]), re.S)


def _call(body: str) -> Optional[dict]:
    """One call's JSON -> OpenAI's tool_call object (None when it is not a call)."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)},
    }


def parse(text: str) -> tuple[Optional[str], list[dict]]:
    """The model's text -> (content outside the calls, or None when empty; the calls). A block whose
    JSON is not a call stays in the content."""
    calls, kept, last = [], [], 0
    for m in _CALL.finditer(text):
        call = _call(m.group(1))
        if call is None:
            continue
        kept.append(text[last : m.start()])
        calls.append(call)
        last = m.end()
    kept.append(text[last:])
    content = "".join(kept).strip() if calls else text
    return (content or None), calls


class StreamParser:
    """Streamed text -> content deltas and whole calls: text before a `<tool_call>` marker goes out as
    content (a possible marker's first characters are held back), a call goes out once its closing
    marker arrived."""

    def __init__(self) -> None:
        self.buffer = ""
        self.calls = 0

    def feed(self, delta: str, final: bool) -> tuple[str, list[dict]]:
        self.buffer += delta
        content, calls = "", []
        while True:
            start = self.buffer.find(HERMES[0])
            if start < 0:
                keep = 0 if final else _partial(self.buffer, HERMES[0])
                content += self.buffer[: len(self.buffer) - keep]
                self.buffer = self.buffer[len(self.buffer) - keep :]
                return content, calls
            content += self.buffer[:start]
            self.buffer = self.buffer[start:]
            m = _CALL.match(self.buffer)
            if m is None:  # the call is not complete yet
                if final:
                    content += self.buffer
                    self.buffer = ""
                return content, calls
            call = _call(m.group(1))
            if call is None:
                content += m.group(0)
            else:
                calls.append(call | {"index": self.calls})
                self.calls += 1
            self.buffer = self.buffer[m.end() :]


def _partial(text: str, marker: str) -> int:
    """How many trailing characters of `text` could begin `marker`."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0
