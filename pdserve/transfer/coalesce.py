"""Merge adjacent descriptors so a run of neighbouring blocks moves as one descriptor.

Descriptor lists are (N, 3) int64 arrays of [region, offset, length] (see
`pdserve.transfer.transport.base.as_desc_array`). Merging keeps the order given: entry i+1
joins entry i only when it starts where i ends, in the same region. For paired lists (what a
transfer moves) a pair joins the previous one only when that holds on both sides, so the
result still pairs up element by element. Pure functions, no I/O; vectorised with numpy
because KV transfers carry thousands of descriptors.
"""

from __future__ import annotations

import numpy as np


def _continues(descs: np.ndarray) -> np.ndarray:
    """Bool mask of length N-1: entry i+1 starts where entry i ends, same region."""
    same_region = descs[1:, 0] == descs[:-1, 0]
    touching = descs[:-1, 1] + descs[:-1, 2] == descs[1:, 1]
    return same_region & touching


def _merge(descs: np.ndarray, joins: np.ndarray) -> np.ndarray:
    """Collapse each run started where `joins` is False into one descriptor."""
    starts = np.flatnonzero(np.concatenate(([True], ~joins)))
    out = descs[starts].copy()
    out[:, 2] = np.add.reduceat(descs[:, 2], starts)
    return out


def coalesce(descs: np.ndarray) -> np.ndarray:
    """One list: merge every entry that continues the previous one."""
    if len(descs) < 2:
        return descs
    return _merge(descs, _continues(descs))


def coalesce_pairs(local: np.ndarray, remote: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Paired lists of equal per-entry lengths: merge pairs adjacent on both sides."""
    if local.shape != remote.shape:
        raise ValueError(f"paired lists differ in shape: {local.shape} vs {remote.shape}")
    if not np.array_equal(local[:, 2], remote[:, 2]):
        raise ValueError("paired descriptors must have equal lengths")
    if len(local) < 2:
        return local, remote
    joins = _continues(local) & _continues(remote)
    if not joins.any():  # scattered blocks: nothing to merge
        return local, remote
    return _merge(local, joins), _merge(remote, joins)
