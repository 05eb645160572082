"""What the decoder needs of the paged KV cache: each layer's K and V block tensors.

`pdserve.kv.cache.KVCache` satisfies this structurally. The model layer names only this
protocol, so it sits below `pdserve.kv` (which builds its cache from `pdserve.model.spec`)
without importing it. The cache owns the memory; the decoder writes a step's K/V into the
slots the step's metadata names and keeps no reference past the step.
"""

from __future__ import annotations

from typing import Protocol

import torch


class PagedKV(Protocol):
    """Per-layer views of a paged KV cache."""

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(K, V) of one layer, each [num_blocks, block_size, num_kv_heads, head_dim]."""
        ...
