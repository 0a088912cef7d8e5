"""The handshake schema: every fact both PD sides must agree on before a byte moves
(docs/pd_protocol.md, the handshake).

The record is derived from model-level facts only (the target's config, the drafter's config or the
env knobs, the flags that shape the wire), never from local speculative flags, so an asymmetric pair
(prefill without a drafter, decode with DSpark) builds the same record. The prefill publishes it at
`GET /route` (all -1); the decode sends its own with every TRANSFER_INFO. Each side compares and
fails the room with a message naming the field.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

SCHEMA_VERSION = 8  # 2: the metadata row carries the first token's logprobs; 3: the transfer backend; 4: streamed;
# 5: a decode's cached prefix (TRANSFER_INFO prefix: the prefill sends only the pieces from there); 6: the
# grammar backend; 7: the drafter's weights (draft-kv); 8: the target's weights


@dataclass(frozen=True)
class HandoffSchema:
    version: int
    transfer_backend: (
        str  # --disaggregation-transfer-backend: how the bytes move (zmq, mooncake, nixl)
    )
    model: str  # identity: sha256 of the target's config.json (canonical) and weight sizes
    dtype: str  # KV and handoff dtype
    # the target's linears, "unquant" or "int8wo" (--torchao-config): the prefill's KV and taps must
    # be what the decode's own forward computes, or its tokens are neither side's greedy output
    weights: str
    page_size: int
    num_layers: int
    kv_heads: int
    head_dim: int
    hidden_size: int
    layer_partition: tuple[
        tuple[int, int], ...
    ]  # the prefill's stages; decode checks it is pp_partition's
    target_layer_ids: tuple[int, ...]  # tap order = column order of the hidden rows
    hidden_width: int  # len(target_layer_ids) * hidden_size
    handoff: str  # tail | hidden | draft-kv
    tail_tokens: int  # rows of the tail handoff (0 unless handoff == tail)
    prefix_cache: (
        str  # this side's prefix (radix) cache: "on" | "off" (every pair is correct, below)
    )
    draft: Optional[
        tuple[int, int, int]
    ]  # draft-kv: (draft layers, draft kv heads, draft head_dim)
    stream_tokens: (
        int  # positions per streamed piece (the decode plans the prefill's pieces with it)
    )
    # --grammar-backend and its version ("llguidance==1.9.1", or "none"): the prefill samples a
    # constrained request's first token under it, the decode every later one
    grammar: str = "none"
    # draft-kv: the context products' weights, "unquant" or "int8wo" (--speculative-draft-model-
    # quantization, else --torchao-config): the prefill's K/V must be the decode drafter's; else "none"
    draft_weights: str = "none"

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["layer_partition"] = [list(b) for b in self.layer_partition]
        d["target_layer_ids"] = list(self.target_layer_ids)
        d["draft"] = list(self.draft) if self.draft is not None else None
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "HandoffSchema":
        """Raise ValueError naming the field for a malformed record (it may come from a socket)."""
        names = {f.name for f in dataclasses.fields(cls)}
        if not isinstance(d, dict) or set(d) != names:
            got = sorted(d) if isinstance(d, dict) else type(d).__name__
            raise ValueError(f"schema record fields {got} are not {sorted(names)}")
        try:
            return cls(
                **{
                    **d,
                    "layer_partition": tuple((int(a), int(b)) for a, b in d["layer_partition"]),
                    "target_layer_ids": tuple(int(i) for i in d["target_layer_ids"]),
                    "draft": tuple(int(x) for x in d["draft"]) if d["draft"] is not None else None,
                }
            )
        except (TypeError, ValueError) as e:
            raise ValueError(f"malformed schema record: {e}") from None


# Fields compared between prefill and decode; layer_partition is checked separately (decode runs PP
# = 1 and accepts any prefill PP size whose partition is the shared function's). stream_tokens must
# agree: a decode's cached prefix is a whole number of pieces. prefix_cache is each side's own:
# every pair of policies is correct (a decode names the prefix it holds, and a prefill keeps the
# drafter's context beside its cached pages, so it can send any position's; docs/prefix_cache.md),
# and version 5 refuses a peer that would ignore the prefix.
COMPARED = (
    "version",
    "transfer_backend",
    "model",
    "dtype",
    "weights",
    "page_size",
    "num_layers",
    "kv_heads",
    "head_dim",
    "hidden_size",
    "target_layer_ids",
    "hidden_width",
    "handoff",
    "tail_tokens",
    "draft",
    "stream_tokens",
    "grammar",
    "draft_weights",
)


def compare(prefill: dict, decode: dict) -> list[str]:
    """Mismatches as 'field: prefill=X decode=Y', in COMPARED order (empty when the records
    agree)."""
    out = []
    for name in COMPARED:
        a, b = prefill.get(name), decode.get(name)
        if a != b:
            out.append(f"{name}: prefill={a!r} decode={b!r}")
    return out


def model_identity(folder: str) -> str:
    """sha256 over the target's config.json (canonical JSON) and the names and sizes of its weight
    files."""
    root = Path(folder)
    h = hashlib.sha256(
        json.dumps(json.loads((root / "config.json").read_text()), sort_keys=True).encode()
    )
    for f in sorted(root.glob("*.safetensors")):
        h.update(f"{f.name}:{f.stat().st_size}".encode())
    return h.hexdigest()[:16]
