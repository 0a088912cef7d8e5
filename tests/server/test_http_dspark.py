"""The HTTP server with DSpark: spec fields in meta_info, acceptance figures in /metrics and
/server_info, streaming, and greedy outputs equal to a plain server's."""

import pytest
from fastapi.testclient import TestClient

from sparkrelay.models.dspark_checkpoint import write_random_checkpoint
from testkit.http import make_app


@pytest.fixture(scope="module")
def spec_and_plain(tiny_model_dir, tmp_path_factory):
    draft = write_random_checkpoint(
        tmp_path_factory.mktemp("draft") / "d", tiny_model_dir, target_layer_ids=[-1, 0]
    )
    spec_app, _ = make_app(
        tiny_model_dir, speculative_algorithm="DSPARK", speculative_draft_model_path=str(draft)
    )
    plain_app, _ = make_app(tiny_model_dir)
    with TestClient(spec_app) as spec, TestClient(plain_app) as plain:
        yield spec, plain


BODY = {
    "text": "def parse(argv):",
    "sampling_params": {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True},
}


def test_generate_reports_spec_fields_and_matches_plain(spec_and_plain):
    spec, plain = spec_and_plain
    a, b = spec.post("/generate", json=BODY), plain.post("/generate", json=BODY)
    assert a.status_code == 200 and b.status_code == 200
    assert a.json()["output_ids"] == b.json()["output_ids"]
    meta = a.json()["meta_info"]
    assert meta["spec_verify_ct"] >= 1
    assert meta["spec_accept_length"] == pytest.approx(
        (meta["completion_tokens"] - 1) / meta["spec_verify_ct"]
    )
    assert "spec_verify_ct" not in b.json()["meta_info"]


def test_metrics_and_server_info_carry_acceptance(spec_and_plain):
    spec, _ = spec_and_plain
    spec.post("/generate", json=BODY)
    metrics = spec.get("/metrics").text
    assert (
        "sparkrelay:spec_accept_length " in metrics
        and 'sparkrelay:spec_accept_rate{position="0"}' in metrics
    )
    info = spec.get("/server_info").json()
    assert info["speculative_algorithm"] == "DSPARK"
    state = info["internal_states"][0]
    assert state["spec_rounds"] >= 1 and state["avg_spec_accept_length"] >= 1.0
    assert len(state["spec_accept_rate_per_position"]) == 7


def test_streaming_with_dspark(spec_and_plain):
    spec, plain = spec_and_plain
    body = {**BODY, "stream": True}
    with spec.stream("POST", "/generate", json=body) as r:
        lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    import json

    last = json.loads(lines[-2][6:])
    assert last["output_ids"] == plain.post("/generate", json=BODY).json()["output_ids"]
