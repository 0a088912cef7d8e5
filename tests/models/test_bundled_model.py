"""The bundled model: its shape, size, tokenizer, held-out loss, and that it writes recognisable
Python."""

import json
import math

import torch

from sparkrelay import LLM, SamplingParams
from sparkrelay.kvcache.pool import KVPool
from sparkrelay.models.attention import AttnMeta
from sparkrelay.models.decoder import load_causal_lm
from sparkrelay.tools.corpus import read_texts, stdlib_files


def test_layout_and_size(bundled_model_dir):
    cfg = json.loads((bundled_model_dir / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3ForCausalLM"] and cfg["num_hidden_layers"] >= 8
    assert cfg["head_dim"] >= 32
    weights = sum(f.stat().st_size for f in bundled_model_dir.glob("*.safetensors"))
    assert weights <= 20 * 1024 * 1024, f"{weights} bytes of weights"
    tok_cfg = json.loads((bundled_model_dir / "tokenizer_config.json").read_text())
    assert tok_cfg["eos_token"] and "chat_template" in tok_cfg


@torch.inference_mode()
def test_held_out_loss_matches_the_report(bundled_model_dir):
    """Our forward on the held-out code files (codec tables left out) gives the training report's
    figure."""
    from transformers import AutoTokenizer

    report = json.loads((bundled_model_dir / "train_report.json").read_text())
    tok = AutoTokenizer.from_pretrained(bundled_model_dir)
    model = load_causal_lm(str(bundled_model_dir))
    _, held = stdlib_files()
    code = [p for p in held if "encodings" not in p.parts]
    ids = torch.tensor(
        [t for text in read_texts(code) for t in tok.encode(text) + [tok.eos_token_id]]
    )
    seq, losses = report["seq"], []
    blocks = list(range(seq // 16))
    for window in (w for w in ids.split(seq) if w.numel() == seq):
        pool = KVPool(
            range(model.spec.num_layers),
            len(blocks),
            16,
            model.spec.num_kv_heads,
            model.spec.head_dim,
            torch.float32,
            "cpu",
        )
        logits = model(
            AttnMeta.build([0], [seq], [blocks], 16, "cpu"), pool.layers, input_ids=window
        ).logits
        losses.append(torch.nn.functional.cross_entropy(logits[:-1], window[1:]).item())
    loss = sum(losses) / len(losses)
    assert len(losses) == report["held_out_windows_code"]
    assert math.isclose(loss, report["held_out_loss_code"], abs_tol=0.02), (
        loss,
        report["held_out_loss_code"],
    )
    assert loss < 4.5, f"held-out code loss {loss:.3f}"


def test_continues_python_with_python(bundled_model_dir):
    llm = LLM(str(bundled_model_dir))
    prompt = "import os\n\n\nclass Walker:\n    def __init__(self, root):"
    text = llm.generate(prompt, SamplingParams(max_new_tokens=64, temperature=0))["text"]
    print(text)
    markers = ["self.", "def ", "return", " = ", "if ", "(", ":\n"]
    assert sum(m in text for m in markers) >= 4, text
    indents = [len(l) - len(l.lstrip(" ")) for l in text.splitlines() if l.strip()]
    assert all(i % 4 == 0 for i in indents), text
