"""A PD deployment's client side for the tests: the bundled pair's paths and JSON POSTs."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

MODEL, DRAFTER = "models/tiny-qwen3", "models/tiny-qwen3-dspark"
MAX_NEW = 24


def post(url: str, body: dict, timeout: float = 120.0) -> tuple[int, dict]:
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def generate(url: str, ids: list[int], retries_until: float = 0.0) -> tuple[int, dict]:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0.0}}
    while True:
        status, out = post(url + "/generate", body)
        # a router may still be registering its workers
        if status != 503 or time.monotonic() > retries_until:
            return status, out
        time.sleep(0.5)
