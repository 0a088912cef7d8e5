"""FastAPI app: SGLang-native /generate, OpenAI /v1/*, health, info and Prometheus metrics.

Life of an HTTP generation request:
  1. FastAPI validates the JSON into a protocol model (bad shape -> 400 via the validation handler).
  2. protocol.*_items turns it into engine items (bad values -> RequestError -> 400).
  3. AsyncEngine.submit adds them atomically in the engine thread (engine's RequestError -> 400).
  4. Outputs stream back; a streaming response sends SSE chunks, a plain one waits while watching for
     a client disconnect. Leaving early in any way closes the stream, which aborts unfinished requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import secrets
import time
import uuid
from typing import AsyncIterator, Callable, Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

import sparkrelay
from sparkrelay.config import Config
from sparkrelay.engine.request import RequestError, RequestOutput, SamplingParams
from sparkrelay.server import protocol as P
from sparkrelay.server.async_engine import AsyncEngine, GenerationItem, OutputStream
from sparkrelay.server.metrics import Metrics

logger = logging.getLogger(__name__)

OPEN_PATHS = ("/health", "/metrics")
_ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
                405: "MethodNotAllowedError", 500: "InternalServerError", 503: "ServiceUnavailableError"}


class ServerError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def error_body(status: int, message: str) -> dict:
    return {"error": {"message": message, "type": _ERROR_TYPES.get(status, "Error"), "code": status}}


def error_response(status: int, message: str) -> JSONResponse:
    return JSONResponse(error_body(status, message), status_code=status)


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class _ApiKeyMiddleware:
    """Pure ASGI (no BaseHTTPMiddleware) so streaming and disconnect detection stay untouched."""

    def __init__(self, app, api_key: str):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            got = dict(scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(got, self.expected):
                msg = "missing or wrong API key: send `Authorization: Bearer <key>`"
                await error_response(401, msg)(scope, receive, send)
                return
        await self.app(scope, receive, send)


_UNION_TAG = re.compile(r"^(str|int|float|bool|list\[.*\]|dict\[.*\]|[A-Z]\w*)$")  # pydantic's union branch names


def _validation_message(exc: RequestValidationError) -> str:
    errors = list(exc.errors())
    extra = [e for e in errors if e.get("type") == "extra_forbidden"]
    by_loc: dict[str, list[str]] = {}
    for err in extra or errors:
        if err.get("type") == "json_invalid":
            return f"malformed JSON body: {err.get('ctx', {}).get('error', err.get('msg'))}"
        loc = [str(x) for x in err.get("loc", ()) if x != "body" and not _UNION_TAG.match(str(x))]
        msg = "unknown or unsupported field" if err.get("type") == "extra_forbidden" else err.get("msg", "")
        msgs = by_loc.setdefault(".".join(loc) or "body", [])
        if msg not in msgs:
            msgs.append(msg)
    parts = [f"{loc}: {' or '.join(m)}" for loc, m in list(by_loc.items())[:5]]
    return "invalid request: " + "; ".join(parts)


class _Stable:
    """Text deltas for OpenAI streams: holds back a trailing partial stop string or partial UTF-8 char."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops = stops
        self.sent = 0

    def delta(self, out: RequestOutput) -> str:
        text = out.text if out.finished else self._stable(out.text)
        d = text[self.sent:]
        self.sent = max(self.sent, len(text))
        return d

    def _stable(self, text: str) -> str:
        text = text.rstrip("\ufffd")
        hold = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(text)), hold, -1):
                if text.endswith(s[:k]):
                    hold = k
                    break
        return text[:len(text) - hold]


def _finish(out: RequestOutput) -> Optional[str]:
    if not out.finished:
        return None
    kind = (out.finish_reason or {}).get("type")
    return kind if kind in ("stop", "length") else (kind or "stop")


def _failure(out: RequestOutput) -> Optional[str]:
    """The message of an abnormal finish (engine error or shutdown), else None."""
    r = out.finish_reason or {}
    return r.get("message", "request aborted") if out.finished and r.get("type") == "abort" else None


class _Server:
    def __init__(self, engine: AsyncEngine, config: Config):
        self.engine = engine
        self.config = config
        self.metrics = Metrics()
        e = engine.engine
        self.tokenizer = e.tokenizer
        self.limits = P.Limits(context_length=e.context_length, max_n=config.scheduler.max_n)
        self.model_name = config.model.served_model_name or config.model.model_path

    async def outputs(self, stream: OutputStream) -> AsyncIterator[RequestOutput]:
        """The stream's outputs, metered; closes (aborts what is unfinished) however the consumer leaves."""
        trackers = {rid: self.metrics.tracker() for rid in stream.rids}
        try:
            async for out in stream:
                trackers[out.rid].observe(out)
                yield out
        finally:
            stream.close()

    async def collect(self, stream: OutputStream, request: Request) -> dict[str, RequestOutput]:
        """Final output of every request in the stream; gives up (aborting them) if the client disconnects."""
        finals: dict[str, RequestOutput] = {}

        async def drain():
            async for out in self.outputs(stream):
                if out.finished:
                    finals[out.rid] = out

        task = asyncio.ensure_future(drain())
        try:
            while not task.done():
                await asyncio.wait({task}, timeout=0.25)
                if not task.done() and await request.is_disconnected():
                    raise ServerError(499, "client disconnected")
            task.result()
        finally:
            task.cancel()
            stream.close()
        for out in finals.values():
            if _failure(out):
                raise ServerError((out.finish_reason or {}).get("status_code", 500), _failure(out))
        return finals

    def streaming(self, stream: OutputStream, chunks: Callable[[RequestOutput], list], tail: Callable[[], list]):
        async def body():
            async with contextlib.aclosing(self.outputs(stream)) as outs:
                async for out in outs:
                    if _failure(out):
                        yield _sse(error_body(500, _failure(out)))
                        break
                    for c in chunks(out):
                        yield _sse(c)
                for c in tail():
                    yield _sse(c)
            yield "data: [DONE]\n\n"

        return StreamingResponse(body(), media_type="text/event-stream")


# ---------------------------------------------------------------- /generate

def _generate_result(out: RequestOutput, start: float, index: Optional[int]) -> dict:
    meta = {"id": out.rid, "prompt_tokens": out.prompt_tokens, "completion_tokens": len(out.output_ids),
            "finish_reason": out.finish_reason, "e2e_latency": time.perf_counter() - start}
    if out.spec_accept_length is not None:
        meta["spec_verify_ct"] = out.spec_verify_ct
        meta["spec_accept_length"] = out.spec_accept_length
    res = {"text": out.text, "output_ids": list(out.output_ids), "meta_info": meta}
    if index is not None:
        res["index"] = index
    return res


async def _generate(s: _Server, req: P.GenerateRequest, request: Request):
    start = time.perf_counter()
    items, batch = P.generate_items(req, s.tokenizer, s.limits, lambda: uuid.uuid4().hex)
    stream = await s.engine.submit(items)
    index = {it.rid: i for i, it in enumerate(items)}
    if req.stream:
        return s.streaming(stream, lambda o: [_generate_result(o, start, index[o.rid] if batch else None)],
                           lambda: [])
    finals = await s.collect(stream, request)
    results = [_generate_result(finals[it.rid], start, None) for it in items]
    return results if batch else results[0]


# ---------------------------------------------------------------- OpenAI

def _usage(finals: list[RequestOutput], n: int) -> dict:
    prompt = sum(o.prompt_tokens for i, o in enumerate(finals) if i % n == 0)  # once per prompt, not per sample
    completion = sum(len(o.output_ids) for o in finals)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _openai_head(kind: str, oid: str, s: _Server) -> dict:
    return {"id": oid, "object": kind, "created": int(time.time()), "model": s.model_name}


def _choice(chat: bool, index: int, text: str, finish: Optional[str], stream: bool, first: bool = False) -> dict:
    c: dict = {"index": index, "logprobs": None, "finish_reason": finish}
    if not chat:
        c["text"] = text
    elif not stream:
        c["message"] = {"role": "assistant", "content": text}
    else:
        c["delta"] = ({"role": "assistant", "content": text} if first else {"content": text}) if text or first else {}
    return c


async def _openai(s: _Server, req, request: Request, chat: bool):
    oid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    items = (P.chat_items if chat else P.completion_items)(req, s.tokenizer, s.limits, oid)
    stream = await s.engine.submit(items)
    index = {it.rid: i for i, it in enumerate(items)}
    if req.stream:
        return _openai_stream(s, req, stream, items, index, oid, chat)
    finals = await s.collect(stream, request)
    outs = [finals[it.rid] for it in items]
    resp = _openai_head("chat.completion" if chat else "text_completion", oid, s)
    resp["choices"] = [_choice(chat, i, o.text, _finish(o), False) for i, o in enumerate(outs)]
    resp["usage"] = _usage(outs, req.n)
    return resp


def _openai_stream(s: _Server, req, stream: OutputStream, items: list[GenerationItem], index: dict,
                   oid: str, chat: bool) -> StreamingResponse:
    kind = "chat.completion.chunk" if chat else "text_completion"
    usage = bool(req.stream_options and req.stream_options.include_usage)
    deltas = {it.rid: _Stable(it.params.stop) for it in items}
    started: set[str] = set()
    finals: dict[str, RequestOutput] = {}

    def chunk(choices: list, with_usage=None) -> dict:
        c = _openai_head(kind, oid, s) | {"choices": choices}
        return c | {"usage": with_usage} if usage else c

    def chunks(out: RequestOutput) -> list:
        text, finish, first = deltas[out.rid].delta(out), _finish(out), out.rid not in started
        started.add(out.rid)
        if out.finished:
            finals[out.rid] = out
        if not (text or finish or (chat and first)):
            return []
        return [chunk([_choice(chat, index[out.rid], text, finish, True, first)])]

    def tail() -> list:
        outs = [finals[it.rid] for it in items if it.rid in finals]
        return [chunk([], _usage(outs, req.n))] if usage and len(outs) == len(items) else []

    return s.streaming(stream, chunks, tail)


# ---------------------------------------------------------------- app

def _install_error_handlers(app: FastAPI, s: _Server) -> None:
    @app.exception_handler(RequestValidationError)
    async def _on_validation(_req, exc: RequestValidationError):
        s.metrics.num_bad_requests.inc()
        return error_response(400, _validation_message(exc))

    @app.exception_handler(RequestError)
    async def _on_request_error(_req, exc: RequestError):
        s.metrics.num_bad_requests.inc()
        return error_response(400, str(exc))

    @app.exception_handler(ServerError)
    async def _on_server_error(_req, exc: ServerError):
        return error_response(exc.status, str(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _on_http(_req, exc: StarletteHTTPException):
        return error_response(exc.status_code, str(exc.detail))

    @app.exception_handler(Exception)
    async def _on_unexpected(_req, exc: Exception):
        logger.exception("unhandled error")
        return error_response(500, f"internal error: {type(exc).__name__}: {exc}")


def _install_info_routes(app: FastAPI, s: _Server) -> None:
    @app.get("/health")
    async def health():
        return Response(status_code=200 if s.engine.is_alive else 503)

    @app.get("/health_generate")
    async def health_generate(request: Request):
        ids = list(s.tokenizer.encode("Hello")) or [0]
        item = GenerationItem(f"health-{uuid.uuid4().hex}", ids, SamplingParams(max_new_tokens=1, temperature=0.0))
        try:
            await asyncio.wait_for(s.collect(await s.engine.submit([item]), request), timeout=60)
        except Exception as e:
            raise ServerError(503, f"health generation failed: {type(e).__name__}: {e}") from e
        return Response(status_code=200)

    def server_info():
        flat = s.config.flat()
        if flat.get("api_key"):
            flat["api_key"] = "<redacted>"
        state = dict(s.engine.last_stats)
        if "spec_accept_length" in state:
            state["avg_spec_accept_length"] = state["spec_accept_length"]  # SGLang's name
        return flat | {"version": sparkrelay.__version__, "internal_states": [state]}

    def model_info():
        return dict(s.engine.engine.model_info)

    for path, fn in (("/server_info", server_info), ("/get_server_info", server_info),
                     ("/model_info", model_info), ("/get_model_info", model_info)):
        app.add_api_route(path, fn, methods=["GET"])

    @app.get("/metrics")
    async def metrics():
        return Response(s.metrics.render(s.engine.last_stats), media_type=s.metrics.content_type)

    @app.get("/v1/models")
    async def models():
        card = {"id": s.model_name, "object": "model", "created": int(time.time()), "owned_by": "sparkrelay",
                "root": s.config.model.model_path, "max_model_len": s.limits.context_length}
        return {"object": "list", "data": [card]}


async def _parse(model: type[BaseModel], request: Request):
    """The JSON body as `model`, whatever the Content-Type (curl -d sends form-encoded by default)."""
    try:
        data = json.loads(await request.body())
    except ValueError as e:
        raise RequestError(f"malformed JSON body: {e}") from e
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise RequestValidationError(e.errors()) from e


def _install_generation_routes(app: FastAPI, s: _Server) -> None:
    @app.post("/generate")
    async def generate(request: Request):
        return await _generate(s, await _parse(P.GenerateRequest, request), request)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _openai(s, await _parse(P.CompletionRequest, request), request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _openai(s, await _parse(P.ChatCompletionRequest, request), request, chat=True)


def build_app(async_engine: AsyncEngine, config: Config) -> FastAPI:
    """The HTTP app; its lifespan starts the engine thread on the serving loop and stops it at shutdown."""
    s = _Server(async_engine, config)

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        await async_engine.start()
        try:
            yield
        finally:
            async_engine.stop()

    app = FastAPI(title="sparkrelay", version=sparkrelay.__version__, lifespan=lifespan)
    app.state.server = s
    _install_error_handlers(app, s)
    _install_info_routes(app, s)
    _install_generation_routes(app, s)
    if config.server.api_key:
        app.add_middleware(_ApiKeyMiddleware, api_key=config.server.api_key)
    return app
