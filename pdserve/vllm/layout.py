"""vLLM's paged KV cache as transport regions, and byte descriptors for whole blocks.

vLLM hands the worker one tensor per attention layer (`register_kv_caches`). On the CPU
backend of vLLM 0.32 each is [num_blocks, num_kv_heads, block_size, 2 * head_size]: the
block dimension comes first, so block b of a layer is the contiguous byte range
[b * block_nbytes, (b + 1) * block_nbytes). Each distinct tensor becomes one region,
registered in layer-name order; both sides of a transfer run the same model, so region i
is the same layer on both (`signature` guards that), and layer i of the transfer core's
`layer_hook` is region i. This is the core's `KVRegions` (pdserve.transfer.adapter).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pdserve.transfer.descriptors import Desc, block_runs


@dataclass(frozen=True)
class KVLayout:
    """The regions of one instance: per layer, its tensor; all share a block geometry."""

    names: tuple[str, ...]
    tensors: tuple[torch.Tensor, ...]
    num_blocks: int
    block_nbytes: int

    @classmethod
    def from_caches(cls, kv_caches: dict[str, torch.Tensor]) -> KVLayout:
        """ValueError if a layer's tensor is not block-major and contiguous per block."""
        names = tuple(sorted(kv_caches))
        tensors = tuple(kv_caches[n] for n in names)
        first = tensors[0]
        for name, t in zip(names, tensors, strict=True):
            if t.shape != first.shape or t.dtype != first.dtype:
                raise ValueError(f"layer {name}: {tuple(t.shape)} differs from the first layer")
            if not t.is_contiguous():
                raise ValueError(f"layer {name}: the KV tensor is not contiguous")
        num_blocks = first.shape[0]
        block_nbytes = first[0].numel() * first.element_size()
        return cls(names, tensors, num_blocks, block_nbytes)

    @property
    def num_layers(self) -> int:
        return len(self.tensors)

    def signature(self) -> str:
        """What the peer's layout must equal (layers, per-block shape, dtype)."""
        t = self.tensors[0]
        return f"vllm-cpu:{len(self.tensors)}x{tuple(t.shape[1:])}:{t.dtype}"

    def regions(self) -> list[tuple[str, torch.Tensor]]:
        return list(zip(self.names, self.tensors, strict=True))

    def descriptors(
        self,
        remote_num_blocks: int,
        local_blocks: Sequence[int],
        remote_blocks: Sequence[int],
        layers: Sequence[int] | None = None,
    ) -> tuple[list[Desc], list[Desc]]:
        """Paired (region, offset, length) descriptors moving `local_blocks` <->
        `remote_blocks` for `layers` (all by default); runs consecutive on both sides
        become one descriptor. A layer's offsets do not depend on the peer's pool size."""
        nb = self.block_nbytes
        runs = block_runs(local_blocks, remote_blocks)
        which = range(self.num_layers) if layers is None else layers
        local = [(layer, s * nb, n * nb) for layer in which for s, _, n in runs]
        remote = [(layer, d * nb, n * nb) for layer in which for _, d, n in runs]
        return local, remote
