"""Prefix caching across P/D: P computes only what it lacks, D receives only the blocks it
does not hold (push registers, pull reads, only those), output equals the monolithic one,
and a failed partial transfer leaks nothing."""

from __future__ import annotations

import random

import pytest
from pd_harness import Pair, greedy_tokens, make_engine

from pdserve.engine.scheduler import blocks_needed
from pdserve.engine.types import SamplingParams
from pdserve.faults import Faults
from pdserve.model.loader import load_model

pytestmark = pytest.mark.timeout(120)

BLOCK = 16  # pd_harness's block size
SP = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    from pdserve.config import ModelConfig

    return load_model(ModelConfig(cache_dir=tmp_path_factory.mktemp("models")))


def conversation(seed: int) -> list[list[int]]:
    """Three turns: a shared system prompt, then each turn extends the previous one."""
    rng = random.Random(seed)
    system = [rng.randrange(3, 250) for _ in range(70)]
    turns, ids = [], system
    for _ in range(3):
        ids = ids + [rng.randrange(3, 250) for _ in range(rng.randrange(20, 40))]
        turns.append(ids)
    return turns


def moved(pair: Pair) -> int:
    return pair.p.connector.stats.bytes_moved + pair.d.connector.stats.bytes_moved


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_shared_prefix_moves_only_missing_blocks_and_matches_monolithic(loaded, mode) -> None:
    pair = Pair(make_engine(loaded, "prefill", mode), make_engine(loaded, "decode", mode), mode)
    mono = make_engine(loaded, "both", mode)
    try:
        turns = conversation(1)
        per_block = None
        for i, ids in enumerate(turns):
            hits_before = pair.d.stats().prefix_cache_hits
            before = moved(pair)
            out = pair.generate(f"r{i}", ids, SP)
            assert out.error is None, out.error
            pair.settle()  # P's writes are counted when they complete
            assert pair.tokens(f"r{i}") == greedy_tokens(mono, ids, SP), f"turn {i}"
            held = (pair.d.stats().prefix_cache_hits - hits_before) // BLOCK
            sent = blocks_needed(len(ids), BLOCK) - held
            if i == 0:
                assert held == 0
                per_block = (moved(pair) - before) // sent
            else:
                # D held the earlier turns' prompt blocks: only the rest crossed
                assert held >= blocks_needed(len(turns[i - 1]), BLOCK) - 1 > 0
                assert moved(pair) - before == sent * per_block
        assert pair.p.stats().prefix_cache_hits > 0  # P computed only the new turns too
        pair.settle()
    finally:
        pair.close()
        mono.close()


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_failed_partial_transfer_leaks_nothing(loaded, mode) -> None:
    """The second transfer (a partial one: D holds the first turn) fails in the transport;
    the request errors, every block comes back (cached ones stay findable), and the next
    turn works and matches the monolithic output."""
    side = "prefill" if mode == "push" else "decode"  # who posts the transfer
    faults = Faults(fail_transfer_every=2)
    p = make_engine(loaded, "prefill", mode, **({"faults": faults} if side == "prefill" else {}))
    d = make_engine(loaded, "decode", mode, **({"faults": faults} if side == "decode" else {}))
    pair = Pair(p, d, mode)
    mono = make_engine(loaded, "both", mode)
    try:
        turns = conversation(2)
        assert pair.generate("r0", turns[0], SP).error is None
        hits = pair.d.stats().prefix_cache_hits
        failed = pair.generate("r1", turns[1], SP)
        assert failed.error is not None
        assert pair.d.stats().prefix_cache_hits > hits  # it was a partial transfer
        pair.settle()  # integrity on both sides, nothing held
        assert pair.d.pool.num_cached > 0
        ok = pair.generate("r2", turns[2], SP)
        assert ok.error is None and pair.tokens("r2") == greedy_tokens(mono, turns[2], SP)
        pair.settle()
    finally:
        pair.close()
        mono.close()


def test_a_registration_must_name_exactly_the_blocks_past_its_skip() -> None:
    """P checks D's `skip_blocks` before writing: a skip outside the prompt, or block ids
    that do not cover the rest exactly, is a size mismatch (nothing is written)."""
    from pdserve.transfer import messages as m
    from pdserve.transfer.push import _fits

    def reg(block_ids: list[int], skip: int) -> m.PushRegistration:
        return m.PushRegistration(
            transfer_id="t", engine_id="d", incarnation="i", reply_to=("127.0.0.1", 1),
            block_ids=block_ids, num_tokens=40, skip_blocks=skip,
        )  # fmt: skip

    p_blocks = [5, 6, 7]  # 40 tokens in blocks of 16
    assert _fits(reg([1, 2, 3], 0), p_blocks, 40)
    assert _fits(reg([3], 2), p_blocks, 40)
    assert not _fits(reg([], 3), p_blocks, 40)  # the last block is always sent
    assert not _fits(reg([1, 2, 3, 4], -1), p_blocks, 40)
    assert not _fits(reg([2, 3], 2), p_blocks, 40)
    assert not _fits(reg([3], 2), p_blocks, 41)
