"""HTTP request models (SGLang-native and OpenAI) and their translation into engine requests.

Every translation error is a RequestError whose message names the offending field (HTTP 400).
Unknown fields are rejected (extra="forbid") rather than silently ignored; the only fields accepted and ignored
are OpenAI's `user` and the defaults sglang-router adds to /generate bodies. The PD bootstrap fields are
accepted everywhere and attached to each engine item (`with_bootstrap`); an aggregated engine ignores them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from sparkrelay.engine.request import Bootstrap, RequestError, SamplingParams
from sparkrelay.server.async_engine import GenerationItem


@dataclass(frozen=True)
class Limits:
    """What the server needs to know about the engine to validate a request."""

    context_length: int
    max_n: int


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)  # json.loads reads NaN and Infinity


class _Routed(_Strict):
    """PD-disaggregation routing fields that the SGLang router adds to every generation body (native and
    OpenAI); accepted and ignored by an aggregated server."""

    bootstrap_host: Union[str, list[str], None] = None
    bootstrap_port: Union[int, list[Optional[int]], None] = None
    bootstrap_room: Union[int, list[int], None] = None


# ---------------------------------------------------------------- SGLang native /generate

class GenerateSamplingParams(_Strict):
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    stop: Union[str, list[str], None] = None
    stop_token_ids: Optional[list[int]] = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    sampling_seed: Optional[int] = None
    seed: Optional[int] = None
    n: int = 1


class GenerateRequest(_Routed):
    # defaults sglang-router adds to every /generate body it forwards (accepted, not used)
    return_text_in_logprobs: bool = False
    log_metrics: bool = True
    return_hidden_states: bool = False
    background: bool = False
    no_logs: bool = False
    return_bytes: bool = False
    return_entropy: bool = False
    model: Optional[str] = None
    text: Union[str, list[str], None] = None
    input_ids: Union[list[int], list[list[int]], None] = None
    sampling_params: Union[GenerateSamplingParams, list[GenerateSamplingParams], None] = None
    rid: Union[str, list[str], None] = None
    stream: bool = False
    return_logprob: Union[bool, list[bool]] = False


# ---------------------------------------------------------------- OpenAI

class StreamOptions(_Strict):
    include_usage: bool = False


class _OpenAIRequest(_Routed):
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
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Optional[dict[str, float]] = None
    # SGLang extensions
    top_k: int = -1
    min_p: float = 0.0
    ignore_eos: bool = False
    stop_token_ids: Optional[list[int]] = None
    skip_special_tokens: bool = True
    no_stop_trim: bool = False


class CompletionRequest(_OpenAIRequest):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    echo: bool = False
    suffix: Optional[str] = None
    best_of: Optional[int] = None
    logprobs: Optional[int] = None


class ContentPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # e.g. `name`; only role and content reach the template
    role: str
    content: Union[str, list[ContentPart], None] = None


class ChatCompletionRequest(_OpenAIRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[int] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = None
    tools: Optional[list[Any]] = None
    tool_choice: Any = None
    response_format: Optional[dict[str, Any]] = None


# ---------------------------------------------------------------- translation helpers

def _unsupported(field_name: str) -> RequestError:
    return RequestError(f"`{field_name}` is not supported by this server")


def _check_max_tokens(name: str, value: int, limits: Limits) -> None:
    if value < 0:
        raise RequestError(f"`{name}` must be >= 0, got {value}")
    if value > limits.context_length:
        raise RequestError(f"`{name}` = {value} is larger than the context length {limits.context_length}")


def _check_n(n: int, limits: Limits) -> None:
    if not 1 <= n <= limits.max_n:
        raise RequestError(f"`n` must be in 1..{limits.max_n} (--max-n), got {n}")


def _check_prompt(ids: list[int], where: str) -> list[int]:
    if not ids:
        raise RequestError(f"{where} is empty")
    return ids


_INT64 = range(-2**63, 2**63)  # top_k and seed end up in int64 tensors and torch.Generator.manual_seed


def _sampling(**kw: Any) -> SamplingParams:
    if kw.get("temperature", 0) < 0:
        raise RequestError(f"`temperature` must be >= 0, got {kw['temperature']}")
    for name in ("top_k", "seed"):
        if kw.get(name) is not None and kw[name] not in _INT64:
            raise RequestError(f"`{name}` must fit in a signed 64-bit integer, got {kw[name]}"
                               + (" (sample j of n uses seed + j)" if name == "seed" else ""))
    return SamplingParams(**kw)  # verify() raises RequestError with the SGLang field name


def _tokenize(tokenizer, text: str) -> list[int]:
    return list(tokenizer.encode(text))


# ---------------------------------------------------------------- /generate

def _generate_prompts(req: GenerateRequest, tokenizer) -> tuple[list[list[int]], bool]:
    if (req.text is None) == (req.input_ids is None):
        raise RequestError("give exactly one of `text` or `input_ids`")
    if req.text is not None:
        texts = [req.text] if isinstance(req.text, str) else req.text
        ids = [_check_prompt(_tokenize(tokenizer, t), f"text[{i}]") for i, t in enumerate(texts)]
        return ids, not isinstance(req.text, str)
    batch = bool(req.input_ids) and isinstance(req.input_ids[0], list)
    prompts = req.input_ids if batch else [req.input_ids]
    return [_check_prompt(list(p), f"input_ids[{i}]") for i, p in enumerate(prompts)], batch


def _generate_params(sp: GenerateSamplingParams, limits: Limits) -> SamplingParams:
    if sp.n != 1:
        raise RequestError("`sampling_params.n` > 1 is not supported on /generate; use /v1/completions")
    if sp.seed is not None and sp.sampling_seed is not None and sp.seed != sp.sampling_seed:
        raise RequestError("`seed` and `sampling_seed` disagree")
    _check_max_tokens("max_new_tokens", sp.max_new_tokens, limits)
    fields = sp.model_dump(exclude={"sampling_seed", "seed", "n"})
    return _sampling(**fields, seed=sp.seed if sp.seed is not None else sp.sampling_seed)


def generate_items(req: GenerateRequest, tokenizer, limits: Limits, new_id) -> tuple[list[GenerationItem], bool]:
    """Engine items for a /generate request and whether the answer is a list (batch input)."""
    if req.return_logprob not in (False, None) and any(
            [req.return_logprob] if isinstance(req.return_logprob, bool) else req.return_logprob):
        raise _unsupported("return_logprob")
    prompts, batch = _generate_prompts(req, tokenizer)
    sps = req.sampling_params or GenerateSamplingParams()
    sps = sps if isinstance(sps, list) else [sps] * len(prompts)
    rids = req.rid if req.rid is not None else [new_id() for _ in prompts]
    rids = [rids] if isinstance(rids, str) else rids
    if len(sps) != len(prompts) or len(rids) != len(prompts):
        raise RequestError(f"batch of {len(prompts)} prompts needs as many `sampling_params` and `rid` entries")
    items = [GenerationItem(r, p, _generate_params(s, limits)) for r, p, s in zip(rids, prompts, sps)]
    return items, batch


# ---------------------------------------------------------------- OpenAI

def _openai_common(req: _OpenAIRequest, limits: Limits) -> dict[str, Any]:
    if req.presence_penalty or req.frequency_penalty:
        raise _unsupported("presence_penalty / frequency_penalty")
    if req.logit_bias:
        raise _unsupported("logit_bias")
    _check_n(req.n, limits)
    return dict(temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, min_p=req.min_p,
                stop=req.stop or (), stop_token_ids=req.stop_token_ids or (), ignore_eos=req.ignore_eos,
                skip_special_tokens=req.skip_special_tokens, no_stop_trim=req.no_stop_trim)


def _expand(prompts: list[list[int]], max_tokens: list[int], common: dict, n: int, seed: Optional[int],
            base_id: str) -> list[GenerationItem]:
    """n items per prompt, prompt-major (choice index = prompt * n + sample); seed + sample if seeded."""
    items = []
    for p, (ids, mt) in enumerate(zip(prompts, max_tokens)):
        for j in range(n):
            params = _sampling(**common, max_new_tokens=mt, seed=None if seed is None else seed + j)
            items.append(GenerationItem(f"{base_id}-{p * n + j}", ids, params))
    return items


def completion_items(req: CompletionRequest, tokenizer, limits: Limits, base_id: str) -> list[GenerationItem]:
    if req.echo:
        raise _unsupported("echo")
    if req.suffix:
        raise _unsupported("suffix")
    if req.logprobs is not None:
        raise _unsupported("logprobs")
    if req.best_of not in (None, 1, req.n):
        raise _unsupported("best_of")
    common = _openai_common(req, limits)
    p = req.prompt
    if isinstance(p, str):
        prompts = [_tokenize(tokenizer, p)]
    elif p and isinstance(p[0], str):
        prompts = [_tokenize(tokenizer, t) for t in p]
    elif p and isinstance(p[0], list):
        prompts = [list(x) for x in p]
    else:
        prompts = [list(p)]
    prompts = [_check_prompt(x, f"prompt[{i}]" if len(prompts) > 1 else "prompt") for i, x in enumerate(prompts)]
    max_tokens = 16 if req.max_tokens is None else req.max_tokens  # OpenAI's default
    _check_max_tokens("max_tokens", max_tokens, limits)
    return _expand(prompts, [max_tokens] * len(prompts), common, req.n, req.seed, base_id)


def _message_dict(m: ChatMessage) -> dict[str, str]:
    content = m.content if isinstance(m.content, str) or m.content is None else "".join(c.text for c in m.content)
    return {"role": m.role, "content": content or ""}


def chat_prompt_ids(req: ChatCompletionRequest, tokenizer) -> list[int]:
    messages = [_message_dict(m) for m in req.messages]
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    except Exception as e:  # a template may raise on roles or orders it does not support
        raise RequestError(f"chat template failed on `messages`: {e}") from e
    return _check_prompt(list(tokenizer.encode(text, add_special_tokens=False)), "templated chat prompt")


def chat_items(req: ChatCompletionRequest, tokenizer, limits: Limits, base_id: str) -> list[GenerationItem]:
    if req.logprobs or req.top_logprobs:
        raise _unsupported("logprobs")
    if req.tools or req.tool_choice not in (None, "none"):
        raise _unsupported("tools")
    if req.response_format and req.response_format.get("type") != "text":
        raise _unsupported("response_format")
    common = _openai_common(req, limits)
    ids = chat_prompt_ids(req, tokenizer)
    if req.max_tokens is not None and req.max_completion_tokens is not None and req.max_tokens != req.max_completion_tokens:
        raise RequestError("`max_tokens` and `max_completion_tokens` disagree")
    given = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    if given is not None:
        _check_max_tokens("max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens",
                          given, limits)
    # Without a limit, generate up to the context; a prompt that fills it is rejected by the engine.
    max_tokens = given if given is not None else max(limits.context_length - len(ids), 1)
    return _expand([ids], [max_tokens], common, req.n, req.seed, base_id)


# ---------------------------------------------------------------- PD bootstrap fields

def _per_item(value, n: int, name: str) -> list:
    if isinstance(value, list):
        if len(value) != n:
            raise RequestError(f"`{name}` has {len(value)} entries; the request has {n} sequences")
        return value
    if n > 1 and name == "bootstrap_room" and value is not None:
        raise RequestError(f"a batch of {n} sequences needs `bootstrap_room` as a list with one room per sequence")
    return [value] * n


def with_bootstrap(req: _Routed, items: list[GenerationItem]) -> list[GenerationItem]:
    """Attach the router's bootstrap fields to each item (arrays: one element per item, in order)."""
    if req.bootstrap_room is None and req.bootstrap_host is None:
        return items
    n = len(items)
    hosts = _per_item(req.bootstrap_host, n, "bootstrap_host")
    ports = _per_item(req.bootstrap_port, n, "bootstrap_port")
    rooms = _per_item(req.bootstrap_room, n, "bootstrap_room")
    if len(set(r for r in rooms if r is not None)) != len([r for r in rooms if r is not None]):
        raise RequestError("`bootstrap_room` repeats a room; every sequence needs its own")
    return [dataclasses.replace(it, bootstrap=Bootstrap(h or "", p, r)) if r is not None else it
            for it, h, p, r in zip(items, hosts, ports, rooms)]
