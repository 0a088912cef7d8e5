"""Demo: start the HTTP server on the bundled model, ask it a few things through the OpenAI client, print;
then the same greedy prompts on a DSpark server (the bundled drafter): same text, fewer target steps.

python -m sparkrelay.demo [--model-path models/tiny-qwen3] [--draft-model-path models/tiny-qwen3-dspark]
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time

import httpx

# Prompts end at a token boundary the tokenizer would produce: a trailing "\n" on its own is rare in training
# (byte-level BPE merges it with the next line's indentation), and the tiny model answers it badly.
PROMPTS = [
    "import os\n\n\ndef list_python_files(root):",
    "class Stack:\n    def __init__(self):",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with code {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise TimeoutError(f"the server at {url} was not healthy after {timeout:.0f}s")


def run_client(url: str, model: str) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=f"{url}/v1", api_key="none")
    for prompt in PROMPTS:
        t0 = time.monotonic()
        out = client.completions.create(model=model, prompt=prompt, max_tokens=48, temperature=0)
        dt = time.monotonic() - t0
        print(f"--- prompt ({dt * 1000:.0f} ms, {out.usage.completion_tokens} tokens) ---")
        print(prompt + out.choices[0].text)
    print("--- streamed, temperature 0.8 ---")
    stream = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=48, temperature=0.8, seed=1,
                                       stream=True)
    for chunk in stream:
        print(chunk.choices[0].text, end="", flush=True)
    print()
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "def add(a, b):"}],
                                          max_tokens=24, temperature=0)
    print("--- chat ---\n" + (chat.choices[0].message.content or ""))
    info = httpx.get(f"{url}/metrics").text
    lines = [ln for ln in info.splitlines() if ln.startswith(("sparkrelay:generation_tokens_total",
                                                              "sparkrelay:num_requests_total"))]
    print("--- /metrics ---\n" + "\n".join(lines))


def dspark_client(url: str, plain_url: str) -> None:
    """Greedy prompts through SGLang's native /generate on both servers: outputs, acceptance length, latency."""
    print("--- DSpark speculative decoding (greedy, 96 tokens each) ---")
    for prompt in PROMPTS:
        body = {"text": prompt, "sampling_params": {"max_new_tokens": 96, "temperature": 0, "ignore_eos": True}}
        plain = httpx.post(f"{plain_url}/generate", json=body, timeout=120).json()
        spec = httpx.post(f"{url}/generate", json=body, timeout=120).json()
        meta = spec["meta_info"]
        same = "same tokens" if spec["output_ids"] == plain["output_ids"] else "DIFFERENT tokens"
        print(f"{prompt.splitlines()[-1][:40]!r}: {same}; accept length {meta['spec_accept_length']:.2f} over "
              f"{meta['spec_verify_ct']} verify rounds; {plain['meta_info']['e2e_latency'] * 1000:.0f} ms plain, "
              f"{meta['e2e_latency'] * 1000:.0f} ms DSpark")


def start(args_list: list[str]) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "sparkrelay.launch_server", *args_list, "--port", str(port), "--log-level", "warning"]
    print("$ " + " ".join(cmd), flush=True)
    proc = subprocess.Popen(cmd, env={**os.environ})
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, proc)
    return proc, url


def stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", default="models/tiny-qwen3")
    p.add_argument("--draft-model-path", default="models/tiny-qwen3-dspark")
    args = p.parse_args()
    procs = []
    try:
        proc, url = start(["--model-path", args.model_path])
        procs.append(proc)
        run_client(url, args.model_path)
        spec_proc, spec_url = start(["--model-path", args.model_path, "--speculative-algorithm", "DSPARK",
                                     "--speculative-draft-model-path", args.draft_model_path])
        procs.append(spec_proc)
        dspark_client(spec_url, url)
    finally:
        for proc in procs:
            stop(proc)


if __name__ == "__main__":
    main()
