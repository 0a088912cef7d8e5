"""DSpark decoding: every forward writes the drafter's context; a decode step is one propose/verify
round (or, for a batch of at least --speculative-disable-by-batch-size requests, a plain step).

One round for R running requests (row r: anchor = its last token, at position p_r):
  propose  -> drafts d_1..d_n (n_r after caps and confidence truncation) from the drafter
  verify   -> one target forward over [anchor, d_1..d_n] at positions p_r..p_r+n_r, taps captured
  accept   -> spec/verify.py: a_r drafts accepted, next token (correction or bonus), judged on the target's
              logits penalised and grammar-masked the way plain decoding treats them (verify row j: history +
              d_1..d_j; the grammar's state after d_1..d_j)
  commit   -> target KV now valid for p_r..p_r+a_r; the drafter's context is written for those rows
"""

from __future__ import annotations

from typing import Optional

import torch

from sparkrelay.grammar.rows import DraftGuide, Masks
from sparkrelay.models.attention import AttnMeta
from sparkrelay.models.decoder import StageOutput
from sparkrelay.runner.logprobs import token_logprobs
from sparkrelay.runner.model_runner import ModelRunner, RunResult
from sparkrelay.runner.sampler import filter_probs, penalize
from sparkrelay.scheduler.scheduler import Batch
from sparkrelay.spec.proposer import DSparkProposer
from sparkrelay.spec.verify import verify


class SpecRunner(ModelRunner):
    def __init__(
        self,
        *args,
        proposer: DSparkProposer,
        context_length: int,
        disable_by_batch_size: Optional[int] = None,
        **kwargs,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.proposer = proposer
        self.taps = proposer.taps
        self.context_length = context_length
        # --speculative-disable-by-batch-size: decode batches this large take plain steps
        self.disable_by_batch_size = disable_by_batch_size
        self._fed: list = []

    def drafts(self, batch: Batch) -> bool:
        """Whether a decode batch runs a propose/verify round, else one plain step (its fed rows
        still write the drafter's context in after_forward, so a later round has every position)."""
        limit = self.disable_by_batch_size
        return limit is None or len(batch.seqs) < limit

    def after_forward(self, meta: AttnMeta, out: StageOutput) -> None:
        # every fed row of a prefill is a committed prompt position: its features become draft
        # context
        for req in self._fed:
            req.draft_ctx_start = 0  # a (re)computed prompt writes the drafter's whole context
        rows = torch.arange(meta.positions.shape[0], device=self.device)
        self.proposer.write_context(out.taps, rows, meta.positions, meta.slot_mapping)

    @torch.inference_mode()
    def run(self, batch: Batch) -> RunResult:
        if batch.kind != "decode" or not self.drafts(batch):
            self._fed = [s.req for s in batch.seqs if s.start == 0]
            return super().run(batch)
        seqs = batch.seqs
        reqs = [s.req for s in seqs]
        starts = [s.start for s in seqs]
        tables = [r.block_ids for r in reqs]
        sb = self.sampling_batch(reqs)
        vocab = self.model.spec.vocab_size
        guide = DraftGuide.of(
            [r.grammar for r in reqs],
            self.proposer.block_size,
            vocab,
            [r.params.greedy for r in reqs],
        )
        prop = self.proposer.propose(
            [r.all_ids[-1] for r in reqs],
            starts,
            tables,
            self._caps(reqs, starts),
            sb.temperature,
            sb.greedy,
            sb.generators,
            self.shared_gen,
            [r.draft_ctx_start for r in reqs],
            guide,
        )
        if guide is not None:
            guide.finish(prop.drafts)
        n = prop.num_drafts.tolist()
        meta = self.attn_meta(starts, [p + 1 + k for p, k in zip(starts, n)], tables)
        drafts = prop.drafts.tolist()
        ids = [t for r, d, k in zip(reqs, drafts, n) for t in [r.all_ids[-1]] + d[:k]]
        out = self.forward(meta, ids, torch.arange(len(ids)))  # logits at every row: [T, V]
        res = verify(
            prop.drafts,
            prop.num_drafts,
            prop.draft_probs,
            self._target_probs(
                reqs, n, drafts, out.logits, guide.verify_masks(n, drafts) if guide else None
            ),
            sb.greedy,
            sb.generators,
            self.shared_gen,
        )
        accepted, nxt = res.accepted.tolist(), res.next_ids.tolist()
        self._commit_context(meta, out, n, accepted)
        tokens = [d[:a] + [t] for d, a, t in zip(drafts, accepted, nxt)]
        computed = [p + a + 1 for p, a in zip(starts, accepted)]
        res = RunResult(tokens, computed, list(zip(n, accepted)))
        if any(r.params.return_logprob for r in reqs):
            res.logprobs = self._committed_logprobs(reqs, n, tokens, out.logits)
        return res

    @staticmethod
    def _committed_logprobs(
        reqs, n: list[int], tokens: list[list[int]], logits: torch.Tensor
    ) -> list:
        """Logprobs of each request's committed tokens from the verify pass's raw target logits [T,
        V]: verify row j of request r (the anchor, then d_1..) scored its committed token j; never
        the drafter's numbers."""
        rows, ids, ks, offset = [], [], [], 0
        for r, k, toks in zip(reqs, n, tokens):
            if r.params.return_logprob:
                rows += range(offset, offset + len(toks))
                ids += toks
                ks += [r.params.top_logprobs_num] * len(toks)
            offset += k + 1
        entries = iter(
            token_logprobs(
                logits.index_select(0, torch.tensor(rows, device=logits.device)), ids, ks
            )
        )
        return [
            [next(entries) for _ in toks] if r.params.return_logprob else []
            for r, toks in zip(reqs, tokens)
        ]

    def _caps(self, reqs, starts: list[int]) -> list[int]:
        """Drafts worth proposing: no more than the tokens the request may still emit, inside the
        context."""
        return [
            max(0, min(r.params.max_new_tokens - len(r.output_ids), self.context_length - p) - 1)
            for r, p in zip(reqs, starts)
        ]

    def _target_probs(
        self,
        reqs,
        n: list[int],
        drafts: list[list[int]],
        logits: torch.Tensor,
        masks: Optional[Masks] = None,
    ) -> torch.Tensor:
        """logits [T, V] of the verify rows -> p [R, N + 1, V], penalised and filtered as each request samples
        (padded rows 0; in an all-greedy batch, which compares argmaxes of verified rows only, copies of
        other rows). Verify row j of request r follows d_1..d_j, so its penalty history is the request's tokens
        plus those drafts: exactly what plain decoding would have seen had they been accepted. The drafter itself
        proposes from unpenalised logits; that only lowers acceptance, never changes what is committed."""
        reps, raw = [k + 1 for k in n], logits
        # else the raw logits, as before penalties existed
        if any(r.params.penalized for r in reqs):
            rows = [r for r, k in zip(reqs, reps) for _ in range(k)]
            outputs = [
                r.output_ids + d[:j] for r, d, k in zip(reqs, drafts, reps) for j in range(k)
            ]
            # [T, V]
            logits = penalize(
                logits, [r.params for r in rows], [r.prompt_ids for r in rows], outputs
            )
        # row j of a request with a grammar: its mask after d_1..d_j (grammar/rows.py DraftGuide);
        # the raw logits are read again only for logprobs
        if masks is not None:
            fresh = logits is not raw or not any(r.params.return_logprob for r in reqs)
            logits = masks.apply(logits, writable=fresh)
        greedy = all(r.params.greedy for r in reqs)
        # greedy verification only compares argmaxes of the rows a request verified
        probs = logits if greedy else filter_probs(logits, self.sampling_batch(reqs, reps))
        # [T, V] -> [R, B + 1, V]: row r's k + 1 verify rows first, zeros after
        width = self.proposer.block_size + 1
        if reps == [width]:  # one request with a full block: already in that layout
            return probs.view(1, width, -1)
        starts = torch.tensor([0] + reps[:-1]).cumsum(0)
        # [R, B + 1]
        index = (starts[:, None] + torch.arange(width)[None, :]).clamp(max=probs.shape[0] - 1)
        out = probs.index_select(0, index.view(-1).to(probs.device)).view(len(reqs), width, -1)
        if greedy:  # rows past a request's k + 1 are never read by greedy verification
            return out
        valid = torch.arange(width)[None, :] < torch.tensor(reps)[:, None]
        return out * valid.to(probs.device)[:, :, None]

    def _commit_context(
        self, meta: AttnMeta, out: StageOutput, n: list[int], accepted: list[int]
    ) -> None:
        """The anchor and the accepted drafts of each row are committed: their features become draft
        context."""
        rows, offset = [], 0
        for k, a in zip(n, accepted):
            rows.extend(range(offset, offset + a + 1))
            offset += k + 1
        rows_t = torch.tensor(rows, device=self.device)
        self.proposer.write_context(
            out.taps,
            rows_t,
            meta.positions.index_select(0, rows_t),
            meta.slot_mapping.index_select(0, rows_t),
        )
