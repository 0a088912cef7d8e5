"""GGUF loading (models/gguf_file.py) and the converter (tools/convert_gguf.py), on a GGUF file
written here from a random Llama with the gguf package the way llama.cpp's converter writes one: q/k
rows permuted, tensors in Q8_0, Q4_0, Q4_1, F16, BF16 and F32, the bundled byte-level BPE tokenizer
and its chat template as metadata."""

import json

import numpy as np
import pytest
import torch

from sparkrelay import LLM, SamplingParams
from sparkrelay.config import Config, ConfigError
from sparkrelay.models.decoder import load_causal_lm
from sparkrelay.models.gguf_file import gguf_config, gguf_tensors
from sparkrelay.models.loader import CheckpointError
from sparkrelay.tools.convert_gguf import convert
from testkit.families import make_random, pool_for, run
from testkit.hf import load_hf
from testkit.models import tokenizer_source

QUANTS = ("Q8_0", "Q4_0", "Q4_1", "F16", "BF16", "F32")


def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf row order for q/k of a Llama: HF halves -> interleaved pairs."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def write_gguf(hf_dir, path) -> dict[str, torch.Tensor]:
    """The GGUF file of the HF folder; returns the HF tensors after the quantization round trip (the
    reference)."""
    import gguf
    from safetensors.torch import load_file

    cfg = json.loads((hf_dir / "config.json").read_text())
    tensors = load_file(str(hf_dir / "model.safetensors"))
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    add_tokenizer(w)
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, cfg["num_hidden_layers"])
    heads = {"q_proj": cfg["num_attention_heads"], "k_proj": cfg["num_key_value_heads"]}
    reference = {}
    for i, (key, t) in enumerate(sorted(tensors.items())):
        data = t.float().numpy()
        proj = key.split(".")[-2]
        # biases too, as llama.cpp
        stored = llama_cpp_permute(data, heads[proj]) if proj in heads else data
        qtype = gguf.GGMLQuantizationType[QUANTS[i % len(QUANTS)] if data.ndim == 2 else "F32"]
        packed = gguf.quants.quantize(stored, qtype)
        w.add_tensor(
            name_map.get_name(key, try_suffixes=(".weight", ".bias")), packed, raw_dtype=qtype
        )
        back = gguf.quants.dequantize(packed, qtype).reshape(data.shape)
        reference[key] = torch.from_numpy(
            llama_cpp_permute_inverse(back, heads[proj]) if stored is not data else back
        )
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return reference


def llama_cpp_permute_inverse(w: np.ndarray, heads: int) -> np.ndarray:
    return (
        w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def add_tokenizer(w) -> None:
    """The bundled tokenizer as llama.cpp stores a byte-level BPE one ("gpt2": tokens, merges, token
    types)."""
    tok = json.loads((tokenizer_source() / "tokenizer.json").read_text())
    tcfg = json.loads((tokenizer_source() / "tokenizer_config.json").read_text())
    vocab = {**tok["model"]["vocab"], **{a["content"]: a["id"] for a in tok["added_tokens"]}}
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    special = {a["id"] for a in tok["added_tokens"]}
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([3 if i in special else 1 for i in range(len(tokens))])  # CONTROL / NORMAL
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
    w.add_bos_token_id(
        vocab[tcfg["bos_token"]] if tcfg.get("bos_token") else vocab["<|endoftext|>"]
    )
    w.add_eos_token_id(vocab[tcfg["eos_token"]])
    w.add_chat_template(tcfg["chat_template"])


def gguf_of(root, case: str):
    hf_dir = make_random(root / "hf", case)
    path = root / f"tiny-{case}.gguf"
    return hf_dir, path, write_gguf(hf_dir, path)


@pytest.fixture(scope="module")
def gguf_model(tmp_path_factory):
    """SmolLM2's layout: tied embeddings, no biases (what transformers' GGUF reader also reads)."""
    return gguf_of(tmp_path_factory.mktemp("gguf"), "llama-tied")


@pytest.fixture(scope="module")
def gguf_biased(tmp_path_factory):
    return gguf_of(tmp_path_factory.mktemp("gguf_bias"), "llama-bias-tied")


def test_tensors_equal_the_dequantized_checkpoint(gguf_biased):
    _, path, reference = gguf_biased
    got = {k: read() for k, read in gguf_tensors(str(path))}
    assert set(got) == set(reference)
    for key, t in reference.items():
        torch.testing.assert_close(got[key], t, atol=0, rtol=0, msg=key)
    cfg = gguf_config(str(path))
    assert (
        cfg["architectures"] == ["LlamaForCausalLM"]
        and cfg["tie_word_embeddings"]
        and cfg["attention_bias"]
    )


@torch.inference_mode()
def test_gguf_logits_equal_transformers_reading_the_same_file(gguf_model):
    from transformers import AutoModelForCausalLM

    _, path, _ = gguf_model
    hf = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
    ours = load_causal_lm(str(path))
    ids = list(range(7, 60))
    ref = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(
        run(ours, pool_for(ours), ids, 0, list(range(16))).logits, ref, atol=1e-4, rtol=0
    )


def test_converted_folder_serves_the_gguf_tokens(gguf_model, tmp_path):
    _, path, _ = gguf_model
    folder = convert(path, tmp_path / "converted")
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= {
        p.name for p in folder.iterdir()
    }
    assert json.loads((folder / "tokenizer_config.json").read_text())["chat_template"]
    hf = load_hf(folder)  # transformers reads the folder as it is
    greedy = SamplingParams(max_new_tokens=10, temperature=0, ignore_eos=True)
    settings = dict(page_size=4, max_total_tokens=1024)
    a, b = LLM(str(path), **settings), LLM(str(folder), **settings)
    text = a.tokenizer.apply_chat_template(
        [{"role": "user", "content": "def add(a, b):"}], tokenize=False, add_generation_prompt=True
    )
    assert a.tokenizer.encode(text) == b.tokenizer.encode(text)
    assert a.generate(text, greedy)["output_ids"] == b.generate(text, greedy)["output_ids"]
    with torch.inference_mode():
        ref = hf(torch.tensor([b.tokenizer.encode(text)])).logits[0, -1].argmax()
    assert a.generate(text, greedy)["output_ids"][0] == int(ref)


def test_bad_gguf_paths_are_clear_errors(gguf_model, tmp_path):
    hf_dir, path, _ = gguf_model
    with pytest.raises(
        ConfigError, match="--load-format gguf: --model-path .* is not a .gguf file"
    ):
        Config().replace(model_path=str(hf_dir), load_format="gguf").validate()
    with pytest.raises(ConfigError, match="no such GGUF file"):
        Config().replace(model_path=str(tmp_path / "missing.gguf")).validate()
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(path.read_bytes()[:1000])
    with pytest.raises(CheckpointError, match="not a readable GGUF file"):
        load_causal_lm(str(broken))
