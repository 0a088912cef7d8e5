"""OpenAI's /v1/completions and /v1/chat/completions (with the SGLang / vLLM extensions): the
request models and their translation into engine items (n items per prompt, prompt-major)."""

from __future__ import annotations

import json
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from sparkrelay.manager.messages import GenerationItem
from sparkrelay.scheduler.request import MAX_TOP_LOGPROBS, RequestError
from sparkrelay.server.protocol.common import (
    Limits,
    Routed,
    Strict,
    build_params,
    check_extras,
    check_max_tokens,
    check_n,
    check_prompt,
    tokenize,
    unsupported,
)
from sparkrelay.server.protocol.structured import check_grammar, grammar_fields
from sparkrelay.server.protocol.tools import Tool, ToolCall, ToolPlan


class StreamOptions(Strict):
    include_usage: bool = False


class OpenAIRequest(Routed):
    model: Optional[str] = None
    max_tokens: Optional[int] = None
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = 1
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    stop: Union[str, list[str], None] = None
    seed: Optional[int] = None
    user: Optional[str] = None
    presence_penalty: Optional[float] = 0.0  # null: the default, as OpenAI's schema allows
    frequency_penalty: Optional[float] = 0.0
    repetition_penalty: Optional[float] = 1.0  # vLLM / SGLang extension
    logit_bias: Optional[dict[str, float]] = None
    # SGLang extensions
    top_k: int = -1
    min_p: float = 0.0
    ignore_eos: bool = False
    stop_token_ids: Optional[list[int]] = None
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    return_hidden_states: bool = False  # SGLang extension, added by sglang-router (SGLANG_EXTRAS)
    # structured outputs (protocol/structured.py): OpenAI's, vLLM's and SGLang's spellings
    response_format: Optional[dict[str, Any]] = None
    guided_json: Union[dict[str, Any], str, None] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[list[str]] = None
    guided_grammar: Optional[str] = None
    structured_outputs: Optional[dict[str, Any]] = None
    regex: Optional[str] = None
    ebnf: Optional[str] = None


class CompletionRequest(OpenAIRequest):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    echo: bool = False
    suffix: Optional[str] = None
    best_of: Optional[int] = None
    logprobs: Optional[int] = (
        None  # 0..20: the chosen token's logprob and this many top ones (null: off)
    )


class ContentPart(Strict):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    # e.g. `name`; role, content and the tool fields reach the template
    model_config = ConfigDict(extra="allow")
    role: str
    content: Union[str, list[ContentPart], None] = None
    tool_calls: Optional[list[ToolCall]] = None  # an assistant turn's calls
    tool_call_id: Optional[str] = None  # a tool turn: the call it answers


class ChatCompletionRequest(OpenAIRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[int] = None
    logprobs: Optional[bool] = False
    top_logprobs: Optional[int] = None  # 0..20, with logprobs true
    tools: Optional[list[Tool]] = None
    tool_choice: Any = None
    parallel_tool_calls: Optional[bool] = True
    # SGLang extensions that sglang-router adds to every chat body. Without a reasoning parser (this
    # server has none) SGLang ignores both reasoning flags, so either value is served the same way.
    continue_final_message: bool = False
    separate_reasoning: bool = True
    stream_reasoning: bool = True


def _openai_common(req: OpenAIRequest, limits: Limits) -> dict[str, Any]:
    check_extras(req)
    if req.logit_bias:
        raise unsupported("logit_bias")
    check_n(req.n, limits)
    return dict(stop=req.stop or (), stop_token_ids=req.stop_token_ids or ()) | grammar_fields(req)


def _expand(
    req: OpenAIRequest,
    prompts: list[list[int]],
    max_tokens: list[int],
    common: dict,
    base_id: str,
    limits: Limits,
) -> list[GenerationItem]:
    """n items per prompt, prompt-major (choice index = prompt * n + sample); seed + sample if
    seeded."""
    items, n, seed = [], req.n, req.seed
    for p, (ids, mt) in enumerate(zip(prompts, max_tokens)):
        for j in range(n):
            params = build_params(
                req, **common, max_new_tokens=mt, seed=None if seed is None else seed + j
            )
            check_grammar(params, limits.grammar_backend)
            items.append(GenerationItem(f"{base_id}-{p * n + j}", ids, params))
    return items


def completion_items(
    req: CompletionRequest, tokenizer, limits: Limits, base_id: str
) -> list[GenerationItem]:
    if req.suffix:
        raise unsupported("suffix")
    if req.logprobs is not None and not 0 <= req.logprobs <= MAX_TOP_LOGPROBS:
        raise RequestError(
            f"`logprobs` must be in 0..{MAX_TOP_LOGPROBS} (or null: off), got {req.logprobs}"
        )
    if req.best_of not in (None, 1, req.n):
        raise unsupported("best_of")
    common = _openai_common(req, limits)
    if req.logprobs is not None:
        common |= dict(return_logprob=True, top_logprobs_num=req.logprobs)
        # the prompt's logprobs too, from its second token (the first has none); a PD decode
        # leaves them null and the router fills them in from the prefill's answer
        if req.echo:
            common |= dict(logprob_start_len=0)
    p = req.prompt
    if isinstance(p, str):
        prompts = [tokenize(tokenizer, p)]
    elif p and isinstance(p[0], str):
        prompts = [tokenize(tokenizer, t) for t in p]
    elif p and isinstance(p[0], list):
        prompts = [list(x) for x in p]
    else:
        prompts = [list(p)]
    prompts = [
        check_prompt(x, f"prompt[{i}]" if len(prompts) > 1 else "prompt")
        for i, x in enumerate(prompts)
    ]
    max_tokens = 16 if req.max_tokens is None else req.max_tokens  # OpenAI's default
    check_max_tokens("max_tokens", max_tokens, limits)
    return _expand(req, prompts, [max_tokens] * len(prompts), common, base_id, limits)


def echo_texts(req: CompletionRequest, items: list[GenerationItem], tokenizer) -> list[str]:
    """`echo`: per item, the prompt as the client sent it (a token-id prompt decoded)."""
    p, n = req.prompt, req.n
    texts = [p] if isinstance(p, str) else list(p) if p and isinstance(p[0], str) else None
    if texts is not None:
        return [texts[i // n] for i in range(len(items))]
    return [tokenizer.decode(it.prompt_ids) for it in items]


def _message_dict(m: ChatMessage) -> dict[str, Any]:
    content = (
        m.content
        if isinstance(m.content, str) or m.content is None
        else "".join(c.text for c in m.content)
    )
    out: dict[str, Any] = {"role": m.role, "content": content or ""}
    if m.tool_calls:
        out["tool_calls"] = [_template_call(c) for c in m.tool_calls]
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    if getattr(m, "name", None) is not None:
        out["name"] = m.name
    return out


def _template_call(call: ToolCall) -> dict[str, Any]:
    """An OpenAI tool call as templates read it: `function.arguments` parsed from its JSON text."""
    out = call.model_dump(exclude_none=True)
    fn = out["function"]
    if isinstance(fn["arguments"], str):
        try:
            fn["arguments"] = json.loads(fn["arguments"])
        except ValueError:
            raise RequestError(
                "a message's `tool_calls[].function.arguments` is not JSON"
            ) from None
    return out


def chat_prompt_ids(
    req: ChatCompletionRequest, tokenizer, tools: Optional[list[dict]] = None
) -> list[int]:
    messages = [_message_dict(m) for m in req.messages]
    # SGLang / vLLM: the reply extends the last (assistant) message
    cont = req.continue_final_message
    if cont and messages[-1]["role"] != "assistant":
        raise RequestError(
            "`continue_final_message` needs the last message to have role 'assistant'"
        )
    try:
        text = tokenizer.apply_chat_template(
            messages,
            add_generation_prompt=not cont,
            tokenize=False,
            **({"continue_final_message": True} if cont else {}),
            **({"tools": tools} if tools else {}),
        )
    except Exception as e:  # a template may raise on roles or orders it does not support
        raise RequestError(f"chat template failed on `messages`: {e}") from e
    return check_prompt(
        list(tokenizer.encode(text, add_special_tokens=False)), "templated chat prompt"
    )


def chat_items(
    req: ChatCompletionRequest,
    tokenizer,
    limits: Limits,
    base_id: str,
    tools: Optional[ToolPlan] = None,
) -> list[GenerationItem]:
    """`tools`: the request's tool plan (protocol/tools.py `plan`), when it has tools."""
    if req.top_logprobs is not None and not 0 <= req.top_logprobs <= MAX_TOP_LOGPROBS:
        raise RequestError(
            f"`top_logprobs` must be in 0..{MAX_TOP_LOGPROBS}, got {req.top_logprobs}"
        )
    if req.top_logprobs and not req.logprobs:
        raise RequestError("`top_logprobs` needs `logprobs: true`")
    common = _openai_common(req, limits)
    if tools is not None and tools.grammar is not None:
        if any(k in common for k in ("json_schema", "regex", "ebnf")):
            raise RequestError(
                "a constrained `tool_choice` and a structured-output field exclude each other"
            )
        common |= {tools.grammar[0]: tools.grammar[1]}
    if req.logprobs:
        common |= dict(return_logprob=True, top_logprobs_num=req.top_logprobs or 0)
    ids = chat_prompt_ids(req, tokenizer, tools.tools if tools is not None else None)
    if (
        None not in (req.max_tokens, req.max_completion_tokens)
        and req.max_tokens != req.max_completion_tokens
    ):
        raise RequestError("`max_tokens` and `max_completion_tokens` disagree")
    given = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    if given is not None:
        check_max_tokens(
            "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens",
            given,
            limits,
        )
    # Without a limit, generate up to the context; a prompt that fills it is rejected by the engine.
    max_tokens = given if given is not None else max(limits.context_length - len(ids), 1)
    return _expand(req, [ids], [max_tokens], common, base_id, limits)
