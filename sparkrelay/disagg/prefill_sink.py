"""The prefill side of the handoff, one per pipeline stage: capture -> pack -> send.

Every stage streams, per room, what it must hand off through its own PrefillAgent (disagg/handoff.py, the parts):
    all stages   the K/V of its own layers, a piece of STREAM_TOKENS positions as soon as its chunks covered it
    last stage   + the aux rows (hidden) or the draft K/V (draft-kv) of the same positions with each piece; only
                 the last `tail` aux rows [tail, W] (tail), kept for the metadata row, packed once the first token
                 is sampled and sent last (room last)
The last stage keeps the aux rows / draft K/V beside its KV, slot by slot (a pool of the KV pool's slots), not per
room: a prompt whose prefix the prefix cache holds computes only its suffix, and the rows of the
cached positions are still there, in the cached pages' slots, written by the request that computed
them. (`tail` rows are never taken from the cache: the scheduler always computes a prompt's last
`tail` positions.) Each agent's terminal status (Success / Failed + reason) goes to rank 0's status
socket as a `StageReport` (disagg/stage_report.py) {room, stage, state, reason}; rank 0 finishes the
prefill request when every stage has reported.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Optional

import torch

from sparkrelay.config import Config
from sparkrelay.disagg.handoff import build_schema, part_of, pieces
from sparkrelay.disagg.metadata import MetadataLayout, MetadataRow, TailRows, pack
from sparkrelay.disagg.schema import HandoffSchema, compare
from sparkrelay.disagg.stage_report import StageReport, StageReportOutbox
from sparkrelay.envs import DisaggEnv
from sparkrelay.kvcache.pool import KVPool
from sparkrelay.models.attention import slot_index
from sparkrelay.models.decoder import DecoderSpec
from sparkrelay.models.loader import read_config
from sparkrelay.trace import timeline
from sparkrelay.transfer.backends import get_backend
from sparkrelay.transfer.base import KVPoll, Part, piece_name
from sparkrelay.transfer.bootstrap import bootstrap_url as url_of
from sparkrelay.transfer.wire import local_host

logger = logging.getLogger(__name__)


@dataclass
class _Room:
    prompt_len: int
    sent: int = 0  # positions whose pieces went to the agent
    tail: Optional[TailRows] = None  # [tail, W] last stage, tail: only the last rows are ever kept


class PrefillSink:
    def __init__(
        self,
        config: Config,
        stage: int,
        partition: list[tuple[int, int]],
        pool: KVPool,
        status_address: str,
        schema: HandoffSchema,
        env: DisaggEnv,
        bootstrap_url: str = "",
    ) -> None:
        self.stage, self.pool, self.schema = stage, pool, schema
        self.is_last = stage == len(partition) - 1
        self.layout = MetadataLayout.of(schema)
        self.rooms: dict[int, _Room] = {}
        # rooms that reached a terminal state, until rank 0 releases them
        self._ended: set[int] = set()
        self._lock = threading.Lock()
        slots, dtype = pool.num_blocks * pool.page_size, self.pool_dtype
        device = next(iter(pool.layers.values()))[0].device
        # the drafter's context beside the KV, by slot (last stage): [slots, W] hidden; [Ld, 2,
        # slots, kv, hd] draft
        self.aux = (
            torch.zeros(slots, schema.hidden_width, dtype=dtype, device=device)
            if self.is_last and schema.handoff == "hidden"
            else None
        )
        self.draft = (
            torch.zeros(schema.draft[0], 2, slots, *schema.draft[1:], dtype=dtype, device=device)
            if self.is_last and schema.handoff == "draft-kv"
            else None
        )
        dc = config.disagg
        token = env.token(dc.disaggregation_auth_token)
        self._status = StageReportOutbox(status_address, token)
        url = bootstrap_url or url_of(
            local_host(dc.disaggregation_bootstrap_host), dc.disaggregation_bootstrap_port
        )
        # --disaggregation-transfer-backend
        prefill_agent = get_backend(dc.disaggregation_transfer_backend).prefill
        self.agent = prefill_agent(
            stage,
            len(partition),
            schema.to_dict(),
            compare,
            url,
            dc.disaggregation_bootstrap_host,
            env.bootstrap_timeout,
            self._notify,
            prefill_http_port=config.server.port,
            auth_token=token,
            failure_prob=env.test_failure_prob,
            host_ip=env.host_ip,
        )
        self.agent.start()

    def _notify(self, room: int, state: KVPoll, reason: str) -> None:
        """Agent threads report a terminal state: forward it to rank 0, drop what this stage kept
        for the room."""
        timeline.mark(f"stage{self.stage}", "sent", room=room, state=state.name)
        with self._lock:
            self.rooms.pop(room, None)
            self._ended.add(room)
            self._status.send(StageReport(room, self.stage, state, reason))

    # -- the StageSink hooks -----------------------------------------------------------------------
    def after_forward(self, mb, meta, out, aux: Optional[torch.Tensor], draft_kv) -> None:
        row = 0
        for seq in mb.seqs:
            t = seq.end - seq.start
            if seq.room:
                self._capture(seq, aux, draft_kv, meta.slot_mapping[row : row + t], row, t)
            row += t

    def _capture(self, seq, aux, draft_kv, slots: torch.Tensor, row: int, t: int) -> None:
        """slots [t]: where the rows' KV went; the context goes to the same slots (the first chunk
        of a prompt with a cached prefix starts after it)."""
        st = self.rooms.get(seq.room)
        if st is None:
            with self._lock:
                if seq.room in self._ended:
                    return  # the room already failed and was dropped
                st = self.rooms[seq.room] = self._new_room(seq.room, seq.prompt_len)
            self.agent.add_room(seq.room, seq.prompt_len)
        if aux is not None and self.aux is not None:
            self.aux.index_copy_(0, slots, aux[row : row + t])
        if aux is not None and st.tail is not None:
            st.tail.write(seq.start, aux[row : row + t])
        if draft_kv is not None and self.draft is not None:
            for layer, (k, v) in enumerate(draft_kv):
                self.draft[layer, 0].index_copy_(0, slots, k[row : row + t])
                self.draft[layer, 1].index_copy_(0, slots, v[row : row + t])
        self._stream(seq.room, st, seq.end, seq.block_ids)

    def _stream(self, room: int, st: _Room, computed: int, block_ids: list[int]) -> None:
        """Hand over every piece the computed positions [0, computed) complete; a stage other than
        the last ends the room with its last piece (the last stage ends it with the metadata row, in
        on_sampled)."""
        n, parts = st.prompt_len, []
        for a, b in pieces(n, self.schema.stream_tokens):
            if st.sent <= a and b <= computed:
                parts += self._pieces(st, block_ids, a, b)
                st.sent = b
        if parts:
            self._send(room, st, parts, last=st.sent == n and not self.is_last)

    def _new_room(self, room: int, n: int) -> _Room:
        """Registered before the agent hears of it, so a Failed report (which pops it) cannot come
        first."""
        st = _Room(n)
        s = self.schema
        if self.is_last and s.handoff == "tail":
            st.tail = TailRows(n, s.tail_tokens, s.hidden_width, self.pool_dtype)
        return st

    @property
    def pool_dtype(self) -> torch.dtype:
        return next(iter(self.pool.layers.values()))[0].dtype

    def _pieces(self, st: _Room, block_ids: list[int], a: int, b: int) -> list[Part]:
        """The parts of positions [a, b): this stage's K/V [L, 2, t, kv, hd], and on the last stage
        the context."""
        device = next(iter(self.pool.layers.values()))[0].device
        # [t]: positions a..b-1
        slots = slot_index([block_ids], b, self.pool.page_size)[0][a:].to(device)
        kv = torch.stack(
            [
                torch.stack([k.index_select(0, slots), v.index_select(0, slots)])
                for k, v in self.pool.layers.values()
            ]
        )  # [L, 2, t, kv, hd]
        out = [part_of(piece_name("kv", a), tuple(self.pool.layers), kv)]
        if self.aux is not None:
            out.append(
                part_of(
                    piece_name("hidden", a),
                    self.schema.target_layer_ids,
                    self.aux.index_select(0, slots),
                )
            )
        if self.draft is not None:
            out.append(
                part_of(
                    piece_name("draft_kv", a),
                    tuple(range(self.schema.draft[0])),
                    self.draft.index_select(2, slots),
                )
            )
        return out

    def on_sampled(self, mb, tokens: list[int], logprobs: list) -> None:
        """Last stage: the first token (and its logprobs, when asked) is known; pack the metadata
        row (room last) and send it, the room's last part (every piece went out with its chunk)."""
        sampled = [s for s in mb.seqs if s.sample]
        for seq, token, entry in zip(sampled, tokens, logprobs):
            st = self.rooms.get(seq.room) if seq.room else None
            if st is None:
                continue
            self._send(
                seq.room, st, [self._meta(seq.room, st, token, entry or (0.0, []))], last=True
            )

    def _meta(self, room: int, st: _Room, token: int, entry: tuple) -> Part:
        s, dtype = self.schema, self.pool_dtype
        if s.handoff == "tail":
            tail = st.tail
            row = MetadataRow(
                token,
                room,
                tail.rows[-1],
                tail.rows,
                tail.valid,
                first_logprob=entry[0],
                top_logprobs=entry[1],
            )
        else:
            empty = torch.zeros(0, dtype=dtype)
            row = MetadataRow(
                token,
                room,
                empty,
                empty.view(0, s.hidden_width),
                torch.zeros(0, dtype=torch.bool),
                first_logprob=entry[0],
                top_logprobs=entry[1],
            )
        meta = torch.frombuffer(bytearray(pack(self.layout, row)), dtype=torch.uint8)
        return part_of("meta", (), meta)

    def _send(self, room: int, st: _Room, parts: list[Part], last: bool) -> None:
        if last:
            st.tail = None
        timeline.mark(f"stage{self.stage}", "send", room=room, last=last)
        self.agent.send(room, parts, last=last)

    def release(self, rooms: list[int]) -> None:
        """Rank 0 is done with these rooms (finished, failed or aborted by its client): a room not
        yet sent fails towards its decode peer (no-op after Success), then is forgotten."""
        for room in rooms:
            with self._lock:
                self.rooms.pop(room, None)
                self._ended.discard(room)
            if self.agent.poll(room).state not in (KVPoll.Success, KVPoll.Failed):
                self.agent.abort(room, "the prefill request was aborted")
            self.agent.clear(room)

    def close(self) -> None:
        self.agent.close()
        self._status.close()


def make_stage_sink(
    config: Config,
    stage: int,
    partition: list[tuple[int, int]],
    pool: KVPool,
    status_address: str,
    bootstrap_url: str = "",
) -> PrefillSink:
    """Called by each pipeline stage of a prefill server (pipeline/); bootstrap_url "": this server's own."""
    env = DisaggEnv.read()
    spec = DecoderSpec.from_hf(read_config(config.model.model_path))
    dtype = next(iter(pool.layers.values()))[0].dtype
    schema = build_schema(config, spec, dtype, env)
    return PrefillSink(config, stage, partition, pool, status_address, schema, env, bootstrap_url)
