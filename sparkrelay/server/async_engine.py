"""Runs the synchronous Engine in one dedicated thread and bridges its outputs to asyncio.

    asyncio side (HTTP handlers)                    engine thread (owns Engine; the only caller)
    ----------------------------                    --------------------------------------------
    submit() --_Add(items, Future)--> inbox ------> add_request() each; Future gets None or the RequestError
    OutputStream.close() --_Abort(rid)--> inbox --> abort()
    OutputStream <- asyncio.Queue <- call_soon_threadsafe(_deliver, outputs) <- step()

The thread drains the inbox, steps while the engine has work, and blocks on the inbox when idle
(running `engine.check()` each time it goes idle). An exception from `step()` is logged; every
in-flight request then gets an abort output with status 500 and the thread keeps serving.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import queue
import secrets
import signal
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator, Optional

from sparkrelay.scheduler.request import FAKE_BOOTSTRAP_HOST, Bootstrap, RequestError, RequestOutput, SamplingParams

logger = logging.getLogger(__name__)

IDLE_TICK_S = 1.0


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


@dataclass
class _Add:
    items: list[GenerationItem]
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)


@dataclass
class _Abort:
    rid: str


class _Stop:
    pass


class EngineStopped(RuntimeError):
    """The engine thread has stopped (shutdown, or a fatal pipeline failure): HTTP 503."""


def _abort_output(rid: str, message: str, status_code: int) -> RequestOutput:
    reason = {"type": "abort", "message": message, "status_code": status_code}
    return RequestOutput(rid, [], [], True, reason, 0, "")


class OutputStream:
    """Async iterator over the outputs of a group of engine requests, in arrival order.

    Ends when every request of the group has finished. `close()` aborts the unfinished ones;
    always call it (try/finally) so a client that goes away frees its KV blocks.
    """

    def __init__(self, owner: "AsyncEngine", rids: list[str], outputs: asyncio.Queue):
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


class AsyncEngine:
    """Owns an Engine in a background thread. Start it from the event loop that will consume outputs."""

    def __init__(self, engine):
        self.engine = engine
        self._inbox: queue.Queue = queue.Queue()
        self._queues: dict[str, asyncio.Queue] = {}  # touched only on the event loop thread
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._thread: Optional[threading.Thread] = None
        self._live: set[str] = set()  # touched only on the engine thread
        self.last_stats: dict = dict(engine.stats())  # snapshot replaced by the engine thread
        self.num_step_failures = 0
        self.check_error: Optional[str] = None  # the last idle invariant check's failure, if any

    # ---- lifecycle (event loop side) ----

    async def start(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            return
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="sparkrelay-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        if self._thread is None:
            return
        self._inbox.put(_Stop())
        self.engine.wake()
        self._thread.join(timeout)
        self._thread = None

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # ---- requests (event loop side) ----

    async def submit(self, items: list[GenerationItem]) -> OutputStream:
        """Adds all items atomically (all or none); raises RequestError for a bad request."""
        rids = [it.rid for it in items]
        if len(set(rids)) != len(rids) or any(r in self._queues for r in rids):
            raise RequestError(f"request id already in use: {rids}")
        if not self.is_alive:
            raise EngineStopped("the engine is not running")
        outputs: asyncio.Queue = asyncio.Queue()
        for rid in rids:
            self._queues[rid] = outputs
        stream = OutputStream(self, rids, outputs)
        cmd = _Add(items)
        self._inbox.put(cmd)
        self.engine.wake()  # a decode idling on transfers reads its inbox now, not after its wait
        try:
            await asyncio.wrap_future(cmd.future)
        except BaseException:
            stream.close()  # also covers cancellation while waiting: the add may have happened
            raise
        return stream

    async def generate(self, rid: str, prompt_ids: list[int], params: SamplingParams) -> AsyncIterator[RequestOutput]:
        """Outputs of one request; aborts it in the engine if the consumer stops early or is cancelled."""
        stream = await self.submit([GenerationItem(rid, prompt_ids, params)])
        try:
            async for out in stream:
                yield out
        finally:
            stream.close()

    def abort(self, rid: str) -> None:
        self._inbox.put(_Abort(rid))
        self.engine.wake()

    def _unregister(self, rids: list[str]) -> None:
        for rid in rids:
            self._queues.pop(rid, None)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            q = self._queues.get(out.rid)
            if q is not None:
                q.put_nowait(out)

    # ---- engine thread ----

    def _run(self) -> None:
        was_busy = True
        while True:
            busy = self.engine.has_work()
            if was_busy and not busy:
                self._idle_check()
            was_busy = busy
            if self._fatal():
                return
            for cmd in self._drain(block=not busy):
                if isinstance(cmd, _Stop):
                    self._abort_all("server shutting down", 503)
                    return
                self._apply(cmd)
            if self.engine.has_work():
                self._step()

    def _fatal(self) -> bool:
        """A dead pipeline stage: fail every request in flight, stop this thread (/health turns 503) and ask the
        process to shut down (SIGTERM), as SGLang does when a scheduler rank dies; a PD decode peer then sees the
        prefill's bootstrap server go away and fails its rooms."""
        error = self.engine.fatal_error() if hasattr(self.engine, "fatal_error") else None
        if error is None:
            return False
        logger.critical("the engine cannot continue: %s; shutting the server down", error)
        self._abort_all(f"the server is shutting down: {error}", 503)
        self._refuse_pending(f"the server is shutting down: {error}")
        os.kill(os.getpid(), signal.SIGTERM)
        return True

    def _refuse_pending(self, message: str) -> None:
        """Requests still in the inbox of a thread that stops: their submitters get an error, not a hang."""
        for cmd in self._drain(block=False):
            if isinstance(cmd, _Add) and not cmd.future.done():
                cmd.future.set_exception(EngineStopped(message))

    def _drain(self, block: bool) -> list:
        if block:  # wake up now and then to notice a dead pipeline stage while idle
            try:
                first = [self._inbox.get(timeout=IDLE_TICK_S)]
            except queue.Empty:
                return []
        cmds = first if block else []
        while True:
            try:
                cmds.append(self._inbox.get_nowait())
            except queue.Empty:
                return cmds

    def _apply(self, cmd) -> None:
        if isinstance(cmd, _Abort):
            if cmd.rid in self._live:
                self._live.discard(cmd.rid)
                self.engine.abort(cmd.rid)
        else:
            self._add(cmd)
        self._refresh_stats()

    def _add(self, cmd: _Add) -> None:
        added: list[str] = []
        try:
            for it in cmd.items:
                self.engine.add_request(it.rid, it.prompt_ids, it.params, it.bootstrap)
                added.append(it.rid)
        except Exception as e:  # RequestError -> 400; anything else -> 500, both reported to the caller
            for rid in added:
                self.engine.abort(rid)
            cmd.future.set_exception(e)
            return
        self._live.update(added)
        cmd.future.set_result(None)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as e:
            logger.exception("engine step failed; aborting %d in-flight requests", len(self._live))
            self.num_step_failures += 1
            self._abort_all(f"internal engine error: {type(e).__name__}: {e}", 500)
            time.sleep(0.01)  # a persistently failing engine must not spin the CPU
            return
        for out in outputs:
            if out.finished:
                self._live.discard(out.rid)
        if outputs:
            self._post(outputs)
        self._refresh_stats()

    def _abort_all(self, message: str, status_code: int) -> None:
        outputs = [_abort_output(rid, message, status_code) for rid in sorted(self._live)]
        for rid in list(self._live):
            try:
                self.engine.abort(rid)
            except Exception:
                logger.exception("abort of %s failed", rid)
        self._live.clear()
        self._post(outputs)
        self._refresh_stats()

    def _post(self, outputs: list[RequestOutput]) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(self._deliver, outputs)
            except RuntimeError:  # loop closed between the check and the call
                pass

    def _idle_check(self) -> None:
        """Invariants while idle (no block in use, tables consistent); the last result is in /server_info."""
        try:
            self.engine.check()
            self.check_error = None
        except Exception as e:
            self.check_error = f"{type(e).__name__}: {e}"
            logger.exception("engine invariant check failed while idle")

    def _refresh_stats(self) -> None:
        try:
            self.last_stats = dict(self.engine.stats()) | {"check_error": self.check_error}
        except Exception:
            logger.exception("engine.stats() failed")
