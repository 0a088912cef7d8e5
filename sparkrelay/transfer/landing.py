"""Where a one-sided backend's prefill stage writes a room's parts in the decode's memory: the
Landing a decode sends in its TRANSFER_INFO, and the write list a stage makes from it. Pure: no
engine, no socket.

The decode registers its memory with the engine once (target KV pool, draft KV pool, hidden rows,
metadata rows); per room it names the room's pages and the addresses of each region:

    kv        {global layer id: (K base, V base)}, row bytes   token t -> base + slot(t) * row bytes
    draft_kv  {draft layer: (K base, V base)}, row bytes       the same slots (the drafter's pool is paged alike)
    hidden    base, row bytes                                  [slots, W] rows, the same slots
    meta      one address                                      the room's metadata row (whole part)
    slot(t) = pages[t // page_size] * page_size + t % page_size; consecutive pages make one write.

A part's bytes are C order over [planes..., t, row] (kv: [layers, 2, t, heads, head_dim] -> planes (layer, K|V)),
t its positions: the whole prompt, or a streamed piece's ("kv@256": positions 256..256 + t - 1).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

from sparkrelay.transfer.base import Part, split_piece
from sparkrelay.transfer.protocol import MAX_LIST_LEN, FrameError

MAX_ADDR = (1 << 64) - 1
Planes = dict[int, tuple[int, int]]  # layer id -> (K base address, V base address)


@dataclass(frozen=True)
class Landing:
    peer: str  # the decode engine's id (Mooncake "host:port", NIXL agent name)
    peer_meta: bytes  # what a writer loads to reach it (NIXL agent metadata; b"" for Mooncake)
    page_size: int
    pages: tuple[int, ...]  # the room's pages, in token order (on the wire: runs, pack_pages)
    kv: Planes
    kv_row: int
    draft_kv: Planes = field(default_factory=dict)
    draft_row: int = 0
    hidden: int = 0
    hidden_row: int = 0
    meta: int = 0
    meta_bytes: int = 0

    def to_wire(self) -> dict:
        return {
            "peer": self.peer,
            "peer_meta": self.peer_meta,
            "page_size": self.page_size,
            "pages": pack_pages(self.pages),
            "kv": _planes_out(self.kv),
            "kv_row": self.kv_row,
            "draft_kv": _planes_out(self.draft_kv),
            "draft_row": self.draft_row,
            "hidden": self.hidden,
            "hidden_row": self.hidden_row,
            "meta": self.meta,
            "meta_bytes": self.meta_bytes,
        }

    @classmethod
    def from_wire(cls, d: Any, room: int) -> "Landing":
        """FrameError naming the field for a map that is not a valid landing (it came from a
        socket)."""
        if not isinstance(d, dict) or not d:
            raise FrameError(
                "TRANSFER_INFO has no landing: the decode uses a transfer backend without one-sided "
                "writes (--disaggregation-transfer-backend differs between the two servers)",
                room,
            )
        try:
            return cls(
                peer=_text(d["peer"]),
                peer_meta=_blob(d["peer_meta"]),
                page_size=_count(d["page_size"], 1),
                pages=unpack_pages(d["pages"]),
                kv=_planes_in(d["kv"]),
                kv_row=_count(d["kv_row"]),
                draft_kv=_planes_in(d["draft_kv"]),
                draft_row=_count(d["draft_row"]),
                hidden=_addr(d["hidden"]),
                hidden_row=_count(d["hidden_row"]),
                meta=_addr(d["meta"]),
                meta_bytes=_count(d["meta_bytes"]),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise FrameError(
                f"bad landing in TRANSFER_INFO: {type(e).__name__}: {e}"[:300], room
            ) from None


def pack_pages(pages: tuple[int, ...]) -> bytes:
    """Pages as little-endian int32 (first page, count) pairs, one per run of consecutive pages: 8
    bytes a run."""
    out: list[list[int]] = []
    for p in pages:
        if out and out[-1][0] + out[-1][1] == p:
            out[-1][1] += 1
        else:
            out.append([p, 1])
    return np.array(out, dtype="<i4").tobytes()


def unpack_pages(v: Any) -> tuple[int, ...]:
    raw = _blob(v)
    if len(raw) % 8:
        raise ValueError(
            f"pages: {len(raw)} bytes is not a list of int32 (first page, count) pairs"
        )
    pairs = np.frombuffer(raw, dtype="<i4").reshape(-1, 2)
    if (pairs[:, 0] < 0).any() or (pairs[:, 1] < 1).any() or int(pairs[:, 1].sum()) > 1 << 24:
        raise ValueError(
            "pages: a run with a negative first page, no pages, or over 2^24 pages in all"
        )
    return tuple(p for first, count in pairs.tolist() for p in range(first, first + count))


def _planes_out(planes: Planes) -> list[list[int]]:
    return [[layer, k, v] for layer, (k, v) in sorted(planes.items())]


def _planes_in(v: Any) -> Planes:
    return {_count(layer): (_addr(k), _addr(val)) for layer, k, val in _list(v)}


def _list(v: Any) -> list:
    if not isinstance(v, (list, tuple)) or len(v) > MAX_LIST_LEN:
        raise ValueError(f"expected a list of at most {MAX_LIST_LEN} entries")
    return list(v)


def _count(v: Any, lo: int = 0) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= 1 << 40:
        raise ValueError(f"expected an int in {lo}..2^40, got {v!r}"[:100])
    return v


def _addr(v: Any) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= MAX_ADDR:
        raise ValueError(f"expected an address, got {v!r}"[:100])
    return v


def _text(v: Any) -> str:
    if not isinstance(v, str) or not 0 < len(v) <= 255:
        raise ValueError("expected a non-empty str of at most 255 chars")
    return v


def _blob(v: Any) -> bytes:
    if not isinstance(v, bytes):
        raise ValueError("expected bytes")
    return v


def runs(
    pages: tuple[int, ...], page_size: int, n: int, start: int = 0
) -> list[tuple[int, int, int]]:
    """(first token - start, first slot, tokens) of each stretch of consecutive slots holding tokens
    start..n-1."""
    if n > len(pages) * page_size:
        raise ValueError(
            f"{n} tokens need {-(-n // page_size)} pages, the landing has {len(pages)}"
        )
    out: list[list[int]] = []
    for i in range(start // page_size, -(-n // page_size)):
        lo, hi = max(start, i * page_size), min(n, (i + 1) * page_size)
        slot = pages[i] * page_size + lo - i * page_size
        if out and out[-1][1] + out[-1][2] == slot:
            out[-1][2] += hi - lo
        else:
            out.append([lo - start, slot, hi - lo])
    return [tuple(r) for r in out]


def _paged(
    src: int, spec_planes: list[tuple[int, int]], t: int, row: int, stretches
) -> list[tuple[int, int, int]]:
    """Writes of a part laid out [planes, t, row bytes] into per-plane bases; spec_planes: (plane
    index, base)."""
    out = []
    for plane, base in spec_planes:
        for first, slot, k in stretches:
            out.append((src + (plane * t + first) * row, base + slot * row, k * row))
    return out


def writes(
    landing: Landing, parts: list[Part], addrs: dict[str, int], n: int
) -> list[tuple[int, int, int]]:
    """(source address, destination address, bytes) for every part of one stage (addrs: part name -> the address of
    its bytes; a piece, "kv@256", lands at its positions); ValueError when the landing cannot hold a part."""
    out: list[tuple[int, int, int]] = []
    for part in parts:
        out += _part_writes(landing, part, addrs[part.spec.name], n)
    return out


def _tokens(spec) -> int:
    """Positions a KV-like [planes..., 2, t, ...] or row [t, W] part covers."""
    return spec.shape[0] if len(spec.shape) == 2 else spec.shape[2]


def _part_writes(landing: Landing, part: Part, src: int, n: int) -> list[tuple[int, int, int]]:
    spec = part.spec
    base, start = split_piece(spec.name)
    if base == "meta":
        if spec.nbytes > landing.meta_bytes or not landing.meta:
            raise ValueError(
                f"the metadata row is {spec.nbytes} bytes, the landing holds {landing.meta_bytes}"
            )
        return [(src, landing.meta, spec.nbytes)]
    t = _tokens(spec)
    if start + t > n:
        raise ValueError(
            f"part {spec.name!r} covers positions {start}..{start + t - 1}, the prompt has {n}"
        )
    stretches = runs(landing.pages, landing.page_size, start + t, start)
    if base == "hidden":
        _check_row(base, spec.nbytes // max(t, 1), landing.hidden_row, landing.hidden)
        return _paged(src, [(0, landing.hidden)], t, landing.hidden_row, stretches)
    planes, row = _planes(landing, base)
    _check_row(base, spec.nbytes // max(1, 2 * len(spec.layer_ids) * t), row, 1)
    bases: list[tuple[int, int]] = []
    for i, layer in enumerate(spec.layer_ids):
        if layer not in planes:
            raise ValueError(
                f"part {spec.name!r}: the landing has no layer {layer} (it has {sorted(planes)})"
            )
        bases += [(2 * i, planes[layer][0]), (2 * i + 1, planes[layer][1])]
    return _paged(src, bases, t, row, stretches)


def _planes(landing: Landing, name: str) -> tuple[Planes, int]:
    if name == "kv":
        return landing.kv, landing.kv_row
    if name == "draft_kv":
        return landing.draft_kv, landing.draft_row
    raise ValueError(f"part {name!r} has no landing")


def _check_row(name: str, got: int, want: int, base: Optional[int]) -> None:
    if not base or got != want:
        raise ValueError(f"part {name!r}: {got} bytes per token, the landing's rows are {want}")
