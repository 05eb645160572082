"""Whether a request's `SamplingParams` can run on this model: the engine's own check for
in-process callers (the offline API), where no HTTP layer validated them first. A bad value
here would otherwise fail in the middle of a step, and fail the whole batch with it."""

from __future__ import annotations

import math

from pdserve.engine.types import SamplingParams
from pdserve.token_logprob import MAX_LOGPROBS


def sampling_problem(p: SamplingParams, vocab_size: int) -> str | None:
    """Why `p` cannot run on a model of `vocab_size` logits, or None."""
    for name in ("logprobs", "prompt_logprobs"):
        k = getattr(p, name)
        if k is not None and not 0 <= k <= min(MAX_LOGPROBS, vocab_size):
            return f"{name} must be in [0, {MAX_LOGPROBS}] (got {k})"
    values = (p.temperature, p.presence_penalty, p.frequency_penalty, p.repetition_penalty)
    if not all(math.isfinite(v) for v in values) or p.repetition_penalty <= 0:
        return "temperature and penalties must be finite, repetition_penalty > 0"
    if p.min_tokens < 0:
        return f"min_tokens must be >= 0 (got {p.min_tokens})"
    ids = [t for t, _ in p.logit_bias] + list(p.stop_token_ids)
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        return f"token id {bad[0]} (logit_bias or stop_token_ids) is outside [0, {vocab_size})"
    if not all(math.isfinite(b) for _, b in p.logit_bias):
        return "logit_bias values must be finite"
    return None
