"""The one-sided backends' agents (Mooncake, NIXL): the ZMQ agents' control channel, room life cycle, timeouts,
aborts, heartbeats and authentication, with the parts' bytes written by a transfer engine straight into memory the
decode registered, instead of DATA frames.

    decode                                               prefill stage s
    register(pools, hidden rows, metadata rows) at start
    begin(room, ..., landing) -> TRANSFER_INFO + landing  ---->  (room WaitingForInput, parts handed over)
                                                                 writer thread: the stage's parts -> the landing's
                                                                 addresses (engine.write, blocking, one room at a
                                                                 time), then STATUS success on the control channel
    STATUS success from every stage -> Success  <------------   (a failed write: STATUS failed with the reason)
    take(): Parts without data (the bytes are in the landing)

The decode's landing (transfer/landing.py) names its engine (peer id, metadata) and, per part, where each token's
row goes. A decode whose backend differs is refused before this (the schema names the backend); a TRANSFER_INFO
without a landing fails its room with a message saying so.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
from typing import ClassVar, Optional

from sparkrelay.transfer import protocol
from sparkrelay.transfer.agent import start_loop
from sparkrelay.transfer.base import Dest, KVPoll, Part
from sparkrelay.transfer.engines import TransferEngine, buffer_address, engine_error, open_engine
from sparkrelay.transfer.landing import Landing, writes
from sparkrelay.transfer.prefill_room import PrefillRoom
from sparkrelay.transfer.protocol import Data, FrameError, Status, TransferInfo
from sparkrelay.transfer.wire import Outbox
from sparkrelay.transfer.zmq_decode import DecodeAgent
from sparkrelay.transfer.zmq_prefill import PrefillAgent

logger = logging.getLogger(__name__)


class OneSidedPrefill(PrefillAgent):
    engine_name: ClassVar[str] = ""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._engine: Optional[TransferEngine] = None
        self._writes: queue.Queue = queue.Queue()  # (room, rec, dest, parts) to write, in order

    def start(self) -> None:
        self._engine = open_engine(self.engine_name, self.bind_host)  # EngineMissing names what to install
        super().start()
        logger.info("prefill pp_rank %d: transfer backend %s, engine %s", self.pp_rank, self.engine_name,
                    self._engine.peer()[0])

    def _more_threads(self) -> list[threading.Thread]:
        return [*super()._more_threads(), start_loop(f"{self.thread_name}-writer", self._stop, self._write_step)]

    def close(self) -> None:
        super().close()
        if self._engine is not None:
            self._engine.close()

    def _deliver(self, out: Outbox, room: int, rec: PrefillRoom, dest: Dest, parts: list[Part], last: bool) -> None:
        self._writes.put((room, rec, dest, parts, last))  # the sender thread never blocks on a write

    def _write_step(self) -> None:
        try:
            room, rec, dest, parts, last = self._writes.get(timeout=0.1)
        except queue.Empty:
            return
        with self._lock:
            if self._table.rooms.get(room) is not rec or rec.state == KVPoll.Failed:
                return  # aborted while queued: nothing is written into pages the decode may have freed
            landing_map, n = rec.landing, rec.prompt_len
        try:
            landing = Landing.from_wire(landing_map, room)
        except FrameError as e:
            self._fail(room, f"bad TRANSFER_INFO from the decode: {e.reason}")
            return
        try:
            self._write(landing, parts, n)
        except Exception as e:  # the engine's failure fails this room only; the decode hears why
            self._fail(room, f"{self.engine_name} write to the decode engine {landing.peer} failed: {engine_error(e)}")
            return
        if last:  # every hand-over written, in order (one writer thread): the STATUS success may go
            self._enqueue(("written", room, rec, dest))

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

    def _run_job(self, out: Outbox, job: tuple) -> None:
        if job[0] != "written":
            super()._run_job(out, job)
            return
        _, room, rec, dest = job
        with self._lock:
            if self._table.rooms.get(room) is not rec or rec.state == KVPoll.Failed:
                return
        self._put(out, dest, Status.success(room, self.pp_rank), ("done", room, rec))


class OneSidedDecode(DecodeAgent):
    engine_name: ClassVar[str] = ""
    one_sided = True

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._engine: TransferEngine = open_engine(self.engine_name, self.host)
        self._peer: tuple[str, bytes] = self._engine.peer()

    def register(self, regions: list[tuple[int, int]]) -> None:
        for addr, nbytes in regions:
            self._engine.register(addr, nbytes)
        self._peer = self._engine.peer()  # NIXL's metadata lists the registered memory
        logger.info("decode: transfer backend %s, engine %s, %d regions (%.1f MiB) registered", self.engine_name,
                    self._peer[0], len(regions), sum(n for _, n in regions) / (1 << 20))

    def close(self) -> None:
        super().close()
        self._engine.close()

    def _landing(self, landing: Optional[Landing]) -> Optional[dict]:
        if landing is None:
            raise ValueError(f"the {self.engine_name} backend needs the room's landing (where the prefill writes)")
        wire = dataclasses.replace(landing, peer=self._peer[0], peer_meta=self._peer[1]).to_wire()
        size = len(TransferInfo(1, self.host, 1, 0, self._schema, wire).encode()[0])
        if size > protocol.MAX_CONTROL_BYTES:
            raise ValueError(f"the room's landing ({len(landing.pages)} pages in {len(wire['pages']) // 8} runs) "
                             f"makes a {size}-byte TRANSFER_INFO, over {protocol.MAX_CONTROL_BYTES}: the prompt is "
                             "too long for this --page-size (raise it)")
        return wire

    def _transfer_info(self, room: int, rec) -> TransferInfo:
        return TransferInfo(room, self.host, self.port, rec.prompt_len, self._schema, rec.landing, rec.prefix)

    def _on_data(self, msg: Data) -> None:
        raise FrameError(f"DATA frame for room {msg.room} on the {self.engine_name} backend (the prefill sends "
                         "bytes over zmq: --disaggregation-transfer-backend differs between the two servers)",
                         msg.room)

    def _on_status(self, msg: Status) -> None:
        """A stage's success means its writes completed: its parts are in the landing."""
        if msg.status == KVPoll.Success:
            with self._lock:
                rec = self._table.rooms.get(msg.room)
                if rec is not None and rec.state in (KVPoll.WaitingForInput, KVPoll.Transferring) \
                        and msg.pp_rank in rec.expected and msg.pp_rank not in rec.done:
                    rec.received[msg.pp_rank] = {name: Part(spec, b"")
                                                 for name, spec in rec.expected[msg.pp_rank].items()}
                    rec.state = max(rec.state, KVPoll.Transferring)
        super()._on_status(msg)


class MooncakePrefill(OneSidedPrefill):
    engine_name = "mooncake"


class MooncakeDecode(OneSidedDecode):
    engine_name = "mooncake"


class NixlPrefill(OneSidedPrefill):
    engine_name = "nixl"


class NixlDecode(OneSidedDecode):
    engine_name = "nixl"
