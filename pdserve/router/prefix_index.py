"""What prefix each instance probably has cached, predicted from what the router sent it.

The router never sees the instances' block hashes, so it keeps its own approximation (as
SGLang's cache-aware router and the endpoint picker's prefix scorer do): a request's prompt
is cut into chunks of about one KV block (`CHUNK_TOKENS` token ids, or `CHUNK_BYTES` bytes of
text, about the same at 4 bytes per token), named by a chained hash (chunk j's name covers
chunks 0..j, so a match is always a prefix). Each instance gets an LRU set of the chunk
names of the prompts routed to it, bounded at `capacity` names: an instance evicts too, and
an entry the router forgot costs only a missed preference. A chat conversation that grows
turn by turn encodes as the same JSON up to its last message, so its earlier turns match.

Owned by one policy object on the router's event loop (one index per role); no locks.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Any

import msgspec

CHUNK_TOKENS = 16  # pdserve's default block size
CHUNK_BYTES = 64  # about 16 tokens of English text
DEFAULT_CAPACITY = 1 << 16  # chunk names remembered per instance


def prefix_chain(body: dict[str, Any]) -> tuple[bytes, ...]:
    """The chained chunk names of a request's prompt (token ids, text or chat messages)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], list):
        prompt = prompt[0]
    if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        data = b"".join(t.to_bytes(8, "little", signed=True) for t in prompt)
        size = 8 * CHUNK_TOKENS
    else:
        source = body.get("messages", prompt if prompt is not None else "")
        data = source.encode() if isinstance(source, str) else msgspec.json.encode(source)
        size = CHUNK_BYTES
    names: list[bytes] = []
    parent = b"pdserve-router-prefix"
    for start in range(0, len(data) - size + 1, size):
        parent = hashlib.blake2b(parent + data[start : start + size], digest_size=16).digest()
        names.append(parent)
    return tuple(names)


class PrefixIndex:
    """Per instance (by URL): the chunk names it was sent most recently."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        self.capacity = capacity
        self._seen: dict[str, OrderedDict[bytes, None]] = {}

    def match(self, url: str, chain: tuple[bytes, ...]) -> int:
        """How many leading chunks of `chain` the instance was sent (0 if none)."""
        seen = self._seen.get(url)
        if not seen:
            return 0
        n = 0
        for name in chain:
            if name not in seen:
                break
            n += 1
        return n

    def record(self, url: str, chain: tuple[bytes, ...]) -> None:
        """The instance gets this prompt: its chunks become its most recently used."""
        seen = self._seen.setdefault(url, OrderedDict())
        for name in chain:
            seen[name] = None
            seen.move_to_end(name)
        while len(seen) > self.capacity:
            seen.popitem(last=False)
