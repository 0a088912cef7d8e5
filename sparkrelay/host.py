"""What a server process asks of its host: memory (the heap handed back to the OS, freed activations
reused), cores (which ones the engine loop and the HTTP process run on) and the private folder of
its Unix sockets. One module, so every process-level setting of the host is found in one place.

## Memory

Hand the heap memory a process has freed back to the OS, between units of work, at most every
TRIM_EVERY_S.

glibc's malloc keeps freed memory in its arenas and returns to the OS only the free top of each; the
pages of free chunks below a live one stay resident. A prefill stage allocates prompt-sized buffers
of every size (activations, the handoff's rows, their wire copies), and its resident memory grew
steadily under the soak although nothing
leaked: `malloc_trim(0)`, called in the running stage from a debugger, gave much of its heap back
(speed notes of docs/architecture.md). `malloc_trim(0)` also releases the free pages inside the heap
(madvise), so calling it now and then keeps the resident size flat. It runs on the thread that
allocates, between micro-batches or engine steps, so it waits on no lock held by a forward. Not
glibc (no `malloc_trim`): a no-op.

`reuse_freed_memory` is the other half: by default glibc serves a block of 128 KiB and up (its
threshold grows, at most to 32 MiB, with the blocks freed) by mmap and gives it back at free(), and
gives back the free top of the heap past 128 KiB, so each forward's activations, freed and allocated
again by the next layer and the next forward, come back as fresh pages that fault in one by one.
With blocks up to 32 MiB from the heap and 256 MiB of free top kept (the trimmer above still hands
it all back every TRIM_EVERY_S), the pages are reused and the forward is faster (speed notes of
docs/architecture.md). A user's MALLOC_MMAP_THRESHOLD_ or MALLOC_TRIM_THRESHOLD_ wins.

## Cores (--cpu-affinity auto)

Which cores a CPU server's two processes run on (--cpu-affinity auto).

The engine loop's thread is where a decode step's serial work happens (op dispatch, sampling,
detokenizing), and the engine's other OpenMP threads join it only inside parallel regions. The HTTP
process wakes once per streamed token; placed by the kernel, it often lands on the loop thread's
core (the waker's) and stalls the step. So:

    engine loop thread  -> the first core this server may use     (pinned once its OpenMP team exists)
    HTTP process        -> the last one                           (every thread, pinned after the fork)

the engine's other OpenMP threads stay free to run anywhere; pinned, a served stream decodes faster
(speed notes of docs/architecture.md). A PD server, a pipeline's stages and a GPU engine are left to
the kernel, as is a host with a single core: PD servers share a host's cores with other engine
processes by design (launch_server.openmp_policy), and a pinned loop thread cannot move off a core a
co-located prefill stage is using (a PD decode pinned so answered later, not sooner). The cores are
those the process may use (`taskset`, cgroups): aggregated servers sharing a host should each be
started on their own cores, or with --cpu-affinity none, since each would take the same two.
"""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
import tempfile
import time
from typing import Callable, Optional

from sparkrelay.config import Config, ConfigError

logger = logging.getLogger(__name__)

# ---- memory --------------------------------------------------------------------------------------

TRIM_EVERY_S = 2.0
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt's parameters (malloc.h)
MMAP_THRESHOLD = 32 << 20  # glibc's largest: smaller blocks come from the heap and are reused
TRIM_THRESHOLD = 256 << 20  # free memory at the top of the heap that free() keeps
USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")


def reuse_freed_memory() -> bool:
    """Keep freed activation memory in the heap for the next forward (module docstring), for this
    process; True if set (False: not glibc, or the user set glibc's variables)."""
    if any(v in os.environ for v in USER_SETTINGS):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
        mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    )


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


# ---- cores ---------------------------------------------------------------------------------------


def plan(config: Config) -> Optional[tuple[int, int]]:
    """(the engine loop thread's core, the HTTP process's core), or None where nothing is pinned."""
    if (
        config.server.cpu_affinity == "none"
        or config.model.device != "cpu"
        or config.parallel.pp_size > 1
        or config.disagg.disaggregation_mode != "null"
    ):
        return None
    allowed = sorted(os.sched_getaffinity(0))
    return (allowed[0], allowed[-1]) if len(allowed) >= 2 else None


def pin_engine_thread(core: int) -> None:
    """The calling thread only (Linux: sched_setaffinity of 0 is this thread). Called after the
    engine's first
    forward: OpenMP threads made later by this thread would inherit the single core."""
    os.sched_setaffinity(0, {core})
    logger.info("the engine loop runs on core %d (--cpu-affinity)", core)


def pin_process(core: int) -> None:
    """Every thread of this process, and those it starts later (they inherit the creator's mask)."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), {core})
        except ProcessLookupError:  # a thread that ended meanwhile
            pass
    logger.info("the HTTP server runs on core %d (--cpu-affinity)", core)


# ---- sockets -------------------------------------------------------------------------------------

SOCKET_PATH_MAX = 107  # bytes of a Unix socket's path (sun_path is 108 with its terminating NUL)


def socket_folder(prefix: str, longest_name: str) -> str:
    """A new private (0700) folder under TMPDIR for Unix sockets (ZMQ ipc://) named at most like
    `longest_name`, its name holding this process's pid; a ConfigError naming TMPDIR when such a
    socket's path would be too long to bind. The folders of `prefix` whose process is gone are
    removed first: a server killed by SIGKILL never reaches its own cleanup."""
    remove_orphan_folders(prefix)
    folder = tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-")
    path = os.path.join(folder, longest_name)
    if len(path.encode()) > SOCKET_PATH_MAX:
        shutil.rmtree(folder, ignore_errors=True)
        raise ConfigError(
            f"TMPDIR={tempfile.gettempdir()!r} is too long for this server's Unix sockets: {path!r} "
            f"has {len(path.encode())} bytes, the limit is {SOCKET_PATH_MAX}; set TMPDIR to a "
            "shorter folder (e.g. /tmp)"
        )
    return folder


def remove_orphan_folders(prefix: str) -> list[str]:
    """Remove this user's `{prefix}{pid}-*` folders under TMPDIR whose pid no longer runs -> their
    paths. A reused pid only keeps a stale folder a while longer; a live server's is never taken."""
    root, removed = tempfile.gettempdir(), []
    for name in os.listdir(root):
        pid = name[len(prefix) :].split("-", 1)[0]
        path = os.path.join(root, name)
        if not (name.startswith(prefix) and pid.isdigit()) or pid_alive(int(pid)):
            continue
        try:
            if os.stat(path).st_uid == os.getuid():
                shutil.rmtree(path)
                removed.append(path)
        except OSError:  # gone meanwhile (another server swept it) or not ours to remove
            pass
    return removed


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True
