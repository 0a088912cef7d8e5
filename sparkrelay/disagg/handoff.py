"""The DSpark handoff: which schema each side builds, which parts the decode expects from each
prefill stage, and how the decode injects the handed-off context into its draft KV cache.

Parts of one room (PartSpec name, sender, shape; n = prompt length):
    kv@a        every stage    [layers of the stage, 2 (K, V), t, kv_heads, head_dim]   layer_ids = global ids
    hidden@a    last stage     [t, W]  mode hidden: the aux rows of positions a..a+t-1 (taps in target_layer_ids order)
    draft_kv@a  last stage     [draft layers, 2, t, kv_heads, head_dim]  mode draft-kv: the drafter's context K/V
    meta        last stage     [row bytes] uint8: the metadata row (disagg/metadata.py): first token, tail, room
The prompt is cut into pieces of STREAM_TOKENS positions, a = 0, STREAM_TOKENS, ..., t = STREAM_TOKENS (the last one
what is left): a stage sends each piece as soon as its chunks covered it, while the prefill goes on (SGLang sends
each chunk's KV as it is computed); the metadata row goes last, once the first token is sampled. A prefill that
captures nothing (no layer ids) sends kv + meta only; its schema says handoff "none".
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import torch

from sparkrelay.config import Config, ConfigError
from sparkrelay.disagg.metadata import TORCH_DTYPES, MetadataLayout, MetadataRow, unpack
from sparkrelay.disagg.schema import SCHEMA_VERSION, HandoffSchema, model_identity
from sparkrelay.envs import TAIL_TOKENS, DisaggEnv
from sparkrelay.grammar.backends import version
from sparkrelay.models.decoder import DecoderSpec
from sparkrelay.pipeline.capture import resolve_capture, resolve_layer_ids
from sparkrelay.pipeline.partition import pp_partition
from sparkrelay.transfer.base import Part, PartSpec, piece_name, split_piece

DTYPE_NAMES = {v: k for k, v in TORCH_DTYPES.items()}
# Positions per streamed piece: half the pipeline's smallest chunk (pipeline/runner.py
# CHUNK_TOKENS), so a chunk of a long prompt completes its pieces and their KV leaves while the next
# chunk computes.
STREAM_TOKENS = 128


def _draft_config(path: Optional[str]) -> Optional[dict]:
    if path is None:
        return None
    return json.loads((Path(path) / "config.json").read_text())


def _layer_ids(config: Config, spec: DecoderSpec, env: DisaggEnv) -> tuple[int, ...]:
    """The record's taps: on a prefill exactly what its stages capture (pipeline/capture.py resolves
    both); on a decode its drafter's (or the knob's, checked against the drafter's)."""
    if config.disagg.disaggregation_mode == "decode":
        draft_cfg = (
            _draft_config(config.spec.speculative_draft_model_path)
            if config.spec.speculative_algorithm
            else None
        )
        return resolve_layer_ids(env, draft_cfg, spec.num_layers, decode=True)
    return resolve_capture(config, env, spec.num_layers).target_layer_ids


def _check_tail(config: Config, spec: DecoderSpec, env: DisaggEnv) -> None:
    context = config.model.context_length or spec.max_position_embeddings
    if env.tail_tokens > context:
        raise ConfigError(
            f"{env.var(TAIL_TOKENS)}={env.tail_tokens} exceeds the context length {context} "
            "(--context-length, else the model's max_position_embeddings): no prompt has that many rows"
        )


def build_schema(
    config: Config, spec: DecoderSpec, dtype: torch.dtype, env: DisaggEnv
) -> HandoffSchema:
    """This side's schema record, from model-level facts and the flags that shape the wire."""
    _check_tail(config, spec, env)
    ids = _layer_ids(config, spec, env)
    mode = config.disagg.handoff if ids else "none"
    draft = None
    if mode == "draft-kv":
        draft_cfg = _draft_config(config.spec.speculative_draft_model_path)
        # a decode without a drafter: its record cannot describe the drafter's K/V
        if draft_cfg is None:
            raise ConfigError(
                "--dspark-pd-handoff draft-kv needs --speculative-draft-model-path (the drafter's "
                "shape sets the handed-off K/V's)"
            )
        heads = draft_cfg["num_attention_heads"]
        draft = (
            int(draft_cfg["num_hidden_layers"]),
            int(draft_cfg.get("num_key_value_heads") or heads),
            int(draft_cfg.get("head_dim") or draft_cfg["hidden_size"] // heads),
        )
    pp = config.parallel.pp_size if config.disagg.disaggregation_mode == "prefill" else 1
    return HandoffSchema(
        version=SCHEMA_VERSION,
        transfer_backend=config.disagg.disaggregation_transfer_backend,
        model=model_identity(config.model.model_path),
        dtype=DTYPE_NAMES[dtype],
        weights=config.model.torchao_config or "unquant",
        page_size=config.cache.page_size,
        num_layers=spec.num_layers,
        kv_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        hidden_size=spec.hidden_size,
        layer_partition=tuple(pp_partition(spec.num_layers, pp)),
        target_layer_ids=ids,
        hidden_width=len(ids) * spec.hidden_size,
        handoff=mode,
        tail_tokens=env.tail_tokens if mode == "tail" else 0,
        prefix_cache="off" if config.cache.disable_radix_cache else "on",
        draft=draft,
        stream_tokens=STREAM_TOKENS,
        grammar=grammar_identity(config.scheduler.grammar_backend),
        draft_weights=(config.draft_torchao_config or "unquant") if draft else "none",
    )


def grammar_identity(backend: str) -> str:
    """'name==version' of --grammar-backend, or 'none'."""
    return "none" if backend == "none" else f"{backend}=={version(backend)}"


def expected_parts(
    prefill_schema: dict, prompt_len: int, prefix: int = 0
) -> dict[int, list[PartSpec]]:
    """What each prefill stage must send for a prompt of `prompt_len` tokens of which the decode
    holds the first `prefix` (its prefix cache's; a whole number of pieces): the pieces from there,
    and the metadata row (the decode side checks every frame)."""
    s = HandoffSchema.from_dict(prefill_schema)
    stages = len(s.layer_partition)
    if list(s.layer_partition) != pp_partition(s.num_layers, stages):
        raise ValueError(
            f"layer_partition {list(s.layer_partition)} is not pp_partition({s.num_layers}, {stages}) "
            f"= {pp_partition(s.num_layers, stages)}: the two sides split layers differently"
        )
    if prefix and (prefix % s.stream_tokens or not 0 < prefix < prompt_len):
        raise ValueError(
            f"a cached prefix of {prefix} tokens is not a multiple of {s.stream_tokens} below the "
            f"prompt length {prompt_len}"
        )
    spans = [(a, b) for a, b in pieces(prompt_len, s.stream_tokens) if a >= prefix]
    kv_heads, hd = s.kv_heads, s.head_dim
    out = {
        st: [
            PartSpec(
                piece_name("kv", a),
                tuple(range(lo, hi)),
                s.dtype,
                (hi - lo, 2, b - a, kv_heads, hd),
            )
            for a, b in spans
        ]
        for st, (lo, hi) in enumerate(s.layer_partition)
    }
    last = out[stages - 1]
    if s.handoff == "hidden":
        last += [
            PartSpec(piece_name("hidden", a), s.target_layer_ids, s.dtype, (b - a, s.hidden_width))
            for a, b in spans
        ]
    elif s.handoff == "draft-kv":
        layers, heads, hd = s.draft
        last += [
            PartSpec(
                piece_name("draft_kv", a),
                tuple(range(layers)),
                s.dtype,
                (layers, 2, b - a, heads, hd),
            )
            for a, b in spans
        ]
    last.append(PartSpec("meta", (), "uint8", (MetadataLayout.of(s).nbytes,)))
    return out


def pieces(n: int, size: int) -> list[tuple[int, int]]:
    """[a, b) of each streamed piece of an n-position prompt."""
    if size < 1:
        raise ValueError(f"stream_tokens {size} must be at least 1")
    return [(a, min(a + size, n)) for a in range(0, n, size)]


def of_kind(stage: dict[str, Part], base: str) -> list[tuple[int, Part]]:
    """(first position, part) of every piece of `base` a stage sent, by position."""
    out = []
    for name, part in stage.items():
        kind, start = split_piece(name)
        if kind == base:
            out.append((start, part))
    return sorted(out, key=lambda x: x[0])


def tensor_of(part: Part) -> torch.Tensor:
    """A part's bytes as a tensor of its spec's dtype and shape (a copy: the bytes may be
    reused)."""
    dtype = torch.uint8 if part.spec.dtype == "uint8" else TORCH_DTYPES[part.spec.dtype]
    return torch.frombuffer(bytearray(part.data), dtype=dtype).view(part.spec.shape)


def part_of(name: str, layer_ids: tuple[int, ...], t: torch.Tensor) -> Part:
    t = t.contiguous().cpu()
    dtype = "uint8" if t.dtype == torch.uint8 else DTYPE_NAMES[t.dtype]
    return Part(
        PartSpec(name, tuple(layer_ids), dtype, tuple(t.shape)),
        t.view(-1).view(torch.uint8).numpy().tobytes(),
    )


class HandoffError(ValueError):
    """The handed-off context is missing or corrupt: the request fails (the drafter never starts
    cold)."""


def read_meta(schema: HandoffSchema, parts: dict[int, dict[str, Part]], room: int) -> MetadataRow:
    """The metadata row from the prefill's last stage (parts are keyed by its pp rank), its room
    checked first: a row for another room is a corrupt or misrouted buffer (docs/pd_protocol.md,
    failure modes)."""
    row = unpack(MetadataLayout.of(schema), parts[max(parts)]["meta"].data)
    if row.room != room:
        raise HandoffError(
            f"metadata corruption: the row's bootstrap_room {row.room} is not the request's {room}"
        )
    return row


def write_kv(pool, parts: dict[int, dict[str, Part]], slots: torch.Tensor) -> None:
    """Every stage's `kv` pieces into the decode pool at their positions' `slots` ([n] for the
    prompt), paired by global layer id (never by position, the stages may split the layers
    differently from the pool's order); each of the pool's layers must be covered exactly once."""
    seen: list[int] = []
    for stage in sorted(parts):
        kv_pieces = of_kind(parts[stage], "kv")
        for start, part in kv_pieces:
            kv = tensor_of(part)  # [L_s, 2, t, kv_heads, head_dim]
            at = slots[start : start + kv.shape[2]]
            for i, layer in enumerate(part.spec.layer_ids):
                if layer not in pool.layers:
                    raise HandoffError(
                        f"stage {stage} sent KV for layer {layer}, which the decode pool does not have"
                    )
                k_pool, v_pool = pool.layers[layer]
                k_pool.index_copy_(0, at, kv[i, 0].to(k_pool.device))
                v_pool.index_copy_(0, at, kv[i, 1].to(v_pool.device))
        seen += list(kv_pieces[0][1].spec.layer_ids) if kv_pieces else []
    if sorted(seen) != sorted(pool.layers):
        raise HandoffError(
            f"the prefill stages sent KV for layers {sorted(seen)}; the decode needs "
            f"{sorted(pool.layers)}"
        )


def _finite(name: str, t: torch.Tensor) -> torch.Tensor:
    if t.numel() == 0:
        raise HandoffError(f"the {name} rows are empty")
    if not bool(torch.isfinite(t).all()):
        raise HandoffError(f"the {name} rows hold NaN or Inf")
    return t


def inject_context(
    proposer,
    schema: HandoffSchema,
    parts: dict[int, dict[str, Part]],
    row: MetadataRow,
    slots: torch.Tensor,
) -> int:
    """Write the handed-off DSpark context into the decode drafter's KV at the prompt's absolute
    positions, before its first draft step. Returns the first position the drafter's context covers
    (0, or n - tail rows)."""
    n, dev = slots.shape[0], slots.device
    last = parts[
        max(parts)
    ]  # the prefill's last stage (this side's schema has its own, PP = 1, partition)
    if schema.handoff == "hidden":
        rows = of_kind(last, "hidden")
        if not rows:
            raise HandoffError("no hidden rows arrived")
        for start, part in rows:
            features = _finite("hidden", tensor_of(part).to(dev))  # [t, W]
            t = features.shape[0]
            proposer.write_features(
                features, torch.arange(start, start + t, device=dev), slots[start : start + t]
            )
        return 0
    if schema.handoff == "tail":
        k = int(row.tail_valid.sum())
        want = min(n, schema.tail_tokens)
        if k != want or not bool(row.tail_valid[schema.tail_tokens - k :].all()):
            raise HandoffError(
                f"the tail's valid mask {row.tail_valid.int().tolist()} is not the last {want} rows"
            )
        # both are the last prompt row's aux row
        if not torch.equal(row.last_hidden, row.tail_hidden[-1]):
            raise HandoffError("metadata corruption: last_hidden is not the tail's last row")
        features = _finite("tail", row.tail_hidden[schema.tail_tokens - k :].to(dev))  # [k, W]
        proposer.write_features(features, torch.arange(n - k, n, device=dev), slots[n - k :])
        return n - k
    if schema.handoff == "draft-kv":
        kvs = of_kind(last, "draft_kv")
        if not kvs:
            raise HandoffError("no draft K/V arrived")
        for start, part in kvs:
            kv = _finite("draft K/V", tensor_of(part).to(dev))  # [Ld, 2, t, kv_heads, head_dim]
            if kv.shape[0] != len(proposer.pool.layers):
                raise HandoffError(
                    f"draft K/V for {kv.shape[0]} layers; the drafter has {len(proposer.pool.layers)}"
                )
            at = slots[start : start + kv.shape[2]]
            for layer, (k_pool, v_pool) in proposer.pool.layers.items():
                k_pool.index_copy_(0, at, kv[layer, 0].to(k_pool.dtype))
                v_pool.index_copy_(0, at, kv[layer, 1].to(v_pool.dtype))
        return 0
    raise HandoffError(
        f"handoff mode {schema.handoff!r} carries no drafter context; the decode drafter would start "
        "cold (set SPARKRELAY_DSPARK_PD_TARGET_LAYER_IDS or give the prefill the drafter's config)"
    )
