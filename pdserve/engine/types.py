"""Typed values that cross the engine boundary (front end <-> engine loop).

All are msgspec structs so they can later cross a process boundary unchanged.
"""

from __future__ import annotations

import enum

import msgspec

from pdserve.token_logprob import TokenLogprob
from pdserve.transfer.params import KVTransferParams


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS or a stop string
    LENGTH = "length"  # max_tokens or max model length
    ABORT = "abort"  # client went away or the request was cancelled
    ERROR = "error"  # the engine (or a KV transfer) failed this request


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True):
    """Per-request sampling. temperature == 0 means greedy."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: disabled
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0  # EOS and stop_token_ids are masked, stop strings ignored, before it
    # Logprobs (pdserve.engine.logprobs): None asks for none; k >= 0 asks for each token's
    # own logprob plus the k most likely (`prompt_logprobs`: for the prompt's tokens).
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    # Logit processing (pdserve.engine.penalties), vLLM's definitions: presence and
    # frequency over the generated tokens, repetition over prompt + generated tokens.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) pairs

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def processes_logits(self) -> bool:
        """Whether sampling must change the logits first (penalties, bias, min_tokens)."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
            or self.min_tokens
        )


class RequestOutput(msgspec.Struct, kw_only=True):
    """One increment of a request's output, streamed from the engine loop.

    `new_token_ids` / `new_text` hold only what is new since the previous output.
    The last output of a request has `finished=True` and a `finish_reason`; an
    `ERROR` finish carries a human-readable `error`.
    """

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool = False
    finish_reason: FinishReason | None = None
    error: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    kv_transfer_params: KVTransferParams | None = None  # P side: what D needs (see params.py)
    # With `SamplingParams.logprobs`: one per token of `new_token_ids`.
    new_logprobs: list[TokenLogprob | None] | None = None
    # With `SamplingParams.prompt_logprobs`, on the first output only: one per prompt token,
    # None for the first (nothing predicts it).
    prompt_logprobs: list[TokenLogprob | None] | None = None


class EngineRequest(msgspec.Struct, frozen=True, kw_only=True):
    """A validated request as handed to the engine (the front end checked lengths)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float = 0.0
    kv_transfer: KVTransferParams | None = None  # P/D legs only (validated by the front end)


class EngineStats(msgspec.Struct, frozen=True, kw_only=True):
    """Counters for /metrics and load reports."""

    num_running: int
    num_waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    num_preemptions: int = 0
    num_waiting_for_kv: int = 0
    prefix_cache_queries: int = 0  # tokens looked up in the prefix cache (counter)
    prefix_cache_hits: int = 0  # tokens found there (counter)


class LiveRequest(msgspec.Struct, frozen=True, kw_only=True):
    """One live request's progress, as `GET /load` counts it (see server/load_report.py)."""

    request_id: str
    outputs: int  # tokens generated so far
    computed: int  # prompt tokens computed locally so far
    prompt: int  # prompt length; 0 when the KV comes from a prefill instance
    decode_left: int  # output tokens still owed
