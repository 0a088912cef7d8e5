"""The typed messages between the HTTP server and the engine's owner (a thread, or the scheduler process).

    server -> engine:  AddItems (all or none), AbortRequest, FlushCache, Shutdown
    engine -> server:  Ready (EngineInfo) or StartFailed, once; Added (the answer to one AddItems); Flushed (the
                       answer to one FlushCache); Progress (a step's outputs and the stats after it); Fatal (the
                       engine cannot go on)

Between processes each message is one msgpack frame `[kind, fields...]`, fields in the dataclass's order, nested
dataclasses as arrays the same way; `decode` rebuilds the dataclass and raises MessageError for anything else.
On a byte stream (the scheduler process's outputs) each frame goes behind its length: `framed`, `FrameReader`.
Nothing here is pickled. In one process (the engine thread) the dataclasses are handed over as they are.
"""

from __future__ import annotations

import secrets
import struct
import uuid
from dataclasses import astuple, dataclass, field, fields
from typing import Optional

import msgpack

from sparkrelay.scheduler.request import (FAKE_BOOTSTRAP_HOST, Bootstrap, Logprobs, RequestOutput, SamplingParams)


class MessageError(ValueError):
    """A frame that is not one of the messages below."""


@dataclass(frozen=True)
class GenerationItem:
    """One engine request: n > 1 and batch inputs are split into several items before they get here."""

    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    bootstrap: Optional[Bootstrap] = None  # the PD router's fields, one room per item

    @classmethod
    def health_check(cls, prompt_ids: list[int], disaggregation_mode: str) -> "GenerationItem":
        """/health_generate's request, a real greedy generation. On a PD server it carries SGLang's fake bootstrap
        host (a random room), so no peer is contacted: a prefill computes the prompt and sends nothing; a decode
        takes zero KV and a fake first token, then decodes one more token (hence 2 tokens, EOS ignored)."""
        rid = f"health-{uuid.uuid4().hex}"
        if disaggregation_mode == "null":
            return cls(rid, prompt_ids, SamplingParams(max_new_tokens=1, temperature=0.0))
        room = secrets.randbelow((1 << 63) - 1) + 1
        params = SamplingParams(max_new_tokens=2, temperature=0.0, ignore_eos=True)
        return cls(rid, prompt_ids, params, Bootstrap(FAKE_BOOTSTRAP_HOST, None, room))


@dataclass(frozen=True)
class EngineInfo:
    """What the HTTP layer reads of the engine it serves (/server_info, /model_info, request limits)."""

    context_length: int
    max_total_tokens: int
    model_info: dict
    dtype: Optional[str] = None
    speculative_num_draft_tokens: Optional[int] = None
    dist_init_port: Optional[int] = None  # the pipeline stages' rendezvous port (--pp-size > 1)

    @classmethod
    def of(cls, engine) -> "EngineInfo":
        proposer = engine.proposer
        return cls(engine.context_length, engine.max_total_tokens, dict(engine.model_info),
                   str(engine.dtype).removeprefix("torch."), None if proposer is None else proposer.max_drafts,
                   engine.runner.rendezvous_port)


# ---- server -> engine

@dataclass(frozen=True)
class AddItems:
    batch: int  # the id the matching Added answers
    items: tuple[GenerationItem, ...]


@dataclass(frozen=True)
class AbortRequest:
    rid: str


@dataclass(frozen=True)
class FlushCache:
    call: int  # the id the matching Flushed answers


@dataclass(frozen=True)
class Shutdown:
    reason: str = "server shutting down"


# ---- engine -> server

@dataclass(frozen=True)
class Ready:
    info: EngineInfo


@dataclass(frozen=True)
class StartFailed:
    error: str  # the exception's message, as the server would have printed it


@dataclass(frozen=True)
class Added:
    batch: int
    error: Optional[str] = None  # None: every item was added; else none was
    status: int = 400  # 400: the request cannot be served as asked (RequestError); 500: the engine failed


@dataclass(frozen=True)
class Flushed:
    call: int
    error: Optional[str] = None  # None: the prefix cache is empty now; else why nothing was done


@dataclass(frozen=True)
class Progress:
    outputs: tuple[RequestOutput, ...] = ()
    stats: dict = field(default_factory=dict)  # Engine.stats() | check_error, num_step_failures


@dataclass(frozen=True)
class Fatal:
    error: str


MESSAGES = (AddItems, AbortRequest, FlushCache, Shutdown, Ready, StartFailed, Added, Flushed, Progress, Fatal)
_BY_KIND = {cls.__name__: cls for cls in MESSAGES}


def encode(msg) -> bytes:
    if isinstance(msg, AddItems):
        body = [msg.batch, [_item_fields(it) for it in msg.items]]
    elif isinstance(msg, Progress):
        body = [[_output_fields(o) for o in msg.outputs], msg.stats]
    else:
        body = list(astuple(msg))  # flat messages (EngineInfo holds a dict, which msgpack keeps)
    return msgpack.packb([type(msg).__name__, *body], use_bin_type=True)


def decode(frame: bytes):
    try:
        kind, *body = msgpack.unpackb(frame, raw=False, strict_map_key=False)
        cls = _BY_KIND[kind]
        if cls is AddItems:
            return AddItems(int(body[0]), tuple(_item(f) for f in body[1]))
        if cls is Progress:
            return Progress(tuple(_output(f) for f in body[0]), dict(body[1]))
        if cls is Ready:
            return Ready(EngineInfo(*body[0]))
        return cls(*body)
    except (ValueError, TypeError, KeyError, IndexError, msgpack.UnpackException) as e:
        raise MessageError(f"not an engine message: {type(e).__name__}: {e}") from None


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


def _item_fields(it: GenerationItem) -> list:
    params = [getattr(it.params, f.name) for f in fields(SamplingParams)]
    return [it.rid, it.prompt_ids, params, None if it.bootstrap is None else list(astuple(it.bootstrap))]


def _item(f: list) -> GenerationItem:
    rid, prompt_ids, params, bootstrap = f
    return GenerationItem(str(rid), list(prompt_ids), SamplingParams(*params),
                          None if bootstrap is None else Bootstrap(*bootstrap))


def _output_fields(o: RequestOutput) -> list:
    lp = None if o.logprobs is None else [getattr(o.logprobs, f.name) for f in fields(Logprobs)]
    return [o.rid, o.new_ids, o.output_ids, o.finished, o.finish_reason, o.prompt_tokens, o.text, o.spec_verify_ct,
            o.spec_accept_length, lp, o.cached_tokens, o.handoff_bytes]


def _output(f: list) -> RequestOutput:
    *head, lp, cached, handoff = f
    if len(head) != 9:
        raise ValueError(f"an output has {len(head) + 3} fields, not 12")
    return RequestOutput(*head, logprobs=None if lp is None else Logprobs(*lp), cached_tokens=int(cached),
                         handoff_bytes=int(handoff))
