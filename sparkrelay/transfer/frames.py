"""Wire frames and the ZMQ plumbing both agents share.

Every message is one ZMQ multipart message on a PUSH -> PULL pair, over TCP:

    control  [msgpack map]               TRANSFER_INFO, ABORT (decode -> prefill); STATUS (prefill -> decode)
    data     [msgpack map, raw bytes]    DATA (prefill -> decode); the bytes are exactly spec.nbytes, C order

    TRANSFER_INFO {type, room, decode_host, decode_port, prompt_len, schema}
    ABORT         {type, room, reason?}                       reason: optional str, why the decode gave up
    STATUS        {type, room, pp_rank, status, reason}       status: int(KVPoll.Success) or int(KVPoll.Failed)
    DATA          {type, room, pp_rank, name, layer_ids, dtype, shape}   the PartSpec of the bytes frame

Every map key is a str. Nothing is unpickled; every field is type-checked before it is used (parse_* below).

With a shared token (--disaggregation-auth-token) every message gets one more frame, its 32-byte tag:

    control  [msgpack map, tag]          data  [msgpack map, raw bytes, tag]
    tag = HMAC-SHA256(key = token (UTF-8), TAG_LABEL || for each frame before the tag: u64be(len) || bytes)

The receiver checks the tag before it parses anything (FrameAuth.open); a message without a valid tag is dropped
and never fails a room, so a stranger cannot fail a live room. Without a token messages carry no tag.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import threading
import time
from collections import Counter
from typing import Callable, Optional

import msgpack
import zmq
from zmq.utils.monitor import recv_monitor_message

from sparkrelay.transfer.base import DTYPE_SIZES, KVPoll, Part, PartSpec, check_room

logger = logging.getLogger(__name__)

MAX_CONTROL_BYTES = 64 << 10  # a control map or data header (schema included, < 2 KiB) larger than this is refused
MAX_REASON_CHARS = 4096
MAX_LIST_LEN = 4096  # layer_ids / shape entries, and any msgpack array
# msgpack limits: every object costs at least one byte of the frame, so a 64 KiB frame makes at most ~64K objects
# (a few MB); a 4 MiB frame of empty arrays made 268 MB in 6 s. Nesting is capped by msgpack's stack (StackError).
UNPACK_LIMITS = dict(max_str_len=MAX_CONTROL_BYTES, max_bin_len=MAX_CONTROL_BYTES, max_array_len=MAX_LIST_LEN,
                     max_map_len=256, max_ext_len=0)
TAG_BYTES = 32
TAG_LABEL = b"sparkrelay-transfer-frame-v1"
TOKEN_HINT = ("a peer with --disaggregation-auth-token appends a tag frame: set the same "
              "--disaggregation-auth-token on both servers")
WILDCARD_HOSTS = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}


class FrameError(ValueError):
    """A message that breaks the protocol. `room` is set when the message named a valid room."""

    def __init__(self, reason: str, room: Optional[int] = None) -> None:
        super().__init__(reason)
        self.reason, self.room = reason, room


class AuthError(FrameError):
    """A message without a valid tag. Never names a room: a stranger's frame must not fail a live room."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason, None)


# ---- authentication -------------------------------------------------------------------------------------------

def check_token(token: Optional[str]) -> Optional[str]:
    """The token, or None when unset (None or ""); ValueError for one that cannot ride an HTTP header."""
    if token is None or token == "":
        return None
    if not isinstance(token, str) or not 0 < len(token) <= 4096 or not all("!" <= c <= "~" for c in token):
        raise ValueError("--disaggregation-auth-token must be 1..4096 printable ASCII characters without spaces")
    return token


class FrameAuth:
    """HMAC-SHA256 tags on every message when a token is set; a no-op without one. Thread safe (stateless)."""

    def __init__(self, token: Optional[str]) -> None:
        token = check_token(token)
        self._key = None if token is None else token.encode()

    @property
    def enabled(self) -> bool:
        return self._key is not None

    def tag(self, frames: list) -> bytes:
        h = hmac.new(self._key, TAG_LABEL, hashlib.sha256)
        for f in frames:
            h.update(memoryview(f).nbytes.to_bytes(8, "big"))  # lengths make the frame split unambiguous
            h.update(f)
        return h.digest()

    def seal(self, frames: list) -> list:
        return frames if self._key is None else [*frames, self.tag(frames)]

    def open(self, msg: list) -> list:
        """The frames before the tag; AuthError (nothing parsed yet) when the tag is missing or wrong."""
        if self._key is None:
            return msg
        if len(msg) < 2 or len(msg[-1]) != TAG_BYTES:
            raise AuthError(f"no authentication tag ({len(msg)} frame(s); is the peer running without "
                            "--disaggregation-auth-token?)")
        if not hmac.compare_digest(msg[-1], self.tag(msg[:-1])):
            raise AuthError("authentication tag does not match (a different --disaggregation-auth-token, or a "
                            "forged or altered message)")
        return msg[:-1]


def is_loopback(host: str) -> bool:
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name, or a wildcard ("0.0.0.0" / "::" parse and are not loopback)


def warn_if_exposed(host: str, auth: bool, what: str) -> None:
    if not auth and not is_loopback(host):
        logger.warning("%s binds %s, which is not a loopback address, without --disaggregation-auth-token: anyone "
                       "who can reach it can register, read or inject transfer messages. Set the same "
                       "--disaggregation-auth-token (or SPARKRELAY_DISAGGREGATION_AUTH_TOKEN) on both servers.",
                       what, host)


class RejectLog:
    """Counts rejected inputs by kind and logs each reason, rate limited (a burst of `burst` lines, then `per_s`
    lines a second; the next line that gets through says how many were suppressed) so a flood cannot fill disks."""

    def __init__(self, log: logging.Logger, burst: int = 50, per_s: float = 10.0) -> None:
        self._log, self._burst, self._per_s = log, burst, per_s
        self._lock = threading.Lock()
        self._counts: Counter = Counter()
        self._allowance, self._last, self._suppressed = float(burst), time.monotonic(), 0

    def note(self, kind: str, fmt: str, *args, level: int = logging.WARNING) -> None:
        with self._lock:
            self._counts[kind] += 1
            now = time.monotonic()
            self._allowance = min(self._burst, self._allowance + (now - self._last) * self._per_s)
            self._last = now
            if self._allowance < 1:
                self._suppressed += 1
                return
            self._allowance -= 1
            suppressed, self._suppressed = self._suppressed, 0
        if suppressed:
            fmt, args = fmt + " (%d similar lines suppressed)", (*args, suppressed)
        self._log.log(level, fmt, *args, stacklevel=2)

    def counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)


# ---- encoding -------------------------------------------------------------------------------------------------

def pack(msg: dict) -> bytes:
    return msgpack.packb(msg, use_bin_type=True)


def transfer_info(room: int, host: str, port: int, prompt_len: int, schema: dict) -> list[bytes]:
    return [pack({"type": "TRANSFER_INFO", "room": room, "decode_host": host, "decode_port": port,
                  "prompt_len": prompt_len, "schema": schema})]


def abort(room: int, reason: str = "") -> list[bytes]:
    return [pack({"type": "ABORT", "room": room, "reason": reason[:MAX_REASON_CHARS]})]


def status(room: int, pp_rank: int, state: KVPoll, reason: str = "") -> list[bytes]:
    return [pack({"type": "STATUS", "room": room, "pp_rank": pp_rank, "status": int(state),
                  "reason": reason[:MAX_REASON_CHARS]})]


def data(room: int, pp_rank: int, part: Part) -> list:
    return [pack({"type": "DATA", "room": room, "pp_rank": pp_rank, **part.spec.header()}), part.data]


# ---- decoding and validation ----------------------------------------------------------------------------------

def unpack(frame: bytes) -> dict:
    if len(frame) > MAX_CONTROL_BYTES:
        raise FrameError(f"control frame of {len(frame)} bytes exceeds {MAX_CONTROL_BYTES}")
    try:
        msg = msgpack.unpackb(frame, raw=False, strict_map_key=True, **UNPACK_LIMITS)
    except Exception as e:  # msgpack raises several unrelated types on garbage
        raise FrameError(f"undecodable msgpack ({type(e).__name__}{': ' if str(e) else ''}{e})") from None
    if not isinstance(msg, dict) or not isinstance(msg.get("type"), str):
        raise FrameError("not a msgpack map with a str 'type'")
    return msg


def get_room(msg: dict) -> int:
    why = check_room(msg.get("room"))
    if why:
        raise FrameError(why)
    return msg["room"]


def get_int(msg: dict, key: str, lo: int, hi: int, room: Optional[int] = None) -> int:
    v = msg.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise FrameError(f"{key} must be an int in {lo}..{hi}, got {v!r}"[:300], room)
    return v


def get_str(msg: dict, key: str, room: Optional[int] = None, max_len: int = MAX_REASON_CHARS) -> str:
    v = msg.get(key)
    if not isinstance(v, str) or len(v) > max_len:
        raise FrameError(f"{key} must be a str of at most {max_len} chars, got {type(v).__name__}", room)
    return v


def get_int_list(msg: dict, key: str, room: int) -> tuple[int, ...]:
    v = msg.get(key)
    if (not isinstance(v, list) or len(v) > MAX_LIST_LEN
            or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in v)):
        raise FrameError(f"{key} must be a list of non-negative ints", room)
    return tuple(v)


def parse_transfer_info(msg: dict) -> dict:
    room = get_room(msg)
    schema = msg.get("schema")
    if not isinstance(schema, dict):
        raise FrameError("schema must be a map", room)
    return {"room": room, "decode_host": get_str(msg, "decode_host", room, 255),
            "decode_port": get_int(msg, "decode_port", 1, 65535, room),
            "prompt_len": get_int(msg, "prompt_len", 0, 1 << 40, room), "schema": schema}


def parse_status(msg: dict) -> tuple[int, int, int, str]:
    room = get_room(msg)
    return (room, get_int(msg, "pp_rank", 0, 1 << 16, room), get_int(msg, "status", 0, 4, room),
            get_str(msg, "reason", room))


def parse_data_header(msg: dict) -> tuple[int, int, PartSpec]:
    room = get_room(msg)
    pp_rank = get_int(msg, "pp_rank", 0, 1 << 16, room)
    name = get_str(msg, "name", room, 255)
    dtype = get_str(msg, "dtype", room, 64)
    if dtype not in DTYPE_SIZES:
        raise FrameError(f"unknown dtype {dtype!r}", room)
    return room, pp_rank, PartSpec(name, get_int_list(msg, "layer_ids", room), dtype,
                                   get_int_list(msg, "shape", room))


def schema_mismatches(compare: Callable[[dict, dict], list[str]], prefill: dict, decode: dict) -> list[str]:
    try:
        return list(compare(prefill, decode))
    except Exception as e:  # a compare that cannot read the peer's schema is a mismatch, not a dead thread
        return [f"schema compare failed ({type(e).__name__}: {e})"]


# ---- sockets and threads --------------------------------------------------------------------------------------

def advertise_host(host: str) -> str:
    """The address peers should dial for a socket bound on `host` (a wildcard becomes loopback)."""
    return WILDCARD_HOSTS.get(host, host)


def tcp_endpoint(host: str, port: int | str) -> str:
    return f"tcp://[{host.strip('[]')}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def bind_pull(ctx: zmq.Context, host: str, max_msg_size: int) -> tuple[zmq.Socket, int]:
    """A PULL socket on host:<random port>; a frame over max_msg_size bytes makes zmq drop the connection."""
    sock = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, max_msg_size)
    sock.setsockopt(zmq.RCVHWM, 256)
    if ":" in host:
        sock.setsockopt(zmq.IPV6, 1)
    try:
        sock.bind(tcp_endpoint(host, "*"))
    except zmq.ZMQError as e:
        sock.close()
        raise OSError(f"cannot bind a ZMQ PULL socket on {host}: {e}") from None
    port = int(sock.getsockopt(zmq.LAST_ENDPOINT).decode().rsplit(":", 1)[1])
    return sock, port


_PEER_EVENTS = {zmq.EVENT_DISCONNECTED: "a peer disconnected (it closed, or zmq dropped it for a frame over "
                                        "MAXMSGSIZE {max} bytes)",
                zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "a connection failed the ZMTP handshake (not a ZMQ peer?)",
                zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "a connection broke the ZMTP protocol (garbage bytes?)",
                zmq.EVENT_HANDSHAKE_FAILED_AUTH: "a connection failed ZMTP authentication"}


class Inbox:
    """A bound PULL socket and its zmq monitor, owned by one listener thread. What zmq refuses on its own (a frame
    over MAXMSGSIZE, a connection that is not ZMTP) never reaches recv; the monitor's events make it visible in the
    log. Messages are read whole: frames, then the caller checks the tag (FrameAuth.open) before parsing."""

    def __init__(self, ctx: zmq.Context, host: str, max_msg_size: int, who: str, rejects: RejectLog) -> None:
        self.sock, self.port = bind_pull(ctx, host, max_msg_size)
        self.max_msg_size, self.who, self.rejects = max_msg_size, who, rejects
        self.monitor = self.sock.get_monitor_socket(sum(_PEER_EVENTS))
        self.poller = zmq.Poller()
        self.poller.register(self.sock, zmq.POLLIN)
        self.poller.register(self.monitor, zmq.POLLIN)

    def poll(self, timeout_ms: int, limit: int = 256) -> list[list[bytes]]:
        ready = dict(self.poller.poll(timeout_ms))
        if self.monitor in ready:
            self._drain_events()
        out = []
        if self.sock in ready:
            for _ in range(limit):
                try:
                    out.append(self.sock.recv_multipart(zmq.NOBLOCK))
                except zmq.Again:
                    break
        return out

    def _drain_events(self) -> None:
        for _ in range(256):
            try:
                event = recv_monitor_message(self.monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            what = _PEER_EVENTS.get(event["event"])
            if what is not None:  # a disconnect is routine (a peer restarting): info; the others are warnings
                level = logging.INFO if event["event"] == zmq.EVENT_DISCONNECTED else logging.WARNING
                self.rejects.note("connection", "%s: %s", self.who, what.format(max=self.max_msg_size), level=level)

    def close(self) -> None:
        try:
            self.sock.disable_monitor()
        except zmq.ZMQError:
            pass
        self.monitor.close(linger=0)
        self.sock.close(linger=0)


def start_loop(name: str, stop: threading.Event, step: Callable[[], None],
               on_exit: Optional[Callable[[], None]] = None) -> threading.Thread:
    """A daemon thread running step() until `stop` is set; an exception is logged and the loop goes on."""

    def run() -> None:
        while not stop.is_set():
            try:
                step()
            except Exception:
                logger.exception("%s: iteration failed (the thread keeps running)", name)
                stop.wait(0.05)
        if on_exit is not None:
            try:
                on_exit()
            except Exception:
                logger.exception("%s: cleanup failed", name)

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    return thread


class AgentHealth:
    """What both agents report about themselves: their threads are alive; what they refused so far. Needs
    `_threads`, `_closed` and `_rejects` on the agent."""

    def threads_alive(self) -> bool:
        """Every agent thread is running (False before start() and after close())."""
        return bool(self._threads) and not self._closed and all(t.is_alive() for t in self._threads)

    def rejected(self) -> dict[str, int]:
        """Messages and connections refused so far, by kind (auth, protocol, replay, connection)."""
        return self._rejects.counts()
