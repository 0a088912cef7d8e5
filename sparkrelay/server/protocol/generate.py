"""SGLang's native /generate: the request model and its translation into engine items."""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, Optional, Union

import pydantic

from sparkrelay.manager.messages import GenerationItem
from sparkrelay.scheduler.request import RequestError, SamplingParams
from sparkrelay.server.protocol.common import (
    Limits,
    Routed,
    Strict,
    build_params,
    check_extras,
    check_max_tokens,
    check_prompt,
    tokenize,
)
from sparkrelay.server.protocol.structured import check_grammar

# SGLang's `sampling_params` object: SamplingParams' own fields (the logprob ones sit beside it in
# SGLang's body), with the JSON shapes SGLang accepts for `stop` and `stop_token_ids`, plus the
# HTTP-only `sampling_seed` and `n`
_BESIDE = {"return_logprob", "top_logprobs_num", "logprob_start_len"}
_JSON_SHAPES = {
    "stop": (Union[str, list[str], None], None),
    "stop_token_ids": (Optional[list[int]], None),
}
_HINTS = typing.get_type_hints(SamplingParams)
GenerateSamplingParams = pydantic.create_model(
    "GenerateSamplingParams",
    __base__=Strict,
    **{
        f.name: _JSON_SHAPES.get(f.name, (_HINTS[f.name], f.default))
        for f in dataclasses.fields(SamplingParams)
        if f.name not in _BESIDE
    },
    sampling_seed=(Optional[int], None),
    n=(int, 1),
)


class GenerateRequest(Routed):
    # defaults sglang-router adds to every /generate body it forwards (SGLANG_EXTRAS: only the
    # defaults are served)
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


def _generate_prompts(req: GenerateRequest, tokenizer) -> tuple[list[list[int]], bool]:
    if (req.text is None) == (req.input_ids is None):
        raise RequestError("give exactly one of `text` or `input_ids`")
    if req.text is not None:
        texts = [req.text] if isinstance(req.text, str) else req.text
        ids = [check_prompt(tokenize(tokenizer, t), f"text[{i}]") for i, t in enumerate(texts)]
        return ids, not isinstance(req.text, str)
    batch = bool(req.input_ids) and isinstance(req.input_ids[0], list)
    prompts = req.input_ids if batch else [req.input_ids]
    return [check_prompt(list(p), f"input_ids[{i}]") for i, p in enumerate(prompts)], batch


def _generate_params(
    sp: GenerateSamplingParams, limits: Limits, logprobs: dict[str, Any]
) -> SamplingParams:
    if sp.n != 1:
        raise RequestError(
            "`sampling_params.n` > 1 is not supported on /generate; use /v1/completions"
        )
    if sp.seed is not None and sp.sampling_seed is not None and sp.seed != sp.sampling_seed:
        raise RequestError("`seed` and `sampling_seed` disagree")
    check_max_tokens("max_new_tokens", sp.max_new_tokens, limits)
    params = build_params(
        sp,
        seed=sp.seed if sp.seed is not None else sp.sampling_seed,
        stop=sp.stop or (),
        stop_token_ids=sp.stop_token_ids or (),
        **logprobs,
    )
    check_grammar(params, limits.grammar_backend)
    return params


def generate_items(
    req: GenerateRequest, tokenizer, limits: Limits, new_id
) -> tuple[list[GenerationItem], bool]:
    """Engine items for a /generate request and whether the answer is a list (batch input)."""
    check_extras(req)
    prompts, batch = _generate_prompts(req, tokenizer)
    sps = req.sampling_params or GenerateSamplingParams()
    sps = sps if isinstance(sps, list) else [sps] * len(prompts)
    rids = req.rid if req.rid is not None else [new_id() for _ in prompts]
    rids = [rids] if isinstance(rids, str) else rids
    if len(sps) != len(prompts) or len(rids) != len(prompts):
        raise RequestError(
            f"batch of {len(prompts)} prompts needs as many `sampling_params` and `rid` entries"
        )
    logprobs = _generate_logprobs(req, len(prompts))
    items = [
        GenerationItem(r, p, _generate_params(s, limits, lp))
        for r, p, s, lp in zip(rids, prompts, sps, logprobs)
    ]
    return items, batch


def _generate_logprobs(req: GenerateRequest, n: int) -> list[dict[str, Any]]:
    """SGLang's per-request logprob fields (a value, or a list with one per prompt) -> SamplingParams fields (their
    values are checked by SamplingParams.verify when the item's parameters are built)."""
    fields = (("return_logprob", False), ("top_logprobs_num", 0), ("logprob_start_len", -1))
    per = {name: _per_prompt(getattr(req, name), default, n, name) for name, default in fields}
    return [dict(zip(per, values)) for values in zip(*per.values())]


def _per_prompt(value, default, n: int, name: str) -> list:
    if isinstance(value, list):
        if len(value) != n:
            raise RequestError(f"`{name}` has {len(value)} entries; the request has {n} prompts")
        return [default if v is None else v for v in value]
    return [default if value is None else value] * n
