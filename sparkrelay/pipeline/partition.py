"""The one layer -> stage partition, shared by the pipeline stages, the handoff and the decode peer.

Both PD sides call `pp_partition` (and publish its result in the handshake schema), so a stage's
layer range and the owner of every DSpark tap are never computed two ways (docs/pd_protocol.md,
failure modes 14-15).

Tap convention: tap L is the residual-stream output of layer L and belongs to the stage whose range
holds L; tap -1 (the embedding output) belongs to stage 0.
"""

from __future__ import annotations


def pp_partition(num_layers: int, pp_size: int) -> list[tuple[int, int]]:
    """[start, end) per stage. Even split; the remainder goes one layer each to the stages just
    before the last (as vLLM's get_pp_indices), so the first stage (embedding) and the last (norm +
    LM head) stay light."""
    if not 1 <= pp_size <= num_layers:
        raise ValueError(
            f"--pp-size {pp_size} must be in 1..{num_layers} (the model has {num_layers} layers)"
        )
    sizes = [num_layers // pp_size] * pp_size
    for i in range(2, num_layers % pp_size + 2):
        sizes[-i] += 1
    bounds, start = [], 0
    for n in sizes:
        bounds.append((start, start + n))
        start += n
    return bounds


def tap_owner(layer_id: int, partition: list[tuple[int, int]]) -> int:
    """The stage that captures tap `layer_id` (-1: stage 0)."""
    if layer_id == -1:
        return 0
    for stage, (start, end) in enumerate(partition):
        if start <= layer_id < end:
            return stage
    raise ValueError(
        f"target layer id {layer_id} is outside the model's layers [0, {partition[-1][1]})"
    )


def stage_taps(
    layer_ids: tuple[int, ...], partition: list[tuple[int, int]], stage: int
) -> tuple[int, ...]:
    """The tap ids stage `stage` captures, in `layer_ids` order."""
    return tuple(i for i in layer_ids if tap_owner(i, partition) == stage)


def check_layer_ids(layer_ids: tuple[int, ...], num_layers: int) -> None:
    """DSpark taps: distinct, in -1..num_layers-2 (the last layer's output is the LM head's input,
    never a tap)."""
    if not layer_ids:
        raise ValueError("target layer ids are empty")
    if len(set(layer_ids)) != len(layer_ids):
        raise ValueError(f"target layer ids {list(layer_ids)} repeat a layer")
    for i in layer_ids:
        if i == num_layers - 1:
            raise ValueError(
                f"target layer id {i} is the target's last layer; DSpark taps end at {num_layers - 2}"
            )
        if not -1 <= i < num_layers - 1:
            raise ValueError(f"target layer id {i} is outside -1..{num_layers - 2}")
