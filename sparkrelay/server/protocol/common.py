"""What the native and OpenAI request models share: the strict base models, the PD routing fields,
and the checks every route applies (token budgets, n, the sglang-router extras, sampling values)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional, Union

from pydantic import BaseModel, ConfigDict

from sparkrelay.scheduler.request import RequestError, SamplingParams


@dataclass(frozen=True)
class Limits:
    """What the server needs to know about the engine to validate a request."""

    context_length: int
    max_n: int
    grammar_backend: str = "none"  # --grammar-backend: what checks a request's grammar
    tool_call_parser: Optional[str] = None  # --tool-call-parser (None: from the chat template)


class Strict(BaseModel):
    # json.loads reads NaN and Infinity
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class Routed(Strict):
    """PD-disaggregation routing fields that the SGLang router adds to every generation body (native
    and OpenAI); accepted and ignored by an aggregated server."""

    bootstrap_host: Union[str, list[str], None] = None
    bootstrap_port: Union[int, list[Optional[int]], None] = None
    bootstrap_room: Union[int, list[int], None] = None


def unsupported(field_name: str) -> RequestError:
    return RequestError(f"`{field_name}` is not supported by this server")


def check_max_tokens(name: str, value: int, limits: Limits) -> None:
    if value < 0:
        raise RequestError(f"`{name}` must be >= 0, got {value}")
    if value > limits.context_length:
        raise RequestError(
            f"`{name}` = {value} is larger than the context length {limits.context_length}"
        )


def check_n(n: int, limits: Limits) -> None:
    if not 1 <= n <= limits.max_n:
        raise RequestError(f"`n` must be in 1..{limits.max_n} (--max-n), got {n}")


# SGLang request fields that sglang-router (0.3.2) adds to every body it forwards, with their
# defaults; this server serves only the default of each (a non-default value is refused by name).
# `log_metrics`, `no_logs` and the two reasoning flags change nothing here (no reasoning parser), so
# any value is accepted for them.
SGLANG_EXTRAS = {
    "return_hidden_states": False,
    "background": False,
    "return_bytes": False,
    "return_entropy": False,
}


def check_extras(req: BaseModel) -> None:
    for name, default in SGLANG_EXTRAS.items():
        if getattr(req, name, default) != default:
            raise RequestError(
                f"`{name}` = {getattr(req, name)!r} is not supported by this server "
                f"(only the default {default!r} is)"
            )


def check_prompt(ids: list[int], where: str) -> list[int]:
    if not ids:
        raise RequestError(f"{where} is empty")
    return ids


def build_params(model: BaseModel, **given: Any) -> SamplingParams:
    """SamplingParams from the request model's fields of the same names (None: the field's default)
    and `given` (what a route maps from its own names); SamplingParams.verify is the one value check
    (RequestError: a 400)."""
    names = {f.name for f in dataclasses.fields(SamplingParams)}
    fields = {
        n: v
        for n, v in model.model_dump(include=names & set(type(model).model_fields)).items()
        if v is not None
    }
    return SamplingParams(**(fields | given))


def tokenize(tokenizer, text: str) -> list[int]:
    return list(tokenizer.encode(text))
