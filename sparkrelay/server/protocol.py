"""HTTP request models (SGLang-native and OpenAI) and their translation into engine requests.

Every translation error is a RequestError whose message names the offending field (HTTP 400).
Unknown fields are rejected (extra="forbid") rather than silently ignored. OpenAI's `user` is accepted and
ignored; the SGLang fields that sglang-router adds to every body it forwards (`return_hidden_states`,
`continue_final_message`, `separate_reasoning`, ... see SGLANG_EXTRAS) are accepted at their defaults and refused
by name when they ask for something this server does not do. The PD bootstrap fields are
accepted everywhere and attached to each engine item (`with_bootstrap`); an aggregated engine ignores them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from sparkrelay.scheduler.request import MAX_TOP_LOGPROBS, Bootstrap, RequestError, SamplingParams
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
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    sampling_seed: Optional[int] = None
    seed: Optional[int] = None
    n: int = 1


class GenerateRequest(_Routed):
    # defaults sglang-router adds to every /generate body it forwards (SGLANG_EXTRAS: only the defaults are served)
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
    return_logprob: Union[bool, list[bool], None] = False
    top_logprobs_num: Union[int, list[int], None] = 0
    logprob_start_len: Union[int, list[int], None] = -1


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


class CompletionRequest(_OpenAIRequest):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    echo: bool = False
    suffix: Optional[str] = None
    best_of: Optional[int] = None
    logprobs: Optional[int] = None  # 0..20: the chosen token's logprob and this many top ones (null: off)


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
    logprobs: Optional[bool] = False
    top_logprobs: Optional[int] = None  # 0..20, with logprobs true
    tools: Optional[list[Any]] = None
    tool_choice: Any = None
    response_format: Optional[dict[str, Any]] = None
    # SGLang extensions that sglang-router adds to every chat body. Without a reasoning parser (this server has
    # none) SGLang ignores both reasoning flags, so either value is served the same way.
    continue_final_message: bool = False
    separate_reasoning: bool = True
    stream_reasoning: bool = True


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


# SGLang request fields that sglang-router (0.3.2) adds to every body it forwards, with their defaults; this server
# serves only the default of each (a non-default value is refused by name). `log_metrics`, `no_logs` and the two
# reasoning flags change nothing here (no reasoning parser), so any value is accepted for them.
SGLANG_EXTRAS = {"return_hidden_states": False, "background": False, "return_bytes": False, "return_entropy": False}


def _check_extras(req: BaseModel) -> None:
    for name, default in SGLANG_EXTRAS.items():
        if getattr(req, name, default) != default:
            raise RequestError(f"`{name}` = {getattr(req, name)!r} is not supported by this server "
                               f"(only the default {default!r} is)")


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
    _check_extras(req)
    prompts, batch = _generate_prompts(req, tokenizer)
    sps = req.sampling_params or GenerateSamplingParams()
    sps = sps if isinstance(sps, list) else [sps] * len(prompts)
    rids = req.rid if req.rid is not None else [new_id() for _ in prompts]
    rids = [rids] if isinstance(rids, str) else rids
    if len(sps) != len(prompts) or len(rids) != len(prompts):
        raise RequestError(f"batch of {len(prompts)} prompts needs as many `sampling_params` and `rid` entries")
    logprobs = _generate_logprobs(req, len(prompts))
    items = [GenerationItem(r, p, dataclasses.replace(_generate_params(s, limits), **lp))
             for r, p, s, lp in zip(rids, prompts, sps, logprobs)]
    return items, batch


def _generate_logprobs(req: GenerateRequest, n: int) -> list[dict[str, Any]]:
    """SGLang's per-request logprob fields (a value, or a list with one per prompt) -> SamplingParams fields."""
    fields = (("return_logprob", False), ("top_logprobs_num", 0), ("logprob_start_len", -1))
    per = {name: _per_prompt(getattr(req, name), default, n, name) for name, default in fields}
    for k in per["top_logprobs_num"]:
        if not 0 <= k <= MAX_TOP_LOGPROBS:
            raise RequestError(f"`top_logprobs_num` must be in 0..{MAX_TOP_LOGPROBS}, got {k}")
    for k in per["logprob_start_len"]:
        if k < -1:
            raise RequestError(f"`logprob_start_len` must be -1 (output logprobs only) or >= 0, got {k}")
    return [dict(zip(per, values)) for values in zip(*per.values())]


def _per_prompt(value, default, n: int, name: str) -> list:
    if isinstance(value, list):
        if len(value) != n:
            raise RequestError(f"`{name}` has {len(value)} entries; the request has {n} prompts")
        return [default if v is None else v for v in value]
    return [default if value is None else value] * n


# ---------------------------------------------------------------- OpenAI

def _or(value: Optional[float], default: float) -> float:
    return default if value is None else value


def _openai_common(req: _OpenAIRequest, limits: Limits) -> dict[str, Any]:
    _check_extras(req)
    if req.logit_bias:
        raise _unsupported("logit_bias")
    _check_n(req.n, limits)
    return dict(temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, min_p=req.min_p,
                stop=req.stop or (), stop_token_ids=req.stop_token_ids or (), ignore_eos=req.ignore_eos,
                skip_special_tokens=req.skip_special_tokens, no_stop_trim=req.no_stop_trim,
                repetition_penalty=_or(req.repetition_penalty, 1.0), frequency_penalty=_or(req.frequency_penalty, 0.0),
                presence_penalty=_or(req.presence_penalty, 0.0))


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
    if req.logprobs is not None and not 0 <= req.logprobs <= MAX_TOP_LOGPROBS:
        raise RequestError(f"`logprobs` must be in 0..{MAX_TOP_LOGPROBS} (or null: off), got {req.logprobs}")
    if req.best_of not in (None, 1, req.n):
        raise _unsupported("best_of")
    common = _openai_common(req, limits)
    if req.logprobs is not None:
        common |= dict(return_logprob=True, top_logprobs_num=req.logprobs)
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
    cont = req.continue_final_message  # SGLang / vLLM: the reply extends the last (assistant) message
    if cont and messages[-1]["role"] != "assistant":
        raise RequestError("`continue_final_message` needs the last message to have role 'assistant'")
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=not cont, tokenize=False,
                                             **({"continue_final_message": True} if cont else {}))
    except Exception as e:  # a template may raise on roles or orders it does not support
        raise RequestError(f"chat template failed on `messages`: {e}") from e
    return _check_prompt(list(tokenizer.encode(text, add_special_tokens=False)), "templated chat prompt")


def chat_items(req: ChatCompletionRequest, tokenizer, limits: Limits, base_id: str) -> list[GenerationItem]:
    if req.top_logprobs is not None and not 0 <= req.top_logprobs <= MAX_TOP_LOGPROBS:
        raise RequestError(f"`top_logprobs` must be in 0..{MAX_TOP_LOGPROBS}, got {req.top_logprobs}")
    if req.top_logprobs and not req.logprobs:
        raise RequestError("`top_logprobs` needs `logprobs: true`")
    if req.tools or req.tool_choice not in (None, "none"):
        raise _unsupported("tools")
    if req.response_format and req.response_format.get("type") != "text":
        raise _unsupported("response_format")
    common = _openai_common(req, limits)
    if req.logprobs:
        common |= dict(return_logprob=True, top_logprobs_num=req.top_logprobs or 0)
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

_MAX_ROOM = 2**63 - 1


def _sample_room(room: Optional[int], j: int) -> Optional[int]:
    """Sample j's room, derived from its prompt's room as SGLang does (room + j), kept in 1..2^63-1."""
    return room if room is None or j == 0 or not 1 <= room <= _MAX_ROOM else 1 + (room - 1 + j) % _MAX_ROOM


def _per_item(value, n: int, samples: int, name: str) -> list:
    """One value per item. Items are prompt-major with `samples` items per prompt; a single value or one value per
    prompt is spread over the prompt's samples (rooms: prompt room + sample index, both sides derive the same)."""
    prompts = n // samples
    if isinstance(value, list) and len(value) not in (n, prompts):
        raise RequestError(f"`{name}` has {len(value)} entries; the request has {n} sequences"
                           + (f" ({prompts} prompts x n = {samples})" if samples > 1 else ""))
    if isinstance(value, list) and len(value) == n:
        return value
    per_prompt = value if isinstance(value, list) else [value] * prompts
    if name == "bootstrap_room" and not isinstance(value, list) and prompts > 1 and value is not None:
        raise RequestError(f"a batch of {prompts} prompts needs `bootstrap_room` as a list with one room per "
                           f"sequence (or one per prompt, when n > 1)")
    if name != "bootstrap_room":
        return [v for v in per_prompt for _ in range(samples)]
    return [_sample_room(r, j) for r in per_prompt for j in range(samples)]


def with_bootstrap(req: _Routed, items: list[GenerationItem]) -> list[GenerationItem]:
    """Attach the router's bootstrap fields to each item: arrays with one element per item (in order) or per
    prompt (n > 1: sample j of a prompt gets the prompt's room + j, as SGLang does), or one value for all."""
    if req.bootstrap_room is None and req.bootstrap_host is None:
        return items
    n, samples = len(items), getattr(req, "n", 1)
    samples = samples if isinstance(samples, int) and samples >= 1 and n % samples == 0 else 1
    hosts = _per_item(req.bootstrap_host, n, samples, "bootstrap_host")
    ports = _per_item(req.bootstrap_port, n, samples, "bootstrap_port")
    rooms = _per_item(req.bootstrap_room, n, samples, "bootstrap_room")
    if len(set(r for r in rooms if r is not None)) != len([r for r in rooms if r is not None]):
        raise RequestError("`bootstrap_room` repeats a room; every sequence needs its own")
    return [dataclasses.replace(it, bootstrap=Bootstrap(h or "", p, r)) if r is not None else it
            for it, h, p, r in zip(items, hosts, ports, rooms)]
