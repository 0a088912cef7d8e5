"""Reference computations with Hugging Face transformers."""

from __future__ import annotations

import torch


def load_hf(folder, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()


@torch.inference_mode()
def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Plain greedy decoding with transformers' KV cache (no EOS handling: runs the full length)."""
    out = model(torch.tensor([prompt]), use_cache=True)
    tokens = []
    for _ in range(max_new_tokens):
        tok = int(out.logits[0, -1].argmax())
        tokens.append(tok)
        out = model(torch.tensor([[tok]]), past_key_values=out.past_key_values, use_cache=True)
    return tokens
