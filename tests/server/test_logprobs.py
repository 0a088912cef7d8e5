"""Logprobs as SGLang and vLLM return them: the target's log-softmax of its raw logits, equal to
transformers' on the bundled model, the same with and without DSpark (the verify pass scores the
committed tokens), through a pipeline and through PD; the response shapes of /generate and the
OpenAI routes, streamed and not."""

from __future__ import annotations

import importlib.util
import json
import time
from pathlib import Path

import pytest
import torch

from sparkrelay.llm import LLM
from sparkrelay.scheduler.request import RequestError, SamplingParams
from testkit.hf import load_hf
from testkit.http import UvicornThread, make_app

MODEL, DRAFTER = "models/tiny-qwen3", "models/tiny-qwen3-dspark"
TOL = 1e-4
MAX_NEW = 16


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(MODEL).encode(
        Path("sparkrelay/scheduler/stop.py").read_text()
    )
    return [ids[:30], ids[100:111]]


@pytest.fixture(scope="module")
def hf():
    return load_hf(MODEL)


def hf_logprobs(hf, ids: list[int]) -> torch.Tensor:
    """[len(ids), V]: row i = log p(. | ids[: i + 1]) in float32."""
    with torch.inference_mode():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)


def greedy(k: int = 5, start: int = -1, max_new: int = MAX_NEW) -> SamplingParams:
    return SamplingParams(
        max_new_tokens=max_new,
        temperature=0.0,
        ignore_eos=True,
        return_logprob=True,
        top_logprobs_num=k,
        logprob_start_len=start,
    )


@pytest.fixture(scope="module")
def plain_and_dspark(prompts):
    params = greedy(start=0)
    plain = LLM(MODEL, chunked_prefill_size=8)  # the 30-token prompt is scored in four chunks
    spec = LLM(MODEL, speculative_algorithm="DSPARK", speculative_draft_model_path=DRAFTER)
    out = [plain.generate(prompts, params), spec.generate(prompts, params)]
    plain.engine.close()
    spec.engine.close()
    return out


def values(entries: list) -> list[float]:
    return [e[0] for e in entries]


def test_output_logprobs_equal_transformers_with_and_without_dspark(plain_and_dspark, prompts, hf):
    plain, spec = plain_and_dspark
    for p, a, b in zip(prompts, plain, spec):
        ma, mb = a["meta_info"], b["meta_info"]
        assert a["output_ids"] == b["output_ids"] and mb["spec_verify_ct"] >= 1
        ref = hf_logprobs(hf, p + a["output_ids"])
        want = [ref[len(p) - 1 + i, t].item() for i, t in enumerate(a["output_ids"])]
        for meta in (ma, mb):
            got = meta["output_token_logprobs"]
            assert [e[1] for e in got] == a["output_ids"] and all(e[2] is None for e in got)
            assert max(abs(x - y) for x, y in zip(values(got), want)) < TOL
        assert (
            max(
                abs(x - y)
                for x, y in zip(
                    values(ma["output_token_logprobs"]), values(mb["output_token_logprobs"])
                )
            )
            < TOL
        )
        # the top logprobs: sorted, the greedy token first, equal to transformers' top 5
        for i, (top, chosen) in enumerate(zip(mb["output_top_logprobs"], a["output_ids"])):
            assert (
                len(top) == 5
                and top[0][1] == chosen
                and values(top) == sorted(values(top), reverse=True)
            )
            ref_v, ref_i = ref[len(p) - 1 + i].topk(5)
            assert max(abs(x - y) for x, y in zip(values(top), ref_v.tolist())) < TOL
            assert [e[1] for e in top][:2] == ref_i.tolist()[:2]


def test_input_logprobs_equal_transformers(plain_and_dspark, prompts, hf):
    for out in plain_and_dspark:
        for p, o in zip(prompts, out):
            meta, ref = o["meta_info"], hf_logprobs(hf, p)
            got = meta["input_token_logprobs"]
            assert (
                [e[1] for e in got] == p
                and got[0][0] is None
                and meta["input_top_logprobs"][0] is None
            )
            want = [ref[i - 1, p[i]].item() for i in range(1, len(p))]
            assert max(abs(x - y) for x, y in zip(values(got[1:]), want)) < TOL
            assert all(len(t) == 5 for t in meta["input_top_logprobs"][1:])


def test_logprob_start_len_and_top_zero(prompts):
    llm = LLM(MODEL)
    try:
        p = prompts[0]
        meta = llm.generate(p, greedy(k=0, start=25, max_new=3))["meta_info"]
        assert [e[1] for e in meta["input_token_logprobs"]] == p[25:] and None not in values(
            meta["input_token_logprobs"]
        )
        assert "output_top_logprobs" not in meta and len(meta["output_token_logprobs"]) == 3
        assert (
            "output_token_logprobs"
            not in llm.generate(p, SamplingParams(max_new_tokens=2))["meta_info"]
        )
        # scoring a prompt: no token generated
        scored = llm.generate(p, greedy(k=0, start=0, max_new=0))
        assert scored["output_ids"] == [] and len(
            scored["meta_info"]["input_token_logprobs"]
        ) == len(p)
        assert values(scored["meta_info"]["input_token_logprobs"])[25:] == pytest.approx(
            values(meta["input_token_logprobs"]), abs=TOL
        )
        with pytest.raises(RequestError, match="logprob_start_len"):
            llm.engine.add_request("x", p, greedy(start=len(p)))
    finally:
        llm.engine.close()


def close_entries(a: list, b: list) -> bool:
    """Two input/output logprob lists: the same token ids, values within TOL (None where the other
    is None)."""
    return [e[1] for e in a] == [e[1] for e in b] and all(
        (x is None and y is None) or (x is not None and y is not None and abs(x - y) < TOL)
        for x, y in zip(values(a), values(b))
    )


def close_tops(a: list, b: list) -> bool:
    """Two top-logprob lists (per position a list, or None at position 0): the same values within
    TOL."""
    return len(a) == len(b) and all(
        (x is None and y is None)
        or (
            x is not None
            and y is not None
            and len(x) == len(y)
            and max((abs(u - v) for u, v in zip(values(x), values(y))), default=0) < TOL
        )
        for x, y in zip(a, b)
    )


def test_pipeline_pp2_logprobs(prompts, plain_and_dspark, hf):
    """--pp-size 2: the last stage scores the sampled token and, for logprob_start_len >= 0, the
    prompt positions of each chunk (chunked prefill: four chunks of 8), and sends them back to rank
    0 with the tokens."""
    llm = LLM(MODEL, pp_size=2, chunked_prefill_size=8)
    try:
        out = llm.generate(prompts[0], greedy(k=3))
        scored = {start: llm.generate(prompts, greedy(start=start)) for start in (0, 5)}
    finally:
        llm.engine.close()
    ref = plain_and_dspark[0][0]["meta_info"]
    assert out["output_ids"] == plain_and_dspark[0][0]["output_ids"]
    assert (
        max(
            abs(x - y)
            for x, y in zip(
                values(out["meta_info"]["output_token_logprobs"]),
                values(ref["output_token_logprobs"]),
            )
        )
        < TOL
    )
    for a, b in zip(out["meta_info"]["output_top_logprobs"], ref["output_top_logprobs"]):
        assert [e[1] for e in a][:2] == [e[1] for e in b][:2]
    assert (
        "input_token_logprobs" not in out["meta_info"]
        or out["meta_info"]["input_token_logprobs"] == []
    )
    for start, outs in scored.items():
        for p, o, pp1 in zip(prompts, outs, plain_and_dspark[0]):
            meta, want = (
                o["meta_info"],
                pp1["meta_info"],
            )  # PP=1 scored from 0: the same positions from `start`
            assert o["output_ids"] == pp1["output_ids"]
            assert [e[1] for e in meta["input_token_logprobs"]] == p[start:]
            assert close_entries(meta["input_token_logprobs"], want["input_token_logprobs"][start:])
            assert close_tops(meta["input_top_logprobs"], want["input_top_logprobs"][start:])
            assert close_entries(meta["output_token_logprobs"], want["output_token_logprobs"])
            hf_ref = hf_logprobs(hf, p)
            got = [
                (i, v) for i, v in enumerate(values(meta["input_token_logprobs"]), start) if i > 0
            ]
            assert len(got) == len(p) - max(start, 1) and all(v is not None for _, v in got)
            assert max(abs(v - hf_ref[i - 1, p[i]].item()) for i, v in got) < TOL


def test_descriptor_carries_scored_prompt_tokens_only_when_asked():
    """The prompt tokens a last stage scores ride in the descriptor body; a sequence that did not
    ask adds nothing, and the reply shape grows by one row per scored position."""
    from sparkrelay.pipeline.descriptor import (
        SEQ_FIELDS,
        STEP,
        MicroBatch,
        SeqDesc,
        decode,
        encode,
        reply_shape,
    )

    plain = SeqDesc(0, 0, 0, 8, 20, False, [0, 1], SamplingParams(temperature=0.0))
    asked = SeqDesc(
        1,
        7,
        8,
        16,
        20,
        True,
        [2, 3, 4],
        SamplingParams(temperature=0.0),
        logprobs=3,
        score_first=9,
        score_ids=[11, 12, 13, 14, 15, 16, 17, 18],
    )
    header, body, floats = encode(MicroBatch(STEP, 4, 0, 1, [plain], []))
    assert body.numel() == SEQ_FIELDS + 2 and reply_shape([plain]) == (
        1,
        1,
    )  # zero-cost without logprobs
    mb = decode(*encode(MicroBatch(STEP, 5, 0, 1, [plain, asked], [(3, 9)])))
    assert mb.seqs[0].score_ids == [] and mb.seqs[0].score_first == -1 and mb.released == [(3, 9)]
    assert (mb.seqs[1].score_first, mb.seqs[1].score_ids, mb.seqs[1].logprobs) == (
        9,
        asked.score_ids,
        3,
    )
    assert reply_shape(mb.seqs) == (2 + 8, 8)  # token rows 2 + 2k, prompt rows 1 + 2k


def test_router_merges_prefill_inputs_plain_batched_and_split_sse():
    import asyncio

    from sparkrelay.router.logprobs import merge_json, merge_stream, prefill_inputs

    ins = [[None, 5, None], [-1.5, 6, None]]
    pre = json.dumps(
        [
            {"meta_info": {"input_token_logprobs": ins}},
            {"meta_info": {"input_token_logprobs": ins[1:]}},
        ]
    )
    inputs = prefill_inputs(pre.encode(), stream=False)
    dec = json.dumps(
        [{"meta_info": {"input_token_logprobs": []}}, {"meta_info": {"input_token_logprobs": []}}]
    )
    merged = json.loads(merge_json(dec.encode(), inputs))
    assert [m["meta_info"]["input_token_logprobs"] for m in merged] == [ins, ins[1:]]
    sse_pre = (
        b"".join(
            b"data: "
            + json.dumps({"index": i, "meta_info": {"input_token_logprobs": x}}).encode()
            + b"\n\n"
            for i, x in ((0, ins[:1]), (1, ins[1:]), (0, ins))
        )
        + b"data: [DONE]\n\n"
    )
    inputs = prefill_inputs(sse_pre, stream=True)
    assert inputs == {0: {"input_token_logprobs": ins}, 1: {"input_token_logprobs": ins[1:]}}
    events = [
        {"index": 1, "text": "a", "meta_info": {"input_token_logprobs": []}},
        {"index": 0, "meta_info": {}},
    ]
    raw = (
        b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"
    )

    async def run() -> bytes:
        async def pieces():  # split at every 7 bytes: events cross chunk boundaries
            for i in range(0, len(raw), 7):
                yield raw[i : i + 7]

        return b"".join([c async for c in merge_stream(pieces(), inputs)])

    out = asyncio.run(run())
    got = [json.loads(e[6:]) for e in out.decode().split("\n\n") if e.startswith("data: {")]
    assert got[0]["meta_info"]["input_token_logprobs"] == ins[1:] and got[0]["text"] == "a"
    assert got[1]["meta_info"] == {"input_token_logprobs": ins} and out.endswith(
        b"data: [DONE]\n\n"
    )


# ---------------------------------------------------------------- HTTP shapes (real uvicorn,
# official client)


@pytest.fixture(scope="module")
def server():
    app, _ = make_app(Path(MODEL), context_length=512, max_total_tokens=8192)
    with UvicornThread(app) as srv:
        yield srv


def post(url: str, body: dict) -> tuple[int, dict]:
    import httpx

    r = httpx.post(url, json=body, timeout=120)
    return r.status_code, r.json()


def sse(url: str, body: dict) -> list[dict]:
    import httpx

    with httpx.stream("POST", url, json=body, timeout=120) as r:
        lines = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(ln) for ln in lines[:-1]]


def test_generate_shapes_streamed_and_text(server, prompts, plain_and_dspark):
    body = {
        "input_ids": prompts[0],
        "return_logprob": True,
        "top_logprobs_num": 2,
        "logprob_start_len": 0,
        "return_text_in_logprobs": True,
        "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0},
    }
    status, out = post(server.url + "/generate", body)
    assert status == 200, out
    meta, ref = out["meta_info"], plain_and_dspark[0][0]["meta_info"]
    assert (
        max(
            abs(x - y)
            for x, y in zip(
                values(meta["output_token_logprobs"]), values(ref["output_token_logprobs"])
            )
        )
        < TOL
    )
    assert all(
        isinstance(e[2], str) for e in meta["output_token_logprobs"] + meta["input_token_logprobs"]
    )
    assert all(len(t) == 2 and isinstance(t[0][2], str) for t in meta["output_top_logprobs"])
    assert (
        len(meta["input_token_logprobs"]) == len(prompts[0])
        and meta["input_top_logprobs"][0] is None
    )
    chunks = sse(server.url + "/generate", body | {"stream": True})
    lens = [len(c["meta_info"]["output_token_logprobs"]) for c in chunks]
    # cumulative, as SGLang sends
    assert lens == sorted(lens) and lens[-1] == MAX_NEW and len(chunks) > 1
    assert chunks[-1]["meta_info"]["output_token_logprobs"] == meta["output_token_logprobs"]


def test_openai_completions_and_chat_shapes(server, prompts, plain_and_dspark):
    import openai

    oc = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    ref = values(plain_and_dspark[0][0]["meta_info"]["output_token_logprobs"])
    comp = oc.completions.create(
        model=MODEL,
        prompt=prompts[0],
        max_tokens=MAX_NEW,
        temperature=0,
        logprobs=3,
        extra_body={"ignore_eos": True},
    )
    lp = comp.choices[0].logprobs
    assert max(abs(x - y) for x, y in zip(lp.token_logprobs, ref)) < TOL
    assert "".join(lp.tokens) == comp.choices[0].text and len(lp.top_logprobs) == MAX_NEW
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(MAX_NEW)]
    # greedy: the chosen token is the most likely one
    for d, v in zip(lp.top_logprobs, lp.token_logprobs):
        assert 1 <= len(d) <= 3 and max(d.values()) == pytest.approx(v, abs=TOL)
    streamed = list(
        oc.completions.create(
            model=MODEL,
            prompt=prompts[0],
            max_tokens=MAX_NEW,
            temperature=0,
            logprobs=3,
            stream=True,
            extra_body={"ignore_eos": True},
        )
    )
    parts = [c.choices[0].logprobs for c in streamed if c.choices and c.choices[0].logprobs]
    assert sum((p.token_logprobs for p in parts), []) == lp.token_logprobs
    assert sum((p.text_offset for p in parts), []) == lp.text_offset
    assert oc.completions.create(model=MODEL, prompt="x", max_tokens=2).choices[0].logprobs is None

    msgs = [{"role": "user", "content": "def f():"}]
    chat = oc.chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=8, temperature=0, logprobs=True, top_logprobs=2
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens == 8
    for c in content:
        assert len(c.top_logprobs) == 2 and c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob
        assert c.top_logprobs[0].token == c.token and c.bytes == list(c.token.encode())
        assert c.logprob == pytest.approx(c.top_logprobs[0].logprob, abs=TOL)
    chunks = list(
        oc.chat.completions.create(
            model=MODEL,
            messages=msgs,
            max_tokens=8,
            temperature=0,
            logprobs=True,
            top_logprobs=2,
            stream=True,
        )
    )
    got = [
        c
        for ch in chunks
        if ch.choices and ch.choices[0].logprobs
        for c in ch.choices[0].logprobs.content
    ]
    assert [(c.token, c.logprob) for c in got] == [(c.token, c.logprob) for c in content]
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        oc.chat.completions.create(model=MODEL, messages=msgs, logprobs=True, top_logprobs=21)
    with pytest.raises(openai.BadRequestError, match="logprobs"):
        oc.completions.create(model=MODEL, prompt="x", logprobs=-1)


# ---------------------------------------------------------------- PD: PP=2 prefill + DSpark decode,
# router

SGLANG_ROUTER = pytest.param(
    "sglang",
    marks=[
        pytest.mark.slow,
        pytest.mark.skipif(
            importlib.util.find_spec("sglang_router") is None,
            reason="sglang-router is not installed",
        ),
    ],
)


# ~17 s each
@pytest.mark.parametrize(
    "router", [pytest.param("sparkrelay", marks=pytest.mark.slow), SGLANG_ROUTER]
)
def test_pd_logprobs_equal_aggregated(tmp_path, prompts, plain_and_dspark, router):
    """The prefill's last stage scores the first token and carries it in the metadata row; the
    decode scores the rest from its verify passes; with logprob_start_len >= 0 the prefill (PP=2)
    scores the prompt and the router merges its input lists into the decode's answer, streamed and
    not."""
    from sparkrelay.tools.cluster import PDSettings, start_pd

    settings = PDSettings(model=MODEL, drafter=DRAFTER, pp_size=2, handoff="hidden", router=router)
    cluster = start_pd(settings, str(tmp_path))
    try:
        deadline = time.monotonic() + 30
        for p, ref in zip(prompts, plain_and_dspark[0]):
            body = {
                "input_ids": p,
                "return_logprob": True,
                "top_logprobs_num": 20,
                "sampling_params": {
                    "max_new_tokens": MAX_NEW,
                    "temperature": 0,
                    "ignore_eos": True,
                },
            }
            while True:
                status, out = post(cluster.url + "/generate", body)
                if status != 503 or time.monotonic() > deadline:
                    break
                time.sleep(0.5)
            assert status == 200, (out, cluster.decode.log_tail())
            meta = out["meta_info"]
            assert (
                out["output_ids"] == ref["output_ids"]
                and len(meta["output_token_logprobs"]) == MAX_NEW
            )
            assert (
                max(
                    abs(x - y)
                    for x, y in zip(
                        values(meta["output_token_logprobs"]),
                        values(ref["meta_info"]["output_token_logprobs"]),
                    )
                )
                < TOL
            )
            first = meta["output_top_logprobs"][0]  # the prefill's, through the metadata row
            assert len(first) == 20 and first[0][1] == ref["output_ids"][0]
            assert values(first[:5]) == pytest.approx(
                values(ref["meta_info"]["output_top_logprobs"][0]), abs=TOL
            )
        for start in (0, 5):
            for p, ref in zip(prompts, plain_and_dspark[0]):
                body = {
                    "input_ids": p,
                    "return_logprob": True,
                    "top_logprobs_num": 5,
                    "logprob_start_len": start,
                    "sampling_params": {
                        "max_new_tokens": MAX_NEW,
                        "temperature": 0,
                        "ignore_eos": True,
                    },
                }
                status, out = post(cluster.url + "/generate", body)
                assert status == 200, (out, cluster.prefill.log_tail(), cluster.decode.log_tail())
                chunks = sse(cluster.url + "/generate", body | {"stream": True})
                want = ref["meta_info"]
                # sglang-router 0.3.2 merges the prefill's input_token_logprobs into a plain answer
                # only (not input_top_logprobs, not streamed chunks); the sparkrelay router merges
                # both lists, into every chunk
                merged = [out["meta_info"]] + (
                    [c["meta_info"] for c in chunks] if router == "sparkrelay" else []
                )
                for meta in merged:
                    assert close_entries(
                        meta["input_token_logprobs"], want["input_token_logprobs"][start:]
                    )
                    if router == "sparkrelay":
                        assert close_tops(
                            meta["input_top_logprobs"], want["input_top_logprobs"][start:]
                        )
                assert out["output_ids"] == ref["output_ids"] and len(chunks) > 1
                assert close_entries(
                    chunks[-1]["meta_info"]["output_token_logprobs"], want["output_token_logprobs"]
                )
        status, out = post(
            cluster.url + "/generate",
            {"input_ids": prompts[0], "return_logprob": True, "logprob_start_len": len(prompts[0])},
        )
        assert status == 400 and "logprob_start_len" in json.dumps(out), out
    finally:
        cluster.stop()
