"""The asyncio side of the engine: HTTP handlers submit engine requests and read their outputs here,
whichever thread or process owns the Engine (loop.py runs it; messages.py are the messages).

    asyncio side (HTTP handlers)                        the engine's owner (EngineLoop, one thread)
    ----------------------------                        -------------------------------------------
    submit() --AddItems(batch, items)------------->     add_request() each --Added(batch, error)--> the Future
    OutputStream.close() --AbortRequest(rid)------>     abort()
    flush_cache() --FlushCache(call)-------------->     flush_cache() --Flushed(call, error)------> the Future
    OutputStream <- asyncio.Queue <- _on_message <-     step() --Progress(outputs, stats)
                                                        a dead pipeline stage --Fatal(error)

`AsyncEngine` runs the loop in a thread of this process (tests, embedding the app); `EngineProcess`
(process.py, what `launch_server` uses) runs it as the scheduler process, as SGLang does.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import signal
import threading
from typing import AsyncIterator, Optional

from sparkrelay.manager.loop import EngineLoop, abort_output
from sparkrelay.manager.messages import (
    AbortRequest,
    Added,
    AddItems,
    EngineInfo,
    Fatal,
    FlushCache,
    Flushed,
    GenerationItem,
    Progress,
    Shutdown,
)
from sparkrelay.scheduler.request import RequestError, RequestOutput, SamplingParams

logger = logging.getLogger(__name__)

__all__ = [
    "AsyncEngine",
    "EngineClient",
    "EngineFailed",
    "EngineStopped",
    "GenerationItem",
    "OutputStream",
]


class EngineStopped(RuntimeError):
    """The engine has stopped (shutdown, or a fatal pipeline failure): HTTP 503."""


class EngineFailed(RuntimeError):
    """The engine failed to add a request for a reason that is not the request's: HTTP 500."""


class OutputStream:
    """Async iterator over the outputs of a group of engine requests, in arrival order.

    Ends when every request of the group has finished. `close()` aborts the unfinished ones;
    always call it (try/finally) so a client that goes away frees its KV blocks.
    """

    def __init__(self, owner: "EngineClient", rids: list[str], outputs: asyncio.Queue):
        self._owner = owner
        self.rids = rids
        self._pending = set(rids)
        self._outputs = outputs
        self._closed = False

    def __aiter__(self) -> "OutputStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if not self._pending:
            self.close()
            raise StopAsyncIteration
        out = await self._outputs.get()
        if out.finished:
            self._pending.discard(out.rid)
        return out

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for rid in self._pending:
            self._owner.abort(rid)
        self._owner._unregister(self.rids)


class EngineClient:
    """Requests in, outputs out, over the typed messages; a transport subclass says how they travel
    (`_start_transport`, `_send`, `stop`, `_transport_alive`). Start it from the event loop that
    consumes outputs."""

    def __init__(self, info: EngineInfo, tokenizer):
        self.info, self.tokenizer = info, tokenizer
        self._queues: dict[
            str, asyncio.Queue
        ] = {}  # every field here is touched on the event loop thread only
        self._adds: dict[int, asyncio.Future] = {}
        self._flushes: dict[int, asyncio.Future] = {}
        self._batches = itertools.count(1)
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._stopped: Optional[str] = None  # why the engine stopped, once it has
        self.last_stats: dict = {}  # the engine's stats after its last step

    @property
    def num_step_failures(self) -> int:
        return int(self.last_stats.get("num_step_failures", 0))

    @property
    def check_error(self) -> Optional[str]:
        return self.last_stats.get("check_error")

    @property
    def is_alive(self) -> bool:
        return self._stopped is None and self._transport_alive()

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._start_transport()

    # ---- requests (event loop side) ----

    async def submit(self, items: list[GenerationItem]) -> OutputStream:
        """Adds all items atomically (all or none); raises RequestError for a bad request."""
        rids = [it.rid for it in items]
        if len(set(rids)) != len(rids) or any(r in self._queues for r in rids):
            raise RequestError(f"request id already in use: {rids}")
        if not self.is_alive:
            raise EngineStopped(self._stopped or "the engine is not running")
        outputs: asyncio.Queue = asyncio.Queue()
        for rid in rids:
            self._queues[rid] = outputs
        stream = OutputStream(self, rids, outputs)
        batch = next(self._batches)
        self._adds[batch] = added = asyncio.get_running_loop().create_future()
        try:
            self._send(AddItems(batch, tuple(items)))
            _raise_for(await added)
        except BaseException:
            self._adds.pop(batch, None)
            stream.close()  # also covers cancellation while waiting: the add may have happened
            raise
        return stream

    async def generate(
        self, rid: str, prompt_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[RequestOutput]:
        """Outputs of one request; aborts it in the engine if the consumer stops early or is
        cancelled."""
        stream = await self.submit([GenerationItem(rid, prompt_ids, params)])
        try:
            async for out in stream:
                yield out
        finally:
            stream.close()

    async def flush_cache(self) -> Optional[str]:
        """Empty the engine's prefix cache: None when it did, else why not (requests in flight,
        engine stopped)."""
        if not self.is_alive:
            return self._stopped or "the engine is not running"
        call = next(self._batches)
        self._flushes[call] = done = asyncio.get_running_loop().create_future()
        try:
            self._send(FlushCache(call))
            return (await done).error
        finally:
            self._flushes.pop(call, None)

    def abort(self, rid: str) -> None:
        if self._stopped is None:
            self._send(AbortRequest(rid))

    def _unregister(self, rids: list[str]) -> None:
        for rid in rids:
            self._queues.pop(rid, None)

    # ---- messages from the engine (event loop thread) ----

    def _post(self, msg) -> None:
        """Thread safe: hand one engine message to the event loop."""
        loop = self._loop
        if loop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(self._on_message, msg)
            except RuntimeError:  # loop closed between the check and the call
                pass

    def _on_message(self, msg) -> None:
        if isinstance(msg, Progress):
            self.last_stats = msg.stats or self.last_stats
            for out in msg.outputs:
                q = self._queues.get(out.rid)
                if q is not None:
                    q.put_nowait(out)
        elif isinstance(msg, (Added, Flushed)):
            futures, key = (
                (self._adds, msg.batch) if isinstance(msg, Added) else (self._flushes, msg.call)
            )
            future = futures.pop(key, None)
            if future is not None and not future.done():
                future.set_result(msg)
        elif isinstance(msg, Fatal) and self._stopped is None:
            self._engine_gone(f"the server is shutting down: {msg.error}")
            os.kill(os.getpid(), signal.SIGTERM)  # as SGLang's server does when its scheduler dies

    def _engine_gone(self, reason: str) -> None:
        """Nothing more will come from the engine: every waiting add and every open stream ends with
        a 503."""
        self._stopped = self._stopped or reason
        for future in self._adds.values():
            if not future.done():
                future.set_result(Added(0, reason, 503))
        self._adds.clear()
        for future in self._flushes.values():
            if not future.done():
                future.set_result(Flushed(0, reason))
        self._flushes.clear()
        for rid, q in list(self._queues.items()):
            q.put_nowait(abort_output(rid, reason, 503))

    # ---- the transport ----

    def _start_transport(self) -> None:
        raise NotImplementedError

    def _send(self, cmd) -> None:
        raise NotImplementedError

    def _transport_alive(self) -> bool:
        raise NotImplementedError

    def stop(self, timeout: float = 10.0) -> None:
        raise NotImplementedError


def _raise_for(added: Added) -> None:
    if added.error is None:
        return
    if added.status == 400:
        raise RequestError(added.error)
    raise (EngineStopped if added.status == 503 else EngineFailed)(added.error)


class AsyncEngine(EngineClient):
    """The Engine stepped by an EngineLoop in a thread of this process (tests, and anyone embedding
    the app)."""

    def __init__(self, engine):
        super().__init__(EngineInfo.of(engine), engine.tokenizer)
        self.engine = engine
        self._engine_loop = EngineLoop(engine, emit=self._post)
        self._thread: Optional[threading.Thread] = None
        self.last_stats = dict(engine.stats())

    def _start_transport(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(
                target=self._engine_loop.run, name="sparkrelay-engine", daemon=True
            )
            self._thread.start()

    def _send(self, cmd) -> None:
        self._engine_loop.put(cmd)

    def _transport_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self, timeout: float = 10.0) -> None:
        if self._thread is None:
            return
        self._engine_loop.put(Shutdown())
        self._thread.join(timeout)
        self._thread = None
