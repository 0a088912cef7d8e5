"""Wire frames and the ZMQ plumbing both agents share.

Every message is one ZMQ multipart message on a PUSH -> PULL pair, over TCP:

    control  [msgpack map]               TRANSFER_INFO, ABORT (decode -> prefill); STATUS (prefill -> decode)
    data     [msgpack map, raw bytes]    DATA (prefill -> decode); the bytes are exactly spec.nbytes, C order

    TRANSFER_INFO {type, room, decode_host, decode_port, prompt_len, schema}
    ABORT         {type, room, reason?}                       reason: optional str, why the decode gave up
    STATUS        {type, room, pp_rank, status, reason}       status: int(KVPoll.Success) or int(KVPoll.Failed)
    DATA          {type, room, pp_rank, name, layer_ids, dtype, shape}   the PartSpec of the bytes frame

Every map key is a str. Nothing is unpickled; every field is type-checked before it is used (parse_* below).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from typing import Callable, Optional

import msgpack
import zmq

from sparkrelay.transfer.base import DTYPE_SIZES, KVPoll, Part, PartSpec, check_room

logger = logging.getLogger(__name__)

MAX_CONTROL_BYTES = 4 << 20  # a control map (schema included) larger than this is refused
MAX_REASON_CHARS = 4096
MAX_LIST_LEN = 1 << 16  # layer_ids / shape entries
WILDCARD_HOSTS = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}


class FrameError(ValueError):
    """A message that breaks the protocol. `room` is set when the message named a valid room."""

    def __init__(self, reason: str, room: Optional[int] = None) -> None:
        super().__init__(reason)
        self.reason, self.room = reason, room


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
        msg = msgpack.unpackb(frame, raw=False, strict_map_key=True)
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
    """A PULL socket on host:<random port>; frames over max_msg_size bytes make zmq drop the connection."""
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


class PushPool:
    """PUSH sockets by (host, port), least recently used closed past `limit`. Owned by one thread only
    (zmq sockets are not thread safe): the agents' sender threads."""

    def __init__(self, ctx: zmq.Context, send_timeout_s: float, limit: int = 1024) -> None:
        self.ctx, self.timeout_ms, self.limit = ctx, int(send_timeout_s * 1000), limit
        self.socks: OrderedDict[tuple[str, int], zmq.Socket] = OrderedDict()

    def send(self, dest: tuple[str, int], frames: list) -> None:
        """Raises zmq.Again when the peer did not take the message within the send timeout."""
        sock = self.socks.get(dest)
        if sock is None:
            sock = self.socks[dest] = self._connect(dest)
            while len(self.socks) > self.limit:
                self.socks.popitem(last=False)[1].close(linger=0)
        self.socks.move_to_end(dest)
        try:
            sock.send_multipart(frames, copy=False)
        except zmq.ZMQError:
            self.drop(dest)
            raise

    def _connect(self, dest: tuple[str, int]) -> zmq.Socket:
        sock = self.ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 1000)
        sock.setsockopt(zmq.SNDHWM, 64)  # a dead peer holds at most this many messages
        sock.setsockopt(zmq.SNDTIMEO, self.timeout_ms)
        sock.setsockopt(zmq.IMMEDIATE, 1)  # block (then time out) instead of queueing for a peer never reached
        if ":" in dest[0]:
            sock.setsockopt(zmq.IPV6, 1)
        sock.connect(tcp_endpoint(*dest))
        return sock

    def drop(self, dest: tuple[str, int]) -> None:
        sock = self.socks.pop(dest, None)
        if sock is not None:
            sock.close(linger=0)

    def close(self) -> None:
        for sock in self.socks.values():
            sock.close()
        self.socks.clear()


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
