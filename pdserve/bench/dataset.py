"""Benchmark workloads: the random dataset (token ids, or words for the chat API), the JSONL
trace reader, and vLLM's ShareGPT and custom (JSONL) datasets.

All produce a list of `BenchRequest`, the only thing the rest of the benchmark sees. A
request owns nothing beyond its prompt and lengths; the arrival schedule is decided
separately (`pdserve.bench.arrivals`) unless a trace carries its own arrival times. Where a
dataset needs token counts of texts (ShareGPT), the caller passes a `CountTokens` function
(`bench serve` asks the server's `/tokenize`; `estimate_tokens` is the fallback).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import msgspec
import numpy as np

from pdserve.options import from_flag, option

WORKLOAD_GROUP = "workload"  # where `pdserve bench serve --help` lists the flags below


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

    input_len: int = option(
        1024,
        flag="--random-input-len",
        aliases=("--input-len",),
        group=WORKLOAD_GROUP,
        metavar="N",
        help="random: prompt tokens (about that many with the chat API)",
    )
    output_len: int = option(
        128,
        flag="--random-output-len",
        aliases=("--output-len",),
        group=WORKLOAD_GROUP,
        metavar="N",
        help="random: tokens to generate (max_tokens)",
    )
    range_ratio: float = option(
        0.0,
        flag="--random-range-ratio",
        aliases=("--range-ratio",),
        group=WORKLOAD_GROUP,
        metavar="R",
        help="random: lengths uniform in [L(1-r), L(1+r)], 0 <= r < 1",
    )
    vocab_size: int = option(256, group=WORKLOAD_GROUP, help="random: token ids are below this")
    token_offset: int = option(10, group=WORKLOAD_GROUP, help="random: lowest token id")

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


# Words of the random text prompts (chat API): common English words, each one token with its
# leading space in GPT-2, Llama and Qwen vocabularies (a byte-level one takes a token a byte).
_WORD_TEXT = """the of and to in is was for on that with as by at from his her they this are be an
    which or had not but one all were we when there can more if no out so said what up its
    about into than them time only new some could these two may first then do any like my
    now over such our man me even most made after also did many before must through back
    years where much your way well down should because each just those people how too little
    state good very make world still own see men work long get here between both life being
    under never day same another know while last might us great old year off come since
    against go came right used take three"""
WORDS: tuple[str, ...] = tuple(_WORD_TEXT.split())

CountTokens = Callable[[Sequence[str]], list[int]]
"""Token counts of a batch of texts, as the server's tokenizer would count each as a prompt."""

CHARS_PER_TOKEN = 4.0  # the estimate's ratio, about right for English in BPE vocabularies


@dataclass(frozen=True)
class MultiTurnConfig:
    """A multi-turn chat trace in token ids, written from the seed (prefix-caching bench).

    Every conversation opens with the same system prompt (`system_len` tokens); turn k's
    prompt is the previous turn's prompt, that turn's reply (`output_len` tokens, drawn here:
    the server's real reply is unknown in advance) and a new user message (`user_len`
    tokens). Requests go out turn by turn (every conversation's turn 1, then every turn 2,
    ...), so a conversation's turns arrive in order and its earlier turns may be cached.
    """

    system_len: int = option(
        512,
        flag="--multiturn-system-len",
        group=WORKLOAD_GROUP,
        metavar="N",
        help="multiturn: tokens of the shared system prompt",
    )
    user_len: int = option(
        64,
        flag="--multiturn-user-len",
        group=WORKLOAD_GROUP,
        metavar="N",
        help="multiturn: tokens of each user message",
    )
    turns: int = option(
        4,
        flag="--multiturn-turns",
        group=WORKLOAD_GROUP,
        metavar="N",
        help="multiturn: turns per conversation (--num-prompts / N conversations); each "
        "turn's reply in the history is --random-output-len tokens",
    )
    # `pdserve bench serve` gives the random dataset's lengths and ids here too.
    output_len: int = from_flag("--random-output-len", 64)
    vocab_size: int = from_flag("--vocab-size", 256)
    token_offset: int = from_flag("--token-offset", 10)

    def __post_init__(self) -> None:
        if min(self.system_len, self.user_len, self.turns, self.output_len) < 1:
            raise ValueError("multiturn lengths and turns must be at least 1")
        if not 0 <= self.token_offset < self.vocab_size:
            raise ValueError("need 0 <= token_offset < vocab_size")


def sample_multiturn(
    cfg: MultiTurnConfig, num_prompts: int, rng: np.random.Generator
) -> list[BenchRequest]:
    """`num_prompts` requests: ceil(num_prompts / turns) conversations, in turn-major order."""

    def tokens(n: int) -> list[int]:
        return rng.integers(cfg.token_offset, cfg.vocab_size, size=n).tolist()

    system = tokens(cfg.system_len)
    num_convs = -(-num_prompts // cfg.turns)
    convs = [list(system) for _ in range(num_convs)]
    requests: list[BenchRequest] = []
    for turn in range(cfg.turns):
        for history in convs:
            if turn:
                history += tokens(cfg.output_len)  # the previous turn's reply
            history += tokens(cfg.user_len)
            requests.append(
                BenchRequest(
                    prompt=list(history), prompt_len=len(history), output_len=cfg.output_len
                )
            )
    return requests[:num_prompts]


def estimate_tokens(texts: Sequence[str]) -> list[int]:
    """Token counts estimated from the length of each text (CHARS_PER_TOKEN chars a token)."""
    return [max(1, round(len(t) / CHARS_PER_TOKEN)) if t else 0 for t in texts]


def tokens_per_word(count: CountTokens) -> float:
    """Mean tokens per word of WORDS with its space, as `count` counts them (random text)."""
    return max(count([" ".join(WORDS)])[0], 1) / len(WORDS)


def sample_random_text(
    cfg: RandomDatasetConfig, num_prompts: int, rng: np.random.Generator, per_word: float
) -> list[BenchRequest]:
    """Random text prompts of about `input_len` tokens, for APIs that take no token ids (chat):
    words drawn uniformly from WORDS, `input_len / per_word` of them. The length is not exact
    (`prompt_len` is None; the server's usage reports it, chat template included)."""
    input_lens = _uniform_lengths(rng, cfg.input_len, cfg.range_ratio, num_prompts)
    output_lens = _uniform_lengths(rng, cfg.output_len, cfg.range_ratio, num_prompts)
    requests = []
    for n_in, n_out in zip(input_lens.tolist(), output_lens.tolist(), strict=True):
        picks = rng.integers(0, len(WORDS), size=max(1, round(n_in / per_word)))
        prompt = " ".join(WORDS[i] for i in picks.tolist())
        requests.append(BenchRequest(prompt=prompt, prompt_len=None, output_len=n_out))
    return requests


class TraceError(ValueError):
    """A dataset or trace file that cannot be used; the message names the file (and line)."""


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


# --- ShareGPT (vLLM's format) --------------------------------------------------------------

# vLLM's filter of ShareGPT conversations (benchmarks' `is_valid_sequence`), in tokens.
SHAREGPT_MIN_LEN = 4
SHAREGPT_MAX_PROMPT_LEN = 1024
SHAREGPT_MAX_TOTAL_LEN = 2048
_HUMAN = ("human", "user")
_GPT = ("gpt", "assistant")


class _Turn(msgspec.Struct):
    speaker: str = msgspec.field(name="from")
    value: str


class _Conversation(msgspec.Struct):
    conversations: list[_Turn] = msgspec.field(default_factory=list)


def _first_exchange(turns: list[_Turn]) -> tuple[str, str] | None:
    """(first human turn, first gpt turn after it), or None (fewer than 2 turns, no such pair)."""
    if len(turns) < 2:
        return None
    human = next((i for i, t in enumerate(turns) if t.speaker in _HUMAN), None)
    if human is None:
        return None
    reply = next((t.value for t in turns[human + 1 :] if t.speaker in _GPT), None)
    return None if reply is None else (turns[human].value, reply)


def read_sharegpt(path: str | Path) -> list[tuple[str, str]]:
    """(prompt, reply) of every usable conversation of a ShareGPT JSON file, in file order:
    a list of {"id", "conversations": [{"from": "human"|"gpt", "value": TEXT}, ...]}."""
    path = Path(path)
    try:
        convs = msgspec.json.decode(path.read_bytes(), type=list[_Conversation])
    except msgspec.DecodeError as exc:
        raise TraceError(f"{path}: not a ShareGPT JSON list of conversations ({exc})") from None
    pairs = [p for c in convs if (p := _first_exchange(c.conversations)) is not None]
    if not pairs:
        raise TraceError(f"{path}: no conversation with a human turn and then a gpt turn")
    return pairs


def _fits(prompt_len: int, output_len: int, fixed_output: bool) -> bool:
    """vLLM's rule; a fixed output length (--sharegpt-output-len) skips the minimum on it."""
    too_short = prompt_len < SHAREGPT_MIN_LEN or (
        not fixed_output and output_len < SHAREGPT_MIN_LEN
    )
    too_long = (
        prompt_len > SHAREGPT_MAX_PROMPT_LEN or prompt_len + output_len > SHAREGPT_MAX_TOTAL_LEN
    )
    return output_len >= 1 and not too_short and not too_long


def sample_sharegpt(
    path: str | Path,
    num_prompts: int,
    rng: np.random.Generator,
    count: CountTokens,
    output_len: int | None = None,
) -> list[BenchRequest]:
    """`num_prompts` conversations of a ShareGPT file (fewer if fewer fit), shuffled by `rng`:
    the first human turn is the prompt; the output length is `output_len`, else the token
    count of the first gpt turn. Conversations out of vLLM's bounds are skipped (prompt
    4..1024 tokens, reply at least 4, both at most 2048). Texts are counted in batches, only
    as many as needed."""
    pairs = read_sharegpt(path)
    order = rng.permutation(len(pairs)).tolist()
    batch = max(num_prompts, 64)
    chosen: list[BenchRequest] = []
    for start in range(0, len(order), batch):
        picked = [pairs[i] for i in order[start : start + batch]]
        prompt_lens = count([prompt for prompt, _ in picked])
        replies = [reply for _, reply in picked]
        reply_lens = count(replies) if output_len is None else [output_len] * len(picked)
        for (prompt, _), n_in, n_out in zip(picked, prompt_lens, reply_lens, strict=True):
            if _fits(n_in, n_out, output_len is not None):
                chosen.append(BenchRequest(prompt=prompt, prompt_len=n_in, output_len=n_out))
        if len(chosen) >= num_prompts:
            break
    if not chosen:
        raise TraceError(
            f"{path}: no conversation within vLLM's bounds (prompt {SHAREGPT_MIN_LEN}.."
            f"{SHAREGPT_MAX_PROMPT_LEN} tokens, reply >= {SHAREGPT_MIN_LEN}, "
            f"both <= {SHAREGPT_MAX_TOTAL_LEN})"
        )
    return chosen[:num_prompts]


# --- custom (vLLM's JSONL) ---------------------------------------------------------------

DEFAULT_CUSTOM_OUTPUT_LEN = 256  # vLLM's --custom-output-len default


class _CustomLine(msgspec.Struct):
    prompt: str
    output_tokens: int | None = None
    max_tokens: int | None = None


def _custom_request(line: _CustomLine, output_len: int | None) -> BenchRequest:
    n_out = output_len or line.output_tokens or line.max_tokens or DEFAULT_CUSTOM_OUTPUT_LEN
    if not line.prompt:
        raise ValueError("'prompt' is empty")
    if n_out < 1:
        raise ValueError(f"the output length must be >= 1, got {n_out}")
    return BenchRequest(prompt=line.prompt, prompt_len=None, output_len=n_out)


def load_custom(
    path: str | Path, num_prompts: int | None = None, output_len: int | None = None
) -> list[BenchRequest]:
    """The first `num_prompts` lines (None: all) of a JSONL file of {"prompt": TEXT}, in file
    order. Output length: `output_len`, else the line's `output_tokens`, else its
    `max_tokens`, else DEFAULT_CUSTOM_OUTPUT_LEN. TraceError names a bad line."""
    path = Path(path)
    decoder = msgspec.json.Decoder(_CustomLine)
    requests = []
    with path.open("rb") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                requests.append(_custom_request(decoder.decode(line), output_len))
            except (msgspec.DecodeError, ValueError) as exc:
                raise TraceError(f"{path}:{lineno}: {exc}") from None
            if len(requests) == num_prompts:
                break
    if not requests:
        raise TraceError(f"{path}: no prompts in file")
    return requests
