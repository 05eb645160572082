"""Which compute dtype suits this CPU, from its feature flags (Linux /proc/cpuinfo).

Measured (docs/results.md, "dtype on CPU"): with AMX-BF16, bf16 matmuls run ~10x faster than
float32 ones and a bf16 prefill takes about half the time, while decode is about as fast or
faster in float32; without native bf16 (no AVX512-BF16, no AMX) bf16 is emulated and float32 is
faster throughout. The loader only advises (an INFO line); the dtype stays the user's choice.
"""

from __future__ import annotations

from pathlib import Path

import torch

CPUINFO = Path("/proc/cpuinfo")
NATIVE_BF16 = frozenset({"amx_bf16", "avx512_bf16"})


def cpu_flags(cpuinfo: Path = CPUINFO) -> frozenset[str]:
    """The first CPU's feature flags; empty where there is no readable /proc/cpuinfo."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return frozenset(value.split())
    return frozenset()


def dtype_advice(dtype: torch.dtype, flags: frozenset[str]) -> str | None:
    """A one-line hint when another dtype would clearly be faster on a CPU with `flags`."""
    if dtype == torch.float32 and "amx_bf16" in flags:
        return (
            "this CPU has AMX-BF16: --dtype bfloat16 roughly halves prefill time (TTFT); "
            "decode is about as fast or faster in float32"
        )
    if dtype == torch.bfloat16 and flags and not flags & NATIVE_BF16:
        return "this CPU has no native bf16 (AMX or AVX512-BF16): --dtype float32 is faster"
    return None
