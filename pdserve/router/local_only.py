"""Requests that one instance serves better than a P/D pair: sent whole to a decode
instance, which prefills them itself (mode "local" in the metrics).

- prompt logprobs (completions with `echo` and `logprobs`, what lm-eval's loglikelihood
  asks): they come from the prompt's logits, which only the instance computing the prompt
  has; D receives the prompt's KV, not its logits.
- `max_tokens: 0` (with `echo`): nothing to decode.

Everything else (logprobs of generated tokens, penalties, `logit_bias`, `min_tokens`,
seeds; `n` > 1 as one P/D request per choice, pdserve.router.choices) goes through P/D:
P samples the first token with the client's sampling fields and
its logprobs travel to D with it (`kv_transfer_params.first_token_logprobs` for pull,
`PushDone` for push). Bodies are read as sent; the instance validates them.
"""

from __future__ import annotations

from typing import Any


def local_only_reason(body: dict[str, Any], path: str) -> str | None:
    """Why this request must be prefilled where it is decoded, or None."""
    if path.endswith("/chat/completions") or body.get("echo") is not True:
        return None
    if body.get("logprobs") is not None:
        return "prompt logprobs (echo with logprobs)"
    if body.get("max_tokens") == 0:
        return "max_tokens 0 (echo)"
    return None
