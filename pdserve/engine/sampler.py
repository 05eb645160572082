"""Token sampling: greedy, temperature, top-k, top-p, per-request seeds.

Greedy rows are taken with one argmax over the batch; sampled rows one at a time,
since each may carry its own generator (seed) and its own filters.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pdserve.engine.types import SamplingParams


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
) -> list[int]:
    """One token id per row of `logits` ([N, vocab], float32)."""
    tokens = logits.argmax(dim=-1).tolist()
    for i, p in enumerate(params):
        if not p.greedy:
            tokens[i] = _sample_row(logits[i], p, generators[i])
    return tokens


def _sample_row(row: torch.Tensor, p: SamplingParams, gen: torch.Generator | None) -> int:
    row = row / p.temperature
    if p.top_k and p.top_k < row.numel():
        kth = torch.topk(row, p.top_k).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    probs = torch.softmax(row, dim=-1)
    if p.top_p < 1.0:
        probs = _top_p(probs, p.top_p)
    return int(torch.multinomial(probs, 1, generator=gen).item())


def skip_draws(gen: torch.Generator, vocab: int, n: int) -> None:
    """Advance `gen` past the draws of `n` sampled tokens over `vocab` ids: what
    `_sample_row` takes from it per token, which does not depend on the probabilities
    (the same call, on uniform ones)."""
    probs = torch.full((vocab,), 1.0 / vocab)
    for _ in range(n):
        torch.multinomial(probs, 1, generator=gen)


def _top_p(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of tokens whose mass reaches `top_p` (always the top one)."""
    sorted_p, idx = probs.sort(descending=True)
    cum = sorted_p.cumsum(0)
    drop = cum - sorted_p > top_p
    sorted_p = sorted_p.masked_fill(drop, 0.0)
    out = torch.zeros_like(probs).scatter_(0, idx, sorted_p)
    return out / out.sum()
