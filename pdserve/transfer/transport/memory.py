"""Registered memory regions and the bounds checks every descriptor goes through.

A region is a contiguous span of memory the caller owns: a torch tensor (CPU or CUDA), a
numpy array, a writable buffer, or a raw (pointer, nbytes) pair. The table keeps a
reference to the object so it cannot be freed while registered; the caller still must not
resize or move it. Region ids are small ints, assigned in registration order, never reused.
"""

from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pdserve.transfer.transport.base import DescriptorError, MemKind, RegionInfo


@dataclass(frozen=True)
class MemorySpan:
    """Where a region's bytes live."""

    ptr: int
    size: int
    mem: MemKind
    device: int
    owner: Any  # the object the caller gave us, kept alive while registered


def _span_of_tensor(t: Any) -> MemorySpan:
    if not t.is_contiguous():
        raise DescriptorError("a registered tensor must be contiguous")
    on_gpu = t.device.type == "cuda"
    device = (t.device.index or 0) if on_gpu else 0
    return MemorySpan(
        t.data_ptr(), t.numel() * t.element_size(), "VRAM" if on_gpu else "DRAM", device, t
    )


def span_of(memory: Any) -> MemorySpan:
    """Describe `memory` (tensor, ndarray, writable buffer or (ptr, nbytes))."""
    if isinstance(memory, tuple):
        ptr, size = memory
        return MemorySpan(int(ptr), int(size), "DRAM", 0, memory)
    if hasattr(memory, "data_ptr") and hasattr(memory, "element_size"):
        return _span_of_tensor(memory)
    arr = memory if isinstance(memory, np.ndarray) else np.frombuffer(memory, dtype=np.uint8)
    if not arr.flags.c_contiguous or not arr.flags.writeable:
        raise DescriptorError("registered memory must be C-contiguous and writable")
    return MemorySpan(arr.ctypes.data, arr.nbytes, "DRAM", 0, memory)


@dataclass
class Region:
    """One registered region; `view()` gives a byte memoryview of host memory."""

    id: int
    name: str
    span: MemorySpan
    granule: int | None
    backend_handle: Any = None  # e.g. NIXL registration descriptors
    _view: memoryview | None = field(default=None, repr=False)

    @property
    def size(self) -> int:
        return self.span.size

    def info(self) -> RegionInfo:
        return RegionInfo(self.id, self.size, self.span.mem, self.span.device, self.granule)

    def view(self) -> memoryview:
        """Writable bytes of a DRAM region (zero-copy, over the caller's memory)."""
        if self.span.mem != "DRAM":
            raise DescriptorError(f"region {self.name!r} is in {self.span.mem}, not host memory")
        if self._view is None:
            raw = (ctypes.c_ubyte * self.size).from_address(self.span.ptr)
            self._view = memoryview(raw).cast("B")
        return self._view


def size_table(sizes: dict[int, int]) -> np.ndarray:
    """Region sizes indexed by region id; -1 marks ids that are not registered."""
    table = np.full(max(sizes, default=-1) + 1, -1, dtype=np.int64)
    for rid, size in sizes.items():
        table[rid] = size
    return table


def check_descs(descs: np.ndarray, sizes: np.ndarray, side: str) -> None:
    """Raise DescriptorError unless every descriptor lies inside a region of `sizes`."""
    regions, offsets, lengths = descs[:, 0], descs[:, 1], descs[:, 2]
    limit = sizes.take(regions, mode="clip")
    ok = (regions >= 0) & (regions < len(sizes)) & (offsets >= 0) & (lengths > 0)
    ok &= offsets <= limit - lengths  # also false for unregistered ids (limit -1)
    if not ok.all():
        _explain(descs, sizes, side, int(np.flatnonzero(~ok)[0]))


def _explain(descs: np.ndarray, sizes: np.ndarray, side: str, i: int) -> None:
    r, o, n = (int(x) for x in descs[i])
    if not 0 <= r < len(sizes) or sizes[r] < 0:
        raise DescriptorError(f"{side} descriptor {i} names unregistered region {r}")
    raise DescriptorError(
        f"{side} descriptor {i} (region {r}, offset {o}, length {n}) is outside "
        f"the registered {int(sizes[r])} bytes"
    )


class RegionTable:
    """The regions of one transport. Registration is rare; lookups are lock-free reads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._regions: dict[int, Region] = {}
        self._sizes = size_table({})

    def add(self, name: str, span: MemorySpan, granule: int | None) -> Region:
        if span.size <= 0:
            raise DescriptorError(f"region {name!r} is empty")
        if granule is not None and (granule <= 0 or span.size % granule):
            raise DescriptorError(f"granule {granule} does not divide region size {span.size}")
        with self._lock:
            region = Region(len(self._regions), name, span, granule)
            self._regions = {**self._regions, region.id: region}  # readers see old or new
            self._sizes = size_table({r.id: r.size for r in self._regions.values()})
        return region

    def get(self, region_id: int) -> Region:
        return self._regions[region_id]

    def all(self) -> list[Region]:
        return list(self._regions.values())

    def sizes(self) -> np.ndarray:
        """Sizes by region id (see `size_table`); replaced, never mutated, on register."""
        return self._sizes

    def infos(self) -> tuple[RegionInfo, ...]:
        return tuple(r.info() for r in self._regions.values())

    def check(self, descs: np.ndarray, side: str = "local") -> None:
        check_descs(descs, self.sizes(), side)

    def views(self, descs: np.ndarray) -> list[memoryview]:
        """Memoryviews of already-checked descriptors, in order."""
        regions = descs[:, 0]
        if (regions == regions[0]).all():  # the common case: one region (the KV cache)
            mv = self._regions[int(regions[0])].view()
            ends = (descs[:, 1] + descs[:, 2]).tolist()
            return [mv[o:e] for o, e in zip(descs[:, 1].tolist(), ends, strict=True)]
        return [self._regions[r].view()[o : o + n] for r, o, n in descs.tolist()]
