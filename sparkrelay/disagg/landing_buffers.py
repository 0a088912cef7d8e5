"""The decode's memory a one-sided backend (Mooncake, NIXL) writes into, and a room's Landing in it.

    target KV pool    KVPool.buffer [2 * layers, slots, kv_heads, head_dim]   the prefill writes K/V at the slots
    draft KV pool     the drafter's KVPool.buffer (mode draft-kv)             the drafter's context K/V, same slots
    hidden rows       [slots, W] (mode hidden)                                every prompt row, same slots
    metadata rows     [num_blocks, row bytes] uint8                           one row per room, at its first page

All four are registered with the engine once, at start. After the room's Success the decode reads
the metadata row and the DSpark context back as Parts, so the checks and the injection are the ZMQ
backend's; the target KV is already in place.
"""

from __future__ import annotations

from typing import Optional

import torch

from sparkrelay.disagg.metadata import TORCH_DTYPES, MetadataLayout
from sparkrelay.disagg.schema import HandoffSchema
from sparkrelay.kvcache.pool import KVPool
from sparkrelay.transfer.base import Part, PartSpec, piece_name, split_piece
from sparkrelay.transfer.landing import Landing


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _planes(pool: KVPool) -> dict[int, tuple[int, int]]:
    return {layer: (k.data_ptr(), v.data_ptr()) for layer, (k, v) in pool.layers.items()}


def _row(pool: KVPool) -> int:
    k = next(iter(pool.layers.values()))[0]
    return k[0].numel() * k.element_size()


class LandingBuffers:
    def __init__(self, schema: HandoffSchema, pool: KVPool, draft_pool: Optional[KVPool]) -> None:
        self.schema, self.pool = schema, pool
        self.draft = draft_pool if schema.handoff == "draft-kv" else None
        slots = pool.num_blocks * pool.page_size
        self.hidden = (
            torch.zeros(slots, schema.hidden_width, dtype=TORCH_DTYPES[schema.dtype])
            if schema.handoff == "hidden"
            else None
        )  # [slots, W]
        self.meta_bytes = MetadataLayout.of(schema).nbytes
        # [blocks, row bytes]
        self.meta = torch.zeros(pool.num_blocks, self.meta_bytes, dtype=torch.uint8)

    def regions(self) -> list[tuple[int, int]]:
        """(address, bytes) of each buffer to register with the engine."""
        bufs = [self.pool.buffer, self.meta] + [t for t in (self.hidden,) if t is not None]
        if self.draft is not None:
            bufs.append(self.draft.buffer)
        return [(t.data_ptr(), _nbytes(t)) for t in bufs]

    def landing(self, block_ids: list[int]) -> Landing:
        """Where a room whose prompt holds `block_ids` receives its parts (peer filled in by the
        agent)."""
        self.meta[block_ids[0]].zero_()  # a row never written reads as room 0: "not landed"
        hidden, draft = self.hidden, self.draft
        return Landing(
            peer="-",
            peer_meta=b"",
            page_size=self.pool.page_size,
            pages=tuple(block_ids),
            kv=_planes(self.pool),
            kv_row=_row(self.pool),
            draft_kv=_planes(draft) if draft is not None else {},
            draft_row=_row(draft) if draft is not None else 0,
            hidden=hidden.data_ptr() if hidden is not None else 0,
            hidden_row=hidden[0].numel() * hidden.element_size() if hidden is not None else 0,
            meta=self.meta[block_ids[0]].data_ptr(),
            meta_bytes=self.meta_bytes,
        )

    def meta_row(
        self, taken: dict[int, dict[str, Part]], block_ids: list[int]
    ) -> dict[int, dict[str, Part]]:
        """The last stage's landed metadata row as a Part with its bytes (a copy), keyed as `taken`
        is."""
        last = max(taken)
        spec = taken[last]["meta"].spec
        return {
            last: {"meta": Part(spec, self.meta[block_ids[0], : spec.nbytes].numpy().tobytes())}
        }

    def parts(
        self, taken: dict[int, dict[str, Part]], slots: torch.Tensor, prefix: int = 0
    ) -> dict[int, dict[str, Part]]:
        """The last stage's landed DSpark context as Parts with their bytes (copies; the metadata
        row: `meta_row`); its pieces, landed at their positions, are read back as one piece of every
        position the prefill sent (from `prefix`, the positions this decode held already:
        "hidden@<prefix>")."""
        last = max(taken)
        out: dict[str, Part] = {}
        sent = slots[prefix:]  # [n - prefix]
        for name, part in taken[last].items():
            kind = split_piece(name)[0]
            name0 = piece_name(kind, prefix)
            if kind == "hidden" and name0 not in out:
                rows = self.hidden.index_select(0, sent)  # [n - prefix, W]
                out[name0] = Part(_spec(part.spec, name0, rows), _bytes(rows))
            elif kind == "draft_kv" and name0 not in out:
                kv = torch.stack(
                    [
                        torch.stack([k.index_select(0, sent), v.index_select(0, sent)])
                        for k, v in self.draft.layers.values()
                    ]
                )  # [Ld, 2, n - prefix, kv_heads, head_dim]
                out[name0] = Part(_spec(part.spec, name0, kv), _bytes(kv))
        return {last: out}


def _spec(piece: PartSpec, name: str, t: torch.Tensor) -> PartSpec:
    """A piece's spec widened to the rows `t` of every position sent."""
    return PartSpec(name, piece.layer_ids, piece.dtype, tuple(t.shape))


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
