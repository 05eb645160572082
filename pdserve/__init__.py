"""pdserve: prefill/decode disaggregated LLM serving with push-based KV-cache transfer.

`from pdserve import LLM, SamplingParams` is the offline Python API (pdserve.offline); it is
imported on first use, so `import pdserve` (and `pdserve --help`) stays free of torch.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from pdserve.offline import LLM

        return LLM
    if name == "SamplingParams":
        from pdserve.engine.types import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'pdserve' has no attribute {name!r}")
