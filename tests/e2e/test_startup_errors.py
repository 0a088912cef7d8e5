"""What a user meets when starting a server: --help (groups, defaults, environment variables, docs),
start-up errors that name the flag and exit 2 before the model loads (a port another process holds,
a hub id given as --model-path), /server_info's resolved settings, and the training tools' output
folders."""

from __future__ import annotations

import dataclasses
import os
import socket
import subprocess
import sys
import time

import pytest

from sparkrelay.config import Config
from sparkrelay.envs import ENV_VARS
from sparkrelay.launch_server import main
from sparkrelay.tools.cluster import free_port

MODEL, DRAFTER = "models/tiny-qwen3", "models/tiny-qwen3-dspark"


def run_main(argv: list[str], capsys) -> tuple[int, str]:
    with pytest.raises(SystemExit) as e:
        main(argv)
    return e.value.code, capsys.readouterr()


@pytest.fixture
def no_model_load(monkeypatch):
    """A start-up error must come before the engine (the model) is built."""
    import sparkrelay.engine.engine as de

    def fail(config):
        raise AssertionError("the model was loaded before the start-up error")

    monkeypatch.setattr(de, "build_engine", fail)


@pytest.fixture
def taken_port():
    """A port another process holds (listening on 127.0.0.1)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


# ---------------------------------------------------------------- --help


def test_help_groups_defaults_env_and_docs(capsys):
    code, out = run_main(["--help"], capsys)
    text = out.out
    assert code == 0
    for title in (
        "model:",
        "KV cache:",
        "scheduler:",
        "speculative decoding (DSpark):",
        "pipeline parallelism:",
        "PD disaggregation:",
        "HTTP server:",
    ):
        assert f"\n{title}\n" in text, title
    # every leaf of the config tree is one generated flag, under its section's group
    sections = text.split("\n\n")
    for section in dataclasses.fields(Config):
        title = section.metadata["title"]
        group = next(s for s in sections if s.startswith(f"{title}:"))
        for leaf in dataclasses.fields(section.default_factory()):
            assert f"--{leaf.name.replace('_', '-')}" in group, (title, leaf.name)
    squashed = " ".join(text.split())  # argparse wraps help lines
    for fragment in (
        "--page-size PAGE_SIZE Tokens per KV cache page (block). (default: 16)",
        "(default: 30000)",
        "(default: 127.0.0.1)",
        "(default: hidden)",
        "(default: 8998)",
    ):
        assert fragment in squashed, fragment
    for name, (default, _) in ENV_VARS.items():
        assert name in text and "SGLANG_" + name.removeprefix("SPARKRELAY_") in text, name
    var = "SPARKRELAY_DISAGGREGATION_BOOTSTRAP_TIMEOUT"
    assert f"{var}, SGLANG_{var.removeprefix('SPARKRELAY_')} (default 300.0)" in text
    assert "docs/dspark_pd.md" in text and "docs/reliability.md" in text
    assert "127.0.0.1 only" in squashed  # where the pipeline's sockets listen (--dist-init-port)


# ---------------------------------------------------------------- port clashes


@pytest.mark.parametrize(
    "flags",
    [
        ["--port", "{port}"],
        ["--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", "{port}"],
        ["--pp-size", "2", "--dist-init-port", "{port}"],
    ],
)
def test_port_in_use_exits_2_naming_the_flag_before_loading(
    flags, taken_port, no_model_load, capsys
):
    argv = ["--model-path", MODEL] + [f.format(port=taken_port) for f in flags]
    if "--port" not in flags:
        argv += ["--port", str(free_port())]  # a free HTTP port: only the flag under test clashes
    code, out = run_main(argv, capsys)
    flag = next(f for f in flags if f.endswith("port"))
    assert code == 2
    assert f"error: {flag} {taken_port}: 127.0.0.1:{taken_port} is already in use" in out.err, (
        out.err
    )
    assert f"choose another {flag}" in out.err


def test_one_port_for_two_flags_exits_2(no_model_load, capsys):
    port = free_port()
    code, out = run_main(
        [
            "--model-path",
            MODEL,
            "--port",
            str(port),
            "--disaggregation-mode",
            "prefill",
            "--disaggregation-bootstrap-port",
            str(port),
        ],
        capsys,
    )
    assert code == 2 and f"--disaggregation-bootstrap-port {port} is also --port" in out.err, (
        out.err
    )


def test_unbindable_host_names_the_host_flag(no_model_load, capsys):
    # TEST-NET-1: not on this host
    code, out = run_main(["--model-path", MODEL, "--host", "192.0.2.1"], capsys)
    assert code == 2 and "cannot bind 192.0.2.1:30000" in out.err and "check --host" in out.err, (
        out.err
    )


def test_port_clash_through_the_entry_point_is_fast(taken_port):
    """The real command line: exit 2 with the flag named, in about the time of an import (no model
    load)."""
    start = time.monotonic()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "sparkrelay.launch_server",
            "--model-path",
            MODEL,
            "--port",
            str(taken_port),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert f"--port {taken_port}" in proc.stderr and "already in use" in proc.stderr
    # the format of every bad flag
    assert "usage: python -m sparkrelay.launch_server" in proc.stderr
    assert time.monotonic() - start < 60


def test_real_start_logs_the_url_users_wait_for():
    """The HTTP socket is bound before the model loads and handed to uvicorn, which then logs no URL
    by itself: the server logs README's `Uvicorn running on http://HOST:PORT` line once it
    listens."""
    from sparkrelay.tools.cluster import healthy

    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "sparkrelay.launch_server",
            "--model-path",
            MODEL,
            "--port",
            str(port),
            "--max-total-tokens",
            "2048",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not healthy(f"http://127.0.0.1:{port}"):
            assert proc.poll() is None and time.monotonic() < deadline, "server did not come up"
            time.sleep(0.2)
    finally:
        proc.terminate()
        out = proc.communicate(timeout=30)[0]
    assert f"Uvicorn running on http://127.0.0.1:{port} (Press CTRL+C to quit)" in out, out


# ---------------------------------------------------------------- model folders


@pytest.mark.parametrize(
    "flag,extra",
    [
        ("--model-path", []),
        ("--tokenizer-path", ["--model-path", MODEL]),
        (
            "--speculative-draft-model-path",
            ["--model-path", MODEL, "--speculative-algorithm", "DSPARK"],
        ),
    ],
)
def test_hub_id_says_local_folders_only(flag, extra, no_model_load, capsys):
    code, out = run_main(extra + [flag, "Qwen/Qwen3-0.6B"], capsys)
    assert code == 2
    assert f"{flag} 'Qwen/Qwen3-0.6B' is not a folder" in out.err
    assert "local folders only" in out.err and "no Hugging Face hub downloads" in out.err
    assert "huggingface-cli download Qwen/Qwen3-0.6B --local-dir models/Qwen3-0.6B" in out.err, (
        out.err
    )


# the second: a typo, `models` exists
@pytest.mark.parametrize("path", ["./no/such/folder", "models/tiny-qwen"])
def test_missing_local_folder_gets_no_hub_advice(path, no_model_load, capsys):
    code, out = run_main(["--model-path", path], capsys)
    assert code == 2 and "local folders only" in out.err and "huggingface-cli" not in out.err, (
        out.err
    )
    assert "a folder holding config.json" in out.err


# ---------------------------------------------------------------- /server_info


def server_info(**leaves) -> dict:
    from fastapi.testclient import TestClient

    from sparkrelay.engine.engine import Engine
    from sparkrelay.manager.client import AsyncEngine
    from sparkrelay.server.http_server import build_app

    config = Config().replace(model_path=MODEL, **leaves).validate()
    engine = Engine(config)
    try:
        with TestClient(build_app(AsyncEngine(engine), config)) as c:
            return c.get("/server_info").json()
    finally:
        engine.close()


def test_server_info_shows_resolved_settings():
    info = server_info(max_total_tokens=2048)  # context_length from the model
    assert info["context_length"] == 4096 and info["max_total_tokens"] == 2048
    assert (
        info["dtype"] == "float32"
        and info["tokenizer_path"] == MODEL
        and info["served_model_name"] == MODEL
    )
    assert info["internal_states"][0]["kv_total_tokens"] == 2048

    info = server_info(
        context_length=256, speculative_algorithm="DSPARK", speculative_draft_model_path=DRAFTER
    )
    assert info["context_length"] == 256
    assert info["max_total_tokens"] == 64 * 256  # the documented default: 64 full-context requests
    assert info["speculative_num_draft_tokens"] == 7  # the drafter's block_size
    assert None not in (info["context_length"], info["max_total_tokens"], info["dtype"])


def test_server_info_shows_the_prefix_cache_and_the_handoff_in_force():
    info = server_info(max_total_tokens=2048)
    assert info["disable_radix_cache"] is False  # the prefix cache is on by default
    assert info["internal_states"][0]["prefix_cache"] == "on"
    # the flag's default, resolved (None only tells it was left out)
    assert info["dspark_pd_handoff"] == "hidden"
    info = server_info(max_total_tokens=2048, disable_radix_cache=True)
    assert (
        info["disable_radix_cache"] is True and info["internal_states"][0]["prefix_cache"] == "off"
    )


# ---------------------------------------------------------------- SGLang flags and the DSpark PD
# knobs


def test_disable_radix_cache_turns_the_prefix_cache_off(capsys):
    from sparkrelay.launch_server import parse_config

    assert parse_config(["--model-path", MODEL]).cache.disable_radix_cache is False
    assert (
        parse_config(["--model-path", MODEL, "--disable-radix-cache"]).cache.disable_radix_cache
        is True
    )
    code, out = run_main(["--help"], capsys)
    squashed = " ".join(out.out.split())
    assert code == 0 and "--disable-radix-cache Turn the prefix (radix) cache off" in squashed
    assert "--enable-radix-cache" not in squashed
    assert "--enable-dp-attention" not in squashed  # the refused SGLang flags stay out of --help


@pytest.mark.parametrize(
    "flags,message",
    [
        (
            ["--enable-radix-cache"],
            "error: --enable-radix-cache is an SGLang flag sparkrelay does not implement; "
            "remove it",
        ),
        (
            ["--enable-dp-attention"],
            "error: --enable-dp-attention is an SGLang flag sparkrelay does not implement",
        ),
        (
            ["--tp-size", "2", "--trust-remote-code"],
            "error: --tp-size, --trust-remote-code are SGLang flags sparkrelay "
            "does not implement; remove them",
        ),
    ],
)
def test_sglang_flags_we_do_not_implement_exit_2_named(flags, message, no_model_load, capsys):
    code, out = run_main(["--model-path", MODEL] + flags, capsys)
    assert code == 2 and message in out.err, out.err
    if "--enable-radix-cache" in flags:
        assert "the prefix (radix) cache is on by default" in out.err


def test_a_typo_is_not_called_an_sglang_flag(no_model_load, capsys):
    code, out = run_main(["--model-path", MODEL, "--enable-dp-atention"], capsys)
    assert (
        code == 2
        and "unrecognized arguments: --enable-dp-atention" in out.err
        and "SGLang" not in out.err
    )


@pytest.mark.parametrize(
    "flags,env,message",
    [
        (
            ["--dspark-pd-handoff", "tail"],
            {},
            "--dspark-pd-handoff tail: the prefill has no DSpark taps to hand off; "
            "give it --speculative-draft-model-path",
        ),
        (
            ["--dspark-pd-handoff", "draft-kv"],
            {},
            "--dspark-pd-handoff draft-kv: the prefill has no DSpark taps to hand off; give it",
        ),
        (
            ["--speculative-draft-model-path", DRAFTER, "--dspark-pd-handoff", "tail"],
            {"SGLANG_DSPARK_PD_PREFILL_TAIL_TOKENS": "5000"},
            "SGLANG_DSPARK_PD_PREFILL_TAIL_TOKENS=5000 exceeds the context length 4096",
        ),
        (
            ["--speculative-draft-model-path", DRAFTER],
            {"SGLANG_DSPARK_PD_TARGET_LAYER_IDS": "1 3 5"},
            "SGLANG_DSPARK_PD_TARGET_LAYER_IDS='1 3 5': '1 3 5' is not an integer (separate the items with commas",
        ),
    ],
)
def test_prefill_without_usable_taps_refuses_to_start(flags, env, message):
    """Through the real entry point: the prefill exits with the flag or variable named, before
    serving (it used to start, and every request then failed at the handshake with a 502)."""
    import os

    argv = [
        sys.executable,
        "-m",
        "sparkrelay.launch_server",
        "--model-path",
        MODEL,
        "--port",
        str(free_port()),
        "--disaggregation-mode",
        "prefill",
        "--disaggregation-bootstrap-port",
        str(free_port()),
        *flags,
    ]
    clean = {k: v for k, v in os.environ.items() if "_DSPARK_PD_" not in k}
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120, env={**clean, **env})
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr[-2000:]
    assert "Uvicorn running" not in proc.stderr + proc.stdout


# ---------------------------------------------------------------- training tools


@pytest.mark.parametrize(
    "module,tool,bundled",
    [
        ("target", "train_tiny_target", "models/tiny-qwen3"),
        ("drafter", "train_tiny_dspark", "models/tiny-qwen3-dspark"),
    ],
)
def test_training_tools_do_not_overwrite_bundled_models_by_default(module, tool, bundled):
    import importlib

    mod = importlib.import_module(f"sparkrelay.tools.train.{module}")
    args = mod.parse_args([])
    assert args.out == f".cache/{tool}/model"
    assert mod.parse_args(["--work-dir", "/tmp/w"]).out == "/tmp/w/model"
    assert mod.parse_args(["--out", bundled]).out == bundled  # only when asked


def test_the_api_socket_sends_without_nagle():
    """Accepted connections inherit TCP_NODELAY from the socket `bind` makes (asyncio sets it only
    on sockets whose proto is IPPROTO_TCP; the bootstrap server's socket was not, and answered
    keep-alive requests 44 ms late)."""
    import socket

    from sparkrelay.launch_server import bind

    sock = bind("--port", "--host", "127.0.0.1", 0)
    try:
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
    finally:
        sock.close()


@pytest.mark.parametrize("pp", ["1", "2"])
def test_a_tmpdir_too_long_for_unix_sockets_is_named(pp, tmp_path):
    """The scheduler's command socket (and the pipeline stages' sockets) are ipc:// files under
    TMPDIR; a path too long to bind is a start-up error naming TMPDIR, not ZMQ's "File name too
    long" from deep inside."""
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    port = free_port()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "sparkrelay.launch_server",
            "--model-path",
            MODEL,
            "--port",
            str(port),
            "--pp-size",
            pp,
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "TMPDIR": str(deep)},
    )
    assert proc.returncode != 0
    assert f"TMPDIR={str(deep)!r} is too long for this server's Unix sockets" in proc.stderr, (
        proc.stderr[-2000:]
    )
    assert "set TMPDIR to a shorter folder" in proc.stderr
    assert not any(p.name.startswith("sparkrelay-") for p in deep.iterdir())  # nothing left behind
