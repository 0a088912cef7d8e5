"""launch_server runs its engine in a scheduler process (manager/process.py): either process going
away takes the other one with it, a request in flight then ends with an error instead of hanging,
and nothing is orphaned."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from sparkrelay.tools.cluster import free_port, server_argv, start

SCHED = "sparkrelay-sche"  # /proc/PID/comm keeps 15 bytes of the name the scheduler process gives itself


def _children(pid: int) -> list[int]:
    kids = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        kids += [int(k) for k in (task / "children").read_text().split()]
    return kids


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except OSError:
        return False


def _wait_gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not _alive(pid)


def _serve(model: Path, tmp_path: Path):
    port = free_port()
    server = start(
        "server", server_argv(str(model), port, ["--log-level", "info"]), port, str(tmp_path)
    )
    scheduler = [
        k
        for k in _children(server.proc.pid)
        if Path(f"/proc/{k}/comm").read_text().strip() == SCHED
    ]
    assert len(scheduler) == 1, _children(server.proc.pid)
    return server, scheduler[0]


def test_a_dead_scheduler_process_ends_the_server_and_its_requests(tiny_model_dir, tmp_path):
    server, scheduler = _serve(tiny_model_dir, tmp_path)
    try:
        body = {
            "input_ids": [5, 6, 7],
            "stream": True,
            "sampling_params": {"max_new_tokens": 1000, "temperature": 0, "ignore_eos": True},
        }
        chunks: list[str] = []

        def stream():
            with httpx.stream("POST", server.url + "/generate", json=body, timeout=30) as r:
                chunks.extend(r.iter_lines())

        reader = threading.Thread(target=stream)
        reader.start()
        deadline = time.monotonic() + 20
        # killed once the stream flows, not after a fixed pause: an idle host decodes all 1,000
        # tokens in under 1 s
        while len(chunks) < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        os.kill(scheduler, signal.SIGKILL)
        reader.join(20)
        assert not reader.is_alive(), "the streamed request hung after its engine died"
        assert any("scheduler process exited" in c for c in chunks), chunks[-3:]
        # the HTTP server shut itself down (SGLang does the same)
        assert server.proc.wait(20) is not None
    finally:
        server.kill()


def test_a_dead_http_process_ends_the_scheduler_process(tiny_model_dir, tmp_path):
    server, scheduler = _serve(tiny_model_dir, tmp_path)
    try:
        r = httpx.post(
            server.url + "/generate",
            json={"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2}},
        )
        assert r.status_code == 200, r.text
        os.kill(server.proc.pid, signal.SIGKILL)
        assert _wait_gone(scheduler, 10), "the scheduler process outlived its HTTP server"
        assert server.wait_for_log("the HTTP process (pid")
    finally:
        server.kill()


def test_sigterm_stops_both_processes_cleanly(tiny_model_dir, tmp_path):
    server, scheduler = _serve(tiny_model_dir, tmp_path)
    os.kill(server.proc.pid, signal.SIGTERM)  # only the HTTP process, as a supervisor may do
    assert server.proc.wait(20) in (
        0,
        -signal.SIGTERM,
    )  # uvicorn re-raises the signal once it has shut down
    assert _wait_gone(scheduler, 5)
    assert "Traceback" not in server.log_tail(200), server.log_tail(200)


def test_openmp_policy_lowers_spinning_only_where_processes_share_cores(monkeypatch):
    import sys

    from sparkrelay.config import Config
    from sparkrelay.launch_server import SHARED_CORES_SPIN, openmp_policy

    # as in a fresh launch_server, before torch loads
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    for name in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY"):
        monkeypatch.delenv(name, raising=False)
    # aggregated: libgomp's default
    assert openmp_policy(Config()) is None and "GOMP_SPINCOUNT" not in os.environ
    assert (
        openmp_policy(Config().replace(pp_size=2))
        == SHARED_CORES_SPIN
        == os.environ["GOMP_SPINCOUNT"]
    )
    monkeypatch.setenv("GOMP_SPINCOUNT", "50")
    # the user's value wins
    assert openmp_policy(Config().replace(disaggregation_mode="decode")) is None
    assert os.environ["GOMP_SPINCOUNT"] == "50"
    monkeypatch.delenv("GOMP_SPINCOUNT")
    monkeypatch.setenv("OMP_WAIT_POLICY", "active")
    assert openmp_policy(Config().replace(disaggregation_mode="prefill")) is None


def _cores(pid: int, tid: int) -> set[int]:
    return os.sched_getaffinity(tid) if Path(f"/proc/{pid}/task/{tid}").exists() else set()


def test_cpu_affinity_keeps_the_engine_loop_and_the_http_process_on_their_own_cores(
    tiny_model_dir, tmp_path
):
    """--cpu-affinity auto (the default): the scheduler's main thread (the engine loop) on the first
    core, every thread of the HTTP process on the last, the engine's other threads (OpenMP) free; a
    served request still works."""
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < 2:
        pytest.skip("one core: nothing is pinned")
    server, scheduler = _serve(tiny_model_dir, tmp_path)
    try:
        r = httpx.post(
            server.url + "/generate",
            json={"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 4}},
        )
        assert r.status_code == 200, r.text
        http_threads = [int(t) for t in os.listdir(f"/proc/{server.proc.pid}/task")]
        assert all(_cores(server.proc.pid, t) in ({allowed[-1]}, set()) for t in http_threads)
        assert os.sched_getaffinity(scheduler) == {
            allowed[0]
        }  # a process's pid is its main thread's id
        others = [int(t) for t in os.listdir(f"/proc/{scheduler}/task") if int(t) != scheduler]
        # OpenMP's worker, the inbox thread
        assert any(_cores(scheduler, t) == set(allowed) for t in others)
        assert server.wait_for_log("the engine loop runs on core") and server.wait_for_log(
            "the HTTP server runs on core"
        )
    finally:
        server.stop()


def test_cpu_affinity_plan_pins_only_an_aggregated_cpu_server_with_two_cores_or_more(monkeypatch):
    from sparkrelay.config import Config
    from sparkrelay.host import plan

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {3, 1, 2})
    assert plan(Config()) == (1, 3)
    assert plan(Config().replace(cpu_affinity="none")) is None
    assert plan(Config().replace(pp_size=2)) is None
    assert plan(Config().replace(disaggregation_mode="decode")) is None
    assert plan(Config().replace(device="cuda")) is None
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {5})
    assert plan(Config()) is None
