"""The PD router's bootstrap fields (host, port, room; docs/pd_protocol.md, the router protocol)
spread over a request's engine items: one Bootstrap per item, rooms derived per sample as SGLang
derives them."""

from __future__ import annotations

import dataclasses
from typing import Optional

from sparkrelay.manager.messages import GenerationItem
from sparkrelay.scheduler.request import Bootstrap, RequestError
from sparkrelay.server.protocol.common import Routed

_MAX_ROOM = 2**63 - 1


def _sample_room(room: Optional[int], j: int) -> Optional[int]:
    """Sample j's room, derived from its prompt's room as SGLang does (room + j), kept in
    1..2^63-1."""
    return (
        room
        if room is None or j == 0 or not 1 <= room <= _MAX_ROOM
        else 1 + (room - 1 + j) % _MAX_ROOM
    )


def _per_item(value, n: int, samples: int, name: str) -> list:
    """One value per item. Items are prompt-major with `samples` items per prompt; a single value or
    one value per prompt is spread over the prompt's samples (rooms: prompt room + sample index,
    both sides derive the same)."""
    prompts = n // samples
    if isinstance(value, list) and len(value) not in (n, prompts):
        raise RequestError(
            f"`{name}` has {len(value)} entries; the request has {n} sequences"
            + (f" ({prompts} prompts x n = {samples})" if samples > 1 else "")
        )
    if isinstance(value, list) and len(value) == n:
        return value
    per_prompt = value if isinstance(value, list) else [value] * prompts
    if (
        name == "bootstrap_room"
        and not isinstance(value, list)
        and prompts > 1
        and value is not None
    ):
        raise RequestError(
            f"a batch of {prompts} prompts needs `bootstrap_room` as a list with one room per "
            f"sequence (or one per prompt, when n > 1)"
        )
    if name != "bootstrap_room":
        return [v for v in per_prompt for _ in range(samples)]
    return [_sample_room(r, j) for r in per_prompt for j in range(samples)]


def with_bootstrap(req: Routed, items: list[GenerationItem]) -> list[GenerationItem]:
    """Attach the router's bootstrap fields to each item: arrays with one element per item (in
    order) or per prompt (n > 1: sample j of a prompt gets the prompt's room + j, as SGLang does),
    or one value for all."""
    if req.bootstrap_room is None and req.bootstrap_host is None:
        return items
    n, samples = len(items), getattr(req, "n", 1)
    samples = samples if isinstance(samples, int) and samples >= 1 and n % samples == 0 else 1
    hosts = _per_item(req.bootstrap_host, n, samples, "bootstrap_host")
    ports = _per_item(req.bootstrap_port, n, samples, "bootstrap_port")
    rooms = _per_item(req.bootstrap_room, n, samples, "bootstrap_room")
    if len(set(r for r in rooms if r is not None)) != len([r for r in rooms if r is not None]):
        raise RequestError("`bootstrap_room` repeats a room; every sequence needs its own")
    return [
        dataclasses.replace(it, bootstrap=Bootstrap(h or "", p, r)) if r is not None else it
        for it, h, p, r in zip(items, hosts, ports, rooms)
    ]
