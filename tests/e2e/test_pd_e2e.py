"""End to end PD on the bundled pair, through the real entry points: a prefill server (--pp-size N,
no drafter), a DSpark decode server and a router, all subprocesses on 127.0.0.1.

Greedy, 20 prompts (one longer than 1,000 tokens, one shorter than the tail): every topology and
handoff mode must produce exactly the aggregated DSpark tokens; `hidden` and `draft-kv` must also
give exactly the aggregated acceptance per request (same verify rounds, same accept length). `tail`
acceptance is reported, not asserted equal (the drafter sees only the last rows of the prompt).

The default run (CI) does PP=2 + hidden through sparkrelay's router; the full matrix and
sglang-router are marked slow (`pytest -m slow tests/e2e/test_pd_e2e.py`). Every route (native and
OpenAI, streamed, n = 2) through both routers against the aggregated server:
tests/e2e/test_sglang_router_routes.py (default run).
"""

from __future__ import annotations

import importlib.util
import json
import time
import urllib.error
import urllib.request

import pytest

from sparkrelay.tools.cluster import PDSettings, start_pd
from testkit.pd import (  # noqa: F401
    DRAFTER,
    MAX_NEW,
    MODEL,
    check_against,
    dspark_reference,
    generate,
    pd_prompts,
    post,
)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return pd_prompts()


@pytest.fixture(scope="module")
def reference(prompts) -> list[dict]:
    return dspark_reference(prompts)


def run_pd(tmp_path, prompts, also=None, decode_info=None, **settings) -> list[dict]:
    """Each prompt through the deployment, one at a time; `also(url)` runs against it and
    `decode_info(decode url)` against its decode server before it stops."""
    cluster = start_pd(PDSettings(model=MODEL, drafter=DRAFTER, **settings), str(tmp_path))
    try:
        results = []
        for i, ids in enumerate(prompts):
            status, out = generate(
                cluster.url, ids, retries_until=time.monotonic() + (30 if i == 0 else 0)
            )
            assert status == 200, (
                status,
                out,
                cluster.decode.log_tail(),
                cluster.prefill.log_tail(),
            )
            results.append(out)
        if also is not None:
            also(cluster.url)
        if decode_info is not None:
            decode_info(cluster.decode.url)
        return results
    finally:
        cluster.stop()


def traced(tmp_path) -> dict:
    return {"SPARKRELAY_TRACE": str(tmp_path / "trace")}


def assert_streamed(tmp_path, stages: int = 2) -> None:
    """The longest prompt's handoff left in pieces while its prefill computed: on every stage,
    several sends, the first before the stage had computed its last two chunks (trace/timeline.py
    events)."""
    from sparkrelay.trace import timeline

    events = timeline.read(str(tmp_path / "trace"))
    chunks = [e for e in events if e["event"] == "chunk"]
    rooms = [r for e in chunks for r in e["rooms"]]
    room = max(set(rooms), key=rooms.count)  # the >1,000-token prompt: the most chunks
    for stage in range(stages):
        ends = [e["end"] for e in chunks if e["source"] == f"stage{stage}" and room in e["rooms"]]
        sends = [
            e["t"]
            for e in events
            if e["source"] == f"stage{stage}" and e["event"] == "send" and e.get("room") == room
        ]
        assert len(ends) >= 4 and len(sends) >= 4, (stage, len(ends), len(sends))
        assert min(sends) < sorted(ends)[-2], (
            f"stage {stage} sent nothing before its last two chunks"
        )


def test_pd_pp2_hidden_through_router(tmp_path, prompts, reference):
    """CI's end-to-end PD test: PP=2 prefill (no drafter) + DSpark decode + sparkrelay router; the
    long prompt's handoff streams while the prefill computes."""

    # the OpenAI routes carry the bootstrap fields too (docs/pd_protocol.md, failure mode 6)
    def openai_route(
        url,
    ):
        status, out = post(
            url + "/v1/completions", {"prompt": prompts[3], "max_tokens": MAX_NEW, "temperature": 0}
        )
        assert status == 200 and out["choices"][0]["text"] == reference[3]["text"], out

    # chunked prefill on the prefill side: the >1,000-token prompt is captured in 256-token chunks
    # at absolute positions (docs/pd_protocol.md, failure mode 21)
    results = run_pd(
        tmp_path,
        prompts,
        also=openai_route,
        pp_size=2,
        handoff="hidden",
        router="sparkrelay",
        prefill_args=["--chunked-prefill-size", "256"],
        prefill_env=traced(tmp_path),
    )
    check_against(reference, results, exact_acceptance=True)
    assert_streamed(tmp_path)


def landed_rooms(backend: str, landed: list[int]):
    """A decode_info check: the decode runs `backend`; appends how many rooms an engine wrote into
    its memory."""

    def check(url):
        info = json.loads(urllib.request.urlopen(url + "/server_info").read())
        assert info["disaggregation_transfer_backend"] == backend
        landed.append(info["internal_states"][0]["landed_rooms_total"])

    return check


@pytest.mark.parametrize("backend, mode", [("mooncake", "hidden"), ("nixl", "draft-kv")])
def test_pd_one_sided_backend_through_router(tmp_path, prompts, reference, backend, mode):
    """CI's end-to-end test per one-sided backend: the KV, the metadata row and the DSpark context
    are written by the engine into the decode's registered memory (docs/dspark_pd.md, transfer
    backends)."""
    flag = ["--disaggregation-transfer-backend", backend]
    landed: list[int] = []
    # control: HMAC
    token = {"SPARKRELAY_DISAGGREGATION_AUTH_TOKEN": "pd-secret"} if backend == "nixl" else {}
    results = run_pd(
        tmp_path,
        prompts,
        pp_size=2,
        handoff=mode,
        router="sparkrelay",
        decode_info=landed_rooms(backend, landed),
        prefill_args=flag + ["--chunked-prefill-size", "256"],
        decode_args=flag,
        env=token,
        prefill_env=traced(tmp_path),
    )
    check_against(reference, results, exact_acceptance=True)
    assert landed == [len(prompts)]
    assert_streamed(tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["zmq", "mooncake", "nixl"])
@pytest.mark.parametrize("mode", ["hidden", "draft-kv", "tail"])
def test_pd_backend_matrix(tmp_path, prompts, reference, backend, mode):
    """Every backend x handoff mode, PP=2 through the router: the full matrix."""
    flag = ["--disaggregation-transfer-backend", backend]
    landed: list[int] = []
    results = run_pd(
        tmp_path,
        prompts,
        pp_size=2,
        handoff=mode,
        router="sparkrelay",
        prefill_args=flag,
        decode_args=flag,
        decode_info=landed_rooms(backend, landed),
    )
    taus = check_against(reference, results, exact_acceptance=mode != "tail")
    assert landed == [
        0 if backend == "zmq" else len(prompts)
    ]  # one-sided: every room written by the engine
    print(f"\n{backend} {mode}: mean accept length {sum(taus) / len(taus):.3f}")


@pytest.mark.slow
@pytest.mark.parametrize("pp", [1, 2, 4])
@pytest.mark.parametrize("mode", ["hidden", "draft-kv", "tail"])
def test_pd_matrix(tmp_path, prompts, reference, pp, mode, record_property):
    results = run_pd(tmp_path, prompts, pp_size=pp, handoff=mode, router="sparkrelay")
    taus = check_against(reference, results, exact_acceptance=mode != "tail")
    mean = sum(taus) / len(taus)
    ref = sum(r["meta_info"]["spec_accept_length"] for r in reference) / len(reference)
    record_property("mean_accept_length", mean)
    print(f"\nPP={pp} {mode}: mean accept length {mean:.3f} (aggregated {ref:.3f})")


@pytest.mark.slow
@pytest.mark.skipif(
    importlib.util.find_spec("sglang_router") is None, reason="sglang-router is not installed"
)
def test_pd_through_sglang_router(tmp_path, prompts, reference):
    results = run_pd(tmp_path, prompts, pp_size=2, handoff="hidden", router="sglang")
    check_against(reference, results, exact_acceptance=True)
