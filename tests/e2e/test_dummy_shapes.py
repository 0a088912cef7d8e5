"""`--load-format dummy` end to end at a reduced real-ish shape: Qwen3-0.6B's width, heads and
vocabulary (hidden 1,024, 16 q / 8 kv heads of 128, MLP 3,072, vocabulary 151,936, tied) with 4
layers, and a 2-layer DSpark drafter, all random weights, no weight files. Through the real entry
points (subprocesses on 127.0.0.1):

    launch_server plain                       -> the reference greedy tokens
    launch_server DSpark (dummy drafter)      == the reference
    PD: prefill --pp-size 2 (draft-kv: the prefill projects the drafter's context with its own dummy tensors)
        + DSpark decode + sparkrelay router   == the reference, and the aggregated DSpark acceptance exactly

Equal tokens across processes need equal weights in every process: each tensor is seeded from its
name (models/dummy.py). float32, so that greedy ties cannot flip between batch shapes.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from sparkrelay.tools import make_configs
from sparkrelay.tools.cluster import PDSettings, free_port, server_argv, start, start_pd
from testkit.pd import post

MAX_NEW = 6
ARGS = ["--load-format", "dummy", "--dtype", "float32", "--max-total-tokens", "2048"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> tuple[str, str]:
    out = tmp_path_factory.mktemp("dummy-shapes")
    cfg = make_configs.target_config("qwen3-0.6b", num_hidden_layers=4, max_window_layers=4)
    make_configs.write_target(out / "target", cfg, tokenizer_from=Path("models/configs/qwen3-0.6b"))
    # one tap per stage
    make_configs.write_drafter(out / "drafter", make_configs.drafter_config(cfg, 2, [1, 2]))
    assert not list(out.rglob("*.safetensors"))
    return str(out / "target"), str(out / "drafter")


PROMPTS = [
    list(range(1000, 1013)),
    [151644, 872, 198, 9707, 11, 1246, 525, 498, 30, 151645],
    [7] * 21,
]


def generate_all(url: str, first_deadline: float = 0.0) -> list[dict]:
    results = []
    for ids in PROMPTS:
        while True:  # a router may still be registering its workers
            status, out = post(
                url + "/generate",
                {
                    "input_ids": ids,
                    "sampling_params": {
                        "max_new_tokens": MAX_NEW,
                        "temperature": 0.0,
                        "ignore_eos": True,
                    },
                },
            )
            if status != 503 or time.monotonic() > first_deadline:
                break
            time.sleep(0.5)
        assert status == 200, (status, out)
        results.append(out)
    return results


@pytest.mark.slow  # ~44 s: three deployments at a real shape
def test_dummy_weights_serve_plain_dspark_and_pd(folders, tmp_path):
    target, drafter = folders
    ports = free_port(), free_port()
    spec = ["--speculative-algorithm", "DSPARK", "--speculative-draft-model-path", drafter]
    argvs = [server_argv(target, ports[0], ARGS), server_argv(target, ports[1], ARGS + spec)]
    with ThreadPoolExecutor(2) as pool:  # both aggregated servers start at once
        servers = list(
            pool.map(lambda i: start(f"agg{i}", argvs[i], ports[i], str(tmp_path)), range(2))
        )
    try:
        plain, dspark = (generate_all(s.url) for s in servers)
    finally:
        for s in servers:
            s.stop()
    reference = [r["output_ids"] for r in plain]
    assert all(len(r) == MAX_NEW for r in reference) and len({tuple(r) for r in reference}) > 1
    assert all(0 <= t < 151936 for r in reference for t in r)
    assert [r["output_ids"] for r in dspark] == reference, "DSpark greedy tokens differ from plain"
    assert all(isinstance(r["text"], str) and r["text"] for r in plain)  # every id detokenizes

    cluster = start_pd(
        PDSettings(
            model=target,
            drafter=drafter,
            pp_size=2,
            handoff="draft-kv",
            router="sparkrelay",
            prefill_args=ARGS,
            decode_args=ARGS,
        ),
        str(tmp_path),
    )
    try:
        pd = generate_all(cluster.url, first_deadline=time.monotonic() + 30)
    finally:
        cluster.stop()
    assert [r["output_ids"] for r in pd] == reference, "PD greedy tokens differ from aggregated"
    for got, ref in zip(pd, dspark):  # same drafter context on both sides: the same rounds
        m, r = got["meta_info"], ref["meta_info"]
        assert (m["spec_verify_ct"], m["spec_accept_length"]) == (
            r["spec_verify_ct"],
            r["spec_accept_length"],
        )
