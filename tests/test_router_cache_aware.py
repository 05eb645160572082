"""Cache-aware routing: the router's prefix index and the `cache_aware` policy."""

from __future__ import annotations

import httpx
from test_router_fake_instance import FakeInstance, running_router
from test_router_policy import Stub

from pdserve.router.load_model import Demand
from pdserve.router.policy import CacheAware, make_policy
from pdserve.router.prefix_index import CHUNK_BYTES, CHUNK_TOKENS, PrefixIndex, prefix_chain

SYSTEM = {"role": "system", "content": "You are a helpful assistant. " * 20}


def chat(*turns: str) -> dict:
    msgs = [SYSTEM] + [
        {"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(turns)
    ]
    return {"messages": msgs}


def demand(body: dict, prompt_tokens: int = 200) -> Demand:
    return Demand(prompt_tokens=prompt_tokens, decode_tokens=16, prefix=prefix_chain(body))


def test_chain_of_a_growing_conversation_extends_the_earlier_one() -> None:
    one, two = prefix_chain(chat("hi " * 40)), prefix_chain(chat("hi " * 40, "ok " * 40, "more"))
    assert len(two) > len(one) > 0
    assert two[: len(one) - 1] == one[: len(one) - 1]  # the last chunk may hold "]"
    other = prefix_chain({"messages": [{"role": "system", "content": "Other. " * 60}]})
    assert other[0] != one[0]


def test_token_prompts_chunk_by_tokens_and_text_by_bytes() -> None:
    ids = list(range(5 * CHUNK_TOKENS + 3))
    assert len(prefix_chain({"prompt": ids})) == 5
    assert len(prefix_chain({"prompt": [ids]})) == 5
    assert len(prefix_chain({"prompt": "x" * (3 * CHUNK_BYTES + 1)})) == 3
    assert prefix_chain({"prompt": ids})[:2] == prefix_chain({"prompt": ids[:40]})


def test_index_matches_only_a_prefix_and_forgets_lru() -> None:
    index = PrefixIndex(capacity=4)
    chain = prefix_chain({"prompt": list(range(3 * CHUNK_TOKENS))})
    index.record("a", chain)
    assert index.match("a", chain) == 3 and index.match("b", chain) == 0
    changed_first = prefix_chain({"prompt": [7, *range(1, 3 * CHUNK_TOKENS)]})
    assert index.match("a", changed_first) == 0  # same later tokens after another start
    index.record("a", prefix_chain({"prompt": list(range(100, 100 + 2 * CHUNK_TOKENS))}))
    assert index.match("a", chain) == 0  # chunk 0 was evicted first


def test_follow_up_turns_go_where_the_conversation_is() -> None:
    policy = make_policy("cache_aware", "prefill")
    a, b = Stub("a"), Stub("b")
    first = policy.pick([a, b], demand(chat("question one " * 10)))
    other = policy.pick([a, b], demand({"prompt": "unrelated " * 80}))
    assert other is not first  # no hit anywhere: equal loads rotate
    for turn in range(2, 6):
        body = chat(*(["question one " * 10] + ["answer and follow-up " * 5] * turn))
        assert policy.pick([a, b], demand(body)) is first


def test_load_outweighs_a_small_hit_but_not_a_large_one() -> None:
    policy = CacheAware("prefill")
    body = chat("q " * 50)
    d = demand(body, prompt_tokens=200)
    hit = min(200, policy.index.match("x", d.prefix))  # nothing recorded yet
    assert hit == 0
    warm = policy.pick([Stub("warm"), Stub("cold", outstanding_tokens=10_000)], d)
    assert warm.url == "warm"
    saved = policy.index.match("warm", d.prefix) * CHUNK_TOKENS
    assert 0 < saved <= 200 + CHUNK_TOKENS
    busy_warm, idle = Stub("warm", outstanding_tokens=saved - 1), Stub("cold")
    assert policy.pick([busy_warm, idle], d).url == "warm"  # its load is less than the hit
    busier = Stub("warm", outstanding_tokens=saved + 50)
    assert policy.pick([busier, Stub("cold")], d).url == "cold"


def test_decode_weighs_a_miss_less_unless_it_prefills_locally() -> None:
    policy = CacheAware("decode")
    d = demand(chat("q " * 50), prompt_tokens=200)
    policy.pick([Stub("warm")], d)
    saved = min(200, policy.index.match("warm", d.prefix) * CHUNK_TOKENS)
    # D receives the missed tokens: a load of a third of the hit already sends it elsewhere
    busy = Stub("warm", outstanding_tokens=saved // 3)
    assert policy.pick([busy, Stub("cold")], d).url == "cold"
    local = Demand(200, 16, local_prefill=True, prefix=d.prefix)
    assert policy.pick([busy, Stub("cold2")], local).url == "warm"


def test_router_sends_each_conversation_back_to_its_instances() -> None:
    """Through a running router: two conversations, three turns each, sequential; every
    turn of one conversation lands on the same P and the same D."""
    convs = [("alpha topic " * 30), ("beta subject " * 30)]
    with (
        FakeInstance("prefill") as p1,
        FakeInstance("prefill") as p2,
        FakeInstance("decode") as d1,
        FakeInstance("decode") as d2,
        running_router([p1, p2], [d1, d2], policy="cache_aware") as r,
    ):
        for turn in range(3):
            for c in convs if turn % 2 == 0 else convs[::-1]:  # round robin would mix them
                body = {"model": "fake-model", "prompt": c + " next" * turn, "max_tokens": 4}
                assert httpx.post(f"{r}/v1/completions", json=body).status_code == 200
    for pair in ((p1, p2), (d1, d2)):
        counts = sorted(len(f.received) for f in pair)
        assert counts == [3, 3], counts  # one conversation each, all its turns
        for f in pair:
            firsts = {str(rec.body.get("prompt", ""))[:20] for rec in f.received}
            assert len(firsts) == 1, firsts
