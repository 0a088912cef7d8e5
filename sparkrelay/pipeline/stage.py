"""One pipeline stage: layers [start, end) of the target, their KV pool, the stage's share of the
DSpark capture and, on the last stage, sampling. The same class runs stage 0 inside the engine's
process and stages 1..N-1 in workers.

Per micro-batch (all stages run the same descriptor, pipeline/descriptor.py):
    releases -> AttnMeta.build -> forward of the owned layers (taps at the owned target layer ids)
    -> capture (taps appended / partial fc share added, pipeline/capture.py) -> sink.after_forward
    -> not last: StagePayload for the next stage;  last: sample (+ logprobs) -> sink.on_sampled
       -> rows float64 [B + E, W] (descriptor.reply_shape): the token (-1: no sample), then its logprobs when
          asked; then one row per prompt position the descriptor asked to score (logprob_start_len >= 0)
"""

from __future__ import annotations

import importlib
import os
import time
from typing import Optional, Protocol

import torch
from torch import nn

from sparkrelay.config import Config, ConfigError
from sparkrelay.grammar.bitmask import allowing_all
from sparkrelay.grammar.rows import Masks
from sparkrelay.kvcache.pool import KVPool
from sparkrelay.models.attention import AttnMeta
from sparkrelay.models.decoder import CausalLM, StageOutput
from sparkrelay.models.dspark_context import ContextProjector, load_context_projector
from sparkrelay.models.loader import on_meta
from sparkrelay.models.quant import apply_torchao_config
from sparkrelay.pipeline.capture import CaptureSpec, StagePayload
from sparkrelay.pipeline.descriptor import MicroBatch, SeqDesc, reply_shape, token_width
from sparkrelay.pipeline.partition import stage_taps
from sparkrelay.runner.logprobs import Entry, Scored, score_rows, to_rows, token_logprobs
from sparkrelay.runner.sampler import SeededGenerators, draw
from sparkrelay.trace import timeline

# A stage's sink reports per-room status to rank 0 at RunnerNeeds.status_address
# (pipeline/needs.py), handed unchanged to every stage (rank 0 included) through the launch record;
# the pipeline runs no status endpoint of its own ("": none) and the prefill role passes the address
# of the one it binds on rank 0.


class StageSink(Protocol):
    """Per-stage hook of the PD prefill role (sparkrelay/disagg/prefill_sink.py:
    `make_stage_sink(config, stage, partition, pool, status_address, bootstrap_url)`; bootstrap_url "": the
    prefill's own --disaggregation-bootstrap-host and port). Called on the stage's own
    thread, in micro-batch order."""

    def after_forward(
        self,
        mb: MicroBatch,
        meta: AttnMeta,
        out: StageOutput,
        aux: Optional[torch.Tensor],
        draft_kv: Optional[list[tuple[torch.Tensor, torch.Tensor]]],
    ) -> None:
        """After every micro-batch forward of this stage. mb.seqs: .room, .start, .end, .prompt_len,
        .sample, .block_ids (rows of sequence b are its positions [start, end), in mb.seqs order);
        meta: the AttnMeta (positions [T], slot_mapping [T]); out: this stage's StageOutput (hidden
        [T, d], taps {id: [T, d]} of the taps it owns; the stage's KV of these rows is in `pool` at
        meta.slot_mapping). aux: last stage, mode taps: all k taps [T, k*d] in target_layer_ids
        order, else None. draft_kv: last stage, mode partial: per draft layer (k [T, n_kv, hd], v
        [T, n_kv, hd]) at the rows' absolute positions, else None."""

    def on_sampled(self, mb: MicroBatch, tokens: list[int], logprobs: list) -> None:
        """Last stage, after sampling: one token per sampling sequence (those with .sample), in
        mb.seqs order, and its logprob entry (runner/logprobs.py `Entry`) where the sequence asked
        for logprobs, else None."""

    def release(self, rooms: list[int]) -> None:
        """Rank 0 released these requests (finished or aborted; room 0, i.e. none, is left out):
        drop their state. Releases ride on the next descriptor (step or shutdown) and are applied
        before its forward."""

    # Optional: `close()`, called once when the stage shuts down (PipelineRunner.close, or a
    # worker's SHUTDOWN).


def make_sink(
    factory: Optional[str],
    config: Config,
    stage: int,
    partition: list[tuple[int, int]],
    pool: KVPool,
    status_address: str = "",
    bootstrap_url: str = "",
) -> Optional[StageSink]:
    """`factory` = "module:function" with make_stage_sink's signature, imported here (lazily), or
    None."""
    if factory is None:
        return None
    module, _, name = factory.partition(":")
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ConfigError(
            f"--disaggregation-mode prefill: the stage sink factory {factory} cannot be loaded ({e}); "
            "the prefill role provides it in sparkrelay/disagg/prefill_sink.py"
        ) from e
    return fn(config, stage, partition, pool, status_address, bootstrap_url)


def model_view(full: CausalLM, start: int, end: int) -> CausalLM:
    """Layers [start, end) of an already loaded full model, sharing its modules (no copy, no
    loading)."""
    if (full.start, full.end) == (start, end):
        return full
    with on_meta():
        view = CausalLM(full.spec, start, end, device="meta")
    view.model.embed_tokens = full.model.embed_tokens if start == 0 else None
    view.model.layers = nn.ModuleDict(
        {str(i): full.model.layers[str(i)] for i in range(start, end)}
    )
    view.model.norm = full.model.norm if view.is_last else None
    view.lm_head = full.lm_head if view.is_last else None
    view.head = full.head if view.is_last else None
    view.rotary = full.rotary
    return view


def build_stage(
    index: int,
    partition: list[tuple[int, int]],
    model: CausalLM,
    pool: KVPool,
    capture: CaptureSpec,
    config: Config,
    sink_factory: Optional[str],
    device: torch.device,
    status_address: str = "",
    bootstrap_url: str = "",
) -> Stage:
    """A stage around a loaded model range: the drafter's context weights when it owns taps or
    finishes the partial projection (mode partial), and its sink."""
    projector = None
    owns = (
        stage_taps(capture.target_layer_ids, partition, index) if capture.mode == "partial" else ()
    )
    if capture.mode == "partial" and (owns or index == len(partition) - 1):
        dtype = next(model.parameters()).dtype
        projector = load_context_projector(
            capture.drafter_path, model.spec, dtype, str(device), config.model.load_format
        )
        # the decode drafter's context products, quantized alike (bit-equal K/V)
        apply_torchao_config(projector, config.draft_torchao_config)
        if projector.spec.target_layer_ids != capture.target_layer_ids:
            raise ConfigError(
                f"capture target layer ids {list(capture.target_layer_ids)} != the drafter's "
                f"target_layer_ids {list(projector.spec.target_layer_ids)} (its fc columns)"
            )
    sink = make_sink(sink_factory, config, index, partition, pool, status_address, bootstrap_url)
    return Stage(index, partition, model, pool, capture, projector, sink, config.model.seed, device)


def pool_view(pool: KVPool, start: int, end: int) -> KVPool:
    """The KV tensors of layers [start, end) of a pool holding more (the engine's), shared, not
    copied."""
    if sorted(pool.layers) == list(range(start, end)):
        return pool
    view = KVPool(range(0), pool.num_blocks, pool.page_size, 0, 0, torch.float32, "cpu")
    view.layers = {i: pool.layers[i] for i in range(start, end)}
    return view


def stage_delay(index: int) -> float:
    """Seconds this stage sleeps per micro-batch: SPARKRELAY_TEST_PP_STAGE_DELAY="stage:seconds"
    (tests only)."""
    raw = os.environ.get("SPARKRELAY_TEST_PP_STAGE_DELAY", "")
    if not raw:
        return 0.0
    try:
        stage, seconds = raw.split(":")
        return float(seconds) if int(stage) == index else 0.0
    except ValueError:
        raise ConfigError(
            f"SPARKRELAY_TEST_PP_STAGE_DELAY={raw!r} is not 'stage:seconds'"
        ) from None


class Stage:
    def __init__(
        self,
        index: int,
        partition: list[tuple[int, int]],
        model: CausalLM,
        pool: KVPool,
        capture: CaptureSpec,
        projector: Optional[ContextProjector],
        sink: Optional[StageSink],
        seed: int,
        device: torch.device,
    ) -> None:
        self.index, self.partition, self.model, self.pool = index, partition, model, pool
        self.capture, self.projector, self.sink, self.device = capture, projector, sink, device
        self.is_last = index == len(partition) - 1
        self.own_taps = (
            stage_taps(capture.target_layer_ids, partition, index) if capture.mode != "none" else ()
        )
        self.shared_gen = torch.Generator(device=device).manual_seed(seed)
        self.generators = SeededGenerators(device)
        self.test_delay = stage_delay(index)
        self.threads: Optional[tuple[int, int]] = None  # (alone, shared): see share_cores

    def share_cores(self, alone: int, shared: int) -> None:
        """Stages on one host share its cores: run a micro-batch with `alone` torch threads when no
        other stage can be busy (stage 0 on a step's first micro-batch, the last stage on its last
        one), else `shared`."""
        self.threads = (alone, shared)

    def _trace(self, mb: MicroBatch, began: float) -> None:
        """SPARKRELAY_TRACE (trace/timeline.py): the micro-batch's interval on this stage."""
        if timeline.enabled():
            timeline.mark(
                f"stage{self.index}",
                "chunk",
                step=mb.step,
                mb=mb.index,
                num_mbs=mb.count,
                rooms=[s.room for s in mb.seqs],
                tokens=[[s.start, s.end] for s in mb.seqs],
                start=began,
                end=time.monotonic(),
            )

    def _set_threads(self, mb: MicroBatch) -> None:
        if self.threads is None:
            return
        first, last = mb.index == 0, mb.index == mb.count - 1
        alone = (self.index == 0 and first) or (self.is_last and last)
        n = self.threads[0] if alone else self.threads[1]
        if torch.get_num_threads() != n:
            torch.set_num_threads(n)

    def release(self, released: list[tuple[int, int]]) -> None:
        for req_index, _ in released:
            self.generators.drop(req_index)
        rooms = [room for _, room in released if room]
        if self.sink is not None and rooms:
            self.sink.release(rooms)

    def close(self) -> None:
        close = getattr(self.sink, "close", None)
        if close is not None:
            close()

    @torch.inference_mode()
    def run(
        self,
        mb: MicroBatch,
        input_ids: Optional[torch.Tensor] = None,
        inp: Optional[StagePayload] = None,
    ) -> StagePayload | torch.Tensor:
        """Stage 0: input_ids [T]; later stages: the previous stage's payload. -> the next stage's payload, or on
        the last stage float64 [B + E, W] (`_rows`): column 0 the sampled token (-1 where the sequence does not
        sample), then its logprob row (runner/logprobs.py `to_rows`) when some sequence asked for logprobs; then
        the rows of the prompt positions the descriptor asked to score."""
        self.release(mb.released)
        self._set_threads(mb)
        began = time.monotonic()
        if self.test_delay:
            # SPARKRELAY_TEST_PP_STAGE_DELAY: a slow stage, for fault tests
            time.sleep(self.test_delay)
        seqs = mb.seqs
        meta = AttnMeta.build(
            [s.start for s in seqs],
            [s.end for s in seqs],
            [s.block_ids for s in seqs],
            self.pool.page_size,
            self.device,
        )
        scored = self._scored(seqs) if self.is_last else []
        rows = self._logit_rows(seqs, scored) if self.is_last else None
        out = self.model(
            meta,
            self.pool.layers,
            input_ids=input_ids,
            hidden=None if inp is None else inp.hidden,
            logits_index=rows,
            taps=self.own_taps,
        )
        nxt = self._capture(inp, out)
        if self.sink is not None:
            aux = nxt.taps if self.is_last and self.capture.mode == "taps" else None
            draft_kv = None
            if self.is_last and self.capture.mode == "partial":
                draft_kv = self.projector.finish(nxt.partial, meta.positions)
            self.sink.after_forward(mb, meta, out, aux, draft_kv)
        if not self.is_last:
            self._trace(mb, began)
            return nxt
        num_sampling = sum(s.sample for s in seqs)
        logits = out.logits[:num_sampling]  # [R, V]; then [E, V] of the scored prompt rows
        tokens = self._sample(seqs, logits)
        entries = self._logprobs(seqs, logits, tokens)
        if self.sink is not None:
            self.sink.on_sampled(
                mb,
                [t for t, s in zip(tokens, seqs) if s.sample],
                [e for e, s in zip(entries, seqs) if s.sample],
            )
        prompt = score_rows(
            scored,
            [t for s in seqs for t in s.score_ids],
            [s.logprobs for s in seqs for _ in s.score_ids],
            out.logits[num_sampling:],
            len(seqs),
        )
        rows = self._rows(seqs, tokens, entries, prompt)
        self._trace(mb, began)
        return rows

    def _logprobs(
        self, seqs: list[SeqDesc], logits: torch.Tensor, tokens: list[int]
    ) -> list[Optional[Entry]]:
        """Per sequence: the sampled token's logprob entry from the raw logits [R, V] when it asked,
        else None."""
        sampling = [s for s in seqs if s.sample]
        asked = [j for j, s in enumerate(sampling) if s.logprobs >= 0]
        out: list[Optional[Entry]] = [None] * len(seqs)
        if not asked:
            return out
        chosen = [t for t, s in zip(tokens, seqs) if s.sample]
        entries = iter(
            token_logprobs(
                logits.index_select(0, torch.tensor(asked, device=logits.device)),
                [chosen[j] for j in asked],
                [sampling[j].logprobs for j in asked],
            )
        )
        where = [i for i, s in enumerate(seqs) if s.sample]
        for j in asked:
            out[where[j]] = next(entries)
        return out

    @staticmethod
    def _rows(
        seqs: list[SeqDesc],
        tokens: list[int],
        entries: list[Optional[Entry]],
        prompt: list[Optional[tuple[int, list[Entry]]]],
    ) -> torch.Tensor:
        """-> float64 [B + E, W] (descriptor.reply_shape): the token (-1: no sample) then its logprob row when
        any asked; then the scored prompt positions' rows, sequence by sequence."""
        num_rows, width = reply_shape(seqs)
        out = torch.zeros(num_rows, width, dtype=torch.float64)
        out[: len(seqs), 0] = torch.tensor(tokens, dtype=torch.float64)
        k = (token_width(seqs) - 2) // 2
        for i, e in enumerate(entries):
            if e is not None:
                out[i, 1 : 2 + 2 * k] = to_rows([e], k)[0]
        cursor = len(seqs)
        for s, p in zip(seqs, prompt):
            if p is not None:
                rows = to_rows(p[1], s.logprobs)  # [n, 1 + 2k]
                out[cursor : cursor + len(rows), : rows.shape[1]] = rows
                cursor += len(rows)
        assert cursor == num_rows, "scored prompt rows disagree with the descriptor"
        return out

    def _capture(self, inp: Optional[StagePayload], out: StageOutput) -> StagePayload:
        """Append this stage's taps ([T, k_prev*d] -> [T, (k_prev + k_s)*d]) or add its fc share to the partial."""
        own = [out.taps[i] for i in self.own_taps]  # each [T, d]
        taps = partial = None
        if self.capture.mode == "taps":
            parts = ([inp.taps] if inp is not None and inp.taps is not None else []) + own
            taps = torch.cat(parts, dim=-1) if parts else None
        elif self.capture.mode == "partial":
            t, d = out.hidden.shape
            partial = (
                inp.partial
                if inp is not None
                else torch.zeros(t, d, dtype=torch.float32, device=self.device)
            )
            if own:
                # [T, d_draft]
                partial = partial + self.projector.partial(torch.cat(own, dim=-1), self.own_taps)
        return StagePayload(out.hidden, taps, partial)

    @staticmethod
    def _scored(seqs: list[SeqDesc]) -> list[Scored]:
        """The prompt positions the descriptor asks this stage to score, as runner/model_runner.py
        `prompt_rows` returns them: (index, first position, first flat row, count); the row of
        position p - 1 scores p."""
        out, offset = [], 0
        for i, s in enumerate(seqs):
            if s.score_ids:
                assert s.start < s.score_first <= s.end, (
                    "a scored prompt position outside the fed chunk"
                )
                out.append(
                    (i, s.score_first, offset + s.score_first - 1 - s.start, len(s.score_ids))
                )
            offset += s.end - s.start
        return out

    def _logit_rows(self, seqs: list[SeqDesc], scored: list[Scored]) -> torch.Tensor:
        """[R + E] the last fed row of each sampling sequence, then the rows scoring prompt
        positions."""
        ends = torch.tensor([s.end - s.start for s in seqs]).cumsum(0) - 1  # [B]
        # [E]
        extra = torch.tensor(
            [row + j for _, _, row, n in scored for j in range(n)], dtype=torch.long
        )
        return torch.cat([ends[[i for i, s in enumerate(seqs) if s.sample]], extra]).to(self.device)

    def _sample(self, seqs: list[SeqDesc], logits: torch.Tensor) -> list[int]:
        """logits [R, V] at the sampling sequences' last rows -> one token per sequence (-1: no sample)."""
        rows = [s for s in seqs if s.sample]
        drawn = iter(self._draw(rows, logits) if rows else [])
        return [next(drawn) if s.sample else -1 for s in seqs]

    def _draw(self, rows: list[SeqDesc], logits: torch.Tensor) -> list[int]:
        """logits [R, V] (raw, left untouched) -> one token per row, from the penalised logits (as ModelRunner)."""
        return draw(
            logits,
            [s.params for s in rows],
            [s.req_index for s in rows],
            self.generators,
            self.shared_gen,
            [s.history[: s.prompt_len] for s in rows],
            [s.history[s.prompt_len :] for s in rows],
            self._masks(rows, logits.shape[1]),
        )

    @staticmethod
    def _masks(rows: list[SeqDesc], vocab: int) -> Optional[Masks]:
        """The grammar masks rank 0 sent with the sampling sequences, one bitmask row each."""
        constrained = [i for i, s in enumerate(rows) if s.mask]
        if not constrained:
            return None
        bitmask = allowing_all(len(rows), vocab)
        for i in constrained:
            bitmask[i] = torch.tensor(rows[i].mask, dtype=torch.int64).to(torch.int32)
        return Masks(bitmask, constrained)
