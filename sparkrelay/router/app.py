"""The PD router's HTTP app: pick a (prefill, decode) pair, add bootstrap fields, send to both, relay decode.

Life of one generate request (PD_PROTOCOL.md §1.2):
    client --POST /generate--> router: pick P and D round robin, draw a fresh room
    router --same JSON--> P and D concurrently (httpx.AsyncClient)
    the first side to fail cancels the other; a retryable failure (transport, 408/429/5xx) is retried with a
    new pair and a new room, at most `max_retries` times, always before any byte reaches the client
    client <-- decode's status and body (JSON, or SSE bytes relayed unchanged as they arrive)
"""

from __future__ import annotations

import asyncio
import json
import logging
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import AsyncIterator, Optional

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from sparkrelay.router.rewrite import (CHAT, COMPLETIONS, GENERATE, RETRYABLE, BadRequest, PrefillWorker,
                                       RouterConfig, batch_size, decode_error, draw_rooms, error_body, is_json,
                                       parse_object, sse_error, with_bootstrap)

log = logging.getLogger("sparkrelay.router")
INFO_ROUTES = ("/server_info", "/get_server_info", "/model_info", "/get_model_info", "/v1/models")
FORWARDED_HEADERS = ("authorization",)


@dataclass
class Reply:
    """One upstream answer. status None: transport error or cancelled. `stream` is an open 2xx SSE body."""
    status: Optional[int]
    body: bytes = b""
    media_type: str = "application/json"
    error: str = ""
    cancelled: bool = False
    stream: Optional[httpx.Response] = None

    @property
    def ok(self) -> bool:
        return self.status is not None and 200 <= self.status < 300

    @property
    def failed(self) -> bool:
        return not self.ok and not self.cancelled

    @property
    def retryable(self) -> bool:
        return self.status is None or self.status in RETRYABLE

    def describe(self) -> str:
        return self.error if self.status is None else f"HTTP {self.status}"

    async def close(self) -> None:
        if self.stream is not None:
            await self.stream.aclose()


async def _send(client: httpx.AsyncClient, method: str, url: str, content: Optional[bytes] = None,
                headers: Optional[dict] = None, stream: bool = False) -> Reply:
    """Never raises on transport errors; with `stream`, a 2xx answer comes back unread in Reply.stream."""
    try:
        resp = await client.send(client.build_request(method, url, content=content, headers=headers), stream=True)
    except httpx.HTTPError as e:
        return Reply(None, error=f"{url}: {type(e).__name__}: {e}")
    media = resp.headers.get("content-type", "application/json")
    if stream and resp.is_success:
        return Reply(resp.status_code, media_type=media, stream=resp)
    try:
        body = await resp.aread()
    except httpx.HTTPError as e:
        return Reply(None, error=f"{url}: {type(e).__name__}: {e}")
    finally:
        await resp.aclose()
    return Reply(resp.status_code, body, media)


def _outcome(task: asyncio.Task) -> Reply:
    return Reply(None, error="cancelled", cancelled=True) if task.cancelled() else task.result()


async def _both(p_task: asyncio.Task, d_task: asyncio.Task) -> tuple[Reply, Reply]:
    """Wait for both sides; the first failure cancels the other (it would wait for KV that never comes)."""
    pending = {p_task, d_task}
    try:
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            if any(_outcome(t).failed for t in done):
                break
    finally:
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    return _outcome(p_task), _outcome(d_task)


class Router:
    """Round-robin pair selection and the retry loop; one shared httpx.AsyncClient."""

    def __init__(self, config: RouterConfig, client: httpx.AsyncClient):
        self.config, self.client = config, client
        self._next_p = self._next_d = 0

    def pick(self) -> tuple[PrefillWorker, str]:
        p = self.config.prefill[self._next_p % len(self.config.prefill)]
        d = self.config.decode[self._next_d % len(self.config.decode)]
        self._next_p, self._next_d = self._next_p + 1, self._next_d + 1
        return p, d

    async def attempt(self, path: str, body: dict, batch: Optional[int], headers: dict, stream: bool,
                      used: set[int]) -> tuple[Reply, Reply]:
        p, d = self.pick()
        rooms = draw_rooms(batch or 1, used)
        content = json.dumps(with_bootstrap(body, p, rooms, batch)).encode()
        log.debug("%s room=%s prefill=%s decode=%s", path, rooms if batch else rooms[0], p.url, d)
        p_task = asyncio.create_task(_send(self.client, "POST", p.url + path, content, headers))
        d_task = asyncio.create_task(_send(self.client, "POST", d + path, content, headers, stream))
        try:
            return await _both(p_task, d_task)
        except asyncio.CancelledError:  # the client went away: drop any stream already opened
            if d_task.done() and not d_task.cancelled():
                await d_task.result().close()
            raise

    async def dispatch(self, path: str, body: dict, headers: dict, stream: bool) -> tuple[Reply, Reply]:
        """Attempts until both sides answer 2xx, a failure is not retryable, or retries run out."""
        batch, used = batch_size(path, body), set()
        for attempt in range(self.config.max_retries + 1):
            p, d = await self.attempt(path, body, batch, headers, stream, used)
            bad = p if p.failed else d if d.failed else None
            if bad is None or not bad.retryable or attempt == self.config.max_retries:
                return p, d
            log.warning("%s: %s failed (%s); retry %d/%d with a new room", path, "prefill" if bad is p else
                        "decode", bad.describe(), attempt + 1, self.config.max_retries)
            await d.close()
        raise AssertionError("unreachable")


def _failure(p: Reply, d: Reply) -> Optional[tuple[int, dict]]:
    """(status, error JSON) for the client when the exchange failed, prefill first; None on success."""
    if p.failed:
        code = p.status if p.status is not None and 400 <= p.status < 500 else 502
        detail = p.body.decode("utf-8", "replace")[:2000]
        message = f"prefill server failed: {p.describe()}" + (f": {detail}" if detail else "")
        return code, error_body(message, "prefill_server_error", code)
    if d.status is None:
        return 502, error_body(f"decode server failed: {d.error}", "decode_server_error", 502)
    if not d.ok:
        return d.status, decode_error(d.status, d.body)
    return None


def _relay(d: Reply) -> StreamingResponse:
    upstream = d.stream
    assert upstream is not None

    async def chunks() -> AsyncIterator[bytes]:
        try:
            async for chunk in upstream.aiter_bytes():
                yield chunk
        except httpx.HTTPError as e:
            log.warning("decode stream broke: %s: %s", type(e).__name__, e)
            yield sse_error(error_body(f"decode stream broke: {e}", "decode_server_error", 502))
        finally:
            await upstream.aclose()  # also runs when the client disconnects, so decode can abort

    return StreamingResponse(chunks(), status_code=d.status or 200, media_type="text/event-stream",
                             background=BackgroundTask(upstream.aclose))


def _add_generate_routes(app: FastAPI, router: Router) -> None:
    async def generate(request: Request) -> Response:
        headers = {k: v for k, v in request.headers.items() if k.lower() in FORWARDED_HEADERS}
        headers["content-type"] = "application/json"
        path = request.url.path
        try:
            body = parse_object(await request.body())
            stream = body.get("stream") is True
            p, d = await router.dispatch(path, body, headers, stream)
        except BadRequest as e:
            return JSONResponse(error_body(str(e), "invalid_request_error", 400), 400)
        except RecursionError:  # parsed, but too deep to encode again from here
            return JSONResponse(error_body("request body is nested too deeply", "invalid_request_error", 400), 400)
        failure = _failure(p, d)
        if failure is None:
            return _relay(d) if stream else Response(d.body, d.status or 200, media_type=d.media_type)
        await d.close()
        code, payload = failure
        log.warning("%s failed: %s %s", path, code, payload["error"].get("message"))
        if stream:
            return Response(sse_error(payload), code, media_type="text/event-stream")
        if not p.failed and d.status is not None and is_json(d.body):
            return Response(d.body, code, media_type=d.media_type)  # decode's own JSON error, unchanged
        return JSONResponse(payload, code)

    any_object = {"requestBody": {"required": True, "content": {"application/json": {"schema": {"type": "object"}}}}}
    for path in (GENERATE, COMPLETIONS, CHAT):  # the body is read by hand: the schema says what it must be
        app.add_api_route(path, generate, methods=["POST"], openapi_extra=any_object)


def _add_admin_routes(app: FastAPI, router: Router) -> None:
    client, config = router.client, router.config

    async def health() -> Response:
        return Response(status_code=200)

    async def health_generate() -> Response:
        p, d = router.pick()
        replies = await asyncio.gather(_send(client, "GET", p.url + "/health"), _send(client, "GET", d + "/health"))
        report = {"prefill": replies[0].status, "decode": replies[1].status}
        return JSONResponse(report, 200 if all(r.ok for r in replies) else 503)

    async def info(request: Request) -> Response:
        reply = await _send(client, "GET", config.prefill[0].url + request.url.path)
        if reply.status is None:
            log.warning("info proxy failed: %s", reply.error)
            return JSONResponse(error_body(reply.error, "prefill_server_error", 502), 502)
        return Response(reply.body, reply.status, media_type=reply.media_type)

    async def flush_cache() -> JSONResponse:
        urls = [p.url for p in config.prefill] + list(config.decode)
        replies = await asyncio.gather(*(_send(client, "POST", u + "/flush_cache") for u in urls))
        return JSONResponse({"results": [{"url": u, "status": r.status, "error": r.error or None}
                                         for u, r in zip(urls, replies)]})

    app.add_api_route("/health", health, methods=["GET"])
    app.add_api_route("/health_generate", health_generate, methods=["GET"])
    for path in INFO_ROUTES:
        app.add_api_route(path, info, methods=["GET"])
    app.add_api_route("/flush_cache", flush_cache, methods=["POST"])


def build_app(config: RouterConfig, transport: Optional[httpx.AsyncBaseTransport] = None) -> FastAPI:
    """The router app; `transport` replaces the network (tests). The client is closed on shutdown."""
    client = httpx.AsyncClient(timeout=httpx.Timeout(config.request_timeout_secs), trust_env=False,
                               limits=httpx.Limits(max_connections=None, max_keepalive_connections=256),
                               transport=transport)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        await client.aclose()

    app = FastAPI(title="sparkrelay PD router", lifespan=lifespan)
    router = Router(config, client)
    _add_generate_routes(app, router)
    _add_admin_routes(app, router)
    return app
