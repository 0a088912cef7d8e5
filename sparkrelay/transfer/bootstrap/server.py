"""The prefill bootstrap HTTP server (SGLang's routes: docs/pd_protocol.md, the bootstrap server);
its clients are in bootstrap/client.py.

    prefill stage s --PUT /route {pp_rank, rank_ip, rank_port, ...}--> BootstrapServer (on the prefill leader)
    decode          --GET /route?-1,-1,-1,-1--> server info + schema   (503 until every pp rank registered)
                    --GET /route?0,0,0,pp-->    {rank_ip, rank_port}   (the stage's ZMQ PULL endpoint)
                    --GET /health-->            heartbeat

sparkrelay's prefill runs one attention TP/CP/DP group, so the table is keyed (dp, cp, tp, pp) with
only pp varying; registrations for other sizes are refused with a 400 rather than served wrong.

With an auth token every route but GET /health needs `Authorization: Bearer TOKEN` (401 with a JSON
message otherwise), and the server info says "auth_required": true. Request bodies over
MAX_BODY_BYTES get a 413. Every refusal is logged with its reason (rate limited) and counted
(rejected()).

The server advertises wire.check_advertised(host, host_ip): SPARKRELAY_HOST_IP when set, else its
bind address (a wildcard without it is a ConfigError). A stage that registers a wildcard rank_ip,
or this server's own bind address, is stored at the address peers reach it at: from this host
(its registration came over loopback) the server's advertised address, from another host the
address it registered from.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import logging
import re
import socket
import threading
import time
from collections import OrderedDict
from typing import Optional

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse

from sparkrelay.transfer.base import check_room
from sparkrelay.transfer.bootstrap.client import bootstrap_url, is_int
from sparkrelay.transfer.wire import (
    RejectLog,
    check_advertised,
    check_token,
    is_loopback,
    is_wildcard,
    local_host,
    warn_if_exposed,
)

logger = logging.getLogger(__name__)
_HOST_CHARS = re.compile(r"[A-Za-z0-9.:\-\[\]%_]+")  # names, IPv4, IPv6 (+ zone)

DP_RANK_TTL_S = 120.0
DP_RANK_TABLE_MAX = 1 << 16
REG_INT_FIELDS = (
    "attn_tp_size",
    "attn_tp_rank",
    "attn_cp_size",
    "attn_cp_rank",
    "attn_dp_size",
    "attn_dp_rank",
    "pp_size",
    "pp_rank",
    "system_dp_size",
    "system_dp_rank",
    "rank_port",
)
SINGLE_GROUP_FIELDS = ("attn_tp_size", "attn_cp_size", "attn_dp_size", "system_dp_size")
ROUTE_PARAMS = ("prefill_dp_rank", "prefill_cp_rank", "target_tp_rank", "target_pp_rank")
MAX_BODY_BYTES = 64 << 10  # a registration is < 1 KiB
AUTH_REQUIRED = "bootstrap server requires --disaggregation-auth-token"


class _Refusal(Exception):
    def __init__(self, msg: str, code: int) -> None:
        super().__init__(msg)
        self.msg, self.code = msg, code


def _bad(msg: str, code: int = 400) -> PlainTextResponse:
    return PlainTextResponse(msg, status_code=code)


class BootstrapServer:
    def __init__(
        self,
        host: str,
        port: int,
        pp_size: int,
        schema: dict,
        prefill_http_port: Optional[int],
        page_size: int,
        kv_cache_dtype: str,
        auth_token: Optional[str] = None,
        host_ip: Optional[str] = None,
    ) -> None:
        if pp_size < 1:
            raise ValueError(f"pp_size must be >= 1, got {pp_size}")
        self.advertised = check_advertised(host, host_ip)
        token = check_token(auth_token)
        self._expected_auth = None if token is None else f"Bearer {token}".encode()
        self._rejects = RejectLog(logger)
        self.host, self.port, self.pp_size = host, port, pp_size
        # what the decode will see: tuples become lists
        self.schema = json.loads(json.dumps(schema))
        self.prefill_http_port, self.page_size, self.kv_cache_dtype = (
            prefill_http_port,
            page_size,
            kv_cache_dtype,
        )
        self._lock = threading.Lock()
        self._table: dict[
            tuple[int, int, int, int], dict
        ] = {}  # (dp, cp, tp, pp) -> {rank_ip, rank_port}
        # room -> (dp_rank, registered at)
        self._dp_ranks: OrderedDict[int, tuple[int, float]] = OrderedDict()
        self._server: Optional[uvicorn.Server] = None
        self._thread: Optional[threading.Thread] = None
        self.app = self._build_app()

    # ---- lifecycle ----

    def start(self, timeout: float = 10.0) -> None:
        """Serve in a daemon thread; returns once listening. OSError if host:port cannot be
        bound."""
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        # asyncio sets TCP_NODELAY only on sockets made with proto IPPROTO_TCP, which this one was
        # not: with Nagle on, a reply's body waited for the delayed ACK of its headers on every
        # keep-alive request. Accepted connections inherit it from the listening socket.
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            sock.bind((self.host, self.port))
        except OSError as e:
            sock.close()
            raise OSError(
                e.errno,
                f"bootstrap server cannot listen on {self.host}:{self.port} ({e.strerror}); "
                "is another prefill server using --disaggregation-bootstrap-port?",
            ) from None
        sock.listen(1024)
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(
            self.app,
            log_level="warning",
            access_log=False,
            lifespan="off",
            timeout_graceful_shutdown=1,
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run,
            kwargs={"sockets": [sock]},
            name=f"bootstrap-{self.port}",
            daemon=True,
        )
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise OSError(f"bootstrap server on {self.host}:{self.port} did not start")
            time.sleep(0.01)
        warn_if_exposed(self.host, self._expected_auth is not None, "the bootstrap server")
        logger.info(
            "bootstrap server listening on %s:%d, advertising %s (pp_size %d)",
            self.host,
            self.port,
            self.advertised,
            self.pp_size,
        )

    def threads_alive(self) -> bool:
        """The server thread runs and serves (False before start() and after stop())."""
        srv, thread = self._server, self._thread
        return (
            srv is not None
            and thread is not None
            and thread.is_alive()
            and srv.started
            and not srv.should_exit
        )

    def rejected(self) -> dict[str, int]:
        """Requests refused so far, by kind (auth, size, request)."""
        return self._rejects.counts()

    def stop(self) -> None:
        if self._server is None:
            return
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(5.0)
            if self._thread.is_alive():
                self._server.force_exit = True
                self._thread.join(2.0)
        self._server = self._thread = None

    @property
    def url(self) -> str:
        """Where a process on this host reaches the server (a wildcard bind: loopback)."""
        return bootstrap_url(local_host(self.host), self.port)

    # ---- routes ----

    def _build_app(self) -> FastAPI:
        app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)
        handlers = {  # (body, the address it came from) -> response
            "/route": self._register,
            "/register_dp_rank": lambda body, _: self._register_dp_rank(body),
            "/query_dp_ranks": lambda body, _: self._query_dp_ranks(body),
        }

        async def with_body(request: Request):
            try:
                body = await _json_body(request)
            except _Refusal as e:
                return self._refuse("size" if e.code == 413 else "request", request, e.msg, e.code)
            return self._logged(request, handlers[request.url.path](body, _peer(request)))

        app.put("/route")(with_body)
        app.post("/register_dp_rank")(with_body)
        app.post("/query_dp_ranks")(with_body)

        @app.get("/route")
        async def get_route(request: Request):
            return self._logged(request, self._route(request.query_params))

        @app.get("/health")
        async def health():
            return PlainTextResponse("OK")

        return app if self._expected_auth is None else self._authenticated(app)

    def _authenticated(self, app):
        """Pure ASGI: every request but GET /health must carry the token, checked before any route
        runs."""
        expected = self._expected_auth

        async def asgi(scope, receive, send):
            if scope["type"] == "http" and not (
                scope["method"] == "GET" and scope["path"] == "/health"
            ):
                got = b""
                for name, value in scope["headers"]:
                    if name == b"authorization":
                        got = value
                if not hmac.compare_digest(got, expected):
                    why = (
                        "the Bearer token does not match"
                        if got
                        else "no Authorization: Bearer token was sent"
                    )
                    response = self._refuse("auth", Request(scope), f"{AUTH_REQUIRED} ({why})", 401)
                    await response(scope, receive, send)
                    return
            await app(scope, receive, send)

        return asgi

    def _refuse(self, kind: str, request: Request, msg: str, code: int) -> JSONResponse:
        peer = _peer(request)
        self._rejects.note(
            kind,
            "bootstrap: refused %s %s from %s: %d %s",
            request.method,
            request.url.path,
            peer,
            code,
            msg[:300],
        )
        headers = {"WWW-Authenticate": "Bearer"} if code == 401 else None
        return JSONResponse({"error": msg}, status_code=code, headers=headers)

    def _logged(self, request: Request, response):
        """Log and count a 4xx refusal (503 "not registered yet" is routine, not a refusal)."""
        if 400 <= response.status_code < 500:
            peer = _peer(request)
            self._rejects.note(
                "request",
                "bootstrap: refused %s %s from %s: %d %s",
                request.method,
                request.url.path,
                peer,
                response.status_code,
                bytes(response.body[:300]).decode(errors="replace"),
            )
        return response

    def _register(self, body: dict, peer: str):
        for name in REG_INT_FIELDS:
            if not is_int(body.get(name)):
                return _bad(f"{name}: must be an integer, got {body.get(name)!r}")
        for name in SINGLE_GROUP_FIELDS:
            if body[name] != 1:
                return _bad(
                    f"{name}: this bootstrap server serves one attention group (size 1), got {body[name]}"
                )
        for name in ("attn_tp_rank", "attn_cp_rank", "attn_dp_rank", "system_dp_rank"):
            if body[name] != 0:
                return _bad(f"{name}: must be 0 with a group of size 1, got {body[name]}")
        if body["pp_size"] != self.pp_size:
            return _bad(
                f"pp_size: this prefill server has pp_size {self.pp_size}, got {body['pp_size']}"
            )
        if not 0 <= body["pp_rank"] < self.pp_size:
            return _bad(f"pp_rank: must be in 0..{self.pp_size - 1}, got {body['pp_rank']}")
        if not 1 <= body["rank_port"] <= 65535:
            return _bad(f"rank_port: must be in 1..65535, got {body['rank_port']}")
        rank_ip = body.get("rank_ip")
        if (
            not isinstance(rank_ip, str)
            or not 0 < len(rank_ip) <= 255
            or not _HOST_CHARS.fullmatch(rank_ip)
        ):
            return _bad(f"rank_ip: must be a host name or IP address, got {rank_ip!r}")
        problem = self._check_optional(body)
        if problem:
            return _bad(problem)
        key = (
            0,
            0,
            0,
            body["pp_rank"],
        )  # (dp group, cp, tp, pp); dp group = attn_dp_rank as system_dp_size == 1
        stored = self._stage_host(rank_ip, peer)
        with self._lock:
            self._table[key] = {"rank_ip": stored, "rank_port": body["rank_port"]}
            if self.prefill_http_port is None and body.get("prefill_http_port") is not None:
                self.prefill_http_port = body["prefill_http_port"]
        logger.info(
            "bootstrap: registered pp_rank %d at %s:%d (it sent %s)",
            key[3],
            stored,
            body["rank_port"],
            rank_ip,
        )
        return PlainTextResponse("OK")

    def _stage_host(self, rank_ip: str, peer: str) -> str:
        """What the decodes are told for a stage that registered rank_ip from peer: a wildcard or
        this server's bind address is where the stage's host is reached (this server's advertised
        address when the stage is on this host, i.e. it came over loopback or from the bind
        address, else the address it registered from); any other address as given."""
        own = self.host.strip("[]")
        if not is_wildcard(rank_ip) and rank_ip.strip("[]") != own:
            return rank_ip
        return self.advertised if is_loopback(peer) or peer in ("?", own) else peer

    def _check_optional(self, body: dict) -> Optional[str]:
        page_size, dtype = body.get("page_size"), body.get("kv_cache_dtype")
        if page_size is not None and (not is_int(page_size) or page_size != self.page_size):
            return f"page_size: this prefill server uses {self.page_size}, got {page_size!r}"
        if dtype is not None and dtype != self.kv_cache_dtype:
            return (
                f"kv_cache_dtype: this prefill server uses {self.kv_cache_dtype!r}, got {dtype!r}"
            )
        http_port = body.get("prefill_http_port")
        if http_port is not None and (not is_int(http_port) or not 1 <= http_port <= 65535):
            return f"prefill_http_port: must be an integer in 1..65535 or null, got {http_port!r}"
        lbm = body.get("load_balance_method")
        if lbm is not None and not isinstance(lbm, str):
            return f"load_balance_method: must be a string or null, got {lbm!r}"
        split = body.get("enable_dsa_cache_layer_split")
        if split is not None and not isinstance(split, bool):
            return f"enable_dsa_cache_layer_split: must be a boolean, got {split!r}"
        return None

    def _route(self, params) -> object:
        ranks = {}
        for name in ROUTE_PARAMS:
            value = params.get(name)
            if value is None:
                return _bad(f"missing query parameter {name}")
            try:
                ranks[name] = int(value)
            except ValueError:
                return _bad(f"{name}: must be an integer, got {value!r}")
        with self._lock:
            registered = len(self._table)
            entry = self._table.get(tuple(ranks[n] for n in ROUTE_PARAMS))
            http_port = self.prefill_http_port
        if registered < self.pp_size:
            return _bad(
                f"prefill server not fully registered yet ({registered}/{self.pp_size} ranks)", 503
            )
        if all(v == -1 for v in ranks.values()):
            return JSONResponse(
                {
                    "attn_tp_size": 1,
                    "attn_cp_size": 1,
                    "dp_size": 1,
                    "pp_size": self.pp_size,
                    "page_size": self.page_size,
                    "kv_cache_dtype": self.kv_cache_dtype,
                    "follow_bootstrap_room": False,
                    "enable_dsa_cache_layer_split": False,
                    "prefill_http_port": http_port,
                    "auth_required": self._expected_auth is not None,
                    "schema": self.schema,
                }
            )
        if any(v == -1 for v in ranks.values()):
            return _bad("either all four ranks are -1 (server info) or none is")
        if entry is None:
            return _bad(f"no prefill rank registered for {ranks}", 404)
        return JSONResponse(dict(entry))

    def _register_dp_rank(self, body: dict):
        room, dp_rank = body.get("bootstrap_room"), body.get("dp_rank")
        why = check_room(room)
        if why:
            return _bad(f"bootstrap_room: {why}")
        if not is_int(dp_rank) or dp_rank < 0:
            return _bad(f"dp_rank: must be a non-negative integer, got {dp_rank!r}")
        now = time.monotonic()
        with self._lock:
            self._expire_dp_ranks(now)
            self._dp_ranks.pop(room, None)
            self._dp_ranks[room] = (dp_rank, now)
            while len(self._dp_ranks) > DP_RANK_TABLE_MAX:
                self._dp_ranks.popitem(last=False)
        return PlainTextResponse("OK")

    def _query_dp_ranks(self, body: dict):
        rooms = body.get("bootstrap_rooms")
        if (
            not isinstance(rooms, list)
            or len(rooms) > DP_RANK_TABLE_MAX
            or not all(is_int(r) for r in rooms)
        ):
            return _bad(f"bootstrap_rooms: must be a list of at most {DP_RANK_TABLE_MAX} integers")
        with self._lock:
            self._expire_dp_ranks(time.monotonic())
            found = {str(r): self._dp_ranks[r][0] for r in rooms if r in self._dp_ranks}
        return JSONResponse(found)

    def _expire_dp_ranks(self, now: float) -> None:
        while self._dp_ranks:
            room, (_, t) = next(iter(self._dp_ranks.items()))
            if now - t < DP_RANK_TTL_S:
                break
            del self._dp_ranks[room]


def _peer(request: Request) -> str:
    """The address a request came from, an IPv4-mapped IPv6 one as IPv4 ("?" when unknown)."""
    host = request.client.host if request.client else "?"
    try:
        mapped = getattr(ipaddress.ip_address(host), "ipv4_mapped", None)
    except ValueError:
        return host
    return host if mapped is None else str(mapped)


async def _json_body(request: Request) -> dict:
    """The JSON object in the body, read at most MAX_BODY_BYTES; _Refusal (413 or 400) otherwise."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise _Refusal(f"request body of {declared} bytes is over {MAX_BODY_BYTES}", 413)
    raw = bytearray()
    async for chunk in request.stream():  # a chunked body has no Content-Length: count as it comes
        raw += chunk
        if len(raw) > MAX_BODY_BYTES:
            raise _Refusal(f"request body is over {MAX_BODY_BYTES} bytes", 413)
    try:
        body = json.loads(raw)
    except (
        ValueError,
        UnicodeDecodeError,
        RecursionError,
    ) as e:  # RecursionError: [[[[... nested past the limit
        raise _Refusal(f"body must be JSON ({type(e).__name__})", 400) from None
    if not isinstance(body, dict):
        raise _Refusal("body must be a JSON object", 400)
    return body
