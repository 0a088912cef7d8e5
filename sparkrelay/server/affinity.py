"""Which cores a CPU server's two processes run on (--cpu-affinity auto).

The engine loop's thread is where a decode step's serial work happens (op dispatch, sampling, detokenizing), and
the engine's other OpenMP threads join it only inside parallel regions. The HTTP process wakes once per streamed
token; placed by the kernel, it often lands on the loop thread's core (the waker's) and stalls the step. So:

    engine loop thread  -> the first core this server may use     (pinned once its OpenMP team exists)
    HTTP process        -> the last one                           (every thread, pinned after the fork)

the engine's other OpenMP threads stay free to run anywhere; pinned, a served stream decodes faster (speed notes
of docs/architecture.md). A PD server, a pipeline's stages and a GPU engine are left to the kernel, as is a host
with a single core: PD servers share a host's cores with other engine processes by design
(launch_server.openmp_policy), and a pinned loop thread cannot move off a core a co-located prefill stage is using
(a PD decode pinned so answered later, not sooner). The cores are those the process may use (`taskset`,
cgroups): aggregated servers sharing a host should each be started on their own cores, or with --cpu-affinity
none, since each would take the same two."""

from __future__ import annotations

import logging
import os
from typing import Optional

from sparkrelay.config import Config

logger = logging.getLogger(__name__)


def plan(config: Config) -> Optional[tuple[int, int]]:
    """(the engine loop thread's core, the HTTP process's core), or None where nothing is pinned."""
    if (config.server.cpu_affinity == "none" or config.model.device != "cpu" or config.parallel.pp_size > 1
            or config.disagg.disaggregation_mode != "null"):
        return None
    allowed = sorted(os.sched_getaffinity(0))
    return (allowed[0], allowed[-1]) if len(allowed) >= 2 else None


def pin_engine_thread(core: int) -> None:
    """The calling thread only (Linux: sched_setaffinity of 0 is this thread). Called after the engine's first
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
