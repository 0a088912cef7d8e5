"""lm-eval 0.4 against a running server, the way evaluation harnesses use it: its `local-completions`
model scores a multiple-choice task by loglikelihood (`echo: true, logprobs: 1` over token ids) and
runs a `generate_until` task; every item's loglikelihood equals lm-eval's own `hf` model on the same
weights to 1e-4 (float32), the greedy flags and the generations are equal, and so are the scores. The
tasks are written here, as JSONL, on the real chat model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from testkit.http import UvicornThread, make_app

MC = [
    ("The capital of France is", [" Paris", " London", " Rome", " Berlin"], 0),
    ("Water freezes at zero degrees", [" Celsius", " Fahrenheit", " Kelvin"], 0),
    ("The largest planet in the solar system is", [" Mars", " Jupiter", " Venus"], 1),
    ("Two plus two equals", [" three", " four", " five"], 1),
    ("The opposite of hot is", [" cold", " warm", " loud"], 0),
    ("A week has seven", [" days", " hours", " years"], 0),
]
GEN = ["The capital of Italy is", "List three colors:", "def square(x):\n", "Hello, my name is"]


def _tasks(folder: Path) -> Path:
    (folder / "mc.jsonl").write_text(
        "\n".join(json.dumps({"q": q, "choices": c, "answer": a}) for q, c, a in MC)
    )
    (folder / "gen.jsonl").write_text("\n".join(json.dumps({"q": q, "a": ""}) for q in GEN))
    (folder / "sr_mc.yaml").write_text(
        "task: sr_mc\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {folder / 'mc.jsonl'}\ntest_split: test\noutput_type: multiple_choice\n"
        'doc_to_text: "{{q}}"\ndoc_to_choice: "{{choices}}"\ndoc_to_target: answer\n'
        "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n"
    )
    (folder / "sr_gen.yaml").write_text(
        "task: sr_gen\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {folder / 'gen.jsonl'}\ntest_split: test\noutput_type: generate_until\n"
        'doc_to_text: "{{q}}"\ndoc_to_target: "{{a}}"\n'
        'generation_kwargs:\n  until: ["\\n\\n"]\n  max_gen_toks: 16\n  do_sample: false\n'
        "  temperature: 0\nmetric_list:\n  - metric: exact_match\n    aggregation: mean\n"
        "    higher_is_better: true\n"
    )
    return folder


# ~42 s: lm-eval, a server and its hf model on SmolLM2; echo scoring: test_echo.py (default run)
@pytest.mark.slow
def test_lm_eval_through_the_server_equals_its_hf_model(tmp_path, smollm2_dir):
    import lm_eval  # a test extra
    from lm_eval.tasks import TaskManager

    tm = TaskManager(include_path=str(_tasks(tmp_path)))
    tasks = ["sr_mc", "sr_gen"]
    app, _ = make_app(smollm2_dir, context_length=2048, max_total_tokens=8192)
    with UvicornThread(app) as server:
        served = lm_eval.simple_evaluate(
            model="local-completions",
            model_args=f"model=smollm2,base_url={server.url}/v1/completions,"
            f"tokenizer_backend=huggingface,tokenizer={smollm2_dir},num_concurrent=1,max_retries=1",
            tasks=tasks,
            task_manager=tm,
            log_samples=True,
        )
    hf = lm_eval.simple_evaluate(
        model="hf",
        model_args=f"pretrained={smollm2_dir},dtype=float32,device=cpu",
        tasks=tasks,
        task_manager=tm,
        log_samples=True,
    )
    for a, b in zip(served["samples"]["sr_mc"], hf["samples"]["sr_mc"], strict=True):
        for (lp_a, greedy_a), (lp_b, greedy_b) in zip(
            [r[0] for r in a["resps"]], [r[0] for r in b["resps"]], strict=True
        ):
            assert abs(lp_a - lp_b) < 1e-4, (a["doc"], lp_a, lp_b)
            assert greedy_a == greedy_b, a["doc"]
    gens = [s["resps"] for s in served["samples"]["sr_gen"]]
    assert gens == [s["resps"] for s in hf["samples"]["sr_gen"]]
    assert "Rome" in gens[0][0][0], gens
    assert served["results"]["sr_mc"]["acc,none"] == hf["results"]["sr_mc"]["acc,none"] >= 0.5
