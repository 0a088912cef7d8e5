"""One upstream exchange of the PD router: a Reply per worker, sending without raising, and waiting
for both sides.

Which failures are retried: only a transport failure or a 500/502/503/504 whose body does not say it
is deterministic (a handoff schema mismatch fails the same way with any room). A 4xx from either
side is the request's own fault (or a configuration mismatch) and is relayed at once.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import AsyncIterator, Callable, Optional

import aiohttp

TRANSPORT_ERRORS = (
    aiohttp.ClientError,
    asyncio.TimeoutError,
)  # what aiohttp raises when the exchange breaks
RETRYABLE = frozenset({500, 502, 503, 504})
# words in an error body that no new room or worker pair can cure
DETERMINISTIC_MARKERS = ("schema mismatch",)
GRACE_SECS = (
    1.0  # after a retryable failure, how long the other side may take to say it was deterministic
)


@dataclass
class Reply:
    """One upstream answer. status None: transport error or cancelled. `stream` is an open 2xx SSE
    body."""

    status: Optional[int]
    body: bytes = b""
    media_type: str = "application/json"
    error: str = ""
    cancelled: bool = False
    stream: Optional[aiohttp.ClientResponse] = None
    first: bytes = (
        b""  # a peeked stream's first chunk (`peek`), relayed before the rest of `chunks`
    )
    chunks: Optional[AsyncIterator[bytes]] = None

    @property
    def ok(self) -> bool:
        return self.status is not None and 200 <= self.status < 300

    @property
    def failed(self) -> bool:
        return not self.ok and not self.cancelled

    @property
    def retryable(self) -> bool:
        """A failure that another attempt (new room, next pair) may cure: transport, or a 5xx not
        known to repeat."""
        if self.status is None:
            return not self.cancelled
        return self.status in RETRYABLE and not any(
            m in self.body.decode("utf-8", "replace").lower() for m in DETERMINISTIC_MARKERS
        )

    def describe(self) -> str:
        return self.error if self.status is None else f"HTTP {self.status}"

    def error_object(self) -> Optional[dict]:
        """The worker's own `{"message", "type", "code"}` error object, if its body carries one."""
        try:
            parsed = json.loads(self.body)
        except ValueError:
            return None
        if isinstance(parsed, dict) and isinstance(parsed.get("error"), dict):
            return parsed["error"]
        if isinstance(parsed, dict) and isinstance(
            parsed.get("message") or parsed.get("detail"), str
        ):
            return {"message": parsed.get("message") or parsed.get("detail")}
        return None

    @property
    def flowing(self) -> bool:
        """A peeked 2xx stream whose first chunk is whole SSE data events, none an error: the decode
        has the prompt's KV and streams its tokens."""
        if not self.ok or not self.first.endswith(b"\n\n"):
            return False
        events = [e.strip() for e in self.first.split(b"\n\n") if e.strip()]
        return bool(events) and all(e.startswith(b"data:") and not _is_error(e[5:]) for e in events)

    async def close(self) -> None:
        """Done with a stream: read to its end, its connection goes back to the pool; else the
        connection is closed, so the worker sees its client go (and aborts the request)."""
        if self.stream is not None:
            if self.stream.content.at_eof():
                self.stream.release()
            else:
                self.stream.close()


def _is_error(data: bytes) -> bool:
    """An SSE event's data is anything but a JSON object without an "error" key."""
    try:
        obj = json.loads(data)
    except ValueError:
        return True
    return not isinstance(obj, dict) or "error" in obj


def broke(e: BaseException) -> str:
    """A transport error, named: "ClientConnectorError: Cannot connect to host ..." (a timeout says
    so)."""
    return f"{type(e).__name__}: {e or 'timed out'}"


async def send(
    session: aiohttp.ClientSession,
    method: str,
    url: str,
    content: Optional[bytes] = None,
    headers: Optional[dict] = None,
    stream: bool = False,
    on_status: Optional[Callable[[int], None]] = None,
) -> Reply:
    """Never raises on transport errors; with `stream`, a 2xx answer comes back unread in
    Reply.stream. on_status(status) is called once the answer's headers are in, before its body is
    read."""
    try:
        resp = await session.request(method, url, data=content, headers=headers)
    except TRANSPORT_ERRORS as e:
        return Reply(None, error=f"{url}: {broke(e)}")
    if on_status is not None:
        on_status(resp.status)
    media = resp.headers.get("content-type", "application/json")
    if stream and 200 <= resp.status < 300:
        return Reply(resp.status, media_type=media, stream=resp)
    try:
        body = await resp.read()
    except TRANSPORT_ERRORS as e:
        return Reply(None, error=f"{url}: {broke(e)}")
    finally:
        resp.release()
    return Reply(resp.status, body, media)


async def peek(reply: Reply) -> Reply:
    """Read a 2xx stream's first chunk into reply.first (reply.chunks goes on after it); a transport
    error closes the stream and becomes a failed Reply. Cancelled meanwhile, the stream is
    closed."""
    if not reply.ok or reply.stream is None:
        return reply
    reply.chunks = reply.stream.content.iter_any()
    try:
        reply.first = await anext(reply.chunks, b"")
    except TRANSPORT_ERRORS as e:
        await reply.close()
        return Reply(None, error=broke(e))
    except BaseException:
        await reply.close()
        raise
    return reply


def outcome(task: asyncio.Task) -> Reply:
    return Reply(None, error="cancelled", cancelled=True) if task.cancelled() else task.result()


async def both(
    p_task: asyncio.Task,
    d_task: asyncio.Task,
    grace: float = GRACE_SECS,
    prefill_ok: Optional[Callable[[], bool]] = None,
) -> tuple[Optional[Reply], Reply]:
    """Wait for both sides. A failure cancels the other side (it would wait for KV that never comes); after a
    retryable failure the other side gets `grace` seconds first, so a deterministic cause it reports is seen.
    prefill_ok (a stream the router relays as is): once the prefill has answered 2xx headers and the decode's
    stream carries tokens (Reply.flowing, a peeked stream), the exchange is settled without the rest of the
    prefill's answer, which it sends only after every stage reported its parts sent (a few ms after the decode
    has them): -> (None, decode); the prefill's answer is read to its end in the background."""
    pending = {p_task, d_task}
    try:
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            if (
                prefill_ok is not None
                and d_task.done()
                and p_task in pending
                and outcome(d_task).flowing
                and prefill_ok()
            ):
                _detach(p_task)
                pending = set()
                return None, outcome(d_task)
            failed = [outcome(t) for t in done if outcome(t).failed]
            if failed and pending and all(r.retryable for r in failed):
                _, pending = await asyncio.wait(pending, timeout=grace)
            if failed:
                break
    finally:
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    return outcome(p_task), outcome(d_task)


_detached: set[asyncio.Task] = set()


def _detach(task: asyncio.Task) -> None:
    """Keep a task nobody awaits any more alive until it ends (send() never raises; its Reply is
    dropped)."""
    _detached.add(task)
    task.add_done_callback(_detached.discard)


def should_retry(p: Optional[Reply], d: Reply) -> bool:
    """Retry only when something failed and every failure is retryable (one deterministic failure is
    enough)."""
    bad = [r for r in (p, d) if r is not None and r.failed]
    return bool(bad) and all(r.retryable for r in bad)
