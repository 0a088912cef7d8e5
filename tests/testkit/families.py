"""Small random configs of the Llama, Mistral and Qwen2 families (saved as transformers writes
them), and the two helpers that run a loaded model on a paged pool."""

import shutil

import torch

from sparkrelay.kvcache.pool import KVPool
from sparkrelay.models.attention import AttnMeta
from testkit.models import TOKENIZER_FILES, tokenizer_source

SMALL = dict(
    vocab_size=4096,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=2048,
    rope_theta=10000.0,
    tie_word_embeddings=False,
)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
    "rope_theta": 10000.0,
}
CASES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "llama-tied": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(tie_word_embeddings=True),
    ),  # SmolLM2's layout
    "llama-bias-tied": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(attention_bias=True, mlp_bias=True, tie_word_embeddings=True),
    ),
    "llama3-rope": ("LlamaConfig", "LlamaForCausalLM", dict(rope_parameters=LLAMA3_ROPE)),
    "llama-linear-rope": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}),
    ),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=None)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
}


def make_random(folder, case: str, seed: int = 0, **overrides):
    import transformers

    cfg_name, model_name, extra = CASES[case]
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(
        getattr(transformers, cfg_name)(**{**SMALL, **extra, **overrides})
    ).eval()
    if "bias" in case or case == "qwen2":
        with torch.no_grad():  # transformers starts biases at zero: make them count
            for name, p in model.named_parameters():
                if name.endswith("bias"):
                    p.normal_(0, 0.1)
    model.save_pretrained(folder, safe_serialization=True)
    for name in TOKENIZER_FILES:
        shutil.copy(tokenizer_source() / name, folder / name)
    return folder


def run(model, pool, ids, start, table, hidden=None):
    meta = AttnMeta.build([start], [start + len(ids)], [table], 4, "cpu")
    return model(
        meta,
        pool.layers,
        input_ids=None if hidden is not None else torch.tensor(ids),
        hidden=hidden,
    )


def pool_for(model):
    s = model.spec
    return KVPool(
        range(model.start, model.end), 64, 4, s.num_kv_heads, s.head_dim, torch.float32, "cpu"
    )
