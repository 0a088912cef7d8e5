"""What the soak reads from the running deployment: each process's memory, threads and fds (from
/proc), the servers' internal states until they drain, and the warning and error lines of their
logs."""

from __future__ import annotations

import os
import re
import time
from typing import Optional

import httpx

from sparkrelay.tools.cluster import PDCluster


def _children(pid: int) -> list[int]:
    kids = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                kids += [int(x) for x in f.read().split()]
    except OSError:
        pass
    return kids


def _proc_status(pid: int) -> Optional[dict]:
    try:
        with open(f"/proc/{pid}/status") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None
    if "VmRSS" not in fields:  # a zombie: it exited and its parent has not reaped it yet
        return None
    return {
        "rss_kib": int(fields["VmRSS"].split()[0]),
        "threads": int(fields["Threads"]),
        "fds": fds,
    }


def _label(server: str, pid: int, root: int) -> str:
    if pid == root:
        return server
    try:
        argv = open(f"/proc/{pid}/cmdline").read().split("\0")
    except OSError:
        argv = []
    if "--rank" in argv[:-1]:
        return f"{server}/stage{argv[argv.index('--rank') + 1]}"
    try:
        comm = open(f"/proc/{pid}/comm").read().strip()
    except OSError:
        comm = ""
    return f"{server}/scheduler" if comm.startswith("sparkrelay-sch") else f"{server}/child{pid}"


def snapshot(cluster: PDCluster) -> dict[str, dict]:
    """{label: {rss_kib, threads, fds}} for every server process and all its descendants."""
    out = {}
    for s in cluster.servers():
        todo = [s.proc.pid]
        while todo:
            pid = todo.pop()
            st = _proc_status(pid)
            if st is not None:
                out[_label(s.name, pid, s.proc.pid)] = st
            todo += _children(pid)
    return out


def server_state(url: str) -> dict:
    try:
        with httpx.Client(timeout=10, trust_env=False) as c:
            return c.get(url + "/server_info").json()["internal_states"][0]
    except (httpx.HTTPError, ValueError, KeyError, IndexError) as e:
        return {"error": f"{type(e).__name__}: {e}"}


def drain(cluster: PDCluster, timeout: float = 60.0) -> dict[str, dict]:
    """Poll prefill and decode until idle with no KV in use (or `timeout`); their final internal
    states."""
    busy = (
        "num_running",
        "num_waiting",
        "kv_used_tokens",
        "num_transfers_inflight",
        "num_prealloc",
    )
    end = time.monotonic() + timeout
    while True:
        states = {s.name: server_state(s.url) for s in (cluster.prefill, cluster.decode)}
        if (
            all(not any(st.get(k, 0) for k in busy) and "error" not in st for st in states.values())
            or time.monotonic() > end
        ):
            return states
        time.sleep(0.5)


def log_findings(cluster: PDCluster, keep: int = 8) -> dict[str, dict]:
    pat = re.compile(r"ERROR|CRITICAL|Traceback|WARNING|Exception|exception")
    out = {}
    for s in cluster.servers():
        try:
            lines = [ln.rstrip() for ln in open(s.log_path, errors="replace") if pat.search(ln)]
        except OSError:
            lines = []
        out[s.name] = {"matching_lines": len(lines), "examples": list(dict.fromkeys(lines))[:keep]}
    return out


def print_log_tails(cluster: PDCluster) -> None:
    for s in cluster.servers():
        print(f"---- {s.name} log tail ({s.log_path}, kept) ----\n{s.log_tail(30)}", flush=True)
