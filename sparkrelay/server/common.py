"""What every HTTP route shares: the error format, SSE framing, and the server state that runs the
CPU-heavy part of a request (JSON decoding, chat templates, tokenization) off the event loop, meters
outputs, collects final answers (aborting on client disconnect) and streams chunks."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
from typing import Any, AsyncIterator, Callable, Optional, TypeVar

import orjson
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from sparkrelay.config import Config
from sparkrelay.manager.client import EngineClient, OutputStream
from sparkrelay.scheduler.request import RequestOutput
from sparkrelay.server import protocol as P
from sparkrelay.server.metrics import Metrics

T = TypeVar("T")
# Threads that prepare requests (decode the JSON, render chat templates, tokenize). HF fast
# tokenizers release the GIL while encoding, so a 100k-token prompt being encoded does not stall the
# event loop (health checks, streams, small requests), and up to this many requests are prepared at
# once.
PREP_THREADS = 4

_ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    413: "PayloadTooLargeError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


class ServerError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def error_body(status: int, message: str) -> dict:
    return {
        "error": {"message": message, "type": _ERROR_TYPES.get(status, "Error"), "code": status}
    }


def error_response(status: int, message: str) -> JSONResponse:
    return JSONResponse(error_body(status, message), status_code=status)


SSE_DONE = b"data: [DONE]\n\n"


def sse(obj) -> bytes:
    """One SSE event, UTF-8 as is (like ensure_ascii=False). orjson, because a stream writes one per
    token and a /generate chunk carries every output id so far, where the standard library's json is
    far slower (speed notes of docs/architecture.md)."""
    return b"data: " + orjson.dumps(obj, option=orjson.OPT_NON_STR_KEYS) + b"\n\n"


def stream_error_response(status: int, message: str) -> Response:
    """A streamed request's error as a 200 SSE body: the error event (with the real status as its
    `code`), then [DONE]. A decode server answers so because routers relay its stream: sglang-router
    (0.3.2) rewrites any non-2xx answer to a streamed request into a broken frame (`data: {'error':
    ...` cut at the original length)."""
    return Response(
        sse(error_body(status, message)) + SSE_DONE, 200, media_type="text/event-stream"
    )


def wants_stream_error(request: Request, config: Config) -> bool:
    """Whether an error of this request goes out as `stream_error_response`: a decode server's
    streamed request (`_parse` records `stream` in request.state)."""
    return (
        config.disagg.disaggregation_mode == "decode"
        and getattr(request.state, "stream", False) is True
    )


def failure(out: RequestOutput) -> Optional[str]:
    """The message of an abnormal finish (engine error or shutdown), else None."""
    r = out.finish_reason or {}
    return (
        r.get("message", "request aborted") if out.finished and r.get("type") == "abort" else None
    )


class ServerState:
    def __init__(self, engine: EngineClient, config: Config):
        self.engine = engine
        self.config = config
        self.metrics = Metrics()
        self.tokenizer = engine.tokenizer
        self.limits = P.Limits(
            context_length=engine.info.context_length,
            max_n=config.scheduler.max_n,
            grammar_backend=config.scheduler.grammar_backend,
            tool_call_parser=config.model.tool_call_parser,
        )
        self.model_name = config.model.served_model_name or config.model.model_path
        self._prep: Optional[concurrent.futures.ThreadPoolExecutor] = None  # started on first use

    async def off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        """fn(*args) in a prep thread: CPU work that grows with the request (JSON, templates,
        tokenization)."""
        if self._prep is None:
            self._prep = concurrent.futures.ThreadPoolExecutor(
                PREP_THREADS, thread_name_prefix="sparkrelay-prep"
            )
        return await asyncio.get_running_loop().run_in_executor(
            self._prep, functools.partial(fn, *args)
        )

    async def answer(self, build: Callable[[], Any]) -> JSONResponse:
        """The JSON answer that build() makes, built and rendered in a prep thread: the token texts
        and logprobs of a long prompt or output make a large body."""
        return await self.off_loop(lambda: JSONResponse(build()))

    def close(self) -> None:
        if self._prep is not None:
            self._prep.shutdown(wait=False, cancel_futures=True)
            self._prep = None

    async def outputs(self, stream: OutputStream) -> AsyncIterator[RequestOutput]:
        """The stream's outputs, metered; closes (aborts what is unfinished) however the consumer
        leaves."""
        trackers = {rid: self.metrics.tracker() for rid in stream.rids}
        try:
            async for out in stream:
                trackers[out.rid].observe(out)
                yield out
        finally:
            stream.close()

    async def collect(self, stream: OutputStream, request: Request) -> dict[str, RequestOutput]:
        """Final output of every request in the stream; gives up (aborting them) if the client
        disconnects."""
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
            if failure(out):
                raise ServerError((out.finish_reason or {}).get("status_code", 500), failure(out))
        return finals

    def streaming(
        self,
        stream: OutputStream,
        chunks: Callable[[RequestOutput], list],
        tail: Callable[[], list],
    ):
        async def body():
            async with contextlib.aclosing(self.outputs(stream)) as outs:
                async for out in outs:
                    # the error's own status (e.g. a 4xx schema mismatch), as JSON would
                    if failure(out):
                        yield sse(
                            error_body(
                                (out.finish_reason or {}).get("status_code", 500), failure(out)
                            )
                        )
                        break
                    for c in chunks(out):
                        yield sse(c)
                for c in tail():
                    yield sse(c)
            yield SSE_DONE

        return StreamingResponse(body(), media_type="text/event-stream")
