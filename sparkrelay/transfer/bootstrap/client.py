"""The bootstrap server's clients (bootstrap/server.py): stages register with PUT /route; the decode
reads the server info and each stage's endpoint with GET /route (503 = retry until the deadline) and
heartbeats GET /health. Plain urllib, no proxy, bounded timeouts."""

from __future__ import annotations

import http.client
import json
import time
import urllib.error
import urllib.request
from typing import Callable, Optional

Alive = Optional[Callable[[], bool]]  # False: nobody waits for the answer any more, stop retrying


class BootstrapError(RuntimeError):
    """A bootstrap request the server refused for good (a 4xx other than 503), or a malformed
    answer."""


class BootstrapCancelled(RuntimeError):
    """Retrying stopped because nobody waits for the answer any more (every room that needed it
    ended)."""


def is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


# never route loopback via a proxy
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def bootstrap_url(host: str, port: int) -> str:
    host = host.strip("[]")
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def http_request(
    method: str,
    url: str,
    body: Optional[dict] = None,
    timeout: float = 2.0,
    token: Optional[str] = None,
) -> tuple[int, bytes]:
    """(status, body) for any HTTP answer; connection errors and timeouts raise OSError. `token`:
    sent as `Authorization: Bearer`."""
    data = None if body is None else json.dumps(body).encode()
    headers = {} if data is None else {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    req = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with _OPENER.open(req, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as e:
        with e:
            return e.code, e.read()
    except urllib.error.URLError as e:
        raise OSError(f"{method} {url}: {e.reason}") from None
    except http.client.HTTPException as e:  # a peer that died mid-answer
        raise OSError(f"{method} {url}: {type(e).__name__}: {e}") from None


def _answer_text(text: bytes) -> str:
    """The message of an error answer: the "error" of a JSON object, else the text itself (first 300
    chars)."""
    try:
        answer = json.loads(text)
    except ValueError:
        answer = None
    if isinstance(answer, dict) and isinstance(answer.get("error"), str):
        return answer["error"][:300]
    return text.decode(errors="replace")[:300]


def register_rank(
    bootstrap_url: str, body: dict, retries: int = 5, token: Optional[str] = None
) -> None:
    """PUT /route, retrying connection errors and 5xx with exponential backoff (0.1 s doubling)."""
    last = ""
    for attempt in range(retries + 1):
        try:
            code, text = http_request("PUT", f"{bootstrap_url}/route", body, token=token)
        except OSError as e:
            code, text = 0, str(e).encode()
        if code == 200:
            return
        last = f"HTTP {code}: {_answer_text(text)}" if code else text.decode()
        if 400 <= code < 500:
            raise BootstrapError(
                f"bootstrap server at {bootstrap_url} refused the registration: {last}"
            )
        if attempt < retries:
            time.sleep(0.1 * 2**attempt)
    raise BootstrapError(
        f"could not register with the bootstrap server at {bootstrap_url} after "
        f"{retries + 1} attempts: {last}"
    )


def _get_until(url: str, deadline: float, token: Optional[str] = None, alive: Alive = None) -> dict:
    """GET url, retrying 503 and connection errors until `deadline` (time.monotonic()) or until
    alive() is False; the JSON object."""
    delay, last = 0.05, "no attempt"
    while True:
        if alive is not None and not alive():
            raise BootstrapCancelled(f"GET {url}: no room waits for the answer any more ({last})")
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"GET {url}: not answered before the bootstrap deadline ({last})")
        try:
            code, text = http_request(
                "GET", url, timeout=min(2.0, max(remaining, 0.05)), token=token
            )
        except OSError as e:
            code, text, last = 0, b"", str(e)
        if code == 200:
            try:
                answer = json.loads(text)
            except ValueError:
                answer = None
            if not isinstance(answer, dict):
                raise BootstrapError(f"GET {url}: the answer is not a JSON object")
            return answer
        if code:
            last = f"HTTP {code}: {_answer_text(text)}"
            if code != 503:
                raise BootstrapError(f"GET {url}: {last}")
        time.sleep(max(0.0, min(delay, deadline - time.monotonic())))
        delay = min(delay * 2, 1.0)


def fetch_prefill_info(
    url: str, deadline: float, token: Optional[str] = None, alive: Alive = None
) -> dict:
    """The server info (with "schema") from the bootstrap server at `url`; deadline is a
    time.monotonic()."""
    info = _get_until(
        f"{url}/route?prefill_dp_rank=-1&prefill_cp_rank=-1&target_tp_rank=-1&target_pp_rank=-1",
        deadline,
        token,
        alive,
    )
    pp_size = info.get("pp_size")
    if not is_int(pp_size) or not 1 <= pp_size <= 1024 or not isinstance(info.get("schema"), dict):
        raise BootstrapError(
            f"bootstrap server at {url} sent malformed server info (pp_size {pp_size!r}, "
            f"schema {type(info.get('schema')).__name__})"
        )
    return info


def fetch_rank(
    url: str, pp_rank: int, deadline: float, token: Optional[str] = None, alive: Alive = None
) -> tuple[str, int]:
    """(rank_ip, rank_port): the ZMQ PULL endpoint of prefill stage `pp_rank`."""
    entry = _get_until(
        f"{url}/route?prefill_dp_rank=0&prefill_cp_rank=0&target_tp_rank=0"
        f"&target_pp_rank={pp_rank}",
        deadline,
        token,
        alive,
    )
    ip, port = entry.get("rank_ip"), entry.get("rank_port")
    if not isinstance(ip, str) or not ip or not is_int(port) or not 1 <= port <= 65535:
        raise BootstrapError(
            f"bootstrap server at {url} sent a malformed endpoint for pp_rank {pp_rank}: {entry}"
        )
    return ip, port


def check_health(url: str, timeout: float) -> bool:
    try:
        return http_request("GET", f"{url}/health", timeout=timeout)[0] == 200
    except OSError:
        return False
