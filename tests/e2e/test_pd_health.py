"""/health_generate on PD servers: a real generation with SGLang's fake bootstrap host ("2.2.2.2"),
which never contacts a peer. The prefill (PP 2: no stage captures or sends anything for it) computes
the prompt; the decode takes zero KV and a fake first token (the prompt's last) and decodes from
there. Afterwards a real PD request still works and both sides drain.
"""

from __future__ import annotations

import concurrent.futures
import json
import random
import time
import urllib.error
import urllib.request

import pytest

from sparkrelay.scheduler.request import FAKE_BOOTSTRAP_HOST
from sparkrelay.tools.cluster import PDSettings, start_pd
from testkit.pd import DRAFTER, MODEL, post


def get_status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=120) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def state(url: str) -> dict:
    with urllib.request.urlopen(url + "/server_info", timeout=10) as r:
        return json.loads(r.read())["internal_states"][0]


def assert_drained(url: str, timeout: float = 30.0) -> None:
    """No KV block in use, no request anywhere in the server, the idle invariant check clean."""
    keys = (
        "kv_used_tokens",
        "num_running",
        "num_waiting",
        "num_transfers_inflight",
        "num_prealloc",
    )
    deadline = time.monotonic() + timeout
    while any((s := state(url)).get(k, 0) for k in keys) or s.get("check_error") is not None:
        assert time.monotonic() < deadline, f"{url} did not drain: {s}"
        time.sleep(0.25)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = start_pd(
        PDSettings(model=MODEL, drafter=DRAFTER, pp_size=2, handoff="hidden", router="none"),
        str(tmp_path_factory.mktemp("pd_health")),
    )
    yield c
    c.stop()


def body(ids: list[int], host: str, port, max_new: int) -> dict:
    return {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": max_new, "temperature": 0.0},
        "bootstrap_host": host,
        "bootstrap_port": port,
        "bootstrap_room": random.randrange(1, 1 << 63),
    }


def test_health_generate_answers_200_on_prefill_and_decode(cluster):
    assert get_status(cluster.prefill.url + "/health_generate") == 200, cluster.prefill.log_tail()
    assert get_status(cluster.decode.url + "/health_generate") == 200, cluster.decode.log_tail()
    for server in (cluster.prefill, cluster.decode):
        assert_drained(server.url)


def test_fake_bootstrap_never_contacts_a_peer(cluster):
    ids = list(range(300, 317))
    status, out = post(cluster.prefill.url + "/generate", body(ids, FAKE_BOOTSTRAP_HOST, None, 4))
    # the prefill samples one token, sends nothing
    assert status == 200 and len(out["output_ids"]) == 1, out
    status, out = post(cluster.decode.url + "/generate", body(ids, FAKE_BOOTSTRAP_HOST, None, 3))
    assert status == 200, out
    # fake first token, 2 decoded
    assert len(out["output_ids"]) == 3 and out["output_ids"][0] == ids[-1], out
    assert state(cluster.decode.url)["handoff_bytes_total"] == 0  # nothing was received
    # a real PD request after the fake ones is served as usual
    real = body(ids, "127.0.0.1", cluster.bootstrap_port, 6)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        p = pool.submit(post, cluster.prefill.url + "/generate", real)
        d = pool.submit(post, cluster.decode.url + "/generate", real)
        (ps, pout), (ds, dout) = p.result(), d.result()
    assert ps == 200 and ds == 200 and len(dout["output_ids"]) == 6, (pout, dout)
    # the decode starts from the prefill's first token
    assert dout["output_ids"][0] == pout["output_ids"][0]
    assert state(cluster.decode.url)["handoff_bytes_total"] > 0
    for server in (cluster.prefill, cluster.decode):
        assert_drained(server.url)
