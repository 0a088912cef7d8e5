"""The target's paged KV pool: one K and one V tensor per owned layer, addressed by flat slot
index."""

from __future__ import annotations

import torch


class KVPool:
    """k[layer], v[layer]: [num_blocks * page_size, n_kv, head_dim]; slot s holds one token's K/V.
    Every layer's K and V are views of one buffer [2 * layers, slots, n_kv, head_dim], so a transfer
    engine registers the whole pool as one region (buffer)."""

    def __init__(
        self,
        layers: range,
        num_blocks: int,
        page_size: int,
        n_kv: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        extra_slots: int = 0,
    ) -> None:
        """extra_slots: slots past the pages, addressed by no block table (the drafter's scratch)."""
        slots = num_blocks * page_size + extra_slots
        self.num_blocks, self.page_size = num_blocks, page_size
        self.buffer = torch.zeros(
            2 * len(layers), slots, n_kv, head_dim, dtype=dtype, device=device
        )
        self.layers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {
            layer: (self.buffer[2 * i], self.buffer[2 * i + 1]) for i, layer in enumerate(layers)
        }

    @staticmethod
    def bytes_per_token(num_layers: int, n_kv: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * n_kv * head_dim * torch.finfo(dtype).bits // 8
