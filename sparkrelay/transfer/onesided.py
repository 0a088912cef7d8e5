"""The one-sided carrier (backends "mooncake" and "nixl"): a transfer engine writes a room's parts
straight into memory the decode registered; the control channel carries only the messages.

    decode                                               prefill stage s
    register(pools, hidden rows, metadata rows) at start
    begin(room, ..., landing) -> TRANSFER_INFO + landing  ---->  (room WaitingForInput, parts handed over)
                                                                 writer thread: the stage's parts -> the landing's
                                                                 addresses (engine.write, blocking, one room at a
                                                                 time), then STATUS success on the control channel
    STATUS success from every stage -> Success  <------------   (a failed write: STATUS failed with the reason)
    take(): Parts without data (the bytes are in the landing)

The decode's landing (transfer/landing.py) names its engine (peer id, metadata) and, per part, where
each token's row goes. A decode whose backend differs is refused before this (the schema names the
backend); a TRANSFER_INFO without a landing fails its room with a message saying so.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
from typing import Optional

from sparkrelay.transfer import protocol
from sparkrelay.transfer.agent import start_loop
from sparkrelay.transfer.base import Dest, Part
from sparkrelay.transfer.engines import TransferEngine, buffer_address, engine_error, open_engine
from sparkrelay.transfer.landing import Landing, writes
from sparkrelay.transfer.protocol import FrameError, TransferInfo
from sparkrelay.transfer.wire import Outbox

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class WriteJob:
    """One hand-over for the writer thread (prefill side)."""

    room: int
    rec: object  # the room's PrefillRoom: a write for a room aborted or reused since is skipped
    dest: Dest
    parts: list[Part]
    last: bool


class OneSidedCarrier:
    """Bytes written by a transfer engine (engines.open_engine: Mooncake or NIXL) into the decode's
    landing."""

    one_sided = (
        True  # the decode takes no DATA frames; a stage's STATUS success means its writes completed
    )

    def __init__(self, engine_name: str) -> None:
        self.engine_name = engine_name
        self._engine: Optional[TransferEngine] = None
        self._peer: tuple[str, bytes] = ("", b"")
        self._writes: queue.Queue = queue.Queue()  # WriteJob, in hand-over order

    def open(self, host: str) -> None:
        """Start the engine on `host` (EngineMissing names what to install)."""
        self._engine = open_engine(self.engine_name, host)
        self._peer = self._engine.peer()
        logger.info("transfer backend %s: engine %s on %s", self.engine_name, self._peer[0], host)

    def close(self) -> None:
        if self._engine is not None:
            self._engine.close()

    # ---- prefill side ----

    def threads(self, name: str, stop: threading.Event, side) -> list[threading.Thread]:
        """The writer: one thread, so a stage's hand-overs are written in order and the sender never
        blocks."""
        return [start_loop(f"{name}-writer", stop, lambda: self._write_step(side))]

    def deliver(
        self, side, out: Outbox, room: int, rec, dest: Dest, parts: list[Part], last: bool
    ) -> None:
        self._writes.put(WriteJob(room, rec, dest, parts, last))

    def _write_step(self, side) -> None:
        try:
            job = self._writes.get(timeout=0.1)
        except queue.Empty:
            return
        target = side.landing_of(job.room, job.rec)
        if target is None:
            return  # aborted while queued: nothing is written into pages the decode may have freed
        landing_map, n = target
        try:
            landing = Landing.from_wire(landing_map, job.room)
        except FrameError as e:
            side.abort(job.room, f"bad TRANSFER_INFO from the decode: {e.reason}")
            return
        try:
            self._write(landing, job.parts, n)
        except Exception as e:  # the engine's failure fails this room only; the decode hears why
            side.abort(
                job.room,
                f"{self.engine_name} write to the decode engine {landing.peer} failed: "
                f"{engine_error(e)}",
            )
            return
        if job.last:  # every hand-over written, in order: the STATUS success may go
            side.written(job.room, job.rec, job.dest)

    def _write(self, landing: Landing, parts: list[Part], n: int) -> None:
        addrs = {p.spec.name: buffer_address(p.data) for p in parts}
        plan = writes(landing, parts, addrs, n)
        for p in parts:
            self._engine.register(addrs[p.spec.name], len(p.data))
        try:
            self._engine.write((landing.peer, landing.peer_meta), plan)
        finally:
            for p in parts:
                self._engine.unregister(addrs[p.spec.name])

    # ---- decode side ----

    def register(self, regions: list[tuple[int, int]]) -> None:
        """Memory (address, bytes) the prefill may write into, before the agent starts."""
        for addr, nbytes in regions:
            self._engine.register(addr, nbytes)
        self._peer = self._engine.peer()  # NIXL's metadata lists the registered memory
        logger.info(
            "decode: transfer backend %s, engine %s, %d regions (%.1f MiB) registered",
            self.engine_name,
            self._peer[0],
            len(regions),
            sum(n for _, n in regions) / (1 << 20),
        )

    def landing(self, landing: Optional[Landing], schema: dict, host: str) -> Optional[dict]:
        """The room's landing as TRANSFER_INFO carries it, with this engine's peer; ValueError when
        there is none or when it does not fit in one control message."""
        if landing is None:
            raise ValueError(
                f"the {self.engine_name} backend needs the room's landing (where the prefill writes)"
            )
        wire = dataclasses.replace(landing, peer=self._peer[0], peer_meta=self._peer[1]).to_wire()
        size = len(TransferInfo(1, host, 1, 0, schema, wire).encode()[0])
        if size > protocol.MAX_CONTROL_BYTES:
            raise ValueError(
                f"the room's landing ({len(landing.pages)} pages in {len(wire['pages']) // 8} runs) "
                f"makes a {size}-byte TRANSFER_INFO, over {protocol.MAX_CONTROL_BYTES}: the prompt is "
                "too long for this --page-size (raise it)"
            )
        return wire
