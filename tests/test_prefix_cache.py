"""Prefix caching: the pool's cached states keep their integrity, a block in use is never
evicted or written, and greedy output is the same with and without caching."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.scheduler import ScheduledSeq
from pdserve.engine.types import EngineRequest, SamplingParams
from pdserve.kv.block_pool import BlockIntegrityError, BlockPool
from pdserve.kv.prefix_hash import chain_hash, extend_hashes
from pdserve.model.loader import load_model

# -- the pool ------------------------------------------------------------------------------


def test_freed_cached_block_is_found_until_evicted_lru() -> None:
    pool = BlockPool(3)
    a, b = pool.allocate(2, "r1")
    assert pool.cache(a, b"ha", "r1") and pool.cache(b, b"hb", "r1")
    pool.free([b, a], "r1")  # tail first: b is the older free block
    assert pool.lookup(b"ha") == a and pool.lookup(b"hb") == b
    assert pool.allocate(1, "r2") == [2]  # the never-cached block goes first
    assert pool.allocate(1, "r2") == [b]  # then the least recently freed, evicted
    assert pool.lookup(b"hb") is None and pool.lookup(b"ha") == a
    assert pool.num_evicted == 1
    pool.check_integrity()


def test_shared_block_is_not_evictable_until_every_holder_lets_go() -> None:
    pool = BlockPool(2)
    (a,) = pool.allocate(1, "r1")
    pool.cache(a, b"h", "r1")
    pool.share([a], "r2")
    pool.free([a], "r1")
    assert not pool.can_allocate(2) and pool.owners_of(a) == ("r2",)
    pool.transfer([a], "r2", "hold:r2")  # a P hold keeps it too
    pool.free([a], "hold:r2")
    assert pool.lookup(b"h") == a and pool.is_free(a)
    pool.check_integrity()


def test_only_cached_blocks_are_shared_and_a_hash_names_one_block() -> None:
    pool = BlockPool(3)
    a, b = pool.allocate(2, "r1")
    with pytest.raises(BlockIntegrityError):
        pool.share([a], "r2")
    assert pool.cache(a, b"h", "r1")
    assert not pool.cache(b, b"h", "r1")  # same KV computed twice: the first one stays found
    assert not pool.is_cached(b) and pool.writable_by(b, "r1") and not pool.writable_by(a, "r1")
    pool.share([a], "r2")
    with pytest.raises(BlockIntegrityError):
        pool.share([a], "r2")  # one hold per holder
    pool.check_integrity()


def test_chained_hash_names_the_whole_prefix() -> None:
    t1, t2 = list(range(8)), [*range(4), 9, 9, 9, 9]
    h1: list[bytes] = []
    h2: list[bytes] = []
    extend_hashes(h1, lambda s, e: t1[s:e], 8, 4)
    extend_hashes(h2, lambda s, e: t2[s:e], 8, 4)
    assert h1[0] == h2[0] and h1[1] != h2[1]
    # the same four tokens after a different first block are another block
    assert chain_hash(h1[0], [4, 5, 6, 7]) == h1[1] != chain_hash(b"other", [4, 5, 6, 7])


pool_ops = st.lists(
    st.tuples(
        st.sampled_from(["alloc", "free", "cache", "share", "move"]),
        st.integers(0, 4),  # holder
        st.integers(0, 7),  # count / which hash
    ),
    max_size=100,
)


@settings(max_examples=200)
@given(num_blocks=st.integers(1, 16), operations=pool_ops)
def test_random_cached_sequences_keep_integrity(num_blocks: int, operations: list) -> None:
    """Random allocate/free/cache/share/transfer: integrity holds after each, holds add up,
    and a block somebody holds keeps its hash (is never evicted)."""
    pool = BlockPool(num_blocks)
    held: dict[str, list[int]] = {}
    for op, who, n in operations:
        owner = f"o{who}"
        mine = held.setdefault(owner, [])
        if op == "alloc" and pool.can_allocate(n):
            mine.extend(pool.allocate(n, owner))
        elif op == "free" and mine:
            k = n % len(mine) + 1
            pool.free(mine[:k], owner)
            del mine[:k]
        elif op == "cache" and mine:
            b = mine[n % len(mine)]
            if pool.writable_by(b, owner):
                pool.cache(b, bytes([n]), owner)
        elif op == "share":
            b = pool.lookup(bytes([n]))
            if b is not None and b not in mine:
                pool.share([b], owner)
                mine.append(b)
        elif op == "move" and mine:
            new = f"hold:{owner}:{n}"
            if not held.get(new):
                pool.transfer(mine, owner, new)
                held[new] = mine
                held[owner] = []
        pool.check_integrity()
        assert pool.num_refs == sum(len(b) for b in held.values())
        for blocks in held.values():
            assert all(not pool.is_free(b) for b in blocks)
        cached_held = {b for bs in held.values() for b in bs if pool.is_cached(b)}
        assert all(pool.lookup(pool._hash_of[b]) == b for b in cached_held)
    for owner, blocks in held.items():
        pool.free(blocks, owner)
    assert pool.num_free == num_blocks
    pool.check_integrity()


# -- the engine ------------------------------------------------------------------------------

BLOCK = 4


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    return load_model(ModelConfig(cache_dir=tmp_path_factory.mktemp("models")))


def make_engine(loaded, caching: bool, num_blocks: int, budget: int = 64) -> LLMEngine:
    cfg = EngineConfig(
        cache=CacheConfig(block_size=BLOCK, num_blocks=num_blocks, enable_prefix_caching=caching),
        scheduler=SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=4),
    )
    engine = LLMEngine(loaded, cfg)
    _watch_writes(engine)
    return engine


def _watch_writes(engine: LLMEngine) -> None:
    """Fail the step if it would write a block that is cached or held by anyone else."""
    execute = engine.runner.execute

    def checked(seqs: list[ScheduledSeq], hook=None):
        for s in seqs:
            req = s.request
            first, last = s.num_computed // BLOCK, (s.num_computed + s.num_new - 1) // BLOCK
            for b in req.block_ids[first : last + 1]:
                assert engine.pool.writable_by(b, req.request_id), (req, b)
        return execute(seqs, hook)

    engine.runner.execute = checked  # type: ignore[method-assign]


def drive(engine: LLMEngine, arrivals: list[tuple[int, list[int]]], max_tokens: int) -> dict:
    """Add each prompt at its step number; step until done, checking the pool every step."""
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    out: dict[str, list[int]] = {}
    pending = sorted(enumerate(arrivals), key=lambda x: x[1][0])
    step = 0
    while pending or engine.has_work():
        while pending and pending[0][1][0] <= step:
            i, (_, ids) = pending.pop(0)
            er = EngineRequest(request_id=f"r{i}", prompt_token_ids=ids, params=sp)
            assert engine.add_request(er) == []
        for o in engine.step():
            assert o.error is None, o.error
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
        engine.check_integrity()
        step += 1
    assert engine.pool.num_used == 0
    return out


def test_repeated_prompt_hits_and_computes_only_the_rest(loaded) -> None:
    prompt = list(range(10, 31))  # 21 tokens: 5 full blocks, the hit stops at 20
    engine = make_engine(loaded, caching=True, num_blocks=64)
    first = drive(engine, [(0, prompt)], max_tokens=4)
    assert engine.stats().prefix_cache_hits == 0
    computed: list[int] = []
    execute = engine.runner.execute

    def spy(seqs, hook=None):
        computed.extend(s.num_new for s in seqs if s.num_computed < len(prompt))
        return execute(seqs, hook)

    engine.runner.execute = spy  # type: ignore[method-assign]
    again = drive(engine, [(0, prompt)], max_tokens=4)
    stats = engine.stats()
    assert stats.prefix_cache_queries == 2 * len(prompt) and stats.prefix_cache_hits == 20
    assert computed == [1] and again == first


def test_caching_off_never_hits(loaded) -> None:
    engine = make_engine(loaded, caching=False, num_blocks=64)
    drive(engine, [(0, list(range(3, 40))), (5, list(range(3, 40)))], max_tokens=2)
    s = engine.stats()
    assert (s.prefix_cache_queries, s.prefix_cache_hits, engine.pool.num_cached) == (0, 0, 0)


def _trace(rng: random.Random, n: int) -> list[tuple[int, list[int]]]:
    """Prompts from a few shared prefixes (some of them earlier prompts, extended), random
    arrival steps: hits, misses, sharing among running requests and, in a small pool,
    eviction and preemption."""
    roots = [[rng.randrange(3, 250) for _ in range(rng.randrange(1, 24))] for _ in range(3)]
    out: list[tuple[int, list[int]]] = []
    for _ in range(n):
        base = rng.choice(roots + [p for _, p in out]) if out else rng.choice(roots)
        cut = rng.randrange(0, len(base) + 1)
        tail = [rng.randrange(3, 250) for _ in range(rng.randrange(0, 12))]
        ids = (base[:cut] + tail) or [rng.randrange(3, 250)]
        out.append((rng.randrange(0, 12), ids[:48]))
    return out


@settings(max_examples=12)
@given(seed=st.integers(0, 2**32 - 1), num_blocks=st.sampled_from([14, 20, 256]))
def test_outputs_equal_with_and_without_caching(loaded, seed: int, num_blocks: int) -> None:
    """Random request sequences: same greedy tokens with caching on and off; integrity every
    step; no step writes a cached or shared block (`_watch_writes`)."""
    rng = random.Random(seed)
    trace = _trace(rng, rng.randrange(2, 9))
    on = make_engine(loaded, caching=True, num_blocks=num_blocks, budget=24)
    off = make_engine(loaded, caching=False, num_blocks=num_blocks, budget=24)
    assert drive(on, trace, max_tokens=6) == drive(off, trace, max_tokens=6)
    assert on.stats().prefix_cache_hits <= on.stats().prefix_cache_queries
