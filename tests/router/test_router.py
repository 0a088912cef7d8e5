"""PD router (sparkrelay.router, sparkrelay.launch_router) against stub workers; no model, a few
seconds.

What the stubs emulate: the HTTP face of a sparkrelay/SGLang prefill or decode server as the router
sees it. Each stub is a FastAPI app served by uvicorn in a thread on a free port. It records every
request (method, path, raw body, headers); answers the generate routes with JSON (prefill: {"role":
"prefill"}; decode: its role and the bootstrap_room it got) or, for "stream": true, a fixed SSE byte
sequence sent in timed chunks; answers GET /health, /server_info and /v1/models, and POST
/flush_cache; and fails the next requests with the statuses queued in `fail` (or (status, message,
delay) tuples). No KV moves and the two sides never wait for each
other: only the router's wire contract (docs/pd_protocol.md, the router protocol) is tested. One
module-scoped router runs as a real `python -m sparkrelay.launch_router` subprocess; the others run
in-process under uvicorn.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from sparkrelay.router.app import build_app
from sparkrelay.router.rewrite import (
    MAX_ROOM,
    PrefillWorker,
    RouterConfig,
    batch_size,
    bootstrap_host,
    draw_rooms,
    new_room,
)

REPO = Path(__file__).resolve().parents[2]
SSE_CHUNKS = [
    b'data: {"text": "h\xc3\xa9llo"}\n\n',
    b": keep-alive\n\n",
    b'data: {"text": "\xe2\x9c\x93 w"}\n\n',
    b"data: [DONE]\n\n",
]
BOOT = ("bootstrap_host", "bootstrap_port", "bootstrap_room")


class Stub:
    def __init__(self, role: str):
        self.role, self.seen, self.fail = role, [], []
        self.tag: str | None = None  # when set, only requests carrying this text consume `fail`
        self.app = FastAPI()
        self.app.add_api_route("/{path:path}", self.handle, methods=["GET", "POST"])

    def generate_bodies(self) -> list[dict]:
        return [json.loads(b) for m, p, b, _ in self.seen if m == "POST" and p != "/flush_cache"]

    def aimed_at(self, body: bytes) -> bool:
        """Whether `fail` applies to this request: a cancelled request of an earlier call may land
        late and must not take the failure meant for the next one."""
        if self.tag is None:
            return True
        try:
            return json.loads(body).get("text") == self.tag
        except (ValueError, AttributeError):
            return False

    async def handle(self, request: Request) -> Response:
        body, path = await request.body(), request.url.path
        self.seen.append((request.method, path, body, dict(request.headers)))
        if self.fail and self.aimed_at(body):  # a status, or (status, message, seconds to wait)
            f = self.fail.pop(0)
            status, message, wait = f if isinstance(f, tuple) else (f, f"{self.role} says no", 0)
            await asyncio.sleep(wait)
            return JSONResponse({"error": {"message": message}}, status)
        if request.method == "GET":
            return (
                Response() if path == "/health" else JSONResponse({"role": self.role, "path": path})
            )
        if path == "/flush_cache":
            return Response()
        req = json.loads(body)
        if req.get("stream") and self.role == "decode":
            return StreamingResponse(self.sse(), media_type="text/event-stream")
        return JSONResponse({"role": self.role, "room": req.get("bootstrap_room")})

    async def sse(self):
        for i, chunk in enumerate(SSE_CHUNKS):
            await asyncio.sleep(0.3 if i == len(SSE_CHUNKS) - 1 else 0.01)
            yield chunk


def dead_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


@contextmanager
def serve(app):
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.time() + 10
    while not server.started:
        assert time.time() < deadline and thread.is_alive(), "server did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(10)


@pytest.fixture(scope="module")
def stubs():
    p, p2, d = Stub("prefill"), Stub("prefill-b"), Stub("decode")
    with serve(p.app) as pu, serve(p2.app) as p2u, serve(d.app) as du:
        p.url, p2.url, d.url = pu, p2u, du
        yield p, p2, d


@pytest.fixture(autouse=True)
def clean(request):
    if "stubs" in request.fixturenames:
        for s in request.getfixturevalue("stubs"):
            s.seen.clear(), s.fail.clear()
            s.tag = None


@contextmanager
def router(prefill: list[tuple[str, int | None]], decode: list[str], max_retries: int = 2):
    config = RouterConfig(
        tuple(PrefillWorker(u, port) for u, port in prefill), tuple(decode), 10.0, max_retries
    )
    with (
        serve(build_app(config)) as url,
        httpx.Client(base_url=url, trust_env=False, timeout=10) as client,
    ):
        yield client


@pytest.fixture
def rc(stubs):
    p, _, d = stubs
    with router([(p.url, 8998)], [d.url]) as client:
        yield client


@pytest.fixture(scope="module")
def subprocess_router(stubs):
    p, _, d = stubs
    url = dead_url()
    cmd = [
        sys.executable,
        "-m",
        "sparkrelay.launch_router",
        "--pd-disaggregation",
        "--prefill",
        p.url,
        "--decode",
        d.url,
        "--port",
        url.rsplit(":", 1)[1],
        "--log-level",
        "warn",
    ]
    proc = subprocess.Popen(cmd, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        with httpx.Client(base_url=url, trust_env=False, timeout=10) as client:
            deadline = time.time() + 20
            while True:
                assert proc.poll() is None and time.time() < deadline, "router did not start"
                try:
                    if client.get("/health").status_code == 200:
                        break
                except httpx.TransportError:
                    time.sleep(0.05)
            yield client
    finally:
        proc.terminate()
        proc.wait(10)


def test_identical_bodies_with_bootstrap_fields(stubs, rc):
    p, _, d = stubs
    r = rc.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 4}})
    assert r.status_code == 200 and r.json()["role"] == "decode"
    (pm, pp, pbody, _), (dm, dp, dbody, _) = p.seen[-1], d.seen[-1]
    assert (pm, pp) == (dm, dp) == ("POST", "/generate") and pbody == dbody
    sent = json.loads(pbody)
    assert sent["bootstrap_host"] == "127.0.0.1" and sent["bootstrap_port"] == 8998
    assert 1 <= sent["bootstrap_room"] <= MAX_ROOM and r.json()["room"] == sent["bootstrap_room"]
    assert sent["text"] == "hi" and sent["sampling_params"] == {"max_new_tokens": 4}


def test_subprocess_router_port_null_and_proxies(stubs, subprocess_router):
    p, _, d = stubs
    r = subprocess_router.post(
        "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]}
    )
    assert r.status_code == 200
    sent = p.generate_bodies()[-1]
    assert sent == d.generate_bodies()[-1] and sent["bootstrap_port"] is None
    assert sent["bootstrap_host"] == "127.0.0.1" and sent["bootstrap_room"] > 0
    models = subprocess_router.get("/v1/models")
    assert models.status_code == 200 and models.json() == {"role": "prefill", "path": "/v1/models"}
    # both sides, each worker's own /server_info
    info = subprocess_router.get("/server_info").json()
    assert [w["path"] for w in info["prefill"] + info["decode"]] == ["/server_info"] * 2
    assert [w["url"] for w in info["prefill"] + info["decode"]] == [p.url, d.url] and info[
        "role"
    ] == "router"
    assert subprocess_router.get("/health_generate").status_code == 200
    assert subprocess_router.post("/nope", json={}).status_code == 404


def test_batches_get_arrays_with_distinct_rooms(stubs, rc):
    p, _, d = stubs
    for path, body, n in [
        ("/generate", {"input_ids": [[1, 2], [3], [4]]}, 3),
        ("/generate", {"text": ["a", "b"]}, 2),
        ("/v1/completions", {"prompt": ["a", "b"]}, 2),
        ("/v1/chat/completions", {"n": 3}, 3),
    ]:
        assert rc.post(path, json=body).status_code == 200
        sent = p.generate_bodies()[-1]
        assert sent == d.generate_bodies()[-1]
        assert sent["bootstrap_host"] == ["127.0.0.1"] * n and sent["bootstrap_port"] == [8998] * n
        assert len(set(sent["bootstrap_room"])) == n and all(r > 0 for r in sent["bootstrap_room"])


def test_batch_detection_and_rooms():
    assert batch_size("/generate", {"input_ids": [1, 2]}) is None
    assert batch_size("/v1/completions", {"prompt": [1, 2, 3]}) is None  # one prompt as token ids
    assert batch_size("/v1/completions", {"prompt": [[1], [2]]}) == 2
    assert batch_size("/v1/chat/completions", {"n": 1}) is None
    with pytest.raises(ValueError, match="empty"):
        batch_size("/generate", {"text": []})
    assert new_room(lambda n: 0) == 1 and new_room(lambda n: n - 1) == MAX_ROOM == 2**63 - 1
    used = {1}
    draws = iter([0, 0, 1, 1, 2])  # rooms 1 (used), 1, 2, 2 (drawn already), 3
    assert draw_rooms(2, used, lambda n: next(draws)) == [2, 3]
    assert used == {1, 2, 3}
    assert bootstrap_host("http://[::1]:8000") == "::1"


def test_streaming_is_byte_identical_and_incremental(stubs, rc):
    p, _, d = stubs
    got, first_at = [], None
    with rc.stream("POST", "/v1/completions", json={"prompt": "x", "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for chunk in r.iter_raw():
            first_at = first_at or time.monotonic()
            got.append(chunk)
    assert b"".join(got) == b"".join(SSE_CHUNKS)
    assert time.monotonic() - first_at > 0.2  # the first bytes came before the slow last chunk
    assert p.seen[-1][2] == d.seen[-1][2] and json.loads(p.seen[-1][2])["stream"] is True


def test_decode_error_is_relayed(stubs, rc):
    _, _, d = stubs
    d.fail = [400]
    r = rc.post("/generate", json={"text": "x"})
    assert r.status_code == 400 and r.json() == {"error": {"message": "decode says no"}}
    d.fail = [400]
    r = rc.post("/generate", json={"text": "x", "stream": True})
    assert r.status_code == 400
    events = [e for e in r.content.split(b"\n\n") if e]
    assert json.loads(events[0].removeprefix(b"data: ")) == {"error": {"message": "decode says no"}}
    assert events[1:] == [b"data: [DONE]"]
    with router([(stubs[0].url, None)], [dead_url()], max_retries=0) as client:
        r = client.post("/generate", json={"text": "x"})
        assert r.status_code == 502 and r.json()["error"]["type"] == "decode_server_error"


def test_prefill_error(stubs, rc):
    p, _, d = stubs
    p.fail = [400]
    r = rc.post("/generate", json={"text": "x"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "prefill_server_error"
    # a 400 is not retried
    assert "prefill says no" in r.json()["error"]["message"] and len(p.seen) == 1
    p.fail = [500, 500, 500]
    r = rc.post("/generate", json={"text": "x"})
    error = r.json()["error"]
    assert r.status_code == 502 and (error["type"], error["code"]) == ("prefill_server_error", 502)
    rooms = [b["bootstrap_room"] for b in p.generate_bodies()[1:]]
    assert len(rooms) == 3 == len(set(rooms))  # the first try and 2 retries, each with its own room
    with router([(dead_url(), 1)], [d.url], max_retries=1) as client:
        r = client.post("/generate", json={"text": "x", "stream": True})
        assert (
            r.status_code == 502
            and b"prefill_server_error" in r.content
            and r.content.endswith(b"data: [DONE]\n\n")
        )


def test_retry_uses_a_new_room(stubs, rc):
    p, _, d = stubs
    p.fail = [503]
    r = rc.post("/generate", json={"text": "x"})
    assert r.status_code == 200
    first, second = (b["bootstrap_room"] for b in p.generate_bodies())
    assert (
        first != second and r.json()["room"] == second == d.generate_bodies()[-1]["bootstrap_room"]
    )
    before = len(d.generate_bodies())
    d.fail = [503]
    with rc.stream("POST", "/generate", json={"text": "x", "stream": True}) as s:
        assert s.status_code == 200 and s.read() == b"".join(SSE_CHUNKS)
    rooms = [b["bootstrap_room"] for b in d.generate_bodies()[before:]]
    assert len(rooms) == 2 and rooms[0] != rooms[1] and not {first, second} & set(rooms)


def test_bad_requests(stubs, rc):
    for content in (b"{not json", b"[1, 2]", b'"text"'):
        r = rc.post("/generate", content=content, headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["message"]
    assert "empty" in rc.post("/generate", json={"text": []}).json()["error"]["message"]
    assert not stubs[0].seen and not stubs[2].seen


def test_headers_round_robin_and_fanout(stubs):
    p, p2, d = stubs
    with router([(p.url, 8998), (p2.url, None)], [d.url]) as client:
        for _ in range(2):
            client.post(
                "/generate",
                json={"text": "x"},
                headers={"Authorization": "Bearer t", "X-Other": "1"},
            )
        assert [b["bootstrap_port"] for b in p.generate_bodies() + p2.generate_bodies()] == [
            8998,
            None,
        ]
        for _, _, _, headers in p.seen + p2.seen + d.seen:
            assert headers["authorization"] == "Bearer t" and "x-other" not in headers
        flush = client.post("/flush_cache").json()["results"]
        assert [(r["url"], r["status"]) for r in flush] == [
            (p.url, 200),
            (p2.url, 200),
            (d.url, 200),
        ]
    with router([(p.url, None)], [dead_url()]) as client:
        assert (
            client.get("/health").status_code == 200
            and client.get("/health_generate").status_code == 503
        )


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--prefill", "http://h:1", "port"], "--prefill"),
        (["--prefill", "http://h:1", "1", "2"], "--prefill"),
        (["--prefill", "ftp://h:1"], "--prefill"),
        (["--prefill", "http://h:1", "--decode", "h:2"], "--decode"),
    ],
)
def test_bad_cli_exits_2(argv, flag):
    base = (
        ["--pd-disaggregation", "--decode", "http://d:2"]
        if "--decode" not in argv
        else ["--pd-disaggregation"]
    )
    cmd = [sys.executable, "-m", "sparkrelay.launch_router", *base, *argv]
    out = subprocess.run(
        cmd,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 2 and f"argument {flag}" in out.stderr, out.stderr


def test_cli_needs_pd_mode():
    cmd = [
        sys.executable,
        "-m",
        "sparkrelay.launch_router",
        "--prefill",
        "http://h:1",
        "--decode",
        "http://d:2",
    ]
    out = subprocess.run(
        cmd,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 2 and "only PD mode is supported" in out.stderr


def attempts(stub: Stub, tag: str) -> int:
    """Generate requests `stub` received carrying `tag`: a cancelled request from an earlier call
    may still land late, so each call is counted by its own tag, never by clearing `seen`."""
    return sum(b.get("text") == tag for b in stub.generate_bodies())


def tagged(*stubs: Stub) -> dict:
    """A body with a fresh text, which the failures armed on `stubs` are aimed at."""
    body = {"text": f"x-{time.monotonic_ns()}"}
    for stub in stubs:
        stub.tag = body["text"]
    return body


@pytest.mark.parametrize("side", ["prefill", "decode"])
@pytest.mark.parametrize("status", [400, 404, 408, 409, 422, 429])
def test_4xx_is_never_retried(stubs, rc, side, status):
    p, _, d = stubs
    failing, other = (p, d) if side == "prefill" else (d, p)
    failing.fail = [status]
    body = tagged(p, d)
    r = rc.post("/generate", json=body)
    # the other side's request may be cancelled before it arrives; it is never sent twice
    assert (
        r.status_code == status
        and attempts(failing, body["text"]) == 1
        and attempts(other, body["text"]) <= 1
    )


def test_schema_mismatch_is_not_retried(stubs, rc):
    """A schema mismatch fails the same way with every room: one attempt, whatever its status and
    whichever side reports first (the prefill's abort comes first here; the decode names the
    mismatch 0.3 s later)."""
    p, _, d = stubs
    mismatch = "schema mismatch: handoff: prefill='tail' decode='hidden'"
    for fails in ([(500, mismatch, 0)], [(503, "aborted: " + mismatch, 0)]):
        d.fail, body = list(fails), tagged(p, d)
        assert rc.post("/generate", json=body).status_code == fails[0][0]
        assert attempts(d, body["text"]) == 1 and attempts(p, body["text"]) <= 1
    p.fail, d.fail = [(500, "the prefill request was aborted", 0)], [(409, mismatch, 0.3)]
    body = tagged(p, d)
    r = rc.post("/generate", json=body)
    assert r.status_code == 502 and attempts(p, body["text"]) == attempts(d, body["text"]) == 1, (
        r.text
    )
    d.fail, p.fail, body = [], [(500, "transient", 0)], tagged(p, d)
    # a plain 5xx is still retried, with a new room
    assert rc.post("/generate", json=body).status_code == 200
    assert attempts(p, body["text"]) == attempts(d, body["text"]) == 2


def test_errors_are_relayed_flat(stubs, rc):
    p, _, d = stubs
    p.fail = [(400, "`temperature` must be >= 0, got -1.0", 0)]
    r = rc.post("/v1/completions", json={"prompt": "x", "temperature": -1})
    assert r.status_code == 400
    assert r.json() == {
        "error": {
            "message": "prefill server: `temperature` must be >= 0, got -1.0",
            "type": "prefill_server_error",
            "code": 400,
        }
    }
    p.fail = [(422, "bad field", 0)]
    r = rc.post("/v1/chat/completions", json={"messages": [], "stream": True})
    assert r.status_code == 422 and r.headers["content-type"].startswith("text/event-stream")
    events = [e.removeprefix(b"data: ") for e in r.content.split(b"\n\n") if e]
    # one flat JSON object, nothing escaped twice
    assert events[1:] == [b"[DONE]"] and b"\\" not in events[0]
    assert json.loads(events[0]) == {
        "error": {
            "message": "prefill server: bad field",
            "type": "prefill_server_error",
            "code": 422,
        }
    }
    # a decode of its own: the router drops the decode request of an exchange whose prefill failed,
    # but the shared stub may still take that request later (or never), and it would use up a
    # failure queued for the next one
    own = Stub("decode")
    own.fail = [(400, "decode says no", 0)]
    with serve(own.app) as url, router([(p.url, None)], [url]) as client:
        assert client.post("/generate", json={"text": "x"}).json() == {
            "error": {"message": "decode says no"}
        }
    with router([(p.url, None)], [dead_url()], max_retries=0) as client:
        error = client.post("/generate", json={"text": "x"}).json()["error"]
        assert error["message"].startswith("decode server: ") and error["code"] == 502


def test_server_info_shows_both_sides(stubs):
    p, _, d = stubs
    dead = dead_url()
    with router([(p.url, 8998)], [d.url, dead]) as client:
        info = client.get("/get_server_info").json()
    assert info["role"] == "router" and info["router"]["prefill"] == [
        {"url": p.url, "bootstrap_port": 8998}
    ]
    assert info["router"]["decode"] == [d.url, dead] and info["router"]["max_retries"] == 2
    assert info["prefill"] == [{"url": p.url, "role": "prefill", "path": "/server_info"}]
    assert info["decode"][0] == {"url": d.url, "role": "decode", "path": "/server_info"}
    assert info["decode"][1]["url"] == dead and "Cannot connect" in info["decode"][1]["error"]


def metric(text: str, name: str, **labels) -> float:
    """The value of one sample in Prometheus text (0 when absent)."""
    want = "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else ""
    for line in text.splitlines():
        if line.startswith(name + want + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_router_metrics(stubs):
    p, _, d = stubs
    with router([(p.url, None)], [d.url]) as client:
        first = client.get("/metrics")
        assert first.status_code == 200 and first.headers["content-type"].startswith("text/plain")
        assert (
            metric(first.text, "sparkrelay_router:requests_total", route="/generate", status="200")
            == 0
        )
        for _ in range(3):
            assert client.post("/generate", json={"text": "x"}).status_code == 200
        p.fail = [503]
        assert client.post("/generate", json={"text": "x"}).status_code == 200  # after one retry
        d.fail = [400]
        assert client.post("/generate", json={"text": "x"}).status_code == 400
        with client.stream("POST", "/v1/completions", json={"prompt": "x", "stream": True}) as s:
            assert s.read() == b"".join(SSE_CHUNKS)
        text = client.get("/metrics").text
    assert metric(text, "sparkrelay_router:requests_total", route="/generate", status="200") == 4
    assert metric(text, "sparkrelay_router:requests_total", route="/generate", status="400") == 1
    assert (
        metric(text, "sparkrelay_router:requests_total", route="/v1/completions", status="200") == 1
    )
    assert metric(text, "sparkrelay_router:errors_total", route="/generate", side="decode") == 1
    assert metric(text, "sparkrelay_router:retries_total", route="/generate") == 1
    assert metric(text, "sparkrelay_router:upstream_attempts_total", route="/generate") == 6
    assert metric(text, "sparkrelay_router:request_latency_seconds_count", route="/generate") == 5
    assert (
        metric(text, "sparkrelay_router:request_latency_seconds_count", route="/v1/completions")
        == 1
    )
    # stream
    assert (
        metric(text, "sparkrelay_router:request_latency_seconds_sum", route="/v1/completions") > 0.2
    )
    assert "sparkrelay_router:active_requests 0.0" in text


class SlowPrefill(Stub):
    """A prefill that answers a stream with 2xx headers at once and ends its body `seconds` later
    (as a real prefill ends only once every stage reported its parts sent); `ended` counts the
    bodies it finished."""

    def __init__(self, seconds: float):
        super().__init__("prefill")
        self.seconds, self.ended = seconds, 0

    def aimed_at(self, body: bytes) -> bool:
        """Whether `fail` applies to this request: a cancelled request of an earlier call may land
        late and must not take the failure meant for the next one."""
        if self.tag is None:
            return True
        try:
            return json.loads(body).get("text") == self.tag
        except (ValueError, AttributeError):
            return False

    async def handle(self, request: Request) -> Response:
        if request.url.path != "/generate" or not json.loads(await request.body()).get("stream"):
            return await super().handle(request)

        async def body():
            await asyncio.sleep(self.seconds)
            yield b'data: {"text": "p"}\n\ndata: [DONE]\n\n'
            self.ended += 1

        return StreamingResponse(body(), media_type="text/event-stream")


def test_a_flowing_decode_stream_is_relayed_before_the_prefill_answer_ends(stubs):
    """Streamed, without prompt logprobs to merge: the decode's first chunk reaches the client while
    the prefill's answer (2xx headers in) is still open, and that answer is still read to its end;
    with return_logprob the router needs the prefill's whole answer first."""
    _, _, d = stubs
    slow = SlowPrefill(1.5)
    with serve(slow.app) as pu, router([(pu, None)], [d.url]) as client:
        for body, early in (
            ({"text": "x", "stream": True}, True),
            ({"text": "x", "stream": True, "return_logprob": True}, False),
        ):
            t0 = time.monotonic()
            with client.stream("POST", "/generate", json=body) as r:
                chunks = r.iter_bytes()
                first = next(chunks)
                waited = time.monotonic() - t0
                rest = b"".join(chunks)
            assert (
                r.status_code == 200
                and first.startswith(b"data: ")
                and (first + rest).endswith(b"[DONE]\n\n")
            )
            assert (waited < 1.0) if early else (waited >= 1.5), (body, waited)
        deadline = time.monotonic() + 5
        while slow.ended < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert slow.ended == 2  # the relayed request's prefill answer was read to its end, not cut
