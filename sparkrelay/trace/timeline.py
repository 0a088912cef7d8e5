"""Per-request timelines, for latency breakdowns (tools/bench/breakdown.py).

SPARKRELAY_TRACE=DIR makes every process of a deployment (router, servers, pipeline stages) append
one JSON line per event to DIR/<source>-<pid>.jsonl:

    {"t": time.monotonic(), "source": ..., "event": ..., **fields}

time.monotonic() reads CLOCK_MONOTONIC, which every process of a host shares, so one host's files
line up (across hosts they do not). Unset, `mark` costs one environment lookup and writes nothing.
The events:

    source      event        fields          when
    router      in           rooms           a generation request reached the router (rooms drawn)
    router      replied      rooms, side     the prefill's whole reply / the decode's headers came back
    router      first_chunk  rooms           the first byte of the decode's stream went to the client
    <role>      queued       rid, room       Engine.add_request (role: aggregated, prefill or decode)
    <role>      first_token  rid, room       the request's first output left the engine step (prefill: its one
                                             token, once every stage reported its part sent)
    prefill     sampled      rid, room       the prefill sampled the first token
    stage<i>    chunk        step, mb, num_mbs, rooms, tokens, start, end   one micro-batch on pipeline stage i
    stage<i>    send         room            the stage's parts went to its transfer agent
    stage<i>    sent         room, state     the agent reported the room (Success / Failed)
    decode      arrived      room            the engine saw every stage's parts in
    decode      committed    room            the KV and the drafter's context are in place
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import IO

ENV = "SPARKRELAY_TRACE"

_files: dict[tuple[str, str], IO[str]] = {}
_lock = threading.Lock()


def enabled() -> bool:
    return bool(os.environ.get(ENV))


def mark(source: str, event: str, t: float | None = None, **fields) -> None:
    """Append one event (at `t`, default now) when SPARKRELAY_TRACE is set; never raises."""
    directory = os.environ.get(ENV)
    if not directory:
        return
    line = json.dumps(
        {"t": time.monotonic() if t is None else t, "source": source, "event": event, **fields}
    )
    try:
        with _lock:
            f = _files.get((directory, source))
            if f is None:
                os.makedirs(directory, exist_ok=True)
                f = _files[(directory, source)] = open(
                    os.path.join(directory, f"{source}-{os.getpid()}.jsonl"), "a", buffering=1
                )
            f.write(line + "\n")
    except OSError:
        pass  # a trace must never fail a request


def read(directory: str) -> list[dict]:
    """Every event of every file in `directory`, sorted by time."""
    out = []
    for name in sorted(os.listdir(directory)):
        if name.endswith(".jsonl"):
            with open(os.path.join(directory, name)) as f:
                out += [json.loads(line) for line in f if line.strip()]
    return sorted(out, key=lambda e: e["t"])
