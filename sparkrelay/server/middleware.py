"""Pure ASGI middleware (no BaseHTTPMiddleware, so streaming and disconnect detection stay
untouched): the API key check and the request body-size limit."""

from __future__ import annotations

import logging
import secrets
from typing import Any, Callable

from sparkrelay.server.common import ServerError, error_response

logger = logging.getLogger(__name__)

OPEN_PATHS = ("/health", "/metrics")
MIB = 1 << 20


class ApiKeyMiddleware:
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


def _declared_length(scope) -> int:
    """The Content-Length header's value, or -1 without one (a chunked body)."""
    value = dict(scope["headers"]).get(b"content-length", b"")
    return int(value) if value.isdigit() else -1


class BodyLimitMiddleware:
    """Answers 413 to a request whose body is larger than `max_mib` MiB. A declared Content-Length
    over the limit is refused before any byte is read; a chunked body is counted as it arrives and
    refused at the first chunk that passes the limit (raised from `receive` inside the handler
    reading it), so nothing is buffered past the limit. The server (uvicorn) discards the rest of an
    answered request's body and keeps the connection."""

    def __init__(self, app, max_mib: int, on_reject: Callable[[], Any] = lambda: None):
        self.app = app
        self.limit = max_mib * MIB
        self.message = (
            f"request body is larger than this server's limit of {max_mib} MiB "
            f"(--max-request-body-mb)"
        )
        self.on_reject = on_reject

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = _declared_length(scope)
        if declared > self.limit:
            self._log(scope, f"{declared} bytes declared")
            return await error_response(413, self.message)(scope, receive, send)
        await self.app(scope, self._counting(scope, receive), send)

    def _counting(self, scope, receive):
        seen = 0

        async def counted():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    self._log(scope, f"{seen} bytes received so far")
                    raise ServerError(413, self.message)
            return message

        return counted

    def _log(self, scope, size: str) -> None:
        logger.info(
            "rejected %s %s: body too large (%s)", scope.get("method"), scope.get("path"), size
        )
        self.on_reject()
