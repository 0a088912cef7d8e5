"""Demo: start the HTTP server on the bundled model, ask it a few things through the OpenAI client, print.

python -m sparkrelay.demo [--model-path models/tiny-qwen3] [--port 0 (a free port)]
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", default="models/tiny-qwen3")
    p.add_argument("--port", type=int, default=0)
    args = p.parse_args()
    port = args.port or free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "sparkrelay.launch_server", "--model-path", args.model_path, "--port", str(port),
           "--log-level", "warning"]
    print("$ " + " ".join(cmd), flush=True)
    proc = subprocess.Popen(cmd, env={**os.environ})
    try:
        wait_healthy(url, proc)
        run_client(url, args.model_path)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()


if __name__ == "__main__":
    main()
