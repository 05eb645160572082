"""Block hashes for prefix caching: what a full KV block holds, named by its token prefix.

The KV of position i depends on tokens 0..i (and the model, which is fixed per engine), so
a full block is named by the hash of every token up to its end. The hashes are chained:
block j's hash is SHA-256 over block j-1's hash and block j's own tokens, so one pass
over a prompt names all its blocks. SHA-256 is the collision-safe choice (vLLM's default
too): two prefixes that differ anywhere never share a name in practice, so a hit never
returns another prompt's KV.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Callable

ROOT = b"pdserve-prefix-v1"  # the "parent" of a prompt's first block

# tokens [start, end) of a request's prompt + outputs (Request.token_ids)
TokenSlice = Callable[[int, int], list[int]]


def chain_hash(parent: bytes, tokens: list[int]) -> bytes:
    """The hash of a block holding `tokens`, after the block hashed `parent`."""
    h = hashlib.sha256(parent)
    h.update(len(tokens).to_bytes(4, "little"))
    h.update(array("q", tokens).tobytes())
    return h.digest()


def extend_hashes(hashes: list[bytes], tokens: TokenSlice, num_tokens: int, bs: int) -> None:
    """Append to `hashes` (in place) the hashes of the full blocks of the first `num_tokens`
    tokens that it does not have yet."""
    for j in range(len(hashes), num_tokens // bs):
        parent = hashes[j - 1] if j else ROOT
        hashes.append(chain_hash(parent, tokens(j * bs, (j + 1) * bs)))
