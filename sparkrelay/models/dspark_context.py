"""The DSpark drafter's context projection alone, for a prefill server that never drafts (draft-kv
handoff).

    taps F [N, k*d] --fc--> [N, d] --hidden_norm--> C [N, d]
      --per draft layer: k_proj, k_norm, RoPE(pos); v_proj--> (k [N, n_kv, hd], v [N, n_kv, hd])
    (= Qwen3DSparkModel.project_context + context_kv)

Under pipeline parallelism the projection is cut at fc, which is linear: with fc.weight W [d, k*d]
split into column blocks W_i [d, d] (tap i's block, at its index in target_layer_ids),
fc(concat(h_1..h_k)) = Σ_i h_i W_iᵀ. Each stage adds its taps' share (`partial`) to a running
pre-norm sum; the last stage calls `finish`, which applies hidden_norm once to the full sum (never
to a partial sum: RMSNorm is not linear; docs/pd_protocol.md, failure mode 16), then each draft
layer's K/V at absolute positions (failure mode 21).

Only these checkpoint tensors are read (safetensors reads tensor by tensor): fc.weight,
hidden_norm.weight, layers.{i}.self_attn.{k_proj,v_proj}.weight (+ .bias with attention_bias) and
layers.{i}.self_attn.k_norm.weight. The embedding, LM head, Markov and confidence heads and the
draft layers' q/o projections, norms and MLPs are skipped by name (they are parameters of the full
drafter); a key that is no drafter parameter at all is an error.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from sparkrelay.models.decoder import DecoderSpec
from sparkrelay.models.dspark import ARCHITECTURE, ContextKV, DSparkSpec, Qwen3DSparkModel
from sparkrelay.models.dummy import dummy_config, fill_dummy, init_std
from sparkrelay.models.kernels import frozen_linear
from sparkrelay.models.layers import RMSNorm
from sparkrelay.models.loader import (
    SHAPE_FIELDS,
    CheckpointError,
    is_dummy,
    load_weights,
    materialize,
    on_meta,
    read_config,
)


class _ContextAttn(nn.Module):
    """The K/V half of a draft layer's attention (checkpoint names `layers.{i}.self_attn.*`)."""

    def __init__(self, s: DecoderSpec) -> None:
        super().__init__()
        self.n_kv, self.head_dim = s.num_kv_heads, s.head_dim
        self.k_proj = nn.Linear(s.hidden_size, s.num_kv_heads * s.head_dim, bias=s.attention_bias)
        self.v_proj = nn.Linear(s.hidden_size, s.num_kv_heads * s.head_dim, bias=s.attention_bias)
        self.k_norm = RMSNorm(s.head_dim, s.rms_norm_eps)


class _ContextLayer(nn.Module):
    def __init__(self, s: DecoderSpec) -> None:
        super().__init__()
        self.self_attn = _ContextAttn(s)


class ContextProjector(nn.Module):
    def __init__(self, spec: DSparkSpec, device: torch.device | str = "cpu") -> None:
        super().__init__()
        s = spec.body
        self.spec, self.hidden = spec, s.hidden_size
        self.fc = nn.Linear(len(spec.target_layer_ids) * s.hidden_size, s.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.layers = nn.ModuleList(_ContextLayer(s) for _ in range(s.num_layers))
        self.context = ContextKV([layer.self_attn for layer in self.layers])  # as the drafter's
        self.rotary = s.rotary(device)
        self._slices: dict[tuple[int, ...], nn.Module] = {}  # fc column blocks per stage, frozen

    def stage_slice(self, stage_tap_ids: tuple[int, ...]) -> torch.Tensor:
        """fc's columns for these taps -> [d_draft, len(ids) * d], blocks in the order of `stage_tap_ids`."""
        ids, d = list(self.spec.target_layer_ids), self.hidden
        missing = [i for i in stage_tap_ids if i not in ids]
        if missing:
            raise ValueError(f"tap(s) {missing} are not among the drafter's target_layer_ids {ids}")
        w = self.fc.weight  # [d_draft, k*d]
        return torch.cat(
            [w[:, ids.index(i) * d : (ids.index(i) + 1) * d] for i in stage_tap_ids], dim=1
        )

    def partial(self, taps_of_stage: torch.Tensor, stage_tap_ids: tuple[int, ...]) -> torch.Tensor:
        """taps_of_stage [T, k_s*d] (this stage's taps, concatenated in `stage_tap_ids` order) -> its share of
        fc(concat(all taps)), pre-norm: [T, d_draft] float32 (the sum across stages is kept in float32)."""
        key = tuple(stage_tap_ids)
        if key not in self._slices:
            # [d_draft, k_s*d], in its fast layout
            self._slices[key] = frozen_linear(self.stage_slice(key))
        fc_slice = self._slices[key]
        return fc_slice(taps_of_stage.to(self.fc.weight.dtype)).float()

    def finish(
        self, partial: torch.Tensor, positions: torch.Tensor
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The full pre-norm sum [T, d_draft] at absolute `positions` [T] -> per draft layer
        (k [T, n_kv, hd] after k_norm and RoPE, v [T, n_kv, hd])."""
        # [T, d_draft]: the one normalisation
        c = self.hidden_norm(partial.to(self.fc.weight.dtype))
        cos, sin = self.rotary.table(positions, c.dtype)
        return self.context.forward(c, cos, sin)

    def fuse(self) -> None:
        """After loading: every layer's k/v products as one frozen layer, as the full drafter fuses
        them (ContextKV.freeze)."""
        self.context.freeze()


def _drafter_names(spec: DSparkSpec) -> set[str]:
    """Every parameter name of the full drafter (built on the meta device: no memory, nothing
    read)."""
    with on_meta():
        return {name for name, _ in Qwen3DSparkModel(spec, device="meta").named_parameters()}


def load_context_projector(
    folder: str | Path,
    target_spec: DecoderSpec,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    load_format: str = "auto",
) -> ContextProjector:
    """Read only the context-projection tensors of the DeepSpec drafter in `folder` (checked
    complete), or give them their dummy values (`load_format` "dummy": the same as the full
    drafter's, tensor by tensor name)."""
    dummy = is_dummy(load_format)
    hf = dummy_config(folder, SHAPE_FIELDS) if dummy else read_config(folder, SHAPE_FIELDS)
    if hf.get("architectures") != [ARCHITECTURE]:
        raise CheckpointError(
            f"{folder}: architectures {hf.get('architectures')!r} is not [{ARCHITECTURE!r}]"
        )
    spec = DSparkSpec.from_hf(hf, target_spec)
    with on_meta():
        model = ContextProjector(spec, device="meta")
    model = materialize(model, dtype, device)  # allocated once, in `dtype`
    s = spec.body
    model.rotary = s.rotary(device)
    if dummy:
        fill_dummy(model, init_std(hf))
    else:
        drafter = _drafter_names(spec)
        load_weights(model, folder, elsewhere=lambda key: key in drafter, dtype=dtype)
    model.fuse()
    return model.eval().requires_grad_(False)
