"""The loop that owns an Engine: the only caller of its methods, on one thread (the scheduler
process's main thread, or the in-process engine thread), fed by typed commands and reporting typed
events (messages.py).

    put(AddItems | AbortRequest | FlushCache | Shutdown)  (any thread) -> inbox, Engine.wake()
    run():  drain the inbox -> add_request / abort / flush_cache -> step() while there is work
            -> emit(Added | Flushed | Progress | Fatal)

It blocks on the inbox when idle (running `engine.check()` once it has been idle for
IDLE_CHECK_AFTER_S); between steps it hands the freed heap back to the OS now and then (host.py). An
exception from `step()` is logged; every in-flight request then gets an abort output with status 500
and the loop keeps serving.
"""

from __future__ import annotations

import logging
import queue
import time
from typing import Callable, Optional

from sparkrelay.host import HeapTrimmer
from sparkrelay.manager.messages import (
    AbortRequest,
    Added,
    AddItems,
    Fatal,
    FlushCache,
    Flushed,
    Progress,
    Shutdown,
)
from sparkrelay.scheduler.request import RequestError, RequestOutput

logger = logging.getLogger(__name__)

IDLE_TICK_S = 1.0  # an idle loop wakes this often to notice a dead pipeline stage
# The idle invariant check runs once the loop has had nothing to do for this long, not the moment it
# goes idle: run at once it took a core exactly while the request that had just left the engine was
# still on its way (a PD prefill goes idle while its decode commits the first token).
IDLE_CHECK_AFTER_S = 0.1
STATS_EVERY_S = 0.05


def abort_output(rid: str, message: str, status_code: int) -> RequestOutput:
    reason = {"type": "abort", "message": message, "status_code": status_code}
    return RequestOutput(rid, [], [], True, reason, 0, "")


class EngineLoop:
    def __init__(self, engine, emit: Callable[[object], None]):
        self.engine = engine
        self._emit = emit  # called on the loop's thread only
        self._inbox: queue.Queue = queue.Queue()
        self._live: set[str] = set()
        self.num_step_failures = 0
        self._heap = HeapTrimmer()
        self.check_error: Optional[str] = None  # the last idle invariant check's failure, if any
        self._stats_at = 0.0

    def put(self, cmd) -> None:
        """Thread safe: queue a command and end the engine's idle wait."""
        self._inbox.put(cmd)
        self.engine.wake()

    def run(self) -> None:
        """Serve commands until Shutdown (every live request then gets a 503 abort) or a fatal
        engine error."""
        self._emit(Progress((), self._stats()))
        check_due = True
        while True:
            busy = self.engine.has_work()
            check_due = check_due or busy
            if self._fatal():
                return
            cmds = self._drain(
                block=not busy, timeout=IDLE_CHECK_AFTER_S if check_due else IDLE_TICK_S
            )
            if check_due and not busy and not cmds:
                self._idle_check()
                check_due = False
            for cmd in cmds:
                if isinstance(cmd, Shutdown):
                    self._abort_all(cmd.reason, 503)
                    return
                self._apply(cmd)
            if self.engine.has_work():
                self._step()
                self._heap.maybe_trim()

    def _fatal(self) -> bool:
        """A dead pipeline stage: fail every request in flight and report Fatal; the server then
        shuts down, as SGLang's does when a scheduler rank dies (a PD decode peer sees the prefill's
        bootstrap server go away)."""
        error = self.engine.fatal_error() if hasattr(self.engine, "fatal_error") else None
        if error is None:
            return False
        logger.critical("the engine cannot continue: %s; shutting the server down", error)
        self._abort_all(f"the server is shutting down: {error}", 503)
        for cmd in self._drain(block=False):  # queued adds get an answer, not a hang
            if isinstance(cmd, AddItems):
                self._emit(Added(cmd.batch, f"the server is shutting down: {error}", 503))
        self._emit(Fatal(error))
        return True

    def _drain(self, block: bool, timeout: float = IDLE_TICK_S) -> list:
        cmds = []
        if block:
            try:
                cmds.append(self._inbox.get(timeout=timeout))
            except queue.Empty:
                return []
        while True:
            try:
                cmds.append(self._inbox.get_nowait())
            except queue.Empty:
                return cmds

    def _apply(self, cmd) -> None:
        if isinstance(cmd, AbortRequest):
            if cmd.rid in self._live:
                self._live.discard(cmd.rid)
                self.engine.abort(cmd.rid)
        elif isinstance(cmd, FlushCache):
            self._emit(self._flush(cmd))
        else:
            self._emit(self._add(cmd))
        self._emit(Progress((), self._stats()))

    def _add(self, cmd: AddItems) -> Added:
        added: list[str] = []
        try:
            for it in cmd.items:
                self.engine.add_request(it.rid, it.prompt_ids, it.params, it.bootstrap)
                added.append(it.rid)
        # RequestError -> 400; anything else -> 500, both reported to the caller
        except Exception as e:
            for rid in added:
                self.engine.abort(rid)
            if isinstance(e, RequestError):
                return Added(cmd.batch, str(e), 400)
            logger.exception("adding requests failed")
            return Added(cmd.batch, f"internal error: {type(e).__name__}: {e}", 500)
        self._live.update(added)
        return Added(cmd.batch)

    def _flush(self, cmd: FlushCache) -> Flushed:
        try:
            if self.engine.flush_cache():
                logger.info("the prefix cache was flushed")
                return Flushed(cmd.call)
            return Flushed(
                cmd.call,
                "requests are running or waiting: the cache was not flushed (retry when idle)",
            )
        except Exception as e:
            logger.exception("flushing the prefix cache failed")
            return Flushed(cmd.call, f"internal error: {type(e).__name__}: {e}")

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as e:
            logger.exception("engine step failed; aborting %d in-flight requests", len(self._live))
            self.num_step_failures += 1
            fatal = self.engine.fatal_error() if hasattr(self.engine, "fatal_error") else None
            if (
                fatal is not None
            ):  # the pipeline is down: the server is going away, not broken by this batch
                self._abort_all(f"the server is shutting down: {fatal}", 503)
            else:
                self._abort_all(f"internal engine error: {type(e).__name__}: {e}", 500)
            time.sleep(0.01)  # a persistently failing engine must not spin the CPU
            return
        finished = False
        for out in outputs:
            if out.finished:
                self._live.discard(out.rid)
                finished = True
        stats = self._stats() if finished or self._stats_due() else {}
        if outputs or stats:
            self._emit(Progress(tuple(outputs), stats))

    def _stats_due(self) -> bool:
        """Stats go out when the engine goes idle, and at most every STATS_EVERY_S while it is busy
        (they cost the engine thread a dict per step, and a frame across the process boundary)."""
        return not self.engine.has_work() or time.monotonic() - self._stats_at >= STATS_EVERY_S

    def _abort_all(self, message: str, status_code: int) -> None:
        outputs = [abort_output(rid, message, status_code) for rid in sorted(self._live)]
        for rid in list(self._live):
            try:
                self.engine.abort(rid)
            except Exception:
                logger.exception("abort of %s failed", rid)
        self._live.clear()
        self._emit(Progress(tuple(outputs), self._stats()))

    def _idle_check(self) -> None:
        """Invariants while idle (no block in use, tables consistent); the result goes out with the
        stats (and so to /server_info)."""
        try:
            self.engine.check()
            self.check_error = None
        except Exception as e:
            self.check_error = f"{type(e).__name__}: {e}"
            logger.exception("engine invariant check failed while idle")
        self._emit(Progress((), self._stats()))

    def _stats(self) -> dict:
        self._stats_at = time.monotonic()
        try:
            stats = dict(self.engine.stats())
        except Exception:
            logger.exception("engine.stats() failed")
            stats = {}
        return stats | {
            "check_error": self.check_error,
            "num_step_failures": self.num_step_failures,
        }
