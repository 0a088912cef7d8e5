"""What one large request may cost the others: the body-size limit (413) and tokenization off the
event loop.

Each test serves its own app under uvicorn (real sockets: chunked bodies and concurrent clients)."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest

from sparkrelay.config import ConfigError
from testkit.http import UvicornThread, make_app, make_config

SMALL = {
    "input_ids": [1, 2, 3],
    "sampling_params": {"max_new_tokens": 2, "temperature": 0, "ignore_eos": True},
}
MIB = 1 << 20


def _padded(n: int) -> bytes:
    """SMALL as a JSON body of exactly n bytes (trailing whitespace is valid JSON)."""
    body = json.dumps(SMALL).encode()
    assert len(body) <= n
    return body + b" " * (n - len(body))


def _assert_413(r: httpx.Response, limit_mib: int) -> None:
    assert r.status_code == 413, r.text
    err = r.json()["error"]
    assert err["code"] == 413 and err["type"] == "PayloadTooLargeError"
    assert f"{limit_mib} MiB" in err["message"] and "--max-request-body-mb" in err["message"], err


@pytest.fixture(scope="module")
def limited(tiny_model_dir):
    """A server whose body limit is 1 MiB."""
    app, _ = make_app(tiny_model_dir, max_request_body_mb=1)
    with UvicornThread(app) as srv:
        yield srv


def test_body_limit_content_length(limited):
    """A declared body over the limit is a 413 naming the limit and its flag; at the limit it is
    served; the connection stays usable."""
    with httpx.Client(base_url=limited.url, timeout=60) as hc:
        _assert_413(hc.post("/generate", content=_padded(MIB + 1)), 1)
        r = hc.post("/generate", content=_padded(MIB))
        assert r.status_code == 200, r.text
        assert len(r.json()["output_ids"]) == 2
        _assert_413(
            hc.post("/v1/completions", content=b'{"prompt": "' + b"a" * (2 * MIB) + b'"}'), 1
        )
        assert hc.post("/generate", json=SMALL).status_code == 200


def test_body_limit_chunked(limited):
    """Without Content-Length the body is counted as it arrives: 413, then a normal request on the
    same connection is served."""

    def chunks():
        body = _padded(3 * MIB)
        for i in range(0, len(body), 64 * 1024):
            yield body[i : i + 64 * 1024]

    with httpx.Client(base_url=limited.url, timeout=60) as hc:
        r = hc.post("/generate", content=chunks())
        assert (
            "content-length" not in r.request.headers
            and r.request.headers["transfer-encoding"] == "chunked"
        )
        _assert_413(r, 1)
        assert hc.post("/generate", json=SMALL).status_code == 200


def test_body_limit_answers_before_an_endless_body_ends(limited):
    """A chunked body that never ends gets its 413 once it passes the limit: the server neither
    waits for the end nor keeps what it read."""
    head = (
        f"POST /generate HTTP/1.1\r\nHost: 127.0.0.1:{limited.port}\r\nContent-Type: application/json\r\n"
        "Transfer-Encoding: chunked\r\n\r\n"
    ).encode()
    chunk = b" " * (64 * 1024)
    with socket.create_connection(("127.0.0.1", limited.port), timeout=60) as sock:
        start = b'{"input_ids": [1]'
        sock.sendall(head + b"%x\r\n%s\r\n" % (len(start), start))
        for _ in range(2 * MIB // len(chunk)):  # 2 MiB of whitespace, and no terminating chunk
            sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        reply = b""
        while b"\r\n\r\n" not in reply or not reply.rstrip().endswith(b"}"):
            data = sock.recv(65536)
            assert data, f"connection closed before a full answer: {reply!r}"
            reply += data
    status, _, body = reply.partition(b"\r\n\r\n")
    assert status.startswith(b"HTTP/1.1 413"), reply
    assert b"--max-request-body-mb" in body
    assert httpx.post(limited.url + "/generate", json=SMALL, timeout=60).status_code == 200


def test_body_limit_flag_is_validated(tiny_model_dir):
    with pytest.raises(ConfigError, match="--max-request-body-mb"):
        make_config(tiny_model_dir, max_request_body_mb=0)


class _TimedTokenizer:
    """The server's tokenizer, recording when each encode of a large text starts and ends
    (perf_counter)."""

    def __init__(self, tokenizer, big: int):
        self.tokenizer, self.big = tokenizer, big
        self.started = threading.Event()
        self.spans: list[tuple[float, float]] = []

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)

    def encode(self, text, **kw):
        if len(text) < self.big:
            return self.tokenizer.encode(text, **kw)
        start = time.perf_counter()
        self.started.set()
        ids = self.tokenizer.encode(text, **kw)
        self.spans.append((start, time.perf_counter()))
        return ids


def _big_text(tokenizer, seconds: float) -> str:
    """A text whose encoding takes about `seconds` here (measured, then scaled; at most 40 MB)."""
    unit = "The quick brown fox jumps over the lazy dog; it was 42 degrees. "
    sample = unit * 4000
    start = time.perf_counter()
    tokenizer.encode(sample)
    per_char = max(time.perf_counter() - start, 1e-4) / len(sample)
    return unit * min(int(seconds / per_char / len(unit)) + 1, 40_000_000 // len(unit))


def test_large_prompt_tokenizes_off_the_event_loop(tiny_model_dir):
    """While a multi-megabyte prompt is being tokenized, /health and a small /generate are answered:
    each well within half the big encode's own time, and before it ends (a tokenizer on the event
    loop would hold both until it returned)."""
    app, _ = make_app(tiny_model_dir)
    s = app.state.server
    text = _big_text(s.tokenizer, seconds=2.0)
    s.tokenizer = timed = _TimedTokenizer(s.tokenizer, big=len(text))
    big: dict = {}
    with UvicornThread(app) as srv:

        def send_big():
            body = {"text": text, "sampling_params": {"max_new_tokens": 1}}
            big["response"] = httpx.post(srv.url + "/generate", json=body, timeout=300)

        sender = threading.Thread(target=send_big)
        sender.start()
        assert timed.started.wait(120), "the big prompt's tokenization did not start"
        with httpx.Client(base_url=srv.url, timeout=300) as hc:
            t0 = time.perf_counter()
            assert hc.get("/health").status_code == 200
            t1 = time.perf_counter()
            small = hc.post(
                "/generate", json={"text": "Hello", "sampling_params": SMALL["sampling_params"]}
            )
            t2 = time.perf_counter()
        sender.join(300)
    assert small.status_code == 200 and len(small.json()["output_ids"]) == 2, small.text
    # far over 256 tokens
    assert big["response"].status_code == 400 and "context" in big["response"].text
    ((start, end),) = timed.spans
    encode_s = end - start
    assert t2 < end, f"the small requests ended {t2 - end:.2f}s after the big encode did"
    assert t1 - t0 < encode_s / 2 and t2 - t1 < encode_s / 2, (t1 - t0, t2 - t1, encode_s)
