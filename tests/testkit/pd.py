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


def pd_prompts() -> list[list[int]]:
    """20 prompts of the bundled tokenizer: 18 of 9 to 98 tokens, one shorter than the tail (5), one longer
    than 1,000 tokens."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(MODEL)
    text = (
        open("sparkrelay/scheduler/scheduler.py").read()
        + open("sparkrelay/models/decoder.py").read()
    )
    ids = tok.encode(text)
    out = [ids[40 * i : 40 * i + 9 + (i * 13) % 90] for i in range(18)]
    out.append(ids[500:505])  # shorter than the default tail (8)
    out.append(ids[1000:2100])  # longer than 1,000 tokens
    assert len(out[-1]) > 1000 and len(out[-2]) < 8
    return out


def check_against(
    reference: list[dict], results: list[dict], exact_acceptance: bool
) -> list[float]:
    """PD results against aggregated DSpark: equal tokens, and (exact_acceptance) the same verify rounds and
    accept length per request -> the accept lengths."""
    taus = []
    for i, (ref, got) in enumerate(zip(reference, results)):
        assert got["output_ids"] == ref["output_ids"], (
            f"prompt {i}: PD tokens differ from aggregated DSpark"
        )
        m, r = got["meta_info"], ref["meta_info"]
        assert m["spec_verify_ct"] >= 1 and m["spec_accept_length"] >= 1.0
        if exact_acceptance:
            assert (m["spec_verify_ct"], m["spec_accept_length"]) == (
                r["spec_verify_ct"],
                r["spec_accept_length"],
            ), (
                f"prompt {i}: acceptance {m['spec_verify_ct']}/{m['spec_accept_length']} vs aggregated "
                f"{r['spec_verify_ct']}/{r['spec_accept_length']}"
            )
        taus.append(m["spec_accept_length"])
    return taus


def dspark_reference(prompts: list[list[int]], max_new: int = MAX_NEW) -> list[dict]:
    """Aggregated DSpark on the bundled pair, greedy, one prompt at a time (batch 1, as PD requests are
    sent)."""
    from sparkrelay.llm import LLM
    from sparkrelay.scheduler.request import SamplingParams

    llm = LLM(MODEL, speculative_algorithm="DSPARK", speculative_draft_model_path=DRAFTER)
    params = SamplingParams(max_new_tokens=max_new, temperature=0.0)
    out = [llm.generate(p, params) for p in prompts]
    llm.engine.close()
    return out


def server_state(url: str) -> dict:
    with urllib.request.urlopen(url + "/server_info", timeout=10) as r:
        return json.loads(r.read())["internal_states"][0]


def assert_drained(url: str, timeout: float = 20.0) -> None:
    """No KV block in use, nothing in flight, and the idle invariant check clean."""
    deadline = time.monotonic() + timeout
    while True:
        s = server_state(url)
        busy = (
            s["kv_used_tokens"]
            or s.get("num_transfers_inflight", 0)
            or s.get("num_prealloc", 0)
            or s.get("num_quarantined", 0)
            or s["num_running"]
        )
        if not busy and s.get("check_error") is None:
            return
        assert time.monotonic() < deadline, f"{url} did not drain: {s}"
        time.sleep(0.25)
