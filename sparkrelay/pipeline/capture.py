"""What the pipeline captures for DSpark, and the stage-to-stage payload that carries it.

Capture modes (`CaptureSpec.mode`):
  none     aggregated serving: only the hidden stream crosses stages;
  taps     every stage appends the taps it owns (tap L = the residual-stream output of layer L, owned by the stage
           holding L; tap -1 = the embedding output, stage 0: pipeline/partition.py); the last stage holds all k
           taps in target_layer_ids order = the aux rows [T, W = k * d] (hidden / tail handoff);
  partial  every stage adds its taps' share of the drafter's fc to a running pre-norm sum; the last stage applies
           hidden_norm once and each draft layer's K/V projection (draft-kv handoff; models/dspark_context.py).

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
from sparkrelay.envs import DisaggEnv
from sparkrelay.models.loader import read_config
from sparkrelay.pipeline.partition import check_layer_ids, stage_taps

MODES = ("none", "taps", "partial")


@dataclass(frozen=True)
class CaptureSpec:
    mode: str = "none"
    target_layer_ids: tuple[int, ...] = ()   # global layer ids, increasing (-1 first when used)
    drafter_path: Optional[str] = None       # partial: the DeepSpec drafter folder (context weights only are read)

    def validate(self, num_layers: int) -> "CaptureSpec":
        if self.mode not in MODES:
            raise ValueError(f"capture mode {self.mode!r} is not one of {MODES}")
        if self.mode == "none":
            return self
        ids = self.target_layer_ids
        check_layer_ids(ids, num_layers)
        if list(ids) != sorted(ids):
            raise ValueError(f"target layer ids {list(ids)} must increase (the taps travel in stage order)")
        if self.mode == "partial" and not self.drafter_path:
            raise ValueError("capture mode partial needs the drafter folder (its fc / hidden_norm / K-V weights)")
        return self

    def to_dict(self) -> dict:
        return {"mode": self.mode, "target_layer_ids": list(self.target_layer_ids), "drafter_path": self.drafter_path}

    @classmethod
    def from_dict(cls, d: dict) -> "CaptureSpec":
        return cls(d["mode"], tuple(int(i) for i in d["target_layer_ids"]), d.get("drafter_path"))

    @classmethod
    def from_config(cls, config: Config) -> "CaptureSpec":
        """Aggregated: none. Prefill: draft-kv -> partial (ids = the drafter's fc columns); hidden / tail -> taps at
        SPARKRELAY_DSPARK_PD_TARGET_LAYER_IDS or the drafter config's target_layer_ids, none when neither is given
        or SPARKRELAY_DSPARK_PD_ENABLE_PREFILL_CAPTURE is off. The prefill role may pass its own spec instead."""
        if config.disagg.disaggregation_mode != "prefill":
            return cls()
        env, path = DisaggEnv.read(), config.spec.speculative_draft_model_path
        drafter_ids = tuple(read_config(path)["target_layer_ids"]) if path else None
        if config.disagg.dspark_pd_handoff == "draft-kv":
            if drafter_ids is None:
                raise ConfigError("--dspark-pd-handoff draft-kv needs --speculative-draft-model-path (the prefill "
                                  "projects the drafter's context K/V; only those weights are read)")
            if env.target_layer_ids is not None and tuple(env.target_layer_ids) != drafter_ids:
                raise ConfigError(f"SPARKRELAY_DSPARK_PD_TARGET_LAYER_IDS {list(env.target_layer_ids)} != the "
                                  f"drafter's target_layer_ids {list(drafter_ids)} (its fc columns)")
            return cls("partial", drafter_ids, path)
        ids = env.target_layer_ids or drafter_ids
        return cls("taps", tuple(ids)) if env.prefill_capture and ids else cls()


@dataclass
class StagePayload:
    """What one stage hands the next (shapes in the module docstring)."""

    hidden: torch.Tensor              # [T, d]
    taps: Optional[torch.Tensor]      # [T, k_prev * d] or None
    partial: Optional[torch.Tensor]   # [T, d_draft] float32 or None


@dataclass(frozen=True)
class PayloadShape:
    """The widths stage `stage` receives (0: the tensor is not sent)."""

    hidden: int
    taps: int
    partial: int
    dtype: torch.dtype

    @classmethod
    def into_stage(cls, stage: int, capture: CaptureSpec, partition: list[tuple[int, int]], hidden: int,
                   dtype: torch.dtype) -> "PayloadShape":
        ids = capture.target_layer_ids
        k_prev = sum(len(stage_taps(ids, partition, s)) for s in range(stage)) if capture.mode == "taps" else 0
        return cls(hidden, k_prev * hidden, hidden if capture.mode == "partial" else 0, dtype)
