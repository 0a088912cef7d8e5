"""Offline API: `LLM(model_path).generate(prompts, params)`, results shaped like SGLang's
/generate."""

from __future__ import annotations

import itertools
import time
from typing import Sequence, Union

from tqdm.auto import tqdm

from sparkrelay.config import Config
from sparkrelay.engine.engine import Engine
from sparkrelay.scheduler.request import SamplingParams

Prompt = Union[str, list[int]]


class LLM:
    """`settings` are any leaf names of the config tree (page_size=..., max_running_requests=...,
    ...)."""

    def __init__(self, model_path: str, **settings) -> None:
        self.config = Config().replace(model_path=model_path, **settings).validate()
        self.engine = Engine(self.config)
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def generate(
        self,
        prompts: Union[Prompt, Sequence[Prompt]],
        sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
        use_tqdm: bool = False,
    ) -> Union[dict, list[dict]]:
        single = isinstance(prompts, str) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        )
        batch = [prompts] if single else list(prompts)
        params = self._params(sampling_params, len(batch))
        rids = []
        for prompt, p in zip(batch, params):
            rid = f"offline-{next(self._ids)}"
            ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            self.engine.add_request(rid, ids, p)
            rids.append(rid)
        results = self._run(rids, use_tqdm)
        out = [results[r] for r in rids]
        return out[0] if single else out

    def _params(self, sp, n: int) -> list[SamplingParams]:
        if sp is None:
            return [SamplingParams()] * n
        if isinstance(sp, SamplingParams):
            return [sp] * n
        if len(sp) != n:
            raise ValueError(f"{len(sp)} sampling params for {n} prompts")
        return list(sp)

    def _run(self, rids: list[str], use_tqdm: bool) -> dict[str, dict]:
        start = time.monotonic()
        pending, results = set(rids), {}
        bar = tqdm(total=len(rids), desc="generate", disable=not use_tqdm)
        while pending:
            for o in self.engine.step():
                if o.finished and o.rid in pending:
                    pending.discard(o.rid)
                    bar.update(1)
                    results[o.rid] = {
                        "text": o.text,
                        "output_ids": o.output_ids,
                        "meta_info": o.meta_info(time.monotonic() - start),
                    }
        bar.close()
        return results
