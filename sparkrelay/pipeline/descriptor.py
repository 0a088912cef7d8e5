"""The step descriptor: what rank 0 tells every stage about one micro-batch (docs/pd_protocol.md,
failure modes 11, 31).

Rank 0 decides admission, batching and block tables; the other stages have no scheduler and no block
manager and run exactly what the descriptor says, so every stage agrees on which rows a micro-batch
holds.

Wire format, rank k -> rank k+1, in this order (the sends and receives are in pipeline/comm.py):

  1. header  int64 [HEADER_LEN = 8]
       kind, step, mb_index, num_mbs, num_seqs B, num_tokens T, body_len L, num_released R
  2. body    int64 [L]                       (sent only when L > 0)
       B rows of SEQ_FIELDS ints, one per sequence, in micro-batch order:
         req_index, room, start, end, prompt_len, sample, num_blocks, history_len, logprobs, score_first,
         score_count, mask_len, then the integer sampler fields (INT_PARAMS: top_k, then seed as (set, value): an
         optional field takes a flag column too)
       then the B block tables concatenated (num_blocks ids each, in sequence order),
       then the B token histories concatenated (history_len ids each, in sequence order),
       then the B scored prompt tokens concatenated (score_count ids each, in sequence order),
       then the B grammar masks concatenated (mask_len int32 words each, in sequence order),
       then R pairs (req_index, room) of requests rank 0 released since the previous descriptor
  3. floats  float64 [B, FLOAT_FIELDS]  (sent only when B > 0) the float sampler fields per sequence
       (FLOAT_PARAMS: temperature, top_p, min_p and the three penalties)

The sampler's columns are derived by name and type from scheduler/request.py SAMPLER_FIELDS, so a
new sampling field crosses the pipeline without a change here; the last stage rebuilds the request's
SamplingParams from them.

kind: STEP (run the micro-batch) or SHUTDOWN (B = 0: apply the releases, pass it on, exit).
req_index: rank 0's small integer id of the request (stable until it is released; stages key
per-request state, e.g. a seeded sampling generator, by it). room: the PD bootstrap room, 0 when
none (room 0 is never a real room). An optional integer sampler field that is None (no seed) travels
as (0, 0). The sequence feeds positions [start, end); it samples after its last fed row when sample
is 1. logprobs: -1, or k >= 0 when the request asked for logprobs (the last stage then returns them
with the token, `token_width`). history: the sequence's tokens [0, end) (prompt, then output), which
the last stage needs to apply the penalties; sent only for a sampling sequence with a penalty
(history_len 0 otherwise, so a request without penalties costs the wire nothing). score_first,
score_count: prompt logprobs (logprob_start_len >= 0): the last stage scores prompt positions
[score_first, score_first + score_count) of this chunk (the fed row of position p - 1 scores the
token at p; the tokens travel in the body since the last stage sees only hidden states); count 0
(and no ids) for every other sequence, runner/model_runner.py `prompt_rows` decides which positions
(each scored once across chunks). mask: a sampling sequence with a grammar carries the bitmask of the
tokens its grammar allows next (grammar/bitmask.py's words; rank 0 holds the matcher, the last stage
samples under the mask); empty for every other sequence. Every size a receiver needs is in the
header, so it posts receives of exactly the shapes the sender sends; nothing is ever guessed or
posted twice.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass, field

import torch

from sparkrelay.scheduler.request import SAMPLER_FIELDS, SamplingParams

_HINTS = typing.get_type_hints(SamplingParams)
INT_PARAMS = tuple(n for n in SAMPLER_FIELDS if _HINTS[n] in (int, typing.Optional[int]))
FLOAT_PARAMS = tuple(n for n in SAMPLER_FIELDS if _HINTS[n] is float)
assert set(INT_PARAMS + FLOAT_PARAMS) == set(SAMPLER_FIELDS), (
    "a sampler field of a type the descriptor cannot carry"
)
# these take a (set, value) pair
_OPTIONAL = frozenset(n for n in INT_PARAMS if _HINTS[n] is not int)
_FIXED = 12  # req_index .. mask_len
HEADER_LEN, SEQ_FIELDS, FLOAT_FIELDS = (
    8,
    _FIXED + len(INT_PARAMS) + len(_OPTIONAL),
    len(FLOAT_PARAMS),
)
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
    block_ids: list[int]
    # the request's sampling parameters; only SAMPLER_FIELDS cross the wire (a receiving stage has
    # the rest at their defaults, which it never reads)
    params: SamplingParams = SamplingParams()
    # tokens [0, end) when the last stage must penalise, else []
    history: list[int] = field(default_factory=list)
    # -1: none; else the sampled token's logprob and this many top logprobs go back to rank 0
    logprobs: int = -1
    score_first: int = -1  # prompt logprobs: the first prompt position this chunk scores (-1: none)
    # the prompt tokens at score_first, score_first + 1, ...
    score_ids: list[int] = field(default_factory=list)
    # a sampling sequence with a grammar: the int32 words of the tokens it may sample ([] else)
    mask: list[int] = field(default_factory=list)


@dataclass
class MicroBatch:
    """The decoded descriptor. `released`: (req_index, room) of requests to forget, applied before
    the forward."""

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
    rows, tables, histories, scored, masks = [], [], [], [], []
    for s in mb.seqs:
        rows += [
            s.req_index,
            s.room,
            s.start,
            s.end,
            s.prompt_len,
            int(s.sample),
            len(s.block_ids),
            len(s.history),
            s.logprobs,
            s.score_first,
            len(s.score_ids),
            len(s.mask),
        ]
        rows += _int_columns(s.params)
        tables += s.block_ids
        histories += s.history
        scored += s.score_ids
        masks += s.mask
    body = rows + tables + histories + scored + masks + [x for pair in mb.released for x in pair]
    header = [
        mb.kind,
        mb.step,
        mb.index,
        mb.count,
        len(mb.seqs),
        mb.num_tokens,
        len(body),
        len(mb.released),
    ]
    floats = [[getattr(s.params, name) for name in FLOAT_PARAMS] for s in mb.seqs]
    return (
        torch.tensor(header, dtype=torch.int64),
        torch.tensor(body, dtype=torch.int64),
        torch.tensor(floats, dtype=torch.float64).reshape(len(mb.seqs), FLOAT_FIELDS),
    )


def _int_columns(params: SamplingParams) -> list[int]:
    out = []
    for name in INT_PARAMS:
        value = getattr(params, name)
        out += ([0, 0] if value is None else [1, value]) if name in _OPTIONAL else [value]
    return out


def _int_fields(columns: list[int]) -> dict:
    """The inverse of `_int_columns`."""
    out, it = {}, iter(columns)
    for name in INT_PARAMS:
        out[name] = next(it)
        if name in _OPTIONAL:
            value = next(it)
            out[name] = value if out[name] else None
    return out


def sizes(header: torch.Tensor) -> tuple[int, int, int]:
    """header [HEADER_LEN] -> (body_len L, num_seqs B, num_tokens T): the shapes of what follows it."""
    h = header.tolist()
    return h[6], h[4], h[5]


def decode(header: torch.Tensor, body: torch.Tensor, floats: torch.Tensor) -> MicroBatch:
    """The inverse of `encode` (header [HEADER_LEN], body [L], floats [B, FLOAT_FIELDS])."""
    kind, step, index, count, b, t, length, r = header.tolist()
    ints, fl = body.tolist(), floats.tolist()
    assert len(ints) == length and len(fl) == b, (
        f"descriptor body {len(ints)}/{length}, floats {len(fl)}/{b}"
    )
    cursor, seqs, hist_lens, score_lens, mask_lens = b * SEQ_FIELDS, [], [], [], []
    for i in range(b):
        row = ints[i * SEQ_FIELDS : (i + 1) * SEQ_FIELDS]
        req, room, start, end, plen, smp, nb, nh, lp, sf, ns, nm = row[:_FIXED]
        params = SamplingParams(**_int_fields(row[_FIXED:]), **dict(zip(FLOAT_PARAMS, fl[i])))
        seqs.append(
            SeqDesc(
                req,
                room,
                start,
                end,
                plen,
                bool(smp),
                ints[cursor : cursor + nb],
                params,
                logprobs=lp,
                score_first=sf,
            )
        )
        cursor += nb
        hist_lens.append(nh)
        score_lens.append(ns)
        mask_lens.append(nm)
    for s, nh in zip(seqs, hist_lens):
        s.history = ints[cursor : cursor + nh]
        cursor += nh
    for s, ns in zip(seqs, score_lens):
        s.score_ids = ints[cursor : cursor + ns]
        cursor += ns
    for s, nm in zip(seqs, mask_lens):
        s.mask = ints[cursor : cursor + nm]
        cursor += nm
    released = [(ints[j], ints[j + 1]) for j in range(cursor, cursor + 2 * r, 2)]
    mb = MicroBatch(kind, step, index, count, seqs, released)
    assert mb.num_tokens == t and cursor + 2 * r == length, (
        "descriptor header disagrees with its body"
    )
    return mb


def token_width(seqs: list[SeqDesc]) -> int:
    """Floats per sequence of what the last stage returns to rank 0: the token, then when any
    sampling sequence asked for logprobs its logprob and k (logprob, id) pairs, k = the largest
    asked (runner/logprobs.py rows)."""
    k = max((s.logprobs for s in seqs if s.sample), default=-1)
    return 1 if k < 0 else 2 + 2 * k


def reply_shape(seqs: list[SeqDesc]) -> tuple[int, int]:
    """(rows, width) of the float64 reply the last stage sends rank 0 for one micro-batch: B token
    rows (`token_width`), then one row per scored prompt position (sequence order,
    runner/logprobs.py `to_rows`, k = the largest asked by a scoring sequence), all zero-padded to
    the wider of the two."""
    scoring = [s for s in seqs if s.score_ids]
    width = max([token_width(seqs)] + [1 + 2 * s.logprobs for s in scoring])
    return len(seqs) + sum(len(s.score_ids) for s in scoring), width
