"""The paged KV cache memory: one contiguous tensor for all layers, K and V, all blocks.

Layout ("layer_kv_block", row-major):

    [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
                 ^ 0 = K, 1 = V

so block b of layer l's K (or V) is one contiguous run of `block_nbytes` bytes, and n
consecutive block ids are one contiguous run too. A transport registers the whole tensor as a
single memory region (`data_ptr()`, `nbytes`) and addresses blocks with `span()`.

Ownership: the KVCache owns the memory for the life of the engine. It does not know which
blocks are in use: the block pool (pdserve.kv, the lead's code) hands out block ids, and only
the model (writes during a forward step) and the transfer layer (reads/writes whole blocks by
byte span) touch the contents. Nothing here frees or allocates blocks.
"""

from __future__ import annotations

import msgspec
import torch

from pdserve.model.spec import ModelSpec, dtype_name, torch_dtype_of

LAYOUT = "layer_kv_block"


class KVCompat(msgspec.Struct, frozen=True):
    """What two engines must agree on before moving KV blocks between them (handshake)."""

    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    layout: str = LAYOUT


def num_blocks_for_budget(
    spec: ModelSpec, budget_bytes: int, block_size: int, dtype: torch.dtype | str
) -> int:
    """How many blocks (all layers, K and V) fit in `budget_bytes`."""
    return int(budget_bytes) // (spec.kv_bytes_per_token(dtype) * block_size)


class KVCache:
    """Holds the KV tensor; see the module docstring for layout and ownership."""

    def __init__(self, tensor: torch.Tensor, block_size: int) -> None:
        if tensor.dim() != 6 or tensor.shape[1] != 2 or tensor.shape[3] != block_size:
            raise ValueError(f"bad KV tensor shape {tuple(tensor.shape)}")
        if not tensor.is_contiguous():
            raise ValueError("the KV tensor must be contiguous (it is one registered region)")
        self.tensor = tensor
        self.block_size = block_size
        self.num_layers, _, self.num_blocks, _, self.num_kv_heads, self.head_dim = tensor.shape

    @classmethod
    def allocate(
        cls,
        spec: ModelSpec,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype | str,
        device: torch.device | str,
    ) -> KVCache:
        """Allocate a zeroed cache.

        Zeroed on purpose: attention pads batches with real block ids and masks them out, and
        a masked NaN from uninitialised memory would still poison the output (0 * NaN).
        Allocate outside `torch.inference_mode` (as the engine does at start-up): an inference
        tensor refuses in-place torch writes from code running outside that mode.
        """
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        shape = (spec.num_layers, 2, num_blocks, block_size, spec.num_kv_heads, spec.head_dim)
        tensor = torch.zeros(shape, dtype=torch_dtype_of(dtype), device=device)
        return cls(tensor, block_size)

    @property
    def dtype(self) -> torch.dtype:
        return self.tensor.dtype

    @property
    def device(self) -> torch.device:
        return self.tensor.device

    @property
    def block_nbytes(self) -> int:
        """Bytes of one block of one layer's K (or V)."""
        return self.block_size * self.num_kv_heads * self.head_dim * self.tensor.element_size()

    @property
    def nbytes(self) -> int:
        """Bytes of the whole region."""
        return self.tensor.numel() * self.tensor.element_size()

    def data_ptr(self) -> int:
        """Address of the region's first byte."""
        return self.tensor.data_ptr()

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(K, V) views of one layer, each [num_blocks, block_size, num_kv_heads, head_dim]."""
        return self.tensor[layer, 0], self.tensor[layer, 1]

    def span(self, layer: int, kv: int, first_block: int, n_blocks: int = 1) -> tuple[int, int]:
        """(offset, length) in bytes, from data_ptr(), of blocks [first_block, +n_blocks) of
        one layer's K (kv=0) or V (kv=1)."""
        if not (0 <= layer < self.num_layers and kv in (0, 1)):
            raise IndexError(f"layer {layer} / kv {kv} out of range")
        if not (first_block >= 0 and n_blocks >= 0 and first_block + n_blocks <= self.num_blocks):
            raise IndexError(f"blocks [{first_block}, +{n_blocks}) out of [0, {self.num_blocks})")
        index = (layer * 2 + kv) * self.num_blocks + first_block
        return index * self.block_nbytes, n_blocks * self.block_nbytes

    def compat_fingerprint(self) -> KVCompat:
        """The layout facts a peer must share to read or write these blocks."""
        return KVCompat(
            dtype=dtype_name(self.dtype),
            num_layers=self.num_layers,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            block_size=self.block_size,
        )
