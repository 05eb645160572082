"""The random dataset and the JSONL trace reader."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from pdserve.bench.dataset import RandomDatasetConfig, TraceError, load_trace, sample_random


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
