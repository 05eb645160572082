"""Where a KV block's bytes are, as transport descriptors (region, offset, length).

The core moves whole blocks and never looks inside them; an engine tells it where they
are through a `KVRegions` (pdserve.transfer.adapter): the tensors to register with the
transport (region i is the i-th, on every instance of the same engine and model) and the
descriptors of a list of blocks per layer. Two layouts ship:

- `OneRegion`, pdserve's own KV cache: one region shaped
  [layers, 2, num_blocks, block_size, kv_heads, head_dim] (pdserve.kv.cache), so block b
  of (layer, k|v) starts at ((layer * 2 + kv) * num_blocks + b) * block_nbytes; the two
  sides may have different num_blocks.
- pdserve.vllm.layout.KVLayout, vLLM's: one region per layer, block-major.

In both, runs of blocks consecutive on both sides become one descriptor.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

Desc = tuple[int, int, int]  # (region, offset, length) in the peer's registered regions


def block_runs(src: Sequence[int], dst: Sequence[int]) -> list[tuple[int, int, int]]:
    """Split paired block lists into (src_start, dst_start, n) runs, consecutive on both sides."""
    if len(src) != len(dst):
        raise ValueError(f"block lists differ in length: {len(src)} vs {len(dst)}")
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst, strict=True):
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s, d, 1))
    return runs


def block_offset(num_blocks: int, block_nbytes: int, layer: int, kv: int, block: int) -> int:
    return ((layer * 2 + kv) * num_blocks + block) * block_nbytes


def nbytes(descs: Sequence[Desc]) -> int:
    return sum(n for *_, n in descs)


class OneRegion:
    """pdserve's KV cache as one transport region (`KVRegions`; module doc)."""

    def __init__(self, tensor: torch.Tensor, block_nbytes: int) -> None:
        if tensor.dim() < 3 or tensor.shape[1] != 2:
            raise ValueError(f"not a [layers, 2, blocks, ...] KV tensor: {tuple(tensor.shape)}")
        self.tensor = tensor
        self.num_layers = int(tensor.shape[0])
        self.num_blocks = int(tensor.shape[2])
        self.block_nbytes = block_nbytes

    @classmethod
    def of(cls, kv: object) -> OneRegion:
        """Of a pdserve.kv.cache.KVCache (its `tensor` and `block_nbytes`)."""
        return cls(kv.tensor, kv.block_nbytes)  # type: ignore[attr-defined]

    def regions(self) -> list[tuple[str, torch.Tensor]]:
        return [("kv", self.tensor)]

    def descriptors(
        self,
        remote_num_blocks: int,
        local_blocks: Sequence[int],
        remote_blocks: Sequence[int],
        layers: Sequence[int] | None = None,
    ) -> tuple[list[Desc], list[Desc]]:
        """Paired (local, remote) descriptors for `layers` (all by default)."""
        nb = self.block_nbytes
        local: list[Desc] = []
        remote: list[Desc] = []
        runs = block_runs(local_blocks, remote_blocks)
        for layer in range(self.num_layers) if layers is None else layers:
            for k in (0, 1):
                for s, d, n in runs:
                    local.append((0, block_offset(self.num_blocks, nb, layer, k, s), n * nb))
                    remote.append((0, block_offset(remote_num_blocks, nb, layer, k, d), n * nb))
        return local, remote
