"""Benchmark workloads: the random dataset and the JSONL trace reader.

Both produce a list of `BenchRequest`, the only thing the rest of the benchmark sees. A request
owns nothing beyond its prompt and lengths; the arrival schedule is decided separately
(`pdserve.bench.arrivals`) unless a trace carries its own arrival times.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import msgspec
import numpy as np


class BenchRequest(msgspec.Struct, frozen=True, kw_only=True):
    """One request to replay.

    `prompt` is either text or token ids (the completions API accepts a list of ints, which
    gives exact input lengths whatever the server's tokenizer). `prompt_len` is None when
    the prompt is text of unknown token length; the server's reported usage then fills it.
    `arrival_offset_s` is set only for trace requests that recorded their arrival time.
    """

    prompt: str | list[int]
    prompt_len: int | None
    output_len: int
    arrival_offset_s: float | None = None


@dataclass(frozen=True)
class RandomDatasetConfig:
    """Random token prompts, lengths uniform in [L(1-r), L(1+r)] like vLLM's random dataset.

    Token ids are drawn uniformly from [token_offset, vocab_size). The defaults, 10..255,
    stay clear of special tokens in common vocabularies (BOS/EOS/pad sit at the very low
    ids, as in Llama 2, or above the base vocabulary, as in Qwen, GPT-2 and pdserve's
    built-in byte-level tokenizer, whose ids 0..255 are the bytes) and are valid for any
    model with at least 256 tokens.
    """

    input_len: int = 1024
    output_len: int = 128
    range_ratio: float = 0.0
    vocab_size: int = 256
    token_offset: int = 10

    def __post_init__(self) -> None:
        if not 0.0 <= self.range_ratio < 1.0:
            raise ValueError(f"range_ratio must be in [0, 1), got {self.range_ratio}")
        if self.input_len < 1 or self.output_len < 1:
            raise ValueError("input_len and output_len must be at least 1")
        if not 0 <= self.token_offset < self.vocab_size:
            raise ValueError("need 0 <= token_offset < vocab_size")


def _uniform_lengths(rng: np.random.Generator, length: int, ratio: float, n: int) -> np.ndarray:
    low = max(1, int(length * (1.0 - ratio)))
    high = max(low, int(length * (1.0 + ratio)))
    return rng.integers(low, high + 1, size=n)


def sample_random(
    cfg: RandomDatasetConfig, num_prompts: int, rng: np.random.Generator
) -> list[BenchRequest]:
    """Draw `num_prompts` random-token requests; the same rng state gives the same set."""
    input_lens = _uniform_lengths(rng, cfg.input_len, cfg.range_ratio, num_prompts)
    output_lens = _uniform_lengths(rng, cfg.output_len, cfg.range_ratio, num_prompts)
    requests = []
    for n_in, n_out in zip(input_lens.tolist(), output_lens.tolist(), strict=True):
        ids = rng.integers(cfg.token_offset, cfg.vocab_size, size=n_in)
        requests.append(BenchRequest(prompt=ids.tolist(), prompt_len=n_in, output_len=n_out))
    return requests


class TraceError(ValueError):
    """A trace file that cannot be replayed; the message names the file and line."""


class TraceRecord(msgspec.Struct, frozen=True, kw_only=True):
    """One JSONL line of a recorded trace. Unknown fields are ignored.

    Exactly one of `prompt` / `prompt_token_ids`. The arrival time is either `timestamp`
    (absolute seconds, any epoch: offsets are taken from the earliest) or
    `arrival_offset_s` (seconds from the start of the replay).
    """

    output_len: int
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    prompt_len: int | None = None
    timestamp: float | None = None
    arrival_offset_s: float | None = None


def _check_record(rec: TraceRecord) -> None:
    if (rec.prompt is None) == (rec.prompt_token_ids is None):
        raise ValueError("needs exactly one of 'prompt' and 'prompt_token_ids'")
    if rec.prompt_token_ids is not None and not rec.prompt_token_ids:
        raise ValueError("'prompt_token_ids' is empty")
    if rec.output_len < 1:
        raise ValueError(f"'output_len' must be >= 1, got {rec.output_len}")
    if rec.timestamp is not None and rec.arrival_offset_s is not None:
        raise ValueError("give 'timestamp' or 'arrival_offset_s', not both")
    if rec.arrival_offset_s is not None and rec.arrival_offset_s < 0:
        raise ValueError(f"'arrival_offset_s' must be >= 0, got {rec.arrival_offset_s}")


def _read_records(path: Path) -> list[TraceRecord]:
    decoder = msgspec.json.Decoder(TraceRecord)
    records: list[tuple[int, TraceRecord]] = []
    with path.open("rb") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                rec = decoder.decode(line)
                _check_record(rec)
            except (msgspec.DecodeError, ValueError) as exc:
                raise TraceError(f"{path}:{lineno}: {exc}") from None
            records.append((lineno, rec))
    if not records:
        raise TraceError(f"{path}: no requests in trace")
    _check_timing_consistent(path, records)
    return [rec for _, rec in records]


def _has_time(rec: TraceRecord) -> bool:
    return rec.timestamp is not None or rec.arrival_offset_s is not None


def _check_timing_consistent(path: Path, records: list[tuple[int, TraceRecord]]) -> None:
    """Either every line carries an arrival time of the same kind, or none does."""
    first_line, first = records[0]
    for lineno, rec in records[1:]:
        same_kind = (rec.timestamp is None) == (first.timestamp is None) and (
            rec.arrival_offset_s is None
        ) == (first.arrival_offset_s is None)
        if not same_kind:
            raise TraceError(
                f"{path}:{lineno}: arrival time fields differ from line {first_line}; "
                "use 'timestamp' on every line, 'arrival_offset_s' on every line, or neither"
            )


def _arrival_offsets(records: list[TraceRecord]) -> list[float | None]:
    if records[0].timestamp is not None:
        origin = min(r.timestamp for r in records if r.timestamp is not None)
        return [r.timestamp - origin for r in records if r.timestamp is not None]
    return [r.arrival_offset_s for r in records]


def load_trace(path: str | Path, num_prompts: int | None = None) -> list[BenchRequest]:
    """Read a JSONL trace; `num_prompts` keeps the first N lines (None: all).

    Raises TraceError naming the line for a malformed line, a line with neither or both
    prompt fields, or arrival times given on some lines but not others.
    """
    path = Path(path)
    records = _read_records(path)
    offsets = _arrival_offsets(records)
    requests = [
        BenchRequest(
            prompt=rec.prompt if rec.prompt is not None else list(rec.prompt_token_ids or []),
            prompt_len=rec.prompt_len
            if rec.prompt_token_ids is None
            else len(rec.prompt_token_ids),
            output_len=rec.output_len,
            arrival_offset_s=offset,
        )
        for rec, offset in zip(records, offsets, strict=True)
    ]
    requests.sort(key=lambda r: r.arrival_offset_s or 0.0)
    return requests if num_prompts is None else requests[:num_prompts]
