"""Logit processing before sampling: `min_tokens`, `logit_bias` and the three penalties.

vLLM's definitions and order: first the stop tokens are masked while fewer than
`min_tokens` tokens were generated (EOS unless `ignore_eos`, and `stop_token_ids`), then
`logit_bias` is added, then

- repetition (transformers' `RepetitionPenaltyLogitsProcessor`): a token seen in the prompt
  or the output has its logit divided by the penalty when positive, multiplied when not;
- frequency: minus `frequency_penalty` x the token's count in the output;
- presence: minus `presence_penalty` once if the token is in the output.

Greedy picks the argmax of the processed logits; temperature and top-k/top-p come after.
Only rows whose `SamplingParams.processes_logits` are touched, so a batch that asks for none
of this costs one Python check per row.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import torch

from pdserve.engine.types import SamplingParams


def process_logits(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    prompts: Sequence[Sequence[int]],
    outputs: Sequence[Sequence[int]],
    eos_ids: Collection[int],
) -> None:
    """Apply each row's processing to `logits` ([N, vocab], float32) in place."""
    for i, p in enumerate(params):
        if p.processes_logits:
            _process_row(logits[i], p, prompts[i], outputs[i], eos_ids)


def _process_row(
    row: torch.Tensor,
    p: SamplingParams,
    prompt: Sequence[int],
    output: Sequence[int],
    eos_ids: Collection[int],
) -> None:
    if len(output) < p.min_tokens:
        stops = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_ids))
        if stops:
            row[_ids(stops, row)] = float("-inf")
    if p.logit_bias:
        ids, bias = zip(*p.logit_bias, strict=True)
        row.index_add_(0, _ids(ids, row), torch.tensor(bias, dtype=row.dtype, device=row.device))
    if p.repetition_penalty != 1.0:
        seen = torch.zeros_like(row, dtype=torch.bool)
        seen[_ids(prompt, row)] = True
        if output:
            seen[_ids(output, row)] = True
        penalised = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
        row.copy_(torch.where(seen, penalised, row))
    if output and (p.frequency_penalty or p.presence_penalty):
        counts = torch.bincount(_ids(output, row), minlength=row.numel()).to(row.dtype)
        row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)


def _ids(ids: Collection[int], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(list(ids), dtype=torch.long, device=like.device)
