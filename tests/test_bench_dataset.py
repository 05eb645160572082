"""The random datasets (token ids, text), the JSONL trace reader, ShareGPT and custom files."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest

from pdserve.bench.dataset import (
    DEFAULT_CUSTOM_OUTPUT_LEN,
    WORDS,
    RandomDatasetConfig,
    TraceError,
    estimate_tokens,
    load_custom,
    load_trace,
    read_sharegpt,
    sample_random,
    sample_random_text,
    sample_sharegpt,
    tokens_per_word,
)


def _rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


def test_random_exact_lengths_and_token_range() -> None:
    cfg = RandomDatasetConfig(input_len=64, output_len=8, vocab_size=200, token_offset=20)
    reqs = sample_random(cfg, 50, _rng())
    assert len(reqs) == 50
    assert all(r.prompt_len == len(r.prompt) == 64 and r.output_len == 8 for r in reqs)
    ids = np.concatenate([r.prompt for r in reqs])
    assert ids.min() >= 20 and ids.max() < 200
    assert len({tuple(r.prompt) for r in reqs}) == 50  # no shared prompts


def test_random_range_ratio_bounds() -> None:
    cfg = RandomDatasetConfig(input_len=100, output_len=40, range_ratio=0.5)
    reqs = sample_random(cfg, 2000, _rng())
    ins = np.array([r.prompt_len for r in reqs])
    outs = np.array([r.output_len for r in reqs])
    assert ins.min() >= 50 and ins.max() <= 150
    assert outs.min() >= 20 and outs.max() <= 60
    assert ins.mean() == pytest.approx(100, rel=0.03)
    assert len(set(ins.tolist())) > 50  # really spread, not a constant


def test_random_is_seeded() -> None:
    cfg = RandomDatasetConfig(input_len=16, output_len=4, range_ratio=0.25)
    assert sample_random(cfg, 10, _rng(5)) == sample_random(cfg, 10, _rng(5))
    assert sample_random(cfg, 10, _rng(5)) != sample_random(cfg, 10, _rng(6))


@pytest.mark.parametrize(
    "kwargs",
    [{"range_ratio": 1.0}, {"range_ratio": -0.1}, {"input_len": 0}, {"token_offset": 256}],
)
def test_random_config_validation(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        RandomDatasetConfig(**kwargs)


def _write(tmp_path: Path, lines: list[str]) -> Path:
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_trace_with_timestamps(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        [
            json.dumps({"prompt": "hello", "output_len": 4, "timestamp": 1000.5, "extra": 1}),
            "",
            json.dumps({"prompt_token_ids": [5, 6, 7], "output_len": 2, "timestamp": 1000.0}),
            json.dumps({"prompt": "x", "prompt_len": 9, "output_len": 1, "timestamp": 1002.0}),
        ],
    )
    reqs = load_trace(path)
    assert [r.arrival_offset_s for r in reqs] == [0.0, 0.5, 2.0]  # sorted by arrival
    assert reqs[0].prompt == [5, 6, 7] and reqs[0].prompt_len == 3
    assert reqs[1].prompt == "hello" and reqs[1].prompt_len is None
    assert reqs[2].prompt_len == 9 and reqs[2].output_len == 1
    assert len(load_trace(path, num_prompts=2)) == 2


def test_trace_offsets_and_untimed(tmp_path: Path) -> None:
    timed = _write(tmp_path, ['{"prompt": "a", "output_len": 3, "arrival_offset_s": 1.5}'])
    assert load_trace(timed)[0].arrival_offset_s == 1.5
    untimed = _write(
        tmp_path, ['{"prompt": "a", "output_len": 3}', '{"prompt": "b", "output_len": 1}']
    )
    assert [r.arrival_offset_s for r in load_trace(untimed)] == [None, None]
    assert [r.prompt for r in load_trace(untimed)] == ["a", "b"]  # file order kept


@pytest.mark.parametrize(
    ("bad_line", "needle"),
    [
        ("{not json", "malformed"),
        ('{"prompt": "a"}', "output_len"),
        ('{"prompt": "a", "output_len": "many"}', "output_len"),
        ('{"prompt": "a", "prompt_token_ids": [1], "output_len": 2}', "exactly one"),
        ('{"output_len": 2}', "exactly one"),
        ('{"prompt_token_ids": [], "output_len": 2}', "empty"),
        ('{"prompt": "a", "output_len": 0}', "output_len"),
        ('{"prompt": "a", "output_len": 1, "timestamp": 1, "arrival_offset_s": 1}', "not both"),
    ],
)
def test_trace_bad_line_names_its_number(tmp_path: Path, bad_line: str, needle: str) -> None:
    good = '{"prompt": "ok", "output_len": 1}'
    path = _write(tmp_path, [good, good, bad_line])
    with pytest.raises(TraceError, match=rf"trace\.jsonl:3: .*{needle}"):
        load_trace(path)


def test_trace_mixed_timing_is_rejected(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        ['{"prompt": "a", "output_len": 1, "timestamp": 5}', '{"prompt": "b", "output_len": 1}'],
    )
    with pytest.raises(TraceError, match=r":2: arrival time fields differ from line 1"):
        load_trace(path)


def test_empty_trace(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="no requests"):
        load_trace(_write(tmp_path, ["", "  "]))


# --- random text (chat API) -----------------------------------------------------------------


def test_random_text_has_about_the_input_length_in_words() -> None:
    cfg = RandomDatasetConfig(input_len=60, output_len=5, range_ratio=0.0)
    reqs = sample_random_text(cfg, 20, _rng(), per_word=3.0)
    assert all(isinstance(r.prompt, str) and r.prompt_len is None for r in reqs)
    assert all(len(r.prompt.split()) == 20 and r.output_len == 5 for r in reqs)
    assert all(set(r.prompt.split()) <= set(WORDS) for r in reqs)
    assert len({r.prompt for r in reqs}) == 20
    assert sample_random_text(cfg, 3, _rng(1), 1.0) == sample_random_text(cfg, 3, _rng(1), 1.0)


def test_tokens_per_word_uses_the_counter() -> None:
    def by_bytes(texts: Sequence[str]) -> list[int]:
        return [len(t.encode()) for t in texts]

    expected = (sum(len(w) for w in WORDS) + len(WORDS) - 1) / len(WORDS)
    assert tokens_per_word(by_bytes) == pytest.approx(expected)
    assert estimate_tokens(["abcdefgh", "", "a"]) == [2, 0, 1]


# --- ShareGPT ----------------------------------------------------------------------------


def _conv(*turns: tuple[str, str]) -> dict:
    return {"id": "x", "conversations": [{"from": f, "value": v} for f, v in turns]}


def _sharegpt(tmp_path: Path, convs: list[dict]) -> Path:
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(convs))
    return path


def _words(texts: Sequence[str]) -> list[int]:
    """A counter for tests: one token per word."""
    return [len(t.split()) for t in texts]


def test_sharegpt_first_exchange_and_skips(tmp_path: Path) -> None:
    path = _sharegpt(
        tmp_path,
        [
            _conv(("human", "a b c d e"), ("gpt", "1 2 3 4 5 6"), ("human", "later"), ("gpt", "x")),
            _conv(("human", "only one turn")),  # fewer than 2 turns
            _conv(("system", "be brief"), ("human", "p q r s"), ("gpt", "r1 r2 r3 r4")),
            _conv(("gpt", "no human before"), ("gpt", "me neither")),
        ],
    )
    assert read_sharegpt(path) == [("a b c d e", "1 2 3 4 5 6"), ("p q r s", "r1 r2 r3 r4")]
    reqs = sample_sharegpt(path, 10, _rng(), _words)
    assert sorted((r.prompt, r.prompt_len, r.output_len) for r in reqs) == [
        ("a b c d e", 5, 6),
        ("p q r s", 4, 4),
    ]
    fixed = sample_sharegpt(path, 10, _rng(), _words, output_len=2)
    assert [r.output_len for r in fixed] == [2, 2]


def test_sharegpt_vllm_bounds_shuffle_and_count(tmp_path: Path) -> None:
    ok = [_conv(("human", f"w{i} " * 8), ("gpt", "r " * 5)) for i in range(30)]
    bad = [
        _conv(("human", "too short"), ("gpt", "r " * 5)),
        _conv(("human", "x " * 1025), ("gpt", "r " * 5)),  # prompt over 1024
        _conv(("human", "x " * 1000), ("gpt", "r " * 1100)),  # total over 2048
        _conv(("human", "x " * 8), ("gpt", "r r")),  # reply under 4
    ]
    path = _sharegpt(tmp_path, bad + ok)
    reqs = sample_sharegpt(path, 12, _rng(3), _words)
    assert len(reqs) == 12 and all(r.prompt_len == 8 and r.output_len == 5 for r in reqs)
    assert len({r.prompt for r in reqs}) == 12
    assert reqs == sample_sharegpt(path, 12, _rng(3), _words)
    assert reqs != sample_sharegpt(path, 12, _rng(4), _words)
    assert len(sample_sharegpt(path, 100, _rng(), _words)) == 30  # fewer fit than asked
    # a fixed output length replaces the reply's: "r r" and the 1000 + 1100 one fit then
    assert len(sample_sharegpt(path, 100, _rng(), _words, output_len=3)) == 32


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("{not json", "not a ShareGPT JSON"),
        ('{"conversations": []}', "not a ShareGPT JSON"),
        ('[{"conversations": [{"from": "human"}]}]', "not a ShareGPT JSON"),
        ('[{"conversations": [{"from": "human", "value": "hi"}]}]', "no conversation with"),
    ],
)
def test_sharegpt_bad_files(tmp_path: Path, text: str, needle: str) -> None:
    path = tmp_path / "sg.json"
    path.write_text(text)
    with pytest.raises(TraceError, match=needle):
        sample_sharegpt(path, 1, _rng(), _words)


def test_sharegpt_nothing_within_bounds(tmp_path: Path) -> None:
    path = _sharegpt(tmp_path, [_conv(("human", "hi"), ("gpt", "hello there you all"))])
    with pytest.raises(TraceError, match="no conversation within vLLM's bounds"):
        sample_sharegpt(path, 1, _rng(), _words)


# --- custom JSONL ------------------------------------------------------------------------


def test_custom_output_lengths(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        [
            json.dumps({"prompt": "a", "output_tokens": 7, "other": 1}),
            json.dumps({"prompt": "b", "max_tokens": 3}),
            json.dumps({"prompt": "c"}),
            "",
        ],
    )
    reqs = load_custom(path)
    assert [(r.prompt, r.prompt_len, r.output_len) for r in reqs] == [
        ("a", None, 7),
        ("b", None, 3),
        ("c", None, DEFAULT_CUSTOM_OUTPUT_LEN),
    ]
    assert [r.output_len for r in load_custom(path, output_len=2)] == [2, 2, 2]
    assert [r.prompt for r in load_custom(path, num_prompts=2)] == ["a", "b"]


@pytest.mark.parametrize(
    ("bad_line", "needle"),
    [
        ("[1, 2]", "Expected `object`"),
        ('{"text": "a"}', "prompt"),
        ('{"prompt": ""}', "empty"),
        ('{"prompt": "a", "output_tokens": -3}', "must be >= 1"),
    ],
)
def test_custom_bad_line_names_its_number(tmp_path: Path, bad_line: str, needle: str) -> None:
    path = _write(tmp_path, ['{"prompt": "ok"}', bad_line])
    with pytest.raises(TraceError, match=rf"trace\.jsonl:2: .*{needle}"):
        load_custom(path)


def test_multiturn_turns_extend_their_conversation_after_a_shared_system_prompt() -> None:
    from pdserve.bench.dataset import MultiTurnConfig, sample_multiturn

    cfg = MultiTurnConfig(system_len=20, user_len=5, turns=3, output_len=4)
    reqs = sample_multiturn(cfg, 7, np.random.default_rng(3))  # 3 conversations, last cut
    assert len(reqs) == 7
    first, second = reqs[:3], reqs[3:6]
    system = first[0].prompt[:20]
    assert all(r.prompt[:20] == system for r in reqs)
    assert len({tuple(r.prompt) for r in first}) == 3  # different user messages
    for before, after in zip(first, second, strict=True):
        assert after.prompt[: len(before.prompt)] == before.prompt
        assert after.prompt_len == len(before.prompt) + 4 + 5 and after.output_len == 4
    again = sample_multiturn(cfg, 7, np.random.default_rng(3))
    assert [r.prompt for r in again] == [r.prompt for r in reqs]
