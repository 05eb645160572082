"""A request's life inside the engine: its tokens, its blocks and its state.

Owned by the engine thread. `block_ids` are held (in the block pool) by the owner
`request_id` (the first `num_cached_blocks` shared read-only with other holders when
prefix caching found them) while the request is WAITING (after a preemption they are empty),
WAITING_FOR_REMOTE_KV (D: reserved for the incoming prompt KV) or RUNNING. The
transfer core takes them over under its own owners (`Hold`, `Quarantine`) only when
the request ends, or, D, as it fails because its prefill instance is down; it does so
through pdserve.engine.transfer_adapter, which empties `block_ids` (see
pdserve.transfer.adapter). The core never sees this object, only `RemoteRequest`
snapshots of it.
"""

from __future__ import annotations

import enum
import time

import torch

from pdserve.engine.detokenizer import IncrementalDetokenizer
from pdserve.engine.types import EngineRequest, FinishReason, SamplingParams
from pdserve.token_logprob import TokenLogprob


class RequestState(enum.Enum):
    WAITING = "waiting"  # queued for admission (new, or preempted and to be recomputed)
    WAITING_FOR_REMOTE_KV = "waiting_for_remote_kv"  # D side: blocks reserved, KV arriving
    RUNNING = "running"  # admitted: prefilling in chunks, then decoding
    FINISHED = "finished"


class Request:
    """Mutable per-request state; only the engine thread touches it."""

    def __init__(self, req: EngineRequest, detok: IncrementalDetokenizer) -> None:
        self.request_id = req.request_id
        self.prompt_token_ids = list(req.prompt_token_ids)
        self.params: SamplingParams = req.params
        self.arrival_time = req.arrival_time or time.monotonic()
        self.output_token_ids: list[int] = []
        self.block_ids: list[int] = []
        self.num_computed_tokens = 0  # tokens whose K/V are in this request's blocks
        # Prefix caching: the chained hashes of the full blocks of prompt + outputs known so
        # far (kept across preemption: the tokens do not change), and how many of
        # `block_ids` are registered in (or were taken from) the cache.
        self.block_hashes: list[bytes] = []
        self.num_cached_blocks = 0
        self.state = RequestState.WAITING
        self.finish_reason: FinishReason | None = None
        self.detok = detok
        self.kv_transfer = req.kv_transfer
        # D side: the prompt's KV comes from a prefill instance, not from our own compute.
        self.needs_remote_kv = bool(req.kv_transfer and req.kv_transfer.do_remote_prefill)
        self.generator: torch.Generator | None = None
        if req.params.seed is not None:
            self.generator = torch.Generator().manual_seed(req.params.seed)
        # D side: P sampled the first token with the seed's first draw, so D's tokens start
        # at the second (then seeded P/D output equals one instance's), skipped at D's first
        # sampling by the runner.
        self.draws_to_skip = 1 if self.needs_remote_kv and self.generator is not None else 0
        # Only when asked: one per output token; one per prompt token (None for the first),
        # filled by the runner as the prompt's chunks run, handed out with the first output.
        self.logprobs: list[TokenLogprob | None] | None = None
        if req.params.logprobs is not None:
            self.logprobs = []
        self.prompt_logprobs: list[TokenLogprob | None] | None = None
        if req.params.prompt_logprobs is not None:
            self.prompt_logprobs = [None]
        self.prompt_logprobs_sent = False

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_ids(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output."""
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:  # decode: a slice of the outputs, without copying the whole prompt
            return self.output_token_ids[start - p : end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - p]

    @property
    def last_logprob(self) -> TokenLogprob | None:
        """The logprobs of the last output token, when the request asked for them (P/D: what
        travels to D with the first token)."""
        return self.logprobs[-1] if self.logprobs else None

    @property
    def is_remote_decode(self) -> bool:
        """P side: only the prompt is computed here; the KV then goes to a decode instance."""
        return bool(self.kv_transfer and self.kv_transfer.do_remote_decode)

    @property
    def is_finished(self) -> bool:
        return self.state is RequestState.FINISHED

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.state.name}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, blocks={len(self.block_ids)})"
        )
