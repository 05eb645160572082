"""Requests that one instance serves better than a P/D pair: sent whole to a decode
instance, which prefills them itself (mode "local" in the metrics).

- prompt logprobs (completions with `echo` and `logprobs`, what lm-eval's loglikelihood
  asks): they come from the prompt's logits, which only the instance computing the prompt
  has; D receives the prompt's KV, not its logits.
- `max_tokens: 0` (with `echo`): nothing to decode.
- `n` > 1: the instance runs the n choices as n requests (pdserve.server.fanout); through
  P/D each would need its own prefill and transfer of the same prompt.

Everything else (logprobs of generated tokens, penalties, `logit_bias`, `min_tokens`,
seeds) goes through P/D: P samples the first token with the client's sampling fields and
its logprobs travel to D with it (`kv_transfer_params.first_token_logprobs` for pull,
`PushDone` for push). Bodies are read as sent; the instance validates them.
"""

from __future__ import annotations

from typing import Any


def local_only_reason(body: dict[str, Any], path: str) -> str | None:
    """Why this request must be prefilled where it is decoded, or None."""
    n = body.get("n")
    if type(n) is int and n > 1:
        return "n > 1"
    if path.endswith("/chat/completions") or body.get("echo") is not True:
        return None
    if body.get("logprobs") is not None:
        return "prompt logprobs (echo with logprobs)"
    if body.get("max_tokens") == 0:
        return "max_tokens 0 (echo)"
    return None
