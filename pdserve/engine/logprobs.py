"""Log-probabilities of sampled and prompt tokens, computed only for requests that ask.

Logprobs are those of the model's raw distribution, `log_softmax(logits)`, before
penalties, `logit_bias`, temperature or top-k/top-p (vLLM's default, "raw_logprobs"), so
they do not depend on how a token was chosen. Each `TokenLogprob` carries the token's own
logprob, its rank in the distribution (1 = most likely) and the `k` most likely tokens.

Ownership: values only; the engine thread makes them (runner), the front end formats them
(pdserve.server.logprobs_format). A P instance's first token's logprob travels to D with the
token (`KVTransferParams.first_token_logprobs`, `PushDone.first_token_logprobs`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

from pdserve.token_logprob import TokenLogprob

if TYPE_CHECKING:
    from pdserve.engine.request import Request
    from pdserve.engine.types import RequestOutput, SamplingParams
    from pdserve.model.decoder import Decoder


def token_logprobs(logits: torch.Tensor, token_ids: list[int], k: int) -> list[TokenLogprob]:
    """The logprob, rank and top `k` of `token_ids[i]` under row i of `logits` ([N, vocab])."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    ids = torch.tensor(token_ids, dtype=torch.long, device=logprobs.device).unsqueeze(1)
    chosen = logprobs.gather(1, ids)
    ranks = (logprobs > chosen).sum(dim=1) + 1
    top_vals, top_idx = logprobs.topk(k, dim=-1) if k else (chosen[:, :0], ids[:, :0])
    return [
        TokenLogprob(t, lp, r, ti, tv)
        for t, lp, r, ti, tv in zip(
            token_ids,
            chosen.squeeze(1).tolist(),
            ranks.tolist(),
            top_idx.tolist(),
            top_vals.tolist(),
            strict=True,
        )
    ]


class _PromptRequest(Protocol):
    prompt_token_ids: list[int]
    prompt_logprobs: list[TokenLogprob | None] | None
    params: SamplingParams


def prompt_chunk_logprobs(
    model: Decoder, hidden: torch.Tensor, req: _PromptRequest, first_pos: int
) -> None:
    """Extend `req.prompt_logprobs` with the prompt tokens this chunk predicts.

    `hidden` holds the chunk's rows for positions [first_pos, first_pos + len(hidden)); row j
    predicts token first_pos + j + 1. Positions already recorded (a preempted request
    computes its prompt again) are skipped, as are outputs (positions past the prompt).
    """
    done = req.prompt_logprobs
    assert done is not None
    prompt = req.prompt_token_ids
    lo = len(done) - 1 - first_pos  # first row whose target is not recorded yet
    hi = min(len(hidden), len(prompt) - 1 - first_pos)
    if hi <= max(lo, 0) or lo < 0:
        return  # nothing new, or a gap (chunks always run in order, so none is expected)
    targets = prompt[first_pos + lo + 1 : first_pos + hi + 1]
    logits = model.compute_logits(hidden[lo:hi])
    done.extend(token_logprobs(logits, targets, req.params.prompt_logprobs or 0))


def attach_logprobs(req: Request, out: RequestOutput) -> None:
    """Give `out` the logprobs of its new tokens, and the prompt's with the first output.

    A token without logprobs (D's first token when its P leg sent none) has None.
    """
    n = len(out.new_token_ids)
    if req.logprobs is not None:
        out.new_logprobs = req.logprobs[-n:] if n else []
    if req.prompt_logprobs is not None and not req.prompt_logprobs_sent:
        out.prompt_logprobs = req.prompt_logprobs
        req.prompt_logprobs_sent = True
