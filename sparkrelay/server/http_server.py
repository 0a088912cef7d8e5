"""FastAPI app: SGLang-native /generate, OpenAI /v1/*, health, info and Prometheus metrics.

Life of an HTTP generation request:
  1. FastAPI validates the JSON into a protocol model (bad shape -> 400 via the validation handler).
  2. protocol.*_items turns it into engine items (bad values -> RequestError -> 400).
  3. EngineClient.submit adds them atomically in the engine's loop (engine's RequestError -> 400).
  4. Outputs stream back; a streaming response sends SSE chunks, a plain one waits while watching
     for a client disconnect. Leaving early in any way closes the stream, which aborts unfinished
     requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time
import uuid
from typing import Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

import sparkrelay
from sparkrelay.config import Config
from sparkrelay.manager.client import EngineClient, EngineFailed, EngineStopped
from sparkrelay.manager.messages import GenerationItem
from sparkrelay.scheduler.request import RequestError, RequestOutput
from sparkrelay.server import protocol as P
from sparkrelay.server.common import (
    ServerError,
    ServerState,
    error_response,
    stream_error_response,
    wants_stream_error,
)
from sparkrelay.server.middleware import ApiKeyMiddleware, BodyLimitMiddleware
from sparkrelay.server.openai_api import openai_response, token_text

logger = logging.getLogger(__name__)

# pydantic's union branch names
_UNION_TAG = re.compile(r"^(str|int|float|bool|list\[.*\]|dict\[.*\]|[A-Z]\w*)$")


def _validation_message(exc: RequestValidationError) -> str:
    errors = list(exc.errors())
    extra = [e for e in errors if e.get("type") == "extra_forbidden"]
    by_loc: dict[str, list[str]] = {}
    for err in extra or errors:
        if err.get("type") == "json_invalid":
            return f"malformed JSON body: {err.get('ctx', {}).get('error', err.get('msg'))}"
        loc = [str(x) for x in err.get("loc", ()) if x != "body" and not _UNION_TAG.match(str(x))]
        msg = (
            "unknown or unsupported field"
            if err.get("type") == "extra_forbidden"
            else err.get("msg", "")
        )
        key = ".".join(loc) or "body"
        if key not in by_loc and len(by_loc) == 5:
            break  # five are shown; a body with a million unknown keys must not cost seconds here
        msgs = by_loc.setdefault(key, [])
        if msg not in msgs:
            msgs.append(msg)
    parts = [f"{loc}: {' or '.join(m)}" for loc, m in list(by_loc.items())[:5]]
    return "invalid request: " + "; ".join(parts)


# ---------------------------------------------------------------- /generate


def _generate_result(out: RequestOutput, start: float, index: Optional[int], text_of=None) -> dict:
    """SGLang's answer; with return_logprob its meta_info holds every logprob so far (cumulative
    when streamed), token texts from `text_of` (return_text_in_logprobs)."""
    res = {
        "text": out.text,
        "output_ids": list(out.output_ids),
        "meta_info": out.meta_info(time.perf_counter() - start, text_of),
    }
    if index is not None:
        res["index"] = index
    return res


async def _generate(s: ServerState, req: P.GenerateRequest, request: Request):
    start = time.perf_counter()
    items, batch = await s.off_loop(
        P.generate_items, req, s.tokenizer, s.limits, lambda: uuid.uuid4().hex
    )
    items = P.with_bootstrap(req, items)
    stream = await s.engine.submit(items)
    index = {it.rid: i for i, it in enumerate(items)}
    text_of = token_text(s.tokenizer) if req.return_text_in_logprobs else None
    if req.stream:
        return s.streaming(
            stream,
            lambda o: [_generate_result(o, start, index[o.rid] if batch else None, text_of)],
            lambda: [],
        )
    finals = await s.collect(stream, request)
    return await s.answer(lambda: _generate_answer(items, finals, start, batch, text_of))


def _generate_answer(
    items: list[GenerationItem],
    finals: dict[str, RequestOutput],
    start: float,
    batch: bool,
    text_of,
) -> list | dict:
    results = [_generate_result(finals[it.rid], start, None, text_of) for it in items]
    return results if batch else results[0]


# ---------------------------------------------------------------- app


def _install_error_handlers(app: FastAPI, s: ServerState) -> None:
    def bad_request(req: Request, message: str):
        s.metrics.num_bad_requests.inc()
        # as often as the access log
        logger.info("rejected %s %s: %s", req.method, req.url.path, message[:300])
        if wants_stream_error(req, s.config):
            return stream_error_response(400, message)
        return error_response(400, message)

    @app.exception_handler(RequestValidationError)
    async def _on_validation(req, exc: RequestValidationError):
        return bad_request(req, _validation_message(exc))

    @app.exception_handler(RequestError)
    async def _on_request_error(req, exc: RequestError):
        return bad_request(req, str(exc))

    @app.exception_handler(ServerError)
    async def _on_server_error(_req, exc: ServerError):
        return error_response(exc.status, str(exc))

    @app.exception_handler(EngineStopped)
    async def _on_engine_stopped(_req, exc: EngineStopped):
        return error_response(503, str(exc))

    @app.exception_handler(EngineFailed)
    async def _on_engine_failed(_req, exc: EngineFailed):
        return error_response(500, str(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _on_http(_req, exc: StarletteHTTPException):
        return error_response(exc.status_code, str(exc.detail))

    @app.exception_handler(Exception)
    async def _on_unexpected(_req, exc: Exception):
        logger.exception("unhandled error")
        return error_response(500, f"internal error: {type(exc).__name__}: {exc}")


def _resolved_settings(s: ServerState) -> dict:
    """The settings whose flag default means "decide at start" (None, auto), as the engine resolved
    them, so /server_info shows the figures in force (as SGLang's does), not the unresolved
    flags."""
    info = s.engine.info
    out = {
        "context_length": info.context_length,
        "max_total_tokens": info.max_total_tokens,
        "tokenizer_path": s.config.model.tokenizer_path or s.config.model.model_path,
        "served_model_name": s.model_name,
        "dspark_pd_handoff": s.config.disagg.handoff,
    }
    for name in ("dtype", "speculative_num_draft_tokens", "dist_init_port"):
        if getattr(info, name) is not None:
            out[name] = getattr(info, name)
    return out


def _install_info_routes(app: FastAPI, s: ServerState) -> None:
    @app.get("/health")
    async def health():
        return Response(status_code=200 if s.engine.is_alive else 503)

    @app.get("/health_generate")
    async def health_generate(request: Request):
        ids = list(s.tokenizer.encode("Hello")) or [0]
        # PD: a fake bootstrap
        item = GenerationItem.health_check(ids, s.config.disagg.disaggregation_mode)
        try:
            await asyncio.wait_for(s.collect(await s.engine.submit([item]), request), timeout=60)
        except Exception as e:
            raise ServerError(503, f"health generation failed: {type(e).__name__}: {e}") from e
        return Response(status_code=200)

    def server_info():
        flat = s.config.flat() | _resolved_settings(s)
        for secret in ("api_key", "disaggregation_auth_token"):
            if flat.get(secret):
                flat[secret] = "<redacted>"
        state = dict(s.engine.last_stats)
        if "spec_accept_length" in state:
            state["avg_spec_accept_length"] = state["spec_accept_length"]  # SGLang's name
        return flat | {"version": sparkrelay.__version__, "internal_states": [state]}

    def model_info():
        return dict(s.engine.info.model_info)

    for path, fn in (
        ("/server_info", server_info),
        ("/get_server_info", server_info),
        ("/model_info", model_info),
        ("/get_model_info", model_info),
    ):
        app.add_api_route(path, fn, methods=["GET"])

    async def flush_cache():
        """SGLang's: empty the prefix cache; 400 (nothing done) while requests are in flight."""
        error = await s.engine.flush_cache()
        if error is None:
            return Response("Cache flushed.\n", media_type="text/plain")
        return Response(
            f"Cache not flushed: {error}\n",
            status_code=400 if s.engine.is_alive else 503,
            media_type="text/plain",
        )

    app.add_api_route("/flush_cache", flush_cache, methods=["GET", "POST"])

    @app.get("/metrics")
    async def metrics():
        return Response(s.metrics.render(s.engine.last_stats), media_type=s.metrics.content_type)

    @app.get("/v1/models")
    async def models():
        card = {
            "id": s.model_name,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "sparkrelay",
            "root": s.config.model.model_path,
            "max_model_len": s.limits.context_length,
        }
        return {"object": "list", "data": [card]}


def _load_json(body: bytes):
    """The body's JSON, checked to hold only valid Unicode."""
    try:
        data = json.loads(body)
        # a lone surrogate (JSON "\ud800") cannot be tokenized
        json.dumps(data, ensure_ascii=False).encode()
    except RecursionError as e:
        raise RequestError("malformed JSON body: nested too deeply") from e
    except UnicodeEncodeError as e:
        raise RequestError(
            f"invalid request: a string holds a lone UTF-16 surrogate "
            f"{e.object[e.start : e.end]!r}, which is not valid Unicode"
        ) from e
    except ValueError as e:
        raise RequestError(f"malformed JSON body: {e}") from e
    return data


def _validate(model: type[BaseModel], data) -> BaseModel:
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise RequestValidationError(e.errors()) from e


async def _parse(s: ServerState, model: type[BaseModel], request: Request):
    """The JSON body as `model`, whatever the Content-Type (curl -d sends form-encoded by default).
    The body's size is bounded by BodyLimitMiddleware; decoding and validating it take time that
    grows with it, so they run off the event loop."""
    data = await s.off_loop(_load_json, await request.body())
    # how errors are answered
    request.state.stream = isinstance(data, dict) and data.get("stream") is True
    return await s.off_loop(_validate, model, data)


_SCHEMA_REF = "#/components/schemas/{model}"


def _body_doc(model: type[BaseModel]) -> dict:
    """openapi_extra documenting a JSON body that `_parse` reads by hand (FastAPI cannot see it)."""
    schema = {"$ref": _SCHEMA_REF.format(model=model.__name__)}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def _document_bodies(app: FastAPI, models: tuple[type[BaseModel], ...]) -> None:
    """Adds the body models (and the models they use) to the OpenAPI schema's components."""
    base = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            components = base().setdefault("components", {}).setdefault("schemas", {})
            for model in models:
                schema = model.model_json_schema(ref_template=_SCHEMA_REF)
                components.update(schema.pop("$defs", {}))
                components[model.__name__] = schema
        return app.openapi_schema

    app.openapi = openapi


def _install_generation_routes(app: FastAPI, s: ServerState) -> None:
    @app.post("/generate", openapi_extra=_body_doc(P.GenerateRequest))
    async def generate(request: Request):
        return await _generate(s, await _parse(s, P.GenerateRequest, request), request)

    @app.post("/v1/completions", openapi_extra=_body_doc(P.CompletionRequest))
    async def completions(request: Request):
        return await openai_response(
            s, await _parse(s, P.CompletionRequest, request), request, chat=False
        )

    @app.post("/v1/chat/completions", openapi_extra=_body_doc(P.ChatCompletionRequest))
    async def chat_completions(request: Request):
        return await openai_response(
            s, await _parse(s, P.ChatCompletionRequest, request), request, chat=True
        )

    _document_bodies(app, (P.GenerateRequest, P.CompletionRequest, P.ChatCompletionRequest))


def build_app(async_engine: EngineClient, config: Config) -> FastAPI:
    """The HTTP app; its lifespan connects the engine (thread or process) to the serving loop and
    stops it at shutdown."""
    s = ServerState(async_engine, config)

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        await async_engine.start()
        try:
            yield
        finally:
            async_engine.stop()
            s.close()

    app = FastAPI(title="sparkrelay", version=sparkrelay.__version__, lifespan=lifespan)
    app.state.server = s
    _install_error_handlers(app, s)
    _install_info_routes(app, s)
    _install_generation_routes(app, s)
    app.add_middleware(
        BodyLimitMiddleware,
        max_mib=config.server.max_request_body_mb,
        on_reject=s.metrics.num_bad_requests.inc,
    )
    # added last, so it runs first: an unknown client learns nothing about the limit
    if config.server.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=config.server.api_key)
    return app
