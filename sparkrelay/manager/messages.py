"""The typed messages between the HTTP server and the engine's owner (a thread, or the scheduler
process).

    server -> engine:  AddItems (all or none), AbortRequest, FlushCache, Shutdown
    engine -> server:  Ready (EngineInfo) or StartFailed, once; Added (the answer to one AddItems); Flushed (the
                       answer to one FlushCache); Progress (a step's outputs and the stats after it); Fatal (the
                       engine cannot go on)

Between processes each message is one codec frame (sparkrelay/codec.py): a msgpack map of its
fields, nested dataclasses as the lists of their fields, every top-level field checked by its rule
on receipt and every nested one by its own constructor; `decode` raises MessageError for anything
else. On a byte stream (the scheduler process's outputs) each frame goes behind its length:
`framed`, `FrameReader`. Nothing here is pickled. In one process (the engine thread) the dataclasses
are handed over as they are.
"""

from __future__ import annotations

import secrets
import struct
import uuid
from dataclasses import dataclass, field
from typing import ClassVar, Optional

from sparkrelay.codec import (
    FrameError,
    Message,
    a_list,
    a_map,
    int_in,
    ints,
    opt_str,
    read_message,
    record,
    records,
    str_max,
)
from sparkrelay.scheduler.request import (
    FAKE_BOOTSTRAP_HOST,
    MAX_TOP_LOGPROBS,
    Bootstrap,
    Logprobs,
    RequestOutput,
    SamplingParams,
)


class MessageError(FrameError):
    """A frame that is not one of the messages below."""


@dataclass(frozen=True)
class GenerationItem:
    """One engine request: n > 1 and batch inputs are split into several items before they get
    here."""

    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    bootstrap: Optional[Bootstrap] = None  # the PD router's fields, one room per item

    @classmethod
    def health_check(cls, prompt_ids: list[int], disaggregation_mode: str) -> "GenerationItem":
        """/health_generate's request, a real greedy generation. On a PD server it carries SGLang's
        fake bootstrap host (a random room), so no peer is contacted: a prefill computes the prompt
        and sends nothing; a decode takes zero KV and a fake first token, then decodes one more
        token (hence 2 tokens, EOS ignored)."""
        rid = f"health-{uuid.uuid4().hex}"
        if disaggregation_mode == "null":
            return cls(rid, prompt_ids, SamplingParams(max_new_tokens=1, temperature=0.0))
        room = secrets.randbelow((1 << 63) - 1) + 1
        params = SamplingParams(max_new_tokens=2, temperature=0.0, ignore_eos=True)
        return cls(rid, prompt_ids, params, Bootstrap(FAKE_BOOTSTRAP_HOST, None, room))


@dataclass(frozen=True)
class EngineInfo:
    """What the HTTP layer reads of the engine it serves (/server_info, /model_info, request
    limits)."""

    context_length: int
    max_total_tokens: int
    model_info: dict
    dtype: Optional[str] = None
    speculative_num_draft_tokens: Optional[int] = None
    dist_init_port: Optional[int] = None  # the pipeline stages' rendezvous port (--pp-size > 1)

    @classmethod
    def of(cls, engine) -> "EngineInfo":
        proposer = engine.proposer
        return cls(
            engine.context_length,
            engine.max_total_tokens,
            dict(engine.model_info),
            str(engine.dtype).removeprefix("torch."),
            None if proposer is None else proposer.max_drafts,
            engine.runner.rendezvous_port,
        )


class EngineMessage(Message):
    """A message between the HTTP server and the engine's owner: local (a socketpair or an ipc://
    socket in a private folder), so its limits are the largest batch and output a server makes, not
    a network's."""

    KEY: ClassVar[str] = ""
    MAX_BYTES: ClassVar[int] = 1 << 30
    MAX_LIST: ClassVar[int] = 1 << 24

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        cls.TYPE = cls.__name__  # on the wire as the class's name


_ID = int_in(0, (1 << 63) - 1)
_TEXT = str_max(1 << 24)
_ITEM = dict(
    rid=_TEXT,
    prompt_ids=ints(1 << 24),
    params=record(SamplingParams),
    bootstrap=record(Bootstrap, True),
)
_LOGPROBS = dict(
    input_start=int_in(-1, 1 << 40),
    top=int_in(0, MAX_TOP_LOGPROBS),
    input_ids=ints(1 << 24),
    output=a_list(1 << 24),
    output_top=a_list(1 << 24),
    input=a_list(1 << 24),
    input_top=a_list(1 << 24),
)
_OUTPUT = dict(
    rid=_TEXT,
    new_ids=ints(1 << 24),
    output_ids=ints(1 << 24),
    logprobs=record(Logprobs, True, **_LOGPROBS),
)


# ---- server -> engine


@dataclass(frozen=True)
class AddItems(EngineMessage):
    RULES: ClassVar[tuple] = (("batch", _ID), ("items", records(GenerationItem, 1 << 20, **_ITEM)))
    batch: int  # the id the matching Added answers
    items: tuple[GenerationItem, ...]


@dataclass(frozen=True)
class AbortRequest(EngineMessage):
    RULES: ClassVar[tuple] = (("rid", _TEXT),)
    rid: str


@dataclass(frozen=True)
class FlushCache(EngineMessage):
    RULES: ClassVar[tuple] = (("call", _ID),)
    call: int  # the id the matching Flushed answers


@dataclass(frozen=True)
class Shutdown(EngineMessage):
    RULES: ClassVar[tuple] = (("reason", _TEXT),)
    reason: str = "server shutting down"


# ---- engine -> server


@dataclass(frozen=True)
class Ready(EngineMessage):
    RULES: ClassVar[tuple] = (("info", record(EngineInfo)),)
    info: EngineInfo


@dataclass(frozen=True)
class StartFailed(EngineMessage):
    RULES: ClassVar[tuple] = (("error", _TEXT),)
    error: str  # the exception's message, as the server would have printed it


@dataclass(frozen=True)
class Added(EngineMessage):
    RULES: ClassVar[tuple] = (
        ("batch", _ID),
        ("error", opt_str(1 << 24)),
        ("status", int_in(400, 599)),
    )
    batch: int
    error: Optional[str] = None  # None: every item was added; else none was
    status: int = (
        400  # 400: the request cannot be served as asked (RequestError); 500: the engine failed
    )


@dataclass(frozen=True)
class Flushed(EngineMessage):
    RULES: ClassVar[tuple] = (("call", _ID), ("error", opt_str(1 << 24)))
    call: int
    error: Optional[str] = None  # None: the prefix cache is empty now; else why nothing was done


@dataclass(frozen=True)
class Progress(EngineMessage):
    RULES: ClassVar[tuple] = (
        ("outputs", records(RequestOutput, 1 << 20, **_OUTPUT)),
        ("stats", a_map),
    )
    outputs: tuple[RequestOutput, ...] = ()
    stats: dict = field(default_factory=dict)  # Engine.stats() | check_error, num_step_failures


@dataclass(frozen=True)
class Fatal(EngineMessage):
    RULES: ClassVar[tuple] = (("error", _TEXT),)
    error: str


MESSAGES = (
    AddItems,
    AbortRequest,
    FlushCache,
    Shutdown,
    Ready,
    StartFailed,
    Added,
    Flushed,
    Progress,
    Fatal,
)
_BY_KIND = {cls.__name__: cls for cls in MESSAGES}


def encode(msg: EngineMessage) -> bytes:
    return msg.encode()[0]


def decode(frame: bytes) -> EngineMessage:
    try:
        return read_message([frame], _BY_KIND, EngineMessage.MAX_BYTES, EngineMessage.MAX_LIST)
    except FrameError as e:
        raise MessageError(f"not an engine message: {e}") from None


FRAME_HEADER = struct.Struct("!I")  # a frame's length in bytes, big-endian


def framed(msg) -> bytes:
    """encode(msg) behind its length: one message on a byte stream."""
    body = encode(msg)
    return FRAME_HEADER.pack(len(body)) + body


class FrameReader:
    """The frames of a byte stream written by `framed`, whatever pieces the bytes arrive in."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data) -> list[bytes]:
        """Append what was read (bytes or a memoryview) -> the frames it completed, in order (a partial one waits
        for more)."""
        self._buf += data
        frames, pos, size = [], 0, len(self._buf)
        while size - pos >= FRAME_HEADER.size:
            (n,) = FRAME_HEADER.unpack_from(self._buf, pos)
            if size - pos - FRAME_HEADER.size < n:
                break
            pos += FRAME_HEADER.size
            frames.append(bytes(self._buf[pos : pos + n]))
            pos += n
        del self._buf[:pos]
        return frames
