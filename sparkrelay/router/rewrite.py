"""Pure helpers of the PD router: worker specs, bootstrap fields, batch detection and error bodies.

Nothing here does I/O. The wire facts follow sglang-router (docs/pd_protocol.md §4): the router adds
`bootstrap_host` (the prefill URL's hostname), `bootstrap_port` (the number given after the prefill
URL, else null) and a random 63-bit `bootstrap_room` to the client's JSON object; for a batch each
becomes an array with one distinct room per element.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from typing import Any, Callable, Optional
from urllib.parse import urlsplit

MAX_ROOM = 2**63 - 1  # rooms are drawn from [1, MAX_ROOM]; 0 is never used
MAX_BATCH = 1 << 16  # one room is drawn per sequence: a chat `n` of 10**12 must not draw forever
GENERATE, COMPLETIONS, CHAT = "/generate", "/v1/completions", "/v1/chat/completions"


class BadRequest(ValueError):
    """A client request the router cannot route: not a JSON object, or an empty batch. Becomes a
    400."""


@dataclass(frozen=True)
class PrefillWorker:
    url: str  # http://host:port, no trailing slash
    bootstrap_port: Optional[int]  # None: the decode server substitutes its own bootstrap port

    @property
    def host(self) -> str:
        return bootstrap_host(self.url)


@dataclass(frozen=True)
class RouterConfig:
    prefill: tuple[PrefillWorker, ...]
    decode: tuple[str, ...]
    request_timeout_secs: float = 1800.0
    max_retries: int = (
        2  # extra attempts after the first, each with a new (P, D) pair and a new room
    )

    def __post_init__(self) -> None:
        assert self.prefill and self.decode, (
            "PD routing needs at least one prefill and one decode worker"
        )
        assert self.max_retries >= 0 and self.request_timeout_secs > 0


def worker_url(url: str) -> str:
    """Validate an http(s) worker URL and drop any trailing slash; ValueError names what is
    wrong."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{url!r} is not an http(s)://host[:port] URL")
    if parts.path.strip("/") or parts.query or parts.fragment:
        raise ValueError(f"{url!r} must not carry a path, query or fragment")
    _ = parts.port  # raises ValueError on a bad port
    return url.rstrip("/")


def bootstrap_host(url: str) -> str:
    """The hostname of a worker URL, IPv6 without brackets ('http://[::1]:8000' -> '::1')."""
    host = urlsplit(url).hostname
    assert host, url
    return host


def parse_prefill(values: list[str]) -> PrefillWorker:
    """`URL [BOOTSTRAP_PORT]` as given to --prefill; 'none' means no port. ValueError on a bad
    value."""
    if not 1 <= len(values) <= 2:
        raise ValueError(
            f"takes URL [BOOTSTRAP_PORT], got {len(values)} values: {' '.join(values)}"
        )
    url = worker_url(values[0])
    if len(values) == 1 or values[1].lower() == "none":
        return PrefillWorker(url, None)
    try:
        port = int(values[1])
    except ValueError:
        raise ValueError(f"bootstrap port {values[1]!r} is not an integer") from None
    if not 1 <= port <= 65535:
        raise ValueError(f"bootstrap port {port} is outside 1..65535")
    return PrefillWorker(url, port)


def new_room(randbelow: Callable[[int], int] = secrets.randbelow) -> int:
    return randbelow(MAX_ROOM) + 1


def draw_rooms(
    n: int, used: set[int], randbelow: Callable[[int], int] = secrets.randbelow
) -> list[int]:
    """n rooms, distinct from each other and from `used` (rooms of earlier attempts); adds them to
    `used`."""
    rooms: list[int] = []
    while len(rooms) < n:
        room = new_room(randbelow)
        if room not in used:
            used.add(room)
            rooms.append(room)
    return rooms


def parse_object(raw: bytes) -> dict:
    """The request body as a JSON object; BadRequest says why not."""
    try:
        body = json.loads(raw)
    except RecursionError:
        raise BadRequest("request body is not valid JSON: nested too deeply") from None
    except ValueError as e:
        raise BadRequest(f"request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise BadRequest(f"request body must be a JSON object, got {type(body).__name__}")
    return body


def is_json(data: bytes) -> bool:
    try:
        json.loads(data)
    except ValueError:
        return False
    return True


def _list_batch(value: Any, field: str) -> Optional[int]:
    if not isinstance(value, list):
        return None
    if not value:
        raise BadRequest(f"`{field}` is an empty list")
    return len(value)


def batch_size(path: str, body: dict) -> Optional[int]:
    """The number of requests in a batch, or None for a single request (sglang-router's
    detection)."""
    n = _batch_size(path, body)
    if n is not None and n > MAX_BATCH:
        raise BadRequest(f"a batch of {n} sequences is more than the router's limit of {MAX_BATCH}")
    return n


def _batch_size(path: str, body: dict) -> Optional[int]:
    if path == GENERATE:
        ids = body.get("input_ids")
        if isinstance(ids, list) and (not ids or isinstance(ids[0], list)):
            return _list_batch(ids, "input_ids")
        return _list_batch(body.get("text"), "text")
    if path == COMPLETIONS:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            return None  # one prompt given as token ids
        return _list_batch(prompt, "prompt")
    if path == CHAT:
        n = body.get("n")
        return n if isinstance(n, int) and not isinstance(n, bool) and n > 1 else None
    return None


def with_bootstrap(
    body: dict, worker: PrefillWorker, rooms: list[int], batch: Optional[int]
) -> dict:
    """A copy of `body` with the three bootstrap fields; arrays of length `batch` when it is a
    batch."""
    if batch is None:
        assert len(rooms) == 1
        return {
            **body,
            "bootstrap_host": worker.host,
            "bootstrap_port": worker.bootstrap_port,
            "bootstrap_room": rooms[0],
        }
    assert len(rooms) == batch
    return {
        **body,
        "bootstrap_host": [worker.host] * batch,
        "bootstrap_port": [worker.bootstrap_port] * batch,
        "bootstrap_room": rooms,
    }


def error_body(message: str, kind: str, code: int) -> dict:
    return {"error": {"message": message, "type": kind, "code": code}}


def decode_error(status: int, body: bytes) -> dict:
    """Decode's non-2xx body as `{"error": {...}}`: kept when it already is one, else its message
    lifted."""
    try:
        parsed = json.loads(body)
    except ValueError:
        parsed = None
    if isinstance(parsed, dict) and isinstance(parsed.get("error"), dict):
        return parsed
    message = body.decode("utf-8", "replace") or f"decode server answered {status}"
    if isinstance(parsed, dict):
        message = str(parsed.get("message") or parsed.get("detail") or message)
    return error_body(message, "decode_server_error", status)


def sse_error(payload: dict) -> bytes:
    """One SSE error event followed by the end-of-stream marker."""
    return b"data: " + json.dumps(payload).encode() + b"\n\ndata: [DONE]\n\n"
