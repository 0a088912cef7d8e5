"""tools/bench/vllm_peer.py and roofline_engines.VllmEngine: the peer speaks one JSON line per
request each way over its own stdout, whatever the library prints, and a bad request gets an error
line, not a dead peer. A stand-in `vllm` package (greedy = the prompt's last id + 1, repeated)
replaces the real one, which lives in its own virtual environment."""

import json
import subprocess
import sys
import textwrap

import pytest

from sparkrelay.tools.bench import roofline_engines as re_

FAKE_VLLM = {
    "__init__.py": """
        import sys
        __version__ = "0.0-test"

        class SamplingParams:
            def __init__(self, max_tokens, **kw):
                self.max_tokens = max_tokens

        class _Out:
            def __init__(self, ids):
                self.token_ids = ids

        class _Req:
            def __init__(self, ids):
                self.outputs = [_Out(ids)]

        class LLM:
            def __init__(self, **kw):
                print("fake vLLM loading", kw["model"])  # a log line on stdout, as vLLM's can be
                self.kw = kw

            def generate(self, prompts, params, use_tqdm=True):
                print("generating", len(prompts))
                return [_Req([p["prompt_token_ids"][-1] + 1] * params.max_tokens) for p in prompts]
    """,
    "inputs.py": """
        def TokensPrompt(prompt_token_ids):
            return {"prompt_token_ids": prompt_token_ids}
    """,
}


@pytest.fixture
def fake_python(tmp_path):
    """A `python` that finds the stand-in vllm package first."""
    pkg = tmp_path / "site" / "vllm"
    pkg.mkdir(parents=True)
    for name, text in FAKE_VLLM.items():
        (pkg / name).write_text(textwrap.dedent(text))
    wrapper = tmp_path / "python"
    wrapper.write_text(f'#!/bin/sh\nPYTHONPATH={tmp_path / "site"} exec {sys.executable} "$@"\n')
    wrapper.chmod(0o755)
    return str(wrapper)


def test_the_engine_drives_the_peer(fake_python, tmp_path):
    target = re_.Target(str(tmp_path), {})
    engine = re_.VllmEngine(target, "bfloat16", fake_python, 64, 4)
    try:
        assert engine.version == "0.0-test" and not engine.same_weights
        assert engine.generate([[1, 2, 3], [7]], 3) == [[4, 4, 4], [8, 8, 8]]
        assert engine.generate([[5]], 1) == [[6]]
    finally:
        engine.close()
    assert engine.proc.returncode == 0


def test_a_bad_request_gets_an_error_line(fake_python, tmp_path):
    proc = subprocess.run(
        [fake_python, str(re_.VllmEngine.PEER), "--model", str(tmp_path)],
        input='{"prompts": [], "new_tokens": 2}\nnot json\n{"prompts": [[1]], "new_tokens": 1}\n',
        capture_output=True,
        text=True,
        timeout=60,
    )
    lines = [json.loads(line) for line in proc.stdout.splitlines()]
    assert lines[0]["ready"] is True
    assert "error" in lines[1] and "error" in lines[2]
    assert lines[3]["outputs"] == [[2]]
    assert "fake vLLM loading" in proc.stderr and proc.returncode == 0
