"""The frames carrier (backend "zmq"): a room's parts travel as DATA frames on the control channel
itself, so nothing but ZMQ is needed and the decode copies the bytes into its pools.

    prefill stage: deliver() queues DATA x N (and, after the last hand-over's, STATUS success) in
    the outbox
    decode:        the listener takes each DATA frame into the room (decode_agent.DecodeAgent._on_data)
"""

from __future__ import annotations

import threading
from typing import Optional

from sparkrelay.transfer.base import Dest, Part
from sparkrelay.transfer.landing import Landing
from sparkrelay.transfer.protocol import Data, Status
from sparkrelay.transfer.wire import Outbox


class FramesCarrier:
    """Bytes as DATA frames: no engine, no extra thread, no landing."""

    one_sided = False  # the decode takes DATA frames

    def open(self, host: str) -> None:
        """Nothing to open: the control channel carries the bytes."""

    def threads(self, name: str, stop: threading.Event, side) -> list[threading.Thread]:
        return []

    def deliver(
        self, side, out: Outbox, room: int, rec, dest: Dest, parts: list[Part], last: bool
    ) -> None:
        """From the prefill's sender thread: the parts as DATA frames, then STATUS success after the
        last hand-over's (side.put fails the room and stops at the first refused frame)."""
        msgs = [(Data.of(room, side.pp_rank, p), ("data", room, rec)) for p in parts]
        if last:
            msgs.append((Status.success(room, side.pp_rank), ("done", room, rec)))
        for msg, tag in msgs:
            if not side.put(out, dest, msg, tag):
                return

    def register(self, regions: list[tuple[int, int]]) -> None:
        """No memory to register: the decode copies the bytes out of the frames."""

    def landing(self, landing: Optional[Landing], schema: dict, host: str) -> Optional[dict]:
        """What TRANSFER_INFO carries as the room's landing: nothing, the parts come as DATA
        frames."""
        return None

    def close(self) -> None:
        """Nothing to close."""
