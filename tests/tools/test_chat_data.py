"""chat_data.py's number variants: new word problems from training prompts, drawn reproducibly, answered
by the target through the offline engine, resumable like the plain answers."""

import json
import re

import pytest

from sparkrelay.tools.train import chat_data

MODEL = "models/tiny-qwen3"


def test_a_variant_redraws_each_integer_at_its_digit_count_and_keeps_the_words():
    text = "Tom has 16 apples and 3 pears; he pays $2,450 for 1000 more. Why? Because 0 is none."
    a = chat_data.number_variant(text, seed=7)
    assert a == chat_data.number_variant(text, seed=7)  # a rerun writes the same prompt
    assert a != chat_data.number_variant(text, seed=8)
    assert re.sub(r"\d+", "#", a) == re.sub(r"\d+", "#", text)
    old, new = re.findall(r"\d+", text), re.findall(r"\d+", a)
    assert [len(x) for x in new] == [len(x) for x in old]
    assert all(x[0] != "0" for x in new)
    assert new != old


def test_variants_skip_prompts_without_digits_and_number_from_one():
    prompts = [("gsm8k", 0, "Add 2 and 3."), ("mt-bench", 0, "Write a poem.")]
    out = chat_data.variant_prompts(prompts, 3)
    assert [(s, i, v) for s, i, v, _ in out] == [("gsm8k", 0, 1), ("gsm8k", 0, 2), ("gsm8k", 0, 3)]
    assert len({text for *_, text in out}) == 3


def write_set(folder, name: str, texts: list[str]) -> None:
    folder.mkdir(exist_ok=True)
    (folder / f"{name}.jsonl").write_text("".join(json.dumps({"turns": [t]}) + "\n" for t in texts))


def test_variant_answers_are_written_once_and_resumed(tmp_path):
    from sparkrelay.tools.corpus import prompt_split

    texts = [f"Sam buys {n} pens at {n + 3} cents each. What does he pay?" for n in range(10, 40)]
    train = [t for t in texts if prompt_split(t) == "train"][:3]
    write_set(tmp_path / "prompts", "gsm8k", train)
    argv = ["--target", MODEL, "--prompts", str(tmp_path / "prompts"), "--sets", "gsm8k"]
    argv += ["--out", str(tmp_path / "out"), "--max-new", "4", "--variants", "2", "--chunk", "4"]
    path = chat_data.generate(chat_data.build_parser().parse_args(argv))
    assert path.name == "greedy_variants.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert sorted((r["i"], r["v"]) for r in rows) == [(i, v) for i in range(3) for v in (1, 2)]
    assert all(len(r["answer_ids"]) == 4 and r["set"] == "gsm8k" for r in rows)
    assert len({tuple(r["prompt_ids"]) for r in rows}) == 6  # six different problems
    path.write_text(
        "".join(json.dumps(r) + "\n" for r in rows[:4]) + '{"set": "gs'
    )  # killed mid-row
    chat_data.generate(chat_data.build_parser().parse_args(argv))
    again = [json.loads(line) for line in path.read_text().splitlines()]
    assert again[:4] == rows[:4]
    # the torn row is dropped and only the two missing problems are answered again
    key = lambda r: (r["i"], r["v"], tuple(r["prompt_ids"]))  # noqa: E731
    assert sorted(map(key, again)) == sorted(map(key, rows))


def test_synthetic_prompts_are_distinct_reproducible_and_mix_every_kind():
    from sparkrelay.tools.train.chat_prompts import TEMPLATES, all_prompts, synthetic_prompts

    every = [text for _, text in all_prompts()]
    assert len(set(every)) == len(every) > 800
    first = synthetic_prompts(200)
    assert first == synthetic_prompts(200) and first != synthetic_prompts(200, seed=1)
    assert synthetic_prompts(50) == first[:50]  # a larger run extends a smaller one
    assert len(set(first)) == 200
    kinds = {kind for kind, _ in TEMPLATES}
    stems = {k: [tpl.split("{t}")[0] for kind, tpl in TEMPLATES if kind == k] for k in kinds}
    seen = {k for k, heads in stems.items() for p in first[:20] for h in heads if p.startswith(h)}
    assert seen == kinds


def test_synthetic_answers_are_their_own_file_and_refuse_the_eval_split(tmp_path):
    argv = ["--target", MODEL, "--out", str(tmp_path), "--max-new", "3", "--synthetic", "5"]
    path = chat_data.generate(chat_data.build_parser().parse_args(argv + ["--mode", "sample"]))
    assert path.name == "sample_synthetic.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert sorted(r["i"] for r in rows) == list(range(5)) and {r["set"] for r in rows} == {"chat"}
    assert all(len(r["answer_ids"]) == 3 for r in rows)
    with pytest.raises(SystemExit):
        chat_data.main(argv + ["--split", "eval"])
