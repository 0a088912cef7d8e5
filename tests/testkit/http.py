"""Shared fixtures for the HTTP tests: a tiny random Qwen3 checkpoint, an engine, and a served app.

The engine is the real `sparkrelay.engine.engine.Engine` when it can be imported, else `FakeEngine`
below, which follows the same contract (set SPARKRELAY_FAKE_ENGINE=1 to force the fake).
The fixtures built on these (tiny_model_dir, served, client) are in tests/conftest.py.
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import threading
import time
from pathlib import Path

from sparkrelay.config import Config
from sparkrelay.scheduler.request import RequestError, RequestOutput, SamplingParams
from sparkrelay.tools.cluster import free_port  # noqa: F401  (one source of ports: never the same twice)

REPO = Path(__file__).resolve().parents[2]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
CONTEXT_LENGTH = 256
MAX_N = 4


def _tokenizer_source() -> Path:
    for d in (REPO / "models" / "tiny-qwen3", REPO / ".cache" / "train_tiny_target" / "tokenizer"):
        if all((d / f).exists() for f in TOKENIZER_FILES):
            return d
    raise FileNotFoundError(
        "no tokenizer files in models/tiny-qwen3 or .cache/train_tiny_target/tokenizer"
    )


def build_tiny_model(out_dir: Path, max_positions: int = 1024) -> Path:
    """A 2-layer random Qwen3 (seed 0) with the bundled tokenizer, written to out_dir."""
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(
        vocab_size=4096,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        tie_word_embeddings=True,
        max_position_embeddings=max_positions,
    )
    transformers.Qwen3ForCausalLM(cfg).save_pretrained(out_dir)
    src = _tokenizer_source()
    for f in TOKENIZER_FILES:
        shutil.copy(src / f, out_dir / f)
    return out_dir


def use_real_engine() -> bool:
    if os.environ.get("SPARKRELAY_FAKE_ENGINE") == "1":
        return False
    try:
        from sparkrelay.engine.engine import Engine  # noqa: F401
    except ImportError:
        return False
    return True


def make_engine(config: Config):
    if use_real_engine():
        from sparkrelay.engine.engine import Engine

        return Engine(config)
    return FakeEngine(config)


class FakeEngine:
    """Contract stand-in for Engine: one pseudo-random token per running request per step, no
    model."""

    def __init__(self, config: Config):
        from transformers import AutoTokenizer

        path = config.model.model_path
        self.tokenizer = AutoTokenizer.from_pretrained(config.model.tokenizer_path or path)
        hf = json.loads((Path(path) / "config.json").read_text())
        self.vocab_size = hf["vocab_size"]
        self.context_length = config.model.context_length or hf["max_position_embeddings"]
        self.page_size = config.cache.page_size
        self.max_total_tokens = config.cache.max_total_tokens or min(
            64 * self.context_length, 2**17
        )
        self.max_running = config.scheduler.max_running_requests
        self.model_info = {
            "model_path": os.path.abspath(path),
            "tokenizer_path": os.path.abspath(path),
            "is_generation": True,
            "architectures": hf.get("architectures", []),
            "model_type": hf.get("model_type"),
        }
        self.eos_ids = {self.tokenizer.eos_token_id}
        self._rng = random.Random(config.model.seed)
        self._reqs: dict[str, dict] = {}  # rid -> state, arrival order
        self._blocks: dict[str, int] = {}  # rid -> KV blocks held (running requests only)

    def add_request(
        self, rid: str, prompt_ids: list[int], params: SamplingParams, bootstrap=None
    ) -> None:
        if rid in self._reqs:
            raise RequestError(f"duplicate request id {rid!r}")
        if not prompt_ids:
            raise RequestError("prompt is empty")
        bad = [t for t in prompt_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise RequestError(f"token id {bad[0]} is out of vocabulary (size {self.vocab_size})")
        if len(prompt_ids) >= self.context_length:
            raise RequestError(
                f"prompt of {len(prompt_ids)} tokens is too long for context {self.context_length}"
            )
        if len(prompt_ids) + params.max_new_tokens > self.context_length:
            raise RequestError(
                f"prompt ({len(prompt_ids)}) + max_new_tokens ({params.max_new_tokens}) "
                f"exceeds the context length {self.context_length}"
            )
        seed = params.seed if params.seed is not None else self._rng.randrange(2**31)
        self._reqs[rid] = {
            "prompt": list(prompt_ids),
            "params": params,
            "out": [],
            "rng": random.Random(seed),
        }

    def abort(self, rid: str) -> None:
        self._reqs.pop(rid, None)
        self._blocks.pop(rid, None)

    def has_work(self) -> bool:
        return bool(self._reqs)

    def flush_cache(self) -> bool:  # no prefix cache: flushed when idle, as the Engine answers
        return not self._reqs

    def step(self) -> list[RequestOutput]:
        self._admit()
        outputs = [self._decode_one(rid) for rid in list(self._blocks)]
        for out in outputs:
            if out.finished:
                self.abort(out.rid)
        return outputs

    def _admit(self) -> None:
        free = self.max_total_tokens // self.page_size - sum(self._blocks.values())
        for rid, r in self._reqs.items():
            need = math.ceil(self.context_length / self.page_size)
            if rid in self._blocks or len(self._blocks) >= self.max_running or need > free:
                continue
            self._blocks[rid] = need
            free -= need

    def _next_token(self, r: dict) -> int:
        p = r["params"]
        ids = r["prompt"] + r["out"]
        if p.greedy:
            return (sum(ids[-3:]) * 2654435761 + len(ids)) % (self.vocab_size - 16) + 16
        return r["rng"].randrange(16, self.vocab_size)

    def _decode_one(self, rid: str) -> RequestOutput:
        r = self._reqs[rid]
        p: SamplingParams = r["params"]
        tok = self._next_token(r)
        r["out"].append(tok)
        text = self.tokenizer.decode(r["out"], skip_special_tokens=p.skip_special_tokens)
        reason = None
        if tok in p.stop_token_ids or (not p.ignore_eos and tok in self.eos_ids):
            reason = {"type": "stop", "matched": tok}
        for s in p.stop:
            if s in text:
                reason = {"type": "stop", "matched": s}
                text = text if p.no_stop_trim else text[: text.index(s)]
                break
        if reason is None and len(r["out"]) >= p.max_new_tokens:
            reason = {"type": "length", "length": p.max_new_tokens}
        return RequestOutput(
            rid, [tok], list(r["out"]), reason is not None, reason, len(r["prompt"]), text
        )

    def stats(self) -> dict:
        used = sum(self._blocks.values()) * self.page_size
        return {
            "num_running": len(self._blocks),
            "num_waiting": len(self._reqs) - len(self._blocks),
            "kv_used_tokens": used,
            "kv_total_tokens": self.max_total_tokens,
            "kv_usage": used / self.max_total_tokens,
        }

    def check(self) -> None:
        assert set(self._blocks) <= set(self._reqs), "blocks held by a finished request"
        assert all(b > 0 for b in self._blocks.values())


# ---------------------------------------------------------------- fixtures


def make_config(model_dir: Path, **leaves) -> Config:
    base = dict(
        model_path=str(model_dir),
        context_length=CONTEXT_LENGTH,
        max_total_tokens=16 * CONTEXT_LENGTH,
        max_n=MAX_N,
        max_running_requests=16,
        page_size=16,
    )
    return Config().replace(**(base | leaves)).validate()


def make_app(model_dir: Path, **leaves):
    from sparkrelay.manager.client import AsyncEngine
    from sparkrelay.server.http_server import build_app

    config = make_config(model_dir, **leaves)
    async_engine = AsyncEngine(make_engine(config))
    return build_app(async_engine, config), async_engine


class UvicornThread:
    """A real uvicorn server on 127.0.0.1:<free port> in a background thread."""

    def __init__(self, app):
        import uvicorn

        self.port = free_port()
        self.server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning")
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> "UvicornThread":
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started:
            assert time.time() < deadline and self.thread.is_alive(), "uvicorn did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(10)


def wait_idle(async_engine, timeout: float = 5.0) -> dict:
    """Waits until the engine has no running or waiting request; returns the last stats snapshot."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        st = async_engine.last_stats
        if st.get("num_running", 0) == 0 and st.get("num_waiting", 0) == 0:
            return st
        time.sleep(0.02)
    raise AssertionError(f"engine not idle after {timeout}s: {async_engine.last_stats}")


def good_generate(client) -> dict:
    """A request that must succeed; bad-input tests run it after every bad request."""
    r = client.post(
        "/generate",
        json={
            "text": "Hello there",
            "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True},
        },
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["meta_info"]["completion_tokens"] == 4
    return body
