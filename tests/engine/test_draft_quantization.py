"""--speculative-draft-model-quantization (SGLang's flag): the drafter's linears in int8 under a bf16
target (or unquantized under an int8wo one); the target's own weights are untouched, fc stays in
--dtype (a draft-kv prefill sums its column blocks in --dtype), DSpark stays lossless (greedy equal to
plain token for token, under a bf16 target), and the draft-kv handshake names the drafter's
weights."""

import pytest
import torch

from sparkrelay import LLM, SamplingParams
from sparkrelay.config import Config, ConfigError
from sparkrelay.disagg.handoff import build_schema
from sparkrelay.disagg.schema import compare
from sparkrelay.envs import DisaggEnv
from sparkrelay.models.decoder import DecoderSpec
from sparkrelay.models.kernels import AvxLinear, PackedLinear, WideLinear, onednn_bf16
from sparkrelay.models.loader import read_config
from sparkrelay.models.quant import Int8Linear
from testkit.models import BUNDLED, PROMPT_SOURCE, code_prompts

GREEDY = SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True)

BF16_OFF = PackedLinear if onednn_bf16() else WideLinear  # with the kernels off


@pytest.mark.parametrize("target, draft", [("", "int8wo"), ("int8wo", "unquant")])
def test_the_drafter_takes_its_own_weights_and_stays_lossless(bundled_drafter_dir, target, draft):
    settings = dict(dtype="bfloat16", torchao_config=target, max_running_requests=4)
    plain = LLM(str(BUNDLED), **settings)
    prompts = code_prompts(plain.tokenizer, 4, PROMPT_SOURCE)
    want = [o["output_ids"] for o in plain.generate(prompts, GREEDY)]
    llm = LLM(
        str(BUNDLED),
        speculative_algorithm="DSPARK",
        speculative_draft_model_path=str(bundled_drafter_dir),
        speculative_draft_model_quantization=draft,
        **settings,
    )
    drafter, model = llm.engine.proposer.drafter, llm.engine.runner.model
    drafted = Int8Linear if draft == "int8wo" else (AvxLinear, BF16_OFF)
    layers = [m for layer in drafter.layers for m in (layer.self_attn.qkv, layer.mlp.down_proj)]
    assert all(isinstance(m, drafted) for m in layers + [drafter.context.product])
    assert not isinstance(drafter.fc, Int8Linear)  # --dtype, as the prefill's column sums
    target_kind = Int8Linear if target else (AvxLinear, BF16_OFF)
    assert isinstance(model.model.layers["0"].mlp.down_proj, target_kind)
    got = [o["output_ids"] for o in llm.generate(prompts, GREEDY)]
    assert llm.engine.stats()["spec_accept_length"] > 1.0
    if not target:  # an int8wo target's 8-row verify and 1-row decode take different kernel
        assert got == want  # paths (AMX from 2 rows), so its greedy ties may break apart


def test_flag_checks_and_the_draft_kv_schema(bundled_drafter_dir):
    base = Config().replace(model_path=str(BUNDLED))
    assert base.draft_torchao_config == ""
    assert base.replace(torchao_config="int8wo").draft_torchao_config == "int8wo"
    assert (
        base.replace(torchao_config="int8wo", speculative_draft_model_quantization="unquant")
    ).draft_torchao_config == ""
    with pytest.raises(ConfigError, match="--speculative-draft-model-quantization 'fp8'"):
        base.replace(
            speculative_algorithm="DSPARK",
            speculative_draft_model_path=str(bundled_drafter_dir),
            speculative_draft_model_quantization="fp8",
        ).validate()
    with pytest.raises(ConfigError, match="needs --speculative-algorithm DSPARK"):
        base.replace(speculative_draft_model_quantization="int8wo").validate()
    spec = DecoderSpec.from_hf(read_config(BUNDLED))
    sides = {}
    for mode, quant in (("prefill", None), ("decode", "int8wo")):
        cfg = base.replace(
            speculative_algorithm="DSPARK" if mode == "decode" else None,
            disaggregation_mode=mode,
            dspark_pd_handoff="draft-kv",
            speculative_draft_model_path=str(bundled_drafter_dir),
            speculative_draft_model_quantization=quant,
        )
        sides[mode] = build_schema(cfg, spec, torch.float32, DisaggEnv.read()).to_dict()
    assert sides["prefill"]["draft_weights"] == "unquant"
    assert compare(sides["prefill"], sides["decode"]) == [
        "draft_weights: prefill='unquant' decode='int8wo'"
    ]
    # the target's own weights: a prefill quantized with --torchao-config, a decode not
    quantized = build_schema(
        base.replace(disaggregation_mode="prefill", torchao_config="int8wo"),
        spec,
        torch.float32,
        DisaggEnv.read(),
    ).to_dict()
    plain = build_schema(
        base.replace(disaggregation_mode="decode"), spec, torch.float32, DisaggEnv.read()
    ).to_dict()
    assert (quantized["weights"], plain["weights"]) == ("int8wo", "unquant")
    assert compare(quantized, plain) == ["weights: prefill='int8wo' decode='unquant'"]
