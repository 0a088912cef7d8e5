"""Pipeline parallelism (sparkrelay/pipeline/): PP = 2 and 4 generate exactly what PP = 1 does
(greedy and seeded sampling, chunked prefill, batches split into micro-batches); the last stage's
DSpark capture (taps, and the partial context projection finished into draft K/V) equals the
single-model reference at absolute positions; a dead stage makes run() fail promptly with its name;
--pp-size beyond the layer count is refused; no worker process outlives its engine.
"""

import os
import signal
import time
from pathlib import Path

import pytest
import torch

from sparkrelay import LLM, SamplingParams
from sparkrelay.config import Config, ConfigError
from sparkrelay.engine.engine import Engine
from sparkrelay.kvcache.pool import KVPool
from sparkrelay.models.attention import AttnMeta
from sparkrelay.models.dspark_checkpoint import load_dspark
from sparkrelay.pipeline.capture import CaptureSpec
from sparkrelay.pipeline.needs import RunnerNeeds
from sparkrelay.pipeline.runner import PipelineRunner
from sparkrelay.trace import timeline

SETTINGS = dict(page_size=4, chunked_prefill_size=16, max_total_tokens=2048)
GREEDY = SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True)
SEEDED = SamplingParams(
    max_new_tokens=8, temperature=0.9, top_p=0.9, top_k=40, seed=7, ignore_eos=True
)
SINK_DIR = "SPARKRELAY_TEST_SINK_DIR"


def child_pids() -> list[int]:
    """Live or unreaped processes whose parent is this one."""
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                stat = Path(f"/proc/{name}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == os.getpid():
                out.append(int(name))
    return out


@pytest.fixture(scope="module")
def prompts(bundled_model_dir):
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(str(bundled_model_dir)).encode(Path(__file__).read_text())
    out = [ids[9 * i : 9 * i + 3 + (i * 7) % 13] for i in range(6)]
    out[2] = ids[200:241]  # 41 tokens: prefilled in 3 chunks of at most 16
    return out


@pytest.fixture(scope="module")
def reference(bundled_model_dir, prompts):
    """PP = 1 through the plain ModelRunner: greedy for all prompts, then seeded sampling for the
    first two."""
    llm = LLM(str(bundled_model_dir), **SETTINGS)
    return [
        o["output_ids"] for o in llm.generate(prompts + prompts[:2], [GREEDY] * 6 + [SEEDED] * 2)
    ]


@pytest.fixture(scope="module", params=[2, 4])
def pp_llm(request, bundled_model_dir):
    llm = LLM(str(bundled_model_dir), pp_size=request.param, **SETTINGS)
    assert len(llm.engine.runner.worker_pids) == request.param - 1
    yield llm
    llm.engine.close()
    llm.engine.close()  # idempotent
    assert not child_pids(), "a pipeline worker outlived its engine"


def test_pp_matches_pp1(pp_llm, prompts, reference):
    outs = pp_llm.generate(prompts + prompts[:2], [GREEDY] * 6 + [SEEDED] * 2)
    assert [o["output_ids"] for o in outs] == reference
    stats = pp_llm.engine.runner.stats
    assert stats["micro_batches"] > stats["steps"], "no step was split into micro-batches"
    pp_llm.engine.check()


def test_pp_serves_a_cached_prefix_like_pp1_uncached(pp_llm, prompts, bundled_model_dir):
    """The prefix cache on a pipeline: the stages hold the cached pages' KV for their own layers at
    the same slots, so the next turn computes only its new tokens and gives the tokens a PP=1 server
    without the cache gives."""
    long = prompts[2] * 3  # 123 tokens
    first = pp_llm.generate(long, GREEDY)
    turn2 = long + first["output_ids"] + prompts[3]
    out = pp_llm.generate(turn2, GREEDY)
    assert out["meta_info"]["cached_tokens"] >= 112
    plain = LLM(str(bundled_model_dir), disable_radix_cache=True, **SETTINGS)
    assert out["output_ids"] == plain.generate(turn2, GREEDY)["output_ids"]
    pp_llm.engine.check()


def test_dead_stage_fails_run_promptly(pp_llm, prompts):
    runner = pp_llm.engine.runner
    # PP 2: stage 1 (next to rank 0); PP 4: stage 2 (not adjacent)
    stage = len(runner.worker_pids) // 2 + 1
    pid = runner.worker_pids[stage - 1]
    os.kill(pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(
        RuntimeError, match=rf"pipeline stage {stage} \(pid {pid}\) exited with code -9"
    ):
        pp_llm.generate(prompts[0], GREEDY)
    assert time.monotonic() - start < 10
    with pytest.raises(RuntimeError, match=rf"pipeline stage {stage} \(pid {pid}\)"):
        pp_llm.engine.step()  # and every later step
    pp_llm.engine.close()
    assert not child_pids()


def test_pp_size_beyond_layers_is_refused(bundled_model_dir):
    config = Config().replace(model_path=str(bundled_model_dir), pp_size=9, **SETTINGS).validate()
    with pytest.raises(ConfigError, match="--pp-size 9"):
        Engine(config)
    assert not child_pids()


# -- DSpark capture through the pipeline -----------------------------------------------------------
class RecordingSink:
    """A StageSink that saves the last stage's aux rows / draft K/V and the released rooms under
    $SINK_DIR."""

    def __init__(self, stage: int, last: bool) -> None:
        self.dir, self.stage, self.last = Path(os.environ[SINK_DIR]), stage, last

    def after_forward(self, mb, meta, out, aux, draft_kv) -> None:
        if self.last:
            rows = {
                "seqs": [(s.room, s.start, s.end) for s in mb.seqs],
                "positions": meta.positions.cpu(),
                "aux": aux,
                "draft_kv": draft_kv,
            }
            torch.save(rows, self.dir / f"rows-{mb.step}-{mb.index}.pt")

    def on_sampled(self, mb, tokens, logprobs) -> None:
        assert (
            self.last
            and len(tokens) == sum(s.sample for s in mb.seqs)
            and all(t >= 0 for t in tokens)
        )
        assert len(logprobs) == len(tokens)

    def release(self, rooms) -> None:
        with open(self.dir / f"released-{self.stage}.txt", "a") as f:
            f.write("".join(f"{r}\n" for r in rooms))


def recording_sink(config, stage, partition, pool, status_address, bootstrap_url=""):
    assert status_address == "" and sorted(pool.layers) == list(range(*partition[stage]))
    return RecordingSink(stage, stage == len(partition) - 1)


def run_capture(folder, pp, capture, prompts, sink_dir, monkeypatch) -> dict[int, dict]:
    """Prefill every prompt (max_new_tokens 1) with the capture on -> {room: {position: saved row index...}}."""
    monkeypatch.setenv(SINK_DIR, str(sink_dir))
    config = Config().replace(model_path=str(folder), **SETTINGS).validate()
    engine = Engine(config)  # pp_size 1 aggregated: ModelRunner, replaced by a capturing pipeline
    needs = RunnerNeeds(capture=capture, sink_factory="test_pipeline:recording_sink")
    engine.runner = PipelineRunner(
        config.replace(pp_size=pp),
        engine.model,
        engine.pool,
        needs,
        room_of=lambda r: 1000 + int(r.rid),
    )
    try:
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, SamplingParams(max_new_tokens=1, temperature=0))
        while engine.has_work():
            engine.step()
    finally:
        engine.close()
    released = [int(x) for x in (sink_dir / f"released-{pp - 1}.txt").read_text().split()]
    assert sorted(released) == [1000 + i for i in range(len(prompts))]  # releases reach the stages
    return [torch.load(f, weights_only=False) for f in sorted(sink_dir.glob("rows-*.pt"))]


def by_room(dumps, key, width_of) -> dict[int, dict[int, torch.Tensor]]:
    """{room: {position: row}} from the saved micro-batches (rows of sequence b follow mb order)."""
    out: dict[int, dict[int, torch.Tensor]] = {}
    for d in dumps:
        row = 0
        for room, start, end in d["seqs"]:
            for pos in range(start, end):
                assert int(d["positions"][row]) == pos  # absolute positions, chunked or not
                out.setdefault(room, {})[pos] = width_of(d[key], row)
                row += 1
    return out


def reference_taps(engine_model, prompt, ids) -> torch.Tensor:
    """One forward of the full model over the whole prompt -> taps concatenated in `ids` order [n, k*d]."""
    s, n = engine_model.spec, len(prompt)
    pool = KVPool(
        range(s.num_layers), -(-n // 4), 4, s.num_kv_heads, s.head_dim, torch.float32, "cpu"
    )
    meta = AttnMeta.build([0], [n], [list(range(-(-n // 4)))], 4, "cpu")
    with torch.inference_mode():
        out = engine_model(meta, pool.layers, input_ids=torch.tensor(prompt), taps=ids)
    return torch.cat([out.taps[i] for i in ids], dim=-1)


@pytest.mark.parametrize("pp", [1, 4])
def test_taps_capture_equals_reference(pp, bundled_model_dir, prompts, tmp_path, monkeypatch):
    ids = (
        -1,
        3,
        4,
    )  # PP 4 stages [0,2) [2,4) [4,6) [6,8): -1 on 0, 3 ends stage 1, 4 starts stage 2, none on 3
    dumps = run_capture(
        bundled_model_dir, pp, CaptureSpec("taps", ids), prompts, tmp_path, monkeypatch
    )
    got = by_room(dumps, "aux", lambda aux, r: aux[r])
    from sparkrelay.models.decoder import load_causal_lm

    model = load_causal_lm(str(bundled_model_dir))
    for i, p in enumerate(prompts):
        ref = reference_taps(model, p, ids)  # [n, 3*d]
        rows = got[1000 + i]
        assert sorted(rows) == list(range(len(p)))
        assert torch.allclose(
            torch.stack([rows[j] for j in range(len(p))]), ref, atol=1e-4, rtol=1e-4
        )
    assert not child_pids()


@pytest.mark.parametrize("pp", [1, 2])
def test_partial_projection_equals_drafter_context_kv(
    pp, bundled_model_dir, bundled_drafter_dir, prompts, tmp_path, monkeypatch
):
    from sparkrelay.models.decoder import load_causal_lm

    model = load_causal_lm(str(bundled_model_dir))
    drafter = load_dspark(bundled_drafter_dir, model.spec, torch.float32, fuse=False)
    # (1, 3, 5, 6): PP 2 puts 1, 3 on stage 0 and 5, 6 on the last stage
    ids = drafter.spec.target_layer_ids
    capture = CaptureSpec("partial", ids, str(bundled_drafter_dir))
    dumps = run_capture(bundled_model_dir, pp, capture, prompts, tmp_path, monkeypatch)
    got = by_room(
        dumps, "draft_kv", lambda kv, r: torch.cat([torch.cat([k[r], v[r]]) for k, v in kv])
    )
    for i, p in enumerate(prompts):
        with torch.inference_mode():
            ctx = drafter.context_kv(
                drafter.project_context(reference_taps(model, p, ids)), torch.arange(len(p))
            )
        # [n, layers * 2 * n_kv, hd]
        ref = torch.cat([torch.cat([k, v], dim=1) for k, v in ctx], dim=1)
        rows = got[1000 + i]
        assert sorted(rows) == list(range(len(p)))
        assert torch.allclose(
            torch.stack([rows[j] for j in range(len(p))]), ref, atol=1e-4, rtol=1e-4
        )
    assert not child_pids()


def read_trace(folder: Path, stage: int) -> list[dict]:
    return [
        e
        for e in timeline.read(str(folder))
        if e["source"] == f"stage{stage}" and e["event"] == "chunk"
    ]


def test_chunks_pipeline_across_stages(bundled_model_dir, tmp_path, monkeypatch):
    """A 1,024-token prompt on 2 stages is cut into 4 chunks of 256 (pipeline/runner.py
    CHUNK_TOKENS): stage 1 runs chunk k while stage 0 runs chunk k + 1 (the stages' recorded
    intervals overlap), and the tokens, the prompt's logprobs and the sampled token's logprobs equal
    PP = 1's."""
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(str(bundled_model_dir)).encode(Path(__file__).read_text())[
        :1024
    ]
    params = SamplingParams(
        max_new_tokens=6,
        temperature=0,
        ignore_eos=True,
        return_logprob=True,
        top_logprobs_num=2,
        logprob_start_len=100,
    )
    settings = dict(page_size=4, chunked_prefill_size=2048, max_total_tokens=4096)
    ref = LLM(str(bundled_model_dir), **settings)
    want = ref.generate([ids], params)[0]
    ref.engine.close()
    monkeypatch.setenv(timeline.ENV, str(tmp_path / "trace"))
    # stage 0 a little slower: overlap is certain
    monkeypatch.setenv("SPARKRELAY_TEST_PP_STAGE_DELAY", "0:0.02")
    llm = LLM(str(bundled_model_dir), pp_size=2, **settings)
    got = llm.generate([ids], params)[0]
    llm.engine.close()
    assert got["output_ids"] == want["output_ids"]
    for key in ("input_token_logprobs", "output_token_logprobs"):
        assert [e[1] for e in got["meta_info"][key]] == [e[1] for e in want["meta_info"][key]]
        assert [e[0] for e in got["meta_info"][key]] == pytest.approx(
            [e[0] for e in want["meta_info"][key]], abs=1e-4
        )
    s0, s1 = ([r for r in read_trace(tmp_path / "trace", s) if r["num_mbs"] == 4] for s in (0, 1))
    assert [r["tokens"] for r in s0] == [[[256 * k, 256 * (k + 1)]] for k in range(4)]
    assert [r["tokens"] for r in s1] == [r["tokens"] for r in s0]
    assert s1[0]["start"] < s0[3]["end"], "stage 1 waited for stage 0's last chunk"
    overlaps = [
        k
        for k in range(3)
        if s1[k]["start"] < s0[k + 1]["end"] and s0[k + 1]["start"] < s1[k]["end"]
    ]
    assert overlaps, f"no chunk ran on stage 1 while stage 0 ran the next: {s0} {s1}"
