"""The PD router's HTTP app: pick a (prefill, decode) pair, add bootstrap fields, send to both,
relay decode.

Life of one generate request:
    client --POST /generate--> router: pick P and D round robin, draw a fresh room
    router --same JSON--> P and D concurrently (one aiohttp.ClientSession)
    the first side to fail cancels the other; a retryable failure (transport, or a 5xx that is not a schema
    mismatch; `upstream.py`) is retried with a new pair and a new room, at most `max_retries` times, always
    before any byte reaches the client; a 4xx or a schema mismatch is relayed at once
    client <-- decode's status and body (JSON, or SSE bytes relayed unchanged as they arrive: a stream goes out once
    the prefill answered 2xx headers and the decode's first chunk carries tokens, without waiting for the rest of
    the prefill's answer); an error is relayed
    flat: the failing worker's own error object, its message prefixed with the side ("prefill
    server: ...") /generate with return_logprob: the prefill's prompt logprobs are merged into the
    decode's answer (`logprobs.py`)
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from contextlib import asynccontextmanager
from typing import AsyncIterator, Callable, Optional

import aiohttp
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from sparkrelay.router.admin import add_admin_routes
from sparkrelay.router.logprobs import merge_json, merge_stream, prefill_inputs, wants_merge
from sparkrelay.router.metrics import RouterMetrics
from sparkrelay.router.rewrite import (
    CHAT,
    COMPLETIONS,
    GENERATE,
    BadRequest,
    PrefillWorker,
    RouterConfig,
    batch_size,
    decode_error,
    draw_rooms,
    error_body,
    is_json,
    parse_object,
    sse_error,
    with_bootstrap,
)
from sparkrelay.router.upstream import (
    TRANSPORT_ERRORS,
    Reply,
    both,
    broke,
    peek,
    send,
    should_retry,
)
from sparkrelay.trace import timeline

log = logging.getLogger("sparkrelay.router")
FORWARDED_HEADERS = ("authorization",)


class Router:
    """Round-robin pair selection and the retry loop; one shared aiohttp.ClientSession (`client`,
    opened by the app's lifespan)."""

    def __init__(self, config: RouterConfig, metrics: RouterMetrics):
        self.config, self.metrics = config, metrics
        self.client: Optional[aiohttp.ClientSession] = None
        self._next_p = self._next_d = 0

    def pick(self) -> tuple[PrefillWorker, str]:
        p = self.config.prefill[self._next_p % len(self.config.prefill)]
        d = self.config.decode[self._next_d % len(self.config.decode)]
        self._next_p, self._next_d = self._next_p + 1, self._next_d + 1
        return p, d

    async def attempt(
        self,
        path: str,
        body: dict,
        batch: Optional[int],
        headers: dict,
        stream: bool,
        used: set[int],
    ) -> tuple[Optional[Reply], Reply]:
        """One exchange with a fresh pair and room -> (prefill, decode) replies; prefill None when its 2xx headers
        and the decode's flowing stream settled it first (upstream.both)."""
        p, d = self.pick()
        rooms = draw_rooms(batch or 1, used)
        content = json.dumps(with_bootstrap(body, p, rooms, batch)).encode()
        log.debug("%s room=%s prefill=%s decode=%s", path, rooms if batch else rooms[0], p.url, d)
        self.metrics.attempts.labels(path).inc()
        timeline.mark("router", "in", rooms=rooms)
        relayed = stream and not wants_merge(path, body)  # the decode's stream goes out as it is
        status: list[int] = []  # the prefill's, once its headers are in
        p_task = asyncio.create_task(
            send(self.client, "POST", p.url + path, content, headers, on_status=status.append)
        )
        d_task = asyncio.create_task(self._decode(d + path, content, headers, stream, relayed))
        if timeline.enabled():
            for task, side in ((p_task, "prefill"), (d_task, "decode")):
                task.add_done_callback(
                    lambda _, side=side: timeline.mark("router", "replied", rooms=rooms, side=side)
                )
        prefill_ok = (lambda: bool(status) and 200 <= status[0] < 300) if relayed else None
        try:
            return await both(p_task, d_task, prefill_ok=prefill_ok)
        except asyncio.CancelledError:  # the client went away: drop any stream already opened
            if d_task.done() and not d_task.cancelled():
                await d_task.result().close()
            raise

    async def _decode(
        self, url: str, content: bytes, headers: dict, stream: bool, first: bool
    ) -> Reply:
        """The decode's answer; with `first`, its stream's first chunk read too (upstream.peek)."""
        reply = await send(self.client, "POST", url, content, headers, stream)
        return await peek(reply) if first else reply

    async def dispatch(
        self, path: str, body: dict, headers: dict, stream: bool
    ) -> tuple[Optional[Reply], Reply]:
        """Attempts until both sides answer 2xx, a failure is deterministic, or retries run out."""
        batch, used = batch_size(path, body), set()
        for attempt in range(self.config.max_retries + 1):
            p, d = await self.attempt(path, body, batch, headers, stream, used)
            if not should_retry(p, d) or attempt == self.config.max_retries:
                return p, d
            bad = p if p is not None and p.failed else d
            log.warning(
                "%s: %s failed (%s); retry %d/%d with a new room",
                path,
                "prefill" if bad is p else "decode",
                bad.describe(),
                attempt + 1,
                self.config.max_retries,
            )
            self.metrics.retries.labels(path).inc()
            await d.close()
        raise AssertionError("unreachable")


def _flat(side: str, reply: Reply, code: int) -> dict:
    """The worker's own error object, flat, its message prefixed with the side that failed."""
    own = reply.error_object() or {}
    text = reply.body.decode("utf-8", "replace")[:2000] if reply.status is not None else reply.error
    message = (
        own.get("message") if isinstance(own.get("message"), str) else (text or reply.describe())
    )
    return {
        "error": {
            **own,
            "message": f"{side} server: {message}",
            "type": f"{side}_server_error",
            "code": code,
        }
    }


def _failure(p: Optional[Reply], d: Reply) -> Optional[tuple[int, dict, str]]:
    """(status, flat error JSON, side) for the client when the exchange failed, prefill first; None
    on success."""
    if p is not None and p.failed:
        code = p.status if p.status is not None and 400 <= p.status < 500 else 502
        return code, _flat("prefill", p, code), "prefill"
    if d.status is None:
        return 502, _flat("decode", d, 502), "decode"
    if not d.ok:
        return d.status, decode_error(d.status, d.body), "decode"
    return None


def _relay(d: Reply, done: Callable[[], None], inputs: Optional[dict] = None) -> StreamingResponse:
    """The decode's SSE stream, as it arrives; with `inputs` (prefill_inputs) each event gets the
    prompt logprobs."""
    assert d.stream is not None

    async def chunks() -> AsyncIterator[bytes]:
        try:
            source = _upstream_bytes(d)
            first = True
            async for chunk in source if inputs is None else merge_stream(source, inputs):
                if first:
                    timeline.mark("router", "first_chunk")
                    first = False
                yield chunk
        except TRANSPORT_ERRORS as e:
            log.warning("decode stream broke: %s", broke(e))
            yield sse_error(
                error_body(f"decode server: stream broke: {broke(e)}", "decode_server_error", 502)
            )
        finally:
            await d.close()  # also runs when the client disconnects, so decode can abort
            done()

    return StreamingResponse(
        chunks(),
        status_code=d.status or 200,
        media_type="text/event-stream",
        background=BackgroundTask(d.close),
    )


async def _upstream_bytes(d: Reply) -> AsyncIterator[bytes]:
    """The decode stream's bytes: a peeked stream's first chunk, then the rest."""
    if d.chunks is None:
        async for chunk in d.stream.content.iter_any():
            yield chunk
        return
    if d.first:
        yield d.first
    async for chunk in d.chunks:
        yield chunk


async def _route(router: Router, request: Request, start: float) -> tuple[Response, int, str]:
    """(response, status, failed side or '') for one generation request."""
    headers = {k: v for k, v in request.headers.items() if k.lower() in FORWARDED_HEADERS}
    headers["content-type"] = "application/json"
    path = request.url.path
    try:
        body = parse_object(await request.body())
        stream = body.get("stream") is True
        p, d = await router.dispatch(path, body, headers, stream)
    except BadRequest as e:
        return JSONResponse(error_body(str(e), "invalid_request_error", 400), 400), 400, "router"
    except RecursionError:  # parsed, but too deep to encode again from here
        message = "request body is nested too deeply"
        return JSONResponse(error_body(message, "invalid_request_error", 400), 400), 400, "router"
    failure = _failure(p, d)
    if failure is None:
        echo = body if path == "/v1/completions" else None
        inputs = prefill_inputs(p.body, stream, echo) if wants_merge(path, body) else None
        if stream:
            status = d.status or 200
            return (
                _relay(
                    d,
                    lambda: router.metrics.finished(path, status, time.monotonic() - start),
                    inputs,
                ),
                status,
                "",
            )
        out = d.body if inputs is None else merge_json(d.body, inputs)
        return Response(out, d.status or 200, media_type=d.media_type), d.status or 200, ""
    await d.close()
    code, payload, side = failure
    log.warning("%s failed: %s %s", path, code, payload["error"].get("message"))
    if stream:
        return Response(sse_error(payload), code, media_type="text/event-stream"), code, side
    if side == "decode" and d.status is not None and is_json(d.body):
        return (
            Response(d.body, code, media_type=d.media_type),
            code,
            side,
        )  # decode's own JSON error, unchanged
    return JSONResponse(payload, code), code, side


def _add_generate_routes(app: FastAPI, router: Router) -> None:
    async def generate(request: Request) -> Response:
        start, metrics = time.monotonic(), router.metrics
        metrics.active.inc()
        try:
            response, status, side = await _route(router, request, start)
        finally:
            metrics.active.dec()
        # a relayed stream is counted when its last byte is out
        if not isinstance(response, StreamingResponse):
            metrics.finished(request.url.path, status, time.monotonic() - start, side)
        return response

    any_object = {
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": {"type": "object"}}},
        }
    }
    for path in (
        GENERATE,
        COMPLETIONS,
        CHAT,
    ):  # the body is read by hand: the schema says what it must be
        app.add_api_route(path, generate, methods=["POST"], openapi_extra=any_object)


def open_session(config: RouterConfig) -> aiohttp.ClientSession:
    """The router's client: no limit on connections (keep-alive to every worker),
    request_timeout_secs to connect and between two reads of an answer (not for a whole stream), no
    proxy from the environment."""
    timeout = aiohttp.ClientTimeout(
        total=None, sock_connect=config.request_timeout_secs, sock_read=config.request_timeout_secs
    )
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0), timeout=timeout, trust_env=False
    )


def build_app(config: RouterConfig) -> FastAPI:
    """The router app; its client session opens at start-up (inside the serving loop) and closes on
    shutdown."""
    router = Router(config, RouterMetrics())

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        router.client = open_session(config)
        try:
            yield
        finally:
            await router.client.close()

    app = FastAPI(title="sparkrelay PD router", lifespan=lifespan)
    _add_generate_routes(app, router)
    add_admin_routes(app, config, lambda: router.client, router.pick, router.metrics)
    return app
