"""Byte descriptors for moving whole KV blocks between two caches of the same layout.

The cache is one region shaped [layers, 2, num_blocks, block_size, kv_heads, head_dim]
(see pdserve.kv.cache), so block b of (layer, k|v) starts at
((layer * 2 + kv) * num_blocks + b) * block_nbytes. The two sides may have different
num_blocks; runs of blocks consecutive on both sides become one descriptor.
"""

from __future__ import annotations

from collections.abc import Sequence

from pdserve.transfer.adapter import KVLayout

Desc = tuple[int, int]  # (offset, length) inside the peer's registered KV region


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


def block_descriptors(
    kv: KVLayout,
    remote_num_blocks: int,
    local_blocks: Sequence[int],
    remote_blocks: Sequence[int],
    layers: Sequence[int] | None = None,
) -> tuple[list[Desc], list[Desc]]:
    """Paired (local, remote) descriptors for `layers` (all by default)."""
    nb = kv.block_nbytes
    local: list[Desc] = []
    remote: list[Desc] = []
    for layer in range(kv.num_layers) if layers is None else layers:
        for k in (0, 1):
            for s, d, n in block_runs(local_blocks, remote_blocks):
                local.append((block_offset(kv.num_blocks, nb, layer, k, s), n * nb))
                remote.append((block_offset(remote_num_blocks, nb, layer, k, d), n * nb))
    return local, remote
