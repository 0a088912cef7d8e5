"""What PD refuses, through the real servers: a prefill and a decode whose handshake schemas differ
(the first request's error names the field and both values, and both servers log it), and a decode
with PP > 1 and DSpark (it refuses to start). Faults in a running deployment are in
test_pd_faults.py."""

from __future__ import annotations

import subprocess
import time

import pytest

from sparkrelay.tools.cluster import PDSettings, free_port, server_argv, start_pd
from testkit.pd import DRAFTER, MODEL, generate

PROMPT = list(range(300, 340))


def _mismatch(tmp_path, field: str, **settings) -> None:
    cluster = start_pd(
        PDSettings(model=MODEL, drafter=DRAFTER, router="sparkrelay", **settings), str(tmp_path)
    )
    try:
        status, out = generate(cluster.url, PROMPT, retries_until=time.monotonic() + 30)
        assert status >= 400, out
        message = out["error"]["message"]
        assert "schema mismatch" in message and field in message, message
        assert "prefill=" in message and "decode=" in message, message
        for server in (
            cluster.prefill,
            cluster.decode,
        ):  # logged on both sides (the prefill's on the ABORT)
            assert server.wait_for_log("schema mismatch"), (server.name, server.log_tail(200))
    finally:
        cluster.stop()


def test_mismatched_tail_length(tmp_path):
    _mismatch(
        tmp_path,
        "tail_tokens",
        handoff="tail",
        pp_size=1,
        prefill_env={"SPARKRELAY_DSPARK_PD_PREFILL_TAIL_TOKENS": "8"},
        decode_env={"SGLANG_DSPARK_PD_PREFILL_TAIL_TOKENS": "4"},
    )  # the SGLang alias is read too


@pytest.mark.slow
def test_mismatched_layer_ids(tmp_path):
    _mismatch(
        tmp_path,
        "target_layer_ids",
        handoff="hidden",
        pp_size=2,
        prefill_env={"SPARKRELAY_DSPARK_PD_TARGET_LAYER_IDS": "1,3,5"},
    )


@pytest.mark.slow
def test_mismatched_handoff_mode(tmp_path):
    _mismatch(
        tmp_path,
        "handoff",
        handoff="hidden",
        pp_size=1,
        prefill_args=["--dspark-pd-handoff", "tail"],
    )


@pytest.mark.slow  # ~22 s; the other mismatches (handoff, tail length) stay in the default run
def test_mismatched_transfer_backend(tmp_path):
    """Mooncake on the prefill, NIXL on the decode: refused before a byte moves, the message names
    both."""
    _mismatch(
        tmp_path,
        "transfer_backend: prefill='mooncake' decode='nixl'",
        prefill_args=["--disaggregation-transfer-backend", "mooncake"],
        decode_args=["--disaggregation-transfer-backend", "nixl"],
    )


def test_decode_pp2_with_dspark_refuses_to_start():
    argv = server_argv(
        MODEL,
        free_port(),
        [
            "--disaggregation-mode",
            "decode",
            "--pp-size",
            "2",
            "--speculative-algorithm",
            "DSPARK",
            "--speculative-draft-model-path",
            DRAFTER,
        ],
    )
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "--pp-size 2" in proc.stderr and "DSpark" in proc.stderr, proc.stderr


@pytest.mark.slow
def test_mismatched_grammar_backend(tmp_path):
    """The prefill samples a constrained request's first token under its grammar backend, the decode
    the rest under its own: two backends (or versions) are refused before a byte moves."""
    _mismatch(
        tmp_path,
        "grammar: prefill='llguidance==",
        pp_size=1,
        decode_args=["--grammar-backend", "xgrammar"],
    )
