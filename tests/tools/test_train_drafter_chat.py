"""The drafter tool's chat path end to end on a small random Llama: answers JSONL in chat_data.py's format ->
training steps (bfloat16 target, autocast) with learning-curve points -> an exported DeepSpec drafter without the
target's embedding and head, which the engine loads by sharing the target's and decodes losslessly."""

import json

import pytest
import torch

from sparkrelay import LLM, SamplingParams
from sparkrelay.tools.train import drafter
from testkit.families import make_random


def write_answers(path, n: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with path.open("w") as f:
        for i in range(n):
            prompt = [1] + torch.randint(
                3, 4000, (int(torch.randint(8, 40, (1,), generator=g)),), generator=g
            ).tolist()
            answer = torch.randint(3, 4000, (48,), generator=g).tolist() + [2]
            f.write(
                json.dumps(
                    {
                        "set": ["gsm8k", "mbpp"][i % 2],
                        "i": i,
                        "prompt_ids": prompt,
                        "answer_ids": answer,
                        "finish": {"type": "stop"},
                    }
                )
                + "\n"
            )


def train_chat(tmp_path, target, out, work: str, steps: int, *extra: str) -> None:
    drafter.main(
        [
            "--data",
            "chat",
            "--target",
            str(target),
            "--answers",
            str(tmp_path / "train.jsonl"),
            "--eval-answers",
            str(tmp_path / "eval.jsonl"),
            "--work-dir",
            str(tmp_path / work),
            "--out",
            str(out),
            "--layers",
            "1",
            "--taps",
            "0",
            "2",
            "--markov-rank",
            "16",
            "--anchors",
            "8",
            "--batch",
            "2",
            "--max-steps",
            str(steps),
            "--eval-every",
            "2",
            "--log-every",
            "1",
            "--mask-token",
            "<|endoftext|>",
            "--target-dtype",
            "bfloat16",
            "--autocast",
            "--no-frozen-copies",
            "--threads",
            "1",
            *extra,
        ]
    )


def test_chat_training_exports_a_drafter_the_engine_serves(tmp_path):
    target = make_random(tmp_path / "target", "llama-tied")
    write_answers(tmp_path / "train.jsonl", 6, 0)
    write_answers(tmp_path / "eval.jsonl", 4, 1)
    out = tmp_path / "drafter"
    train_chat(tmp_path, target, out, "work", 4)
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
    assert "fc.weight" in keys and not keys & {"embed_tokens.weight", "lm_head.weight"}
    report = json.loads((out / "train_report.json").read_text())
    assert report["steps"] == 4 and report["data"]["rows"] == 6
    assert [p["step"] for p in report["learning_curve"]] == [2, 4]
    assert set(report["learning_curve"][0]) >= {"tau", "tau_gsm8k", "tau_mbpp", "cpu_hours"}
    greedy = SamplingParams(max_new_tokens=16, temperature=0, ignore_eos=True)
    prompts = [list(range(5, 5 + n)) for n in (4, 19)]
    spec = LLM(
        str(target),
        speculative_algorithm="DSPARK",
        speculative_draft_model_path=str(out),
        max_total_tokens=1024,
        page_size=4,
    )
    plain = LLM(str(target), max_total_tokens=1024, page_size=4)
    assert [o["output_ids"] for o in spec.generate(prompts, greedy)] == [
        o["output_ids"] for o in plain.generate(prompts, greedy)
    ]
    assert spec.engine.proposer.drafter.shared_with_target == ("embed_tokens", "lm_head")


def test_feature_cache_returns_the_target_pass_and_skips_the_target(tmp_path):
    from sparkrelay.tools.train.drafter_data import load_target, target_features, target_pass

    target = load_target(str(make_random(tmp_path / "target", "llama-tied")), "bfloat16")
    ids = torch.arange(3, 40)
    feats, final = target_pass(target, ids[None], [0, 2])
    first = target_features(target, ids, [0, 2], tmp_path / "feats")
    forward = target.model.forward
    target.model.forward = lambda *a, **k: 1 / 0  # a second pass of the target would raise
    again = target_features(target, ids, [0, 2], tmp_path / "feats")
    target.model.forward = forward
    for got in (first, again):
        assert torch.equal(got[0], feats[0]) and torch.equal(got[1], final[0])
    other = target_features(target, ids, [1], tmp_path / "feats")  # other taps are another entry
    assert (
        other[0].shape[-1] == feats.shape[-1] // 2
        and len(list((tmp_path / "feats").glob("*.pt"))) == 2
    )


def test_a_run_continues_from_an_exported_drafter(tmp_path, monkeypatch):
    """--init-from: the new run starts from the exported weights (not a fresh init) and counts its
    steps, hours and learning curve after the run it continues; a wrong drafter shape is a clear
    error."""
    from safetensors.torch import load_file

    target = make_random(tmp_path / "target", "llama-tied")
    write_answers(tmp_path / "train.jsonl", 6, 0)
    write_answers(tmp_path / "eval.jsonl", 4, 1)
    first, second = tmp_path / "first", tmp_path / "second"
    train_chat(tmp_path, target, first, "work1", 2)
    stored = load_file(str(first / "model.safetensors"))
    seen = {}
    real_step = drafter.train_step

    def spy(model, *a, **k):  # the weights the continued run's first step starts from
        seen.setdefault("fc", model.fc.weight.detach().clone())
        return real_step(model, *a, **k)

    monkeypatch.setattr(drafter, "train_step", spy)
    train_chat(tmp_path, target, second, "work2", 2, "--init-from", str(first))
    assert torch.equal(seen["fc"].to(torch.bfloat16), stored["fc.weight"])
    before, after = (json.loads((d / "train_report.json").read_text()) for d in (first, second))
    assert after["steps"] == 4 and after["this_run"]["from_step"] == 2
    assert [p["step"] for p in after["learning_curve"]] == [2, 4]
    # the earlier run's point, carried over
    assert after["learning_curve"][0] == before["learning_curve"][0]
    with pytest.raises(SystemExit, match="--init-from"):
        train_chat(
            tmp_path,
            target,
            tmp_path / "third",
            "work3",
            1,
            "--init-from",
            str(first),
            "--layers",
            "2",
        )
