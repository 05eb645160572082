"""Engine: greedy output is independent of batching, chunking and preemption; blocks return."""

from __future__ import annotations

import random

import pytest

from pdserve.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.types import EngineRequest, FinishReason, RequestOutput, SamplingParams
from pdserve.model.loader import load_model


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    from pdserve.config import ModelConfig

    return load_model(ModelConfig(cache_dir=tmp_path_factory.mktemp("models")))


def make_engine(loaded, num_blocks=512, budget=2048, chunk=None, max_seqs=64) -> LLMEngine:
    cfg = EngineConfig(
        cache=CacheConfig(block_size=16, num_blocks=num_blocks),
        scheduler=SchedulerConfig(
            max_num_batched_tokens=budget, max_num_seqs=max_seqs, max_prefill_chunk=chunk
        ),
    )
    return LLMEngine(loaded, cfg)


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 250) for _ in range(rng.randrange(1, 300))] for _ in range(n)]


def run(engine: LLMEngine, batch: list[list[int]], **params) -> dict[str, list[RequestOutput]]:
    sp = SamplingParams(max_tokens=params.pop("max_tokens", 24), temperature=0.0, **params)
    for i, ids in enumerate(batch):
        engine.add_request(EngineRequest(request_id=f"r{i}", prompt_token_ids=ids, params=sp))
    outs: dict[str, list[RequestOutput]] = {}
    while engine.has_work():
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
    engine.check_integrity()
    assert engine.pool.num_used == 0
    return outs


def tokens(outs: dict[str, list[RequestOutput]]) -> dict[str, list[int]]:
    return {k: [t for o in v for t in o.new_token_ids] for k, v in outs.items()}


def test_batched_output_equals_alone(loaded) -> None:
    batch = prompts(8)
    together = tokens(run(make_engine(loaded), batch, ignore_eos=True))
    for i, ids in enumerate(batch):
        alone = tokens(run(make_engine(loaded), [ids], ignore_eos=True))["r0"]
        assert together[f"r{i}"] == alone, f"prompt {i} ({len(ids)} tokens) differs"


def test_small_chunks_and_tight_budget_do_not_change_output(loaded) -> None:
    batch = prompts(8, seed=1)
    ref = tokens(run(make_engine(loaded), batch, ignore_eos=True))
    chunked = tokens(run(make_engine(loaded, budget=40, chunk=7), batch, ignore_eos=True))
    assert chunked == ref


def test_preemption_recomputes_to_the_same_output(loaded) -> None:
    batch = prompts(6, seed=2)
    ref = tokens(run(make_engine(loaded), batch, ignore_eos=True, max_tokens=40))
    small = make_engine(loaded, num_blocks=40)
    out = tokens(run(small, batch, ignore_eos=True, max_tokens=40))
    assert small.scheduler.num_preemptions > 0
    assert out == ref


def test_finish_reasons_and_lengths(loaded) -> None:
    engine = make_engine(loaded)
    outs = run(engine, [[5, 6, 7]], max_tokens=5, ignore_eos=True)["r0"]
    assert outs[-1].finished and outs[-1].finish_reason is FinishReason.LENGTH
    assert outs[-1].num_output_tokens == 5 and outs[-1].num_prompt_tokens == 3
    assert not any(o.finished for o in outs[:-1])


def test_impossible_requests_fail_at_once_and_take_no_blocks(loaded) -> None:
    engine = make_engine(loaded, num_blocks=4)
    sp = SamplingParams(max_tokens=100)
    out = engine.add_request(EngineRequest(request_id="big", prompt_token_ids=[1] * 10, params=sp))
    assert out[0].finish_reason is FinishReason.ERROR and "KV cache" in out[0].error
    assert not engine.has_work() and engine.pool.num_used == 0


def test_abort_frees_blocks_mid_generation(loaded) -> None:
    engine = make_engine(loaded)
    sp = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)
    engine.add_request(EngineRequest(request_id="a", prompt_token_ids=[1] * 40, params=sp))
    engine.step()
    assert engine.pool.num_used > 0
    (out,) = engine.abort_request("a")
    assert out.finish_reason is FinishReason.ABORT
    assert engine.pool.num_used == 0 and not engine.has_work()
    engine.check_integrity()


def test_seeded_sampling_is_reproducible(loaded) -> None:
    kw = dict(temperature=0.9, top_p=0.9, top_k=50, seed=1234, max_tokens=16, ignore_eos=True)
    a = make_engine(loaded)
    b = make_engine(loaded)
    batch = prompts(3, seed=3)
    sp = SamplingParams(**kw)
    for eng in (a, b):
        for i, ids in enumerate(batch):
            eng.add_request(EngineRequest(request_id=f"r{i}", prompt_token_ids=ids, params=sp))
    outs = []
    for eng in (a, b):
        got: dict[str, list[int]] = {}
        while eng.has_work():
            for o in eng.step():
                got.setdefault(o.request_id, []).extend(o.new_token_ids)
        outs.append(got)
    assert outs[0] == outs[1]
