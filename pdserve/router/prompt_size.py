"""How many tokens a client request asks for: its prompt length and its decode tokens.

The router needs the prompt length for conditional disaggregation (local prefill below a
threshold) and for its load model. Exact when the client sent token ids (a completion
`prompt` of ints, as `pdserve bench serve` does); for text the router asks an instance
(`POST /tokenize`, one short round trip, only when the answer can change where the request
goes, and not for a text so long that it cannot be under the threshold), and otherwise
estimates from the text's length (about 4 bytes per token, typical of
BPE vocabularies on English; only for the load model, never for the local-prefill choice).
"""

from __future__ import annotations

from typing import Any

import msgspec

from pdserve.router.upstream import Upstream, UpstreamError
from pdserve.server.load_report import TokenCount

BYTES_PER_TOKEN_ESTIMATE = 4
# A text this many bytes per token of the threshold is taken as long without asking an
# instance: real vocabularies average 2-6 bytes per token on real text, so such a prompt
# is far above the threshold. Misjudging one only disaggregates it, the safe side.
BYTES_PER_TOKEN_CEILING = 16
# `/v1/completions` without max_tokens generates 16 tokens (OpenAI's and pdserve's default).
COMPLETION_DEFAULT_MAX_TOKENS = 16


def token_id_count(body: dict[str, Any]) -> int | None:
    """The prompt length when the prompt is token ids (`[1, 2]` or `[[1, 2]]`), else None."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], list):
        prompt = prompt[0]
    if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        return len(prompt)
    return None


def estimated_prompt_tokens(body: dict[str, Any]) -> int:
    """A rough prompt length from the size of the text (or of the chat messages' JSON)."""
    exact = token_id_count(body)
    if exact is not None:
        return exact
    return max(1, _text_bytes(body) // BYTES_PER_TOKEN_ESTIMATE)


def certainly_not_below(body: dict[str, Any], threshold: int) -> bool:
    """Whether the text prompt is so long that it cannot be under `threshold` tokens, so
    the router need not ask an instance to count it (no `/tokenize` round trip)."""
    return _text_bytes(body) >= threshold * BYTES_PER_TOKEN_CEILING


def _text_bytes(body: dict[str, Any]) -> int:
    """UTF-8 size of the prompt text (or of the chat messages' JSON)."""
    source = body.get("messages", body.get("prompt", ""))
    if isinstance(source, str):
        return len(source.encode())
    return len(msgspec.json.encode(source))


def decode_tokens(body: dict[str, Any], path: str, default_chat: int) -> int:
    """The output tokens the request may generate: its max_tokens, else the API default
    (16 for completions; `default_chat` for chat, where the real default is the rest of
    the context)."""
    for key in ("max_completion_tokens", "max_tokens"):
        value = body.get(key)
        if type(value) is int and value > 0:
            return value
    return default_chat if path.endswith("/chat/completions") else COMPLETION_DEFAULT_MAX_TOKENS


async def tokenized_count(
    upstream: Upstream,
    url: str,
    body: dict[str, Any],
    headers: dict[str, str],
    timeout: float,
) -> int | None:
    """The prompt length as the instance at `url` tokenizes it, or None if it cannot say
    (an error, a timeout, an instance without `/tokenize`): the caller then disaggregates
    and the instance that serves the request reports any real problem with it."""
    try:
        r = await upstream.post(
            f"{url}/tokenize", msgspec.json.encode(body), headers, timeout_s=timeout
        )
        if not r.is_success:
            return None
        return msgspec.json.decode(r.content, type=TokenCount).count
    except (UpstreamError, msgspec.DecodeError):
        return None
