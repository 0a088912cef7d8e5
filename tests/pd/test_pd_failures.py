"""PD failures through the real servers: schema mismatches name the field, decode PP > 1 with DSpark refuses to
start, and a killed prefill fails its in-flight requests within the timeout while decode keeps serving others."""

from __future__ import annotations

import concurrent.futures
import random
import subprocess
import sys
import time

import pytest

from sparkrelay.tools.cluster import PDSettings, free_port, server_argv, start, start_pd
from testkit.pd import DRAFTER, MODEL, generate, post

PROMPT = list(range(300, 340))


def _mismatch(tmp_path, field: str, **settings) -> None:
    cluster = start_pd(PDSettings(model=MODEL, drafter=DRAFTER, router="sparkrelay", **settings), str(tmp_path))
    try:
        status, out = generate(cluster.url, PROMPT, retries_until=time.monotonic() + 30)
        assert status >= 400, out
        message = out["error"]["message"]
        assert "schema mismatch" in message and field in message, message
        assert "prefill=" in message and "decode=" in message, message
        for server in (cluster.prefill, cluster.decode):  # logged on both sides (the prefill's on the ABORT)
            assert server.wait_for_log("schema mismatch"), (server.name, server.log_tail(200))
    finally:
        cluster.stop()


def test_mismatched_tail_length(tmp_path):
    _mismatch(tmp_path, "tail_tokens", handoff="tail", pp_size=1,
              prefill_env={"SPARKRELAY_DSPARK_PD_PREFILL_TAIL_TOKENS": "8"},
              decode_env={"SGLANG_DSPARK_PD_PREFILL_TAIL_TOKENS": "4"})  # the SGLang alias is read too


@pytest.mark.slow
def test_mismatched_layer_ids(tmp_path):
    _mismatch(tmp_path, "target_layer_ids", handoff="hidden", pp_size=2,
              prefill_env={"SPARKRELAY_DSPARK_PD_TARGET_LAYER_IDS": "1,3,5"})


@pytest.mark.slow
def test_mismatched_handoff_mode(tmp_path):
    _mismatch(tmp_path, "handoff", handoff="hidden", pp_size=1, prefill_args=["--dspark-pd-handoff", "tail"])


@pytest.mark.slow  # ~22 s; the other mismatches (handoff, tail length) stay in the default run
def test_mismatched_transfer_backend(tmp_path):
    """Mooncake on the prefill, NIXL on the decode: refused before a byte moves, the message names both."""
    _mismatch(tmp_path, "transfer_backend: prefill='mooncake' decode='nixl'",
              prefill_args=["--disaggregation-transfer-backend", "mooncake"],
              decode_args=["--disaggregation-transfer-backend", "nixl"])


def test_decode_pp2_with_dspark_refuses_to_start():
    argv = server_argv(MODEL, free_port(), ["--disaggregation-mode", "decode", "--pp-size", "2",
                                            "--speculative-algorithm", "DSPARK", "--speculative-draft-model-path",
                                            DRAFTER])
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "--pp-size 2" in proc.stderr and "DSpark" in proc.stderr, proc.stderr


def test_killed_prefill_fails_its_requests_decode_keeps_serving(tmp_path):
    """Prefill A is killed while decode waits for A's KV; a second prefill B keeps serving through the same
    decode. Heartbeats (0.5 s x 2) fail A's rooms long before the 300 s waiting timeout."""
    env = {"SPARKRELAY_DISAGGREGATION_HEARTBEAT_INTERVAL": "0.5", "SPARKRELAY_DISAGGREGATION_HEARTBEAT_MAX_FAILURE": "2"}
    a = start_pd(PDSettings(model=MODEL, drafter=DRAFTER, pp_size=2, router="none", env=env), str(tmp_path))
    b_boot, b_port = free_port(), free_port()
    b = start("prefill-b", server_argv(MODEL, b_port, [
        "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", str(b_boot),
        "--speculative-draft-model-path", DRAFTER]), b_port, str(tmp_path), env)
    try:
        room = random.randrange(1, 1 << 63)
        stuck = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 8, "temperature": 0.0},
                 "bootstrap_host": "127.0.0.1", "bootstrap_port": a.bootstrap_port, "bootstrap_room": room}
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            waiting = pool.submit(post, a.decode.url + "/generate", stuck)  # decode only: its KV never comes
            time.sleep(1.0)
            a.prefill.kill()
            killed_at = time.monotonic()
            status, out = waiting.result(timeout=30)
            assert status >= 500 and "lost connection with prefill" in out["error"]["message"], out
            assert time.monotonic() - killed_at < 10
            for i in range(3):  # decode still serves requests whose prefill is alive
                body = {"input_ids": PROMPT[i:], "sampling_params": {"max_new_tokens": 8, "temperature": 0.0},
                        "bootstrap_host": "127.0.0.1", "bootstrap_port": b_boot,
                        "bootstrap_room": random.randrange(1, 1 << 63)}
                both = [pool.submit(post, b.url + "/generate", body), pool.submit(post, a.decode.url + "/generate", body)]
                (ps, _), (ds, dout) = [f.result(timeout=60) for f in both]
                assert ps == 200 and ds == 200 and len(dout["output_ids"]) == 8, dout
        status, info = post(a.decode.url + "/generate", {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 1}})
        assert status == 400 and "bootstrap" in info["error"]["message"]  # a decode server needs the router's fields
    finally:
        b.stop()
        a.stop()


def _kv_used(url: str) -> int:
    import json
    import urllib.request

    with urllib.request.urlopen(url + "/server_info", timeout=10) as r:
        return json.loads(r.read())["internal_states"][0]["kv_used_tokens"]


@pytest.mark.slow  # ~19 s: waits out the transfer timeout on both sides
def test_peer_never_shows_up_fails_after_timeout_and_frees_blocks(tmp_path):
    """A prefill request whose decode never comes, and a decode request whose prefill never gets it, both fail
    with a message naming the timeout, and both servers end with no KV block in use."""
    env = {"SPARKRELAY_DISAGGREGATION_BOOTSTRAP_TIMEOUT": "2", "SPARKRELAY_DISAGGREGATION_WAITING_TIMEOUT": "4"}
    c = start_pd(PDSettings(model=MODEL, drafter=DRAFTER, pp_size=2, router="none", env=env), str(tmp_path))
    try:
        body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 4, "temperature": 0.0},
                "bootstrap_host": "127.0.0.1", "bootstrap_port": c.bootstrap_port}
        t0 = time.monotonic()
        status, out = post(c.prefill.url + "/generate", body | {"bootstrap_room": random.randrange(1, 1 << 63)})
        assert status >= 500 and "BOOTSTRAP_TIMEOUT" in out["error"]["message"], out
        assert 1.5 < time.monotonic() - t0 < 15
        t0 = time.monotonic()
        status, out = post(c.decode.url + "/generate", body | {"bootstrap_room": random.randrange(1, 1 << 63)})
        assert status >= 500 and "TIMEOUT" in out["error"]["message"], out
        assert time.monotonic() - t0 < 15
        assert _kv_used(c.prefill.url) == 0 and _kv_used(c.decode.url) == 0
    finally:
        c.stop()
