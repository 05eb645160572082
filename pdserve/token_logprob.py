"""`TokenLogprob`: the log-probability of one token at one position, as it crosses every
boundary (engine -> front end, P -> D in `kv_transfer_params` and `PushDone`).

A value at the bottom of the import tree (msgspec only), so the engine, the transfer layer
and the HTTP layer share one type without importing each other or torch.
"""

from __future__ import annotations

import msgspec

# The most top logprobs a request may ask for (vLLM's default max_logprobs; OpenAI's 20).
MAX_LOGPROBS = 20


class TokenLogprob(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
    """One position: the token there, its logprob under the model's raw distribution, its
    rank in it (1 = most likely), and the `k` most likely tokens (ids and logprobs, most
    likely first; `k` is what the request asked for, at most 20)."""

    token_id: int
    logprob: float
    rank: int
    top_ids: list[int]
    top_logprobs: list[float]
