"""Hand the heap memory a process has freed back to the OS, between units of work, at most every TRIM_EVERY_S.

glibc's malloc keeps freed memory in its arenas and returns to the OS only the free top of each; the pages of free
chunks below a live one stay resident. A prefill stage allocates prompt-sized buffers of every size (activations,
the handoff's rows, their wire copies), and its resident memory grew steadily under the soak although nothing
leaked: `malloc_trim(0)`, called in the running stage from a debugger, gave much of its heap back (speed notes of
docs/architecture.md). `malloc_trim(0)` also releases the free pages inside the heap (madvise), so calling it now
and then keeps the resident size flat. It runs on the thread that allocates, between micro-batches or engine
steps, so it waits on no lock held by a forward. Not glibc (no `malloc_trim`): a no-op.

`reuse_freed_memory` is the other half: by default glibc serves a block of 128 KiB and up (its threshold grows, at
most to 32 MiB, with the blocks freed) by mmap and gives it back at free(), and gives back the free top of the
heap past 128 KiB, so each forward's activations, freed and allocated again by the next layer and the next forward,
come back as fresh pages that fault in one by one. With blocks up to 32 MiB
from the heap and 256 MiB of free top kept (the trimmer above still hands it all back every TRIM_EVERY_S), the
pages are reused and the forward is faster (speed notes of docs/architecture.md). A user's MALLOC_MMAP_THRESHOLD_
or MALLOC_TRIM_THRESHOLD_ wins.
"""

from __future__ import annotations

import ctypes
import os
import time
from typing import Callable, Optional

TRIM_EVERY_S = 2.0
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt's parameters (malloc.h)
MMAP_THRESHOLD = 32 << 20   # glibc's largest: smaller blocks come from the heap and are reused
TRIM_THRESHOLD = 256 << 20  # free memory at the top of the heap that free() keeps
USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")


def reuse_freed_memory() -> bool:
    """Keep freed activation memory in the heap for the next forward (module docstring), for this process; True if
    set (False: not glibc, or the user set glibc's variables)."""
    if any(v in os.environ for v in USER_SETTINGS):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))


def _malloc_trim() -> Optional[Callable[[int], int]]:
    try:
        fn = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
    return fn


class HeapTrimmer:
    def __init__(self, every_s: float = TRIM_EVERY_S) -> None:
        self._trim = _malloc_trim()
        self.every_s = every_s
        self._at = time.monotonic()
        self.count, self.seconds = 0, 0.0  # trims done, time spent in them

    @property
    def available(self) -> bool:
        return self._trim is not None

    def maybe_trim(self) -> bool:
        """Trim if the last trim is at least every_s old; True if it did."""
        now = time.monotonic()
        if self._trim is None or now - self._at < self.every_s:
            return False
        self._trim(0)
        self._at = time.monotonic()
        self.count += 1
        self.seconds += self._at - now
        return True
