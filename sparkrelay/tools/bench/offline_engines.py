"""The engine configurations of the offline benchmark (python -m sparkrelay.tools.bench.offline): a
`Runner` per engine (sparkrelay's `LLM`, with or without DSpark and torch.compile, and the
transformers reference) and the table of their names. Another configuration is one `EngineConfig`
appended to `ENGINE_CONFIGS`."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Protocol

REFERENCE = "transformers"  # ratios and greedy agreement are taken against this engine


class Runner(Protocol):
    """A loaded engine: greedy-generates exactly `output_len` tokens (EOS ignored) for each prompt
    of a group submitted together, and returns the new token ids in prompt order."""

    def generate(self, prompts: list[list[int]], output_len: int) -> list[list[int]]: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class EngineConfig:
    """One row family of the table: a name and how to load its runner from the parsed arguments."""

    name: str
    load: Callable[[argparse.Namespace], Runner]


# -- sparkrelay ------------------------------------------------------------------------------------


class SparkrelayRunner:
    def __init__(self, args: argparse.Namespace, **settings) -> None:
        from sparkrelay import LLM, SamplingParams

        self._params = SamplingParams
        settings.setdefault("max_running_requests", max(64, max(args.batch_sizes)))
        self.llm = LLM(args.model_path, dtype=args.dtype, device=args.device, **settings)

    def generate(self, prompts: list[list[int]], output_len: int) -> list[list[int]]:
        params = self._params(max_new_tokens=output_len, temperature=0, ignore_eos=True)
        return [list(o["output_ids"]) for o in self.llm.generate(prompts, params)]

    def close(self) -> None:
        del self.llm

    def spec_stats(self) -> Optional[dict]:
        """Acceptance figures since the last call (None without speculative decoding)."""
        stats = self.llm.engine.spec_stats
        return None if stats is None else stats.take()


def load_sparkrelay(args: argparse.Namespace) -> Runner:
    return SparkrelayRunner(args)


def load_dspark(args: argparse.Namespace, **settings) -> Runner:
    if not Path(args.draft_model_path).is_dir():
        raise SystemExit(f"--draft-model-path {args.draft_model_path!r} is not a folder")
    return SparkrelayRunner(
        args,
        speculative_algorithm="DSPARK",
        speculative_draft_model_path=args.draft_model_path,
        speculative_dspark_confidence_threshold=args.confidence_threshold,
        speculative_num_draft_tokens=args.num_draft_tokens,
        **settings,
    )


def load_compiled(args: argparse.Namespace) -> Runner:
    return SparkrelayRunner(args, enable_torch_compile=True)


def load_dspark_compiled(args: argparse.Namespace) -> Runner:
    return load_dspark(args, enable_torch_compile=True)


# -- transformers ----------------------------------------------------------------------------------


class TransformersRunner:
    """`AutoModelForCausalLM.generate` on left-padded groups, greedy, no EOS (so it never stops
    early)."""

    def __init__(self, args: argparse.Namespace) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # its weight-loading bar would interleave with the benchmark's
        self.torch = torch
        self.device = args.device
        dtype = getattr(torch, args.dtype)
        self.model = (
            AutoModelForCausalLM.from_pretrained(args.model_path, dtype=dtype)
            .to(args.device)
            .eval()
        )
        tok = AutoTokenizer.from_pretrained(args.model_path)
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
        gc = self.model.generation_config
        gc.eos_token_id = None  # ignore_eos: run to max_new_tokens, and let EOS itself be generated
        gc.pad_token_id = self.pad_id
        gc.do_sample = False
        for name in (
            "temperature",
            "top_p",
            "top_k",
        ):  # silence "sampling flag set but do_sample=False"
            if hasattr(gc, name):
                setattr(gc, name, None)

    def generate(self, prompts: list[list[int]], output_len: int) -> list[list[int]]:
        torch = self.torch
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):  # left padding
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        with torch.inference_mode():
            out = self.model.generate(
                input_ids=ids.to(self.device),
                attention_mask=mask.to(self.device),
                do_sample=False,
                max_new_tokens=output_len,
                min_new_tokens=output_len,
            )
        return out[:, width:].tolist()

    def close(self) -> None:
        del self.model


def load_transformers(args: argparse.Namespace) -> Runner:
    return TransformersRunner(args)


PLAIN, DSPARK = "sparkrelay", "sparkrelay+dspark"
COMPILED, DSPARK_COMPILED = "sparkrelay+compile", "sparkrelay+dspark+compile"
ENGINE_CONFIGS: list[EngineConfig] = [
    EngineConfig(PLAIN, load_sparkrelay),
    EngineConfig(DSPARK, load_dspark),
    EngineConfig(COMPILED, load_compiled),
    EngineConfig(DSPARK_COMPILED, load_dspark_compiled),
    EngineConfig(REFERENCE, load_transformers),
]
DEFAULT_ENGINES = (PLAIN, DSPARK, REFERENCE)


def plain_of(engine: str) -> str:
    """The non-speculative row a speculative row is compared with (same compile setting)."""
    return engine.replace("+dspark", "")
