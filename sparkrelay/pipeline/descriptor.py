"""The step descriptor: what rank 0 tells every stage about one micro-batch (docs/pd_protocol.md, failure modes 11, 31).

Rank 0 decides admission, batching and block tables; the other stages have no scheduler and no block manager and
run exactly what the descriptor says, so every stage agrees on which rows a micro-batch holds.

Wire format, rank k -> rank k+1, in this order (the sends and receives are in pipeline/comm.py):

  1. header  int64 [HEADER_LEN = 8]
       kind, step, mb_index, num_mbs, num_seqs B, num_tokens T, body_len L, num_released R
  2. body    int64 [L]                       (sent only when L > 0)
       B rows of SEQ_FIELDS = 14 ints, one per sequence, in micro-batch order:
         req_index, room, start, end, prompt_len, sample, greedy, top_k, seed, num_blocks, history_len, logprobs,
         score_first, score_count
       then the B block tables concatenated (num_blocks ids each, in sequence order),
       then the B token histories concatenated (history_len ids each, in sequence order),
       then the B scored prompt tokens concatenated (score_count ids each, in sequence order),
       then R pairs (req_index, room) of requests rank 0 released since the previous descriptor
  3. floats  float64 [B, FLOAT_FIELDS = 6]  (sent only when B > 0)
       temperature, top_p, min_p, repetition_penalty, frequency_penalty, presence_penalty per sequence

kind: STEP (run the micro-batch) or SHUTDOWN (B = 0: apply the releases, pass it on, exit).
req_index: rank 0's small integer id of the request (stable until it is released; stages key per-request state,
e.g. a seeded sampling generator, by it). room: the PD bootstrap room, 0 when none (room 0 is never a real room).
seed: -1 when the request has none. top_k: -1 when off. The sequence feeds positions [start, end); it samples after
its last fed row when sample is 1. logprobs: -1, or k >= 0 when the request asked for logprobs (the last stage
then returns them with the token, `token_width`). history: the sequence's tokens [0, end) (prompt, then output),
which the last stage needs to apply the penalties; sent only for a sampling sequence with a penalty (history_len 0
otherwise, so a request without penalties costs the wire nothing). score_first, score_count: prompt logprobs
(logprob_start_len >= 0): the last stage scores prompt positions [score_first, score_first + score_count) of this
chunk (the fed row of position p - 1 scores the token at p; the tokens travel in the body since the last stage
sees only hidden states); count 0 (and no ids) for every other sequence, runner/model_runner.py `prompt_rows` decides
which positions (each scored once across chunks). Every size a receiver needs is in the header, so
it posts receives of exactly the shapes the sender sends; nothing is ever guessed or posted twice.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

HEADER_LEN, SEQ_FIELDS, FLOAT_FIELDS = 8, 14, 6
STEP, SHUTDOWN = 0, 1


@dataclass
class SeqDesc:
    """One sequence of a micro-batch (the fields a stage and its sink may read)."""

    req_index: int
    room: int
    start: int
    end: int
    prompt_len: int
    sample: bool
    greedy: bool
    top_k: int
    seed: int                 # -1: none
    block_ids: list[int]
    temperature: float
    top_p: float
    min_p: float
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    history: list[int] = field(default_factory=list)  # tokens [0, end) when the last stage must penalise, else []
    logprobs: int = -1  # -1: none; else the sampled token's logprob and this many top logprobs go back to rank 0
    score_first: int = -1  # prompt logprobs: the first prompt position this chunk scores (-1: none)
    score_ids: list[int] = field(default_factory=list)  # the prompt tokens at score_first, score_first + 1, ...

    @property
    def penalized(self) -> bool:
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0


@dataclass
class MicroBatch:
    """The decoded descriptor. `released`: (req_index, room) of requests to forget, applied before the forward."""

    kind: int
    step: int
    index: int
    count: int
    seqs: list[SeqDesc] = field(default_factory=list)
    released: list[tuple[int, int]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.end - s.start for s in self.seqs)


def encode(mb: MicroBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> header int64 [HEADER_LEN], body int64 [L], floats float64 [B, FLOAT_FIELDS] (CPU tensors)."""
    rows, tables, histories, scored = [], [], [], []
    for s in mb.seqs:
        rows += [s.req_index, s.room, s.start, s.end, s.prompt_len, int(s.sample), int(s.greedy), s.top_k, s.seed,
                 len(s.block_ids), len(s.history), s.logprobs, s.score_first, len(s.score_ids)]
        tables += s.block_ids
        histories += s.history
        scored += s.score_ids
    body = rows + tables + histories + scored + [x for pair in mb.released for x in pair]
    header = [mb.kind, mb.step, mb.index, mb.count, len(mb.seqs), mb.num_tokens, len(body), len(mb.released)]
    floats = [[s.temperature, s.top_p, s.min_p, s.repetition_penalty, s.frequency_penalty, s.presence_penalty]
              for s in mb.seqs]
    return (torch.tensor(header, dtype=torch.int64), torch.tensor(body, dtype=torch.int64),
            torch.tensor(floats, dtype=torch.float64).reshape(len(mb.seqs), FLOAT_FIELDS))


def sizes(header: torch.Tensor) -> tuple[int, int, int]:
    """header [HEADER_LEN] -> (body_len L, num_seqs B, num_tokens T): the shapes of what follows it."""
    h = header.tolist()
    return h[6], h[4], h[5]


def decode(header: torch.Tensor, body: torch.Tensor, floats: torch.Tensor) -> MicroBatch:
    """The inverse of `encode` (header [HEADER_LEN], body [L], floats [B, FLOAT_FIELDS])."""
    kind, step, index, count, b, t, length, r = header.tolist()
    ints, fl = body.tolist(), floats.tolist()
    assert len(ints) == length and len(fl) == b, f"descriptor body {len(ints)}/{length}, floats {len(fl)}/{b}"
    cursor, seqs, hist_lens, score_lens = b * SEQ_FIELDS, [], [], []
    for i in range(b):
        req, room, start, end, plen, smp, greedy, top_k, seed, nb, nh, lp, sf, ns = \
            ints[i * SEQ_FIELDS : (i + 1) * SEQ_FIELDS]
        seqs.append(SeqDesc(req, room, start, end, plen, bool(smp), bool(greedy), top_k, seed,
                            ints[cursor : cursor + nb], *fl[i]))
        seqs[-1].logprobs, seqs[-1].score_first = lp, sf
        cursor += nb
        hist_lens.append(nh)
        score_lens.append(ns)
    for s, nh in zip(seqs, hist_lens):
        s.history = ints[cursor : cursor + nh]
        cursor += nh
    for s, ns in zip(seqs, score_lens):
        s.score_ids = ints[cursor : cursor + ns]
        cursor += ns
    released = [(ints[j], ints[j + 1]) for j in range(cursor, cursor + 2 * r, 2)]
    mb = MicroBatch(kind, step, index, count, seqs, released)
    assert mb.num_tokens == t and cursor + 2 * r == length, "descriptor header disagrees with its body"
    return mb


def token_width(seqs: list[SeqDesc]) -> int:
    """Floats per sequence of what the last stage returns to rank 0: the token, then when any sampling sequence
    asked for logprobs its logprob and k (logprob, id) pairs, k = the largest asked (runner/logprobs.py rows)."""
    k = max((s.logprobs for s in seqs if s.sample), default=-1)
    return 1 if k < 0 else 2 + 2 * k


def reply_shape(seqs: list[SeqDesc]) -> tuple[int, int]:
    """(rows, width) of the float64 reply the last stage sends rank 0 for one micro-batch: B token rows
    (`token_width`), then one row per scored prompt position (sequence order, runner/logprobs.py `to_rows`, k =
    the largest asked by a scoring sequence), all zero-padded to the wider of the two."""
    scoring = [s for s in seqs if s.score_ids]
    width = max([token_width(seqs)] + [1 + 2 * s.logprobs for s in scoring])
    return len(seqs) + sum(len(s.score_ids) for s in scoring), width
