"""Model runner: turns a scheduled step into tensors, runs the model, samples.

Reads the KV cache and the requests' block tables; owns no blocks. Writes only the prompt
logprobs of requests that ask for them (`Request.prompt_logprobs`), as their chunks run.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import NamedTuple

import torch

from pdserve.engine.logprobs import prompt_chunk_logprobs, token_logprobs
from pdserve.engine.penalties import process_logits
from pdserve.engine.request import Request
from pdserve.engine.sampler import sample, skip_draws
from pdserve.engine.scheduler import ScheduledSeq
from pdserve.kv.cache import KVCache
from pdserve.model.attention import (
    AttentionMetadata,
    SeqSlice,
    build_attention_metadata,
    long_tensor,
)
from pdserve.model.decoder import Decoder
from pdserve.token_logprob import TokenLogprob


class Sampled(NamedTuple):
    """A sampled token, with its logprobs when the request asked for them."""

    token: int
    logprob: TokenLogprob | None = None


class ModelRunner:
    """Runs one forward pass per engine step on `model` with `kv`."""

    def __init__(
        self, model: Decoder, kv: KVCache, device: torch.device, eos_ids: Collection[int] = ()
    ) -> None:
        self.model = model
        self.kv = kv
        self.device = device
        self.eos_ids = eos_ids  # masked before `min_tokens` (pdserve.engine.penalties)

    @torch.inference_mode()
    def execute(
        self,
        seqs: list[ScheduledSeq],
        on_layer_done: Callable[[int], None] | None = None,
    ) -> dict[str, Sampled]:
        """Forward `seqs`; returns the sampled token for each sequence that samples."""
        ids: list[int] = []
        for s in seqs:
            ids += s.request.token_ids(s.num_computed, s.num_computed + s.num_new)
        slices = [SeqSlice(s.request.block_ids, s.num_computed, s.num_new) for s in seqs]
        meta = build_attention_metadata(slices, self.kv.block_size, self.device)
        input_ids = long_tensor(ids, self.device)
        hidden = self.model(input_ids, meta.positions, meta, self.kv, on_layer_done=on_layer_done)
        if any(s.request.params.prompt_logprobs is not None for s in seqs):
            self._prompt_logprobs(seqs, hidden)
        rows = [i for i, s in enumerate(seqs) if s.samples]
        if not rows:
            return {}
        logits = self.model.compute_logits(_rows_to_sample(hidden, meta, rows))
        return self._sample(logits, [seqs[i].request for i in rows])

    def _sample(self, logits: torch.Tensor, reqs: list[Request]) -> dict[str, Sampled]:
        """Process the logits of the requests that ask (penalties, bias, min_tokens), sample,
        and give the tokens of those that ask their logprobs under the raw logits."""
        params = [r.params for r in reqs]
        wants = [i for i, p in enumerate(params) if p.logprobs is not None]
        raw = logits[wants] if wants else None  # a copy: logprobs are of the raw logits
        if any(p.processes_logits for p in params):
            prompts = [r.prompt_token_ids for r in reqs]
            outputs = [r.output_token_ids for r in reqs]
            process_logits(logits, params, prompts, outputs, self.eos_ids)
        for r in reqs:
            if r.draws_to_skip and r.generator is not None:
                skip_draws(r.generator, logits.shape[-1], r.draws_to_skip)
                r.draws_to_skip = 0
        tokens = sample(logits, params, [r.generator for r in reqs])
        out = {r.request_id: Sampled(t) for r, t in zip(reqs, tokens, strict=True)}
        if raw is not None:
            k = max(params[i].logprobs or 0 for i in wants)
            lps = token_logprobs(raw, [tokens[i] for i in wants], k)
            for i, lp in zip(wants, lps, strict=True):
                r = reqs[i]
                out[r.request_id] = Sampled(tokens[i], _trim(lp, params[i].logprobs or 0))
        return out

    def _prompt_logprobs(self, seqs: list[ScheduledSeq], hidden: torch.Tensor) -> None:
        start = 0
        for s in seqs:
            req = s.request
            if req.params.prompt_logprobs is not None and req.prompt_logprobs is not None:
                rows = hidden[start : start + s.num_new]
                prompt_chunk_logprobs(self.model, rows, req, s.num_computed)
            start += s.num_new


def _trim(lp: TokenLogprob, k: int) -> TokenLogprob:
    """`lp` with its top list cut to `k` (a batch computes the largest k once)."""
    if len(lp.top_ids) == k:
        return lp
    return TokenLogprob(lp.token_id, lp.logprob, lp.rank, lp.top_ids[:k], lp.top_logprobs[:k])


def _rows_to_sample(hidden: torch.Tensor, meta: AttentionMetadata, rows: list[int]) -> torch.Tensor:
    """The hidden states of the last new token of the sequences `rows` (indices into the
    step's sequences). A decode-only step where every sequence samples needs no gather."""
    if len(rows) == meta.num_tokens:  # one token per sequence, all sampling: all of hidden
        return hidden
    return hidden[meta.logits_indices[rows]]
