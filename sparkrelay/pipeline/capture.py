"""What the pipeline captures for DSpark, and the stage-to-stage payload that carries it.

Capture modes (`CaptureSpec.mode`):
  none     aggregated serving: only the hidden stream crosses stages;
  taps     every stage appends the taps it owns (tap L = the residual-stream output of layer L, owned by the stage
           holding L; tap -1 = the embedding output, stage 0: pipeline/partition.py); the last stage holds all k
           taps in target_layer_ids order = the aux rows [T, W = k * d] (hidden / tail handoff);
  partial  every stage adds its taps' share of the drafter's fc to a running pre-norm sum; the last stage applies
           hidden_norm once and each draft layer's K/V projection (draft-kv handoff; models/dspark_context.py).

`resolve_capture` is the one place the taps are resolved (the knobs
SPARKRELAY_DSPARK_PD_TARGET_LAYER_IDS and SPARKRELAY_DSPARK_PD_ENABLE_PREFILL_CAPTURE, the drafter's
config, --dspark-pd-handoff): the stages capture what it returns and the handshake record
(disagg/handoff.py) carries its layer ids.

Stage-to-stage payload, rank k -> rank k+1, right after the step descriptor (pipeline/descriptor.py), in this order:
  hidden   [T, d]        model dtype: the residual stream after the sending stage's last layer. Our decoder layer
                         keeps a single residual stream (h = h + attn(norm(h)); h = h + mlp(norm(h))), so SGLang's
                         separate `hidden_states` and `residual` proxy tensors are this one tensor here.
  taps     [T, k_prev*d] model dtype, mode taps, sent only when k_prev > 0: the taps owned by stages 0..k (the
                         sender and the ones before it), concatenated in target_layer_ids order.
  partial  [T, d_draft]  float32, mode partial: Σ_i h_i W_iᵀ over the taps of stages 0..k (W_i: fc's column block
                         of tap i). Never normalised: RMSNorm of a partial sum is not a share of RMSNorm of the sum.
Widths are fixed at start-up (capture spec + partition); T comes from the descriptor header. Tokens, last stage ->
rank 0: int64 [B], one per sequence of the micro-batch, -1 where the sequence does not sample.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from sparkrelay.config import Config, ConfigError
from sparkrelay.envs import CAPTURE, LAYER_IDS, DisaggEnv
from sparkrelay.models.loader import read_config
from sparkrelay.pipeline.partition import check_layer_ids, stage_taps

MODES = ("none", "taps", "partial")


@dataclass(frozen=True)
class CaptureSpec:
    mode: str = "none"
    target_layer_ids: tuple[int, ...] = ()  # global layer ids, increasing (-1 first when used)
    drafter_path: Optional[str] = (
        None  # partial: the DeepSpec drafter folder (context weights only are read)
    )

    def validate(self, num_layers: int) -> "CaptureSpec":
        if self.mode not in MODES:
            raise ValueError(f"capture mode {self.mode!r} is not one of {MODES}")
        if self.mode == "none":
            return self
        ids = self.target_layer_ids
        check_layer_ids(ids, num_layers)
        if list(ids) != sorted(ids):
            raise ValueError(
                f"target layer ids {list(ids)} must increase (the taps travel in stage order)"
            )
        if self.mode == "partial" and not self.drafter_path:
            raise ValueError(
                "capture mode partial needs the drafter folder (its fc / hidden_norm / K-V weights)"
            )
        return self

    def to_dict(self) -> dict:
        return {
            "mode": self.mode,
            "target_layer_ids": list(self.target_layer_ids),
            "drafter_path": self.drafter_path,
        }

    @classmethod
    def from_dict(cls, d: dict) -> "CaptureSpec":
        return cls(d["mode"], tuple(int(i) for i in d["target_layer_ids"]), d.get("drafter_path"))

    @classmethod
    def from_config(cls, config: Config) -> "CaptureSpec":
        """`resolve_capture` with the environment's knobs and the target's layer count (what a
        prefill's stages capture; the prefill role asks for it, disagg/prefill_role.py)."""
        num_layers = int(read_config(config.model.model_path)["num_hidden_layers"])
        return resolve_capture(config, DisaggEnv.read(), num_layers)


def resolve_layer_ids(
    env: DisaggEnv, draft_cfg: Optional[dict], num_layers: int, decode: bool
) -> tuple[int, ...]:
    """The DSpark taps the handoff carries: SPARKRELAY_DSPARK_PD_TARGET_LAYER_IDS, else the drafter
    config's target_layer_ids, else none (); a prefill with
    SPARKRELAY_DSPARK_PD_ENABLE_PREFILL_CAPTURE off captures none. On decode the drafter needs
    exactly its own taps. Errors name the variable the user set."""
    knob = env.var(LAYER_IDS)
    from_draft = tuple(int(i) for i in draft_cfg["target_layer_ids"]) if draft_cfg else None
    ids = env.target_layer_ids if env.target_layer_ids is not None else from_draft
    if decode and from_draft is not None and ids != from_draft:
        raise ConfigError(
            f"{knob}={','.join(map(str, ids))} differs from the drafter's target_layer_ids "
            f"{list(from_draft)}"
        )
    if not ids or (not decode and not env.prefill_capture):
        return ()
    source = knob if env.target_layer_ids is not None else "the drafter config's target_layer_ids"
    try:
        check_layer_ids(ids, num_layers)
        if list(ids) != sorted(ids):
            raise ValueError(
                f"target layer ids {list(ids)} must increase (the taps travel in stage order)"
            )
    except ValueError as e:
        raise ConfigError(f"{source}: {e}") from None
    return tuple(ids)


def resolve_capture(config: Config, env: DisaggEnv, num_layers: int) -> CaptureSpec:
    """What a prefill captures, resolved in this one place: the stages capture it and the handshake record
    (disagg/handoff.py `build_schema`) carries its layer ids, so the two cannot differ. draft-kv -> partial (the
    drafter's fc columns); hidden / tail -> taps; no taps -> none, which --dspark-pd-handoff given on the command
    line refuses (every request would fail at the handshake)."""
    path = config.spec.speculative_draft_model_path
    draft_cfg = read_config(path) if path else None
    ids = resolve_layer_ids(env, draft_cfg, num_layers, decode=False)
    if not ids:
        _refuse_explicit_handoff_without_taps(config, env)
        return CaptureSpec()
    if config.disagg.handoff != "draft-kv":
        return CaptureSpec("taps", ids)
    if draft_cfg is None:
        raise ConfigError(
            "--dspark-pd-handoff draft-kv needs --speculative-draft-model-path (the prefill projects "
            "the drafter's context K/V; only those weights are read)"
        )
    drafter_ids = tuple(int(i) for i in draft_cfg["target_layer_ids"])
    if ids != drafter_ids:
        raise ConfigError(
            f"{env.var(LAYER_IDS)}={','.join(map(str, ids))} != the drafter's target_layer_ids "
            f"{list(drafter_ids)} (its fc columns)"
        )
    return CaptureSpec("partial", ids, path)


def _refuse_explicit_handoff_without_taps(config: Config, env: DisaggEnv) -> None:
    """Left out, --dspark-pd-handoff on a prefill without taps means a PD pair without DSpark
    (handoff none)."""
    flag = config.disagg.dspark_pd_handoff
    if flag is None:
        return
    if not env.prefill_capture:
        raise ConfigError(
            f"--dspark-pd-handoff {flag}: {env.var(CAPTURE)}=0 turns the prefill's DSpark capture "
            "off, so there is nothing to hand off; unset it, or leave out --dspark-pd-handoff"
        )
    knob = (
        ""
        if flag == "draft-kv"
        else (
            f", or set {LAYER_IDS} (or SGLANG_"
            f"{LAYER_IDS.removeprefix('SPARKRELAY_')}) to the drafter's tap layers"
        )
    )
    raise ConfigError(
        f"--dspark-pd-handoff {flag}: the prefill has no DSpark taps to hand off; give it "
        "--speculative-draft-model-path DRAFTER_DIR (it reads the drafter's target_layer_ids"
        f"{' and context weights' if flag == 'draft-kv' else ''}){knob}"
    )


@dataclass
class StagePayload:
    """What one stage hands the next (shapes in the module docstring)."""

    hidden: torch.Tensor  # [T, d]
    taps: Optional[torch.Tensor]  # [T, k_prev * d] or None
    partial: Optional[torch.Tensor]  # [T, d_draft] float32 or None


@dataclass(frozen=True)
class PayloadShape:
    """The widths stage `stage` receives (0: the tensor is not sent)."""

    hidden: int
    taps: int
    partial: int
    dtype: torch.dtype

    @classmethod
    def into_stage(
        cls,
        stage: int,
        capture: CaptureSpec,
        partition: list[tuple[int, int]],
        hidden: int,
        dtype: torch.dtype,
    ) -> "PayloadShape":
        ids = capture.target_layer_ids
        k_prev = (
            sum(len(stage_taps(ids, partition, s)) for s in range(stage))
            if capture.mode == "taps"
            else 0
        )
        return cls(hidden, k_prev * hidden, hidden if capture.mode == "partial" else 0, dtype)
