"""Engine step trace: one parseable DEBUG record per step, with the batch it ran."""

from __future__ import annotations

import logging
import time

import pytest

from pdserve.config import CacheConfig, EngineConfig, ModelConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.scheduler import SchedulerOutput
from pdserve.engine.steptrace import STEP_LOGGER, StepTracer, parse_step_line
from pdserve.engine.types import EngineRequest, SamplingParams
from pdserve.model.loader import load_model

SERVE_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"  # pdserve serve's


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    return load_model(ModelConfig(cache_dir=tmp_path_factory.mktemp("models")))


def run_two(loaded, max_tokens: int) -> LLMEngine:
    engine = LLMEngine(loaded, EngineConfig(cache=CacheConfig(block_size=16, num_blocks=64)))
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    for i, n in enumerate((5, 9)):
        ids = list(range(3, 3 + n))
        engine.add_request(EngineRequest(request_id=f"r{i}", prompt_token_ids=ids, params=sp))
    while engine.has_work():
        engine.step()
    return engine


def test_each_step_logs_its_batch(loaded, caplog) -> None:
    caplog.set_level(logging.DEBUG, logger=STEP_LOGGER)
    run_two(loaded, max_tokens=4)
    fmt = logging.Formatter(SERVE_FORMAT)
    records = [parse_step_line(fmt.format(r)) for r in caplog.records if r.name == STEP_LOGGER]
    assert all(r is not None for r in records)
    first, *rest = records
    # one step prefills both prompts (the default budget fits them), and samples token 1
    assert (first.prefills, first.prefill_tokens, first.decodes) == (2, 14, 0)
    # tokens 2..4 of both requests: one decode step each
    assert [r.decodes for r in rest] == [2, 2, 2]
    assert all(r.prefills == 0 and r.kv_landed == 0 for r in rest)
    assert all(r.step_s >= 0.0 and r.gap_s >= 0.0 for r in records)
    assert [r.t for r in records] == sorted(r.t for r in records)


def test_off_by_default(loaded, caplog) -> None:
    caplog.set_level(logging.INFO, logger=STEP_LOGGER)
    engine = run_two(loaded, max_tokens=2)
    assert not engine.trace.enabled
    assert not [r for r in caplog.records if r.name == STEP_LOGGER]


def test_landings_count_into_the_next_step_only() -> None:
    logger = logging.getLogger(f"{STEP_LOGGER}.unit")
    logger.setLevel(logging.DEBUG)
    tracer = StepTracer(logger)
    tracer.landed(1)
    tracer.landed(1)
    first = tracer.record(SchedulerOutput(), time.monotonic())
    second = tracer.record(SchedulerOutput(), time.monotonic())
    assert (first.kv_landed, second.kv_landed) == (2, 0)
    assert first.gap_s == 0.0 and second.gap_s >= 0.0


def test_other_lines_are_not_records() -> None:
    assert parse_step_line("2026-11-30 INFO pdserve.serve: step {}") is None
    assert parse_step_line("INFO:     127.0.0.1 - GET /health") is None
