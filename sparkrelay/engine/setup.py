"""How an Engine is built from the config: dtype, model (stage 0's layers), tokenizer, limits,
drafter and runner.

Plain functions, each a step of Engine.__init__ (engine/engine.py), so the engine module keeps the
loop."""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import Optional

import torch

from sparkrelay.config import Config, ConfigError
from sparkrelay.grammar.backends import GrammarError
from sparkrelay.grammar.compiler import GrammarCompiler
from sparkrelay.kvcache.pool import KVPool
from sparkrelay.models.decoder import CausalLM
from sparkrelay.models.dspark_checkpoint import load_dspark
from sparkrelay.models.gguf_file import GGUFError, gguf_tokenizer, is_gguf
from sparkrelay.models.quant import apply_torchao_config
from sparkrelay.pipeline.needs import RunnerNeeds
from sparkrelay.pipeline.partition import pp_partition
from sparkrelay.runner.model_runner import ModelRunner
from sparkrelay.runner.spec_runner import SpecRunner
from sparkrelay.spec.proposer import DSparkProposer
from sparkrelay.spec.stats import SpecStats

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str, device: str) -> torch.dtype:
    if name == "auto":
        return torch.float32 if device == "cpu" else torch.bfloat16
    return DTYPES[name]


def check_device(device: str) -> torch.device:
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"--device {device}: CUDA is not available on this machine")
    return dev


def load_tokenizer(path: str, chat_template: Optional[str] = None):
    """The tokenizer of a model folder, or of a GGUF file (its vocabulary, merges and chat
    template); `chat_template`: a Jinja file that replaces its template (--chat-template). Loaded once
    per process and path (until the path changes): the forked engine process gets the HTTP
    process's, where parsing a GGUF file's vocabulary is most of a start (docs/reliability.md)."""
    try:
        stamp = os.stat(path).st_mtime_ns
    except OSError:
        stamp = None  # a hub id or a missing path: transformers says what is wrong
    return _load_tokenizer(path, chat_template, stamp)


@functools.lru_cache(maxsize=8)
def _load_tokenizer(path: str, chat_template: Optional[str], stamp: Optional[int]):
    from transformers import AutoTokenizer

    if is_gguf(path):
        try:
            tokenizer = gguf_tokenizer(path)
        except GGUFError as e:
            raise ConfigError(f"--tokenizer-path / --model-path: {e}") from None
    else:
        tokenizer = AutoTokenizer.from_pretrained(path)
    if chat_template is not None:
        tokenizer.chat_template = read_chat_template(chat_template)
    return tokenizer


def read_chat_template(path: str) -> str:
    """The text of a --chat-template file, parsed once by Jinja so that a broken one stops the
    start, not the first chat request."""
    import jinja2

    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"--chat-template {path}: cannot read it ({e})") from None
    try:
        jinja2.Environment().parse(text)
    except jinja2.TemplateSyntaxError as e:
        raise ConfigError(f"--chat-template {path}: line {e.lineno}: {e.message}") from None
    return text


def stage0_end(config: Config, hf_config: dict) -> int:
    """With --pp-size N this process is stage 0: it loads (and caches KV for) only the first stage's
    layers."""
    layers = int(hf_config["num_hidden_layers"])
    try:
        return pp_partition(layers, config.parallel.pp_size)[0][1]
    except ValueError as e:
        raise ConfigError(str(e)) from None


def context_length(config: Config, model_max: int) -> int:
    asked = config.model.context_length
    if asked is not None and asked > model_max:
        raise ConfigError(
            f"--context-length {asked} exceeds the model's max_position_embeddings {model_max}"
        )
    return asked or model_max


def eos_ids(folder: str, hf_config: dict, tokenizer) -> tuple[int, ...]:
    ids: list[int] = []
    gen_cfg = Path(folder) / "generation_config.json"
    for source in (json.loads(gen_cfg.read_text()) if gen_cfg.is_file() else {}, hf_config):
        eos = source.get("eos_token_id")
        ids.extend(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return tuple(dict.fromkeys(ids))


# the default pool's cap on cpu, as vLLM's CPU backend (VLLM_CPU_KVCACHE_SPACE 4 GiB)
CPU_KV_BYTES = 4 << 30


def kv_capacity(config: Config, context: int, bytes_per_token: int = 1) -> int:
    """--max-total-tokens (default min(64 contexts, 128k, on cpu what 4 GiB holds at
    `bytes_per_token`, the KV of every layer: all pipeline stages run on this host)) rounded down to
    whole pages."""
    page = config.cache.page_size
    cap = CPU_KV_BYTES // bytes_per_token if config.model.device == "cpu" else 1 << 17
    total = config.cache.max_total_tokens or min(64 * context, 1 << 17, cap)
    if total // page * page < page:
        raise ConfigError(f"--max-total-tokens {total} is smaller than one page ({page})")
    return total // page * page


def read_token_map(path: str, vocab_size: int) -> torch.Tensor:
    """--speculative-token-map: a JSON list of token ids -> the ids [Vh] sorted; every fault names
    the flag. (SGLang's .pt form is a pickle, which sparkrelay never loads: docs/dspark.md §2.2 gives
    the one-line conversion.)"""
    flag = f"--speculative-token-map {path!r}"
    try:
        with open(path, encoding="utf-8") as f:
            ids = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{flag}: not a JSON list of token ids ({e})") from None
    if not isinstance(ids, list) or not ids or not all(type(i) is int for i in ids):
        raise ConfigError(f"{flag}: expected a non-empty JSON list of integer token ids")
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise ConfigError(f"{flag}: token id {bad[0]} is outside [0, {vocab_size})")
    if len(set(ids)) != len(ids):
        raise ConfigError(f"{flag}: token ids repeat")
    return torch.tensor(sorted(ids), dtype=torch.long)


def build_proposer(
    config: Config, model: CausalLM, dtype: torch.dtype, device: torch.device, num_blocks: int
) -> DSparkProposer:
    sp = config.spec
    try:
        drafter = load_dspark(
            sp.speculative_draft_model_path,
            model.spec,
            dtype,
            config.model.device,
            share_embedding_from=model.model.embed_tokens.weight,
            share_lm_head_from=model.lm_head.weight,
            load_format=config.model.load_format,
        )
    except ValueError as e:
        raise ConfigError(
            f"--speculative-draft-model-path {sp.speculative_draft_model_path}: {e}"
        ) from e
    if sp.speculative_token_map is not None:
        drafter.restrict_vocab(read_token_map(sp.speculative_token_map, model.spec.vocab_size))
    # fc stays in --dtype: a draft-kv prefill sums its column blocks stage by stage in --dtype
    # (ContextProjector.partial), so both sides' C, and the K/V made from it, are alike
    apply_torchao_config(drafter, config.draft_torchao_config, keep=("fc",))
    cap = sp.speculative_num_draft_tokens or drafter.spec.block_size
    return DSparkProposer(
        drafter,
        num_blocks,
        config.cache.page_size,
        device,
        cap,
        sp.speculative_dspark_confidence_threshold,
        head=model.head,
        max_rows=config.scheduler.max_running_requests,
    )


def build_runner(
    config: Config,
    model: CausalLM,
    pool: KVPool,
    device: torch.device,
    proposer: Optional[DSparkProposer],
    context: int,
    needs: RunnerNeeds,
):
    """(runner, spec stats or None): a pipeline of stage processes (--pp-size > 1, or a role that
    needs stages: a prefill's send the handoff), a drafting runner (DSpark) or the plain one."""
    seed = config.model.seed
    if proposer is None and (config.parallel.pp_size > 1 or needs.pipeline):
        # stage processes only when a pipeline is asked for
        from sparkrelay.pipeline.runner import (
            PipelineRunner,
        )

        return PipelineRunner(config, model, pool, needs), None
    if proposer is None:
        return ModelRunner(model, pool, device, seed), None
    runner = SpecRunner(
        model,
        pool,
        device,
        seed,
        proposer=proposer,
        context_length=context,
        disable_by_batch_size=config.spec.speculative_disable_by_batch_size,
    )
    return runner, SpecStats(proposer.max_drafts)


def build_grammars(
    config: Config, tokenizer, vocab_size: int, eos: tuple[int, ...]
) -> Optional[GrammarCompiler]:
    """The grammar compiler of --grammar-backend (None: structured outputs are refused); a missing
    backend package is a start-up error naming the flag."""
    name = config.scheduler.grammar_backend
    if name == "none":
        return None
    try:
        return GrammarCompiler(name, tokenizer, vocab_size, eos)
    except GrammarError as e:
        raise ConfigError(str(e)) from None


def compile_model(model: CausalLM, proposer: Optional[DSparkProposer]) -> None:
    """torch.compile the forwards, shapes dynamic (token counts and context lengths change every
    step). Prefill, one-sequence decode and batched decode trace different graphs; the cache limit
    leaves room."""
    import torch._dynamo

    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 32)
    model.body = torch.compile(model.body, dynamic=True)
    if proposer is not None:
        proposer.drafter.block_forward_paged = torch.compile(
            proposer.drafter.block_forward_paged, dynamic=True
        )


def model_info(config: Config, hf_config: dict) -> dict:
    mc = config.model
    return {
        "model_path": os.path.abspath(mc.model_path),
        "tokenizer_path": os.path.abspath(mc.tokenizer_path or mc.model_path),
        "is_generation": True,
        "architectures": hf_config.get("architectures", ["Qwen3ForCausalLM"]),
        "model_type": hf_config.get("model_type", "qwen3"),
    }
