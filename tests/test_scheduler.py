"""Scheduler: token budget, chunked prefill, admission and preemption, with exact block ids."""

from __future__ import annotations

from pdserve.config import SchedulerConfig
from pdserve.engine.detokenizer import IncrementalDetokenizer
from pdserve.engine.request import Request, RequestState
from pdserve.engine.scheduler import Scheduler
from pdserve.engine.types import EngineRequest, SamplingParams
from pdserve.kv.block_pool import BlockPool

BS = 4


class NullDecoder:
    def decode(self, ids, skip_special_tokens=True) -> str:
        return ""


def req(rid: str, n: int) -> Request:
    er = EngineRequest(request_id=rid, prompt_token_ids=list(range(n)), params=SamplingParams())
    return Request(er, IncrementalDetokenizer(NullDecoder()))


def make(num_blocks: int, budget: int = 64, max_seqs: int = 8, chunk: int | None = None):
    cfg = SchedulerConfig(
        max_num_batched_tokens=budget, max_num_seqs=max_seqs, max_prefill_chunk=chunk
    )
    pool = BlockPool(num_blocks)
    return Scheduler(cfg, pool, BS), pool


def run_step(s: Scheduler, sampled: int = 7):
    """What the engine does after a step: advance computed tokens, append a token."""
    out = s.schedule()
    for seq in out.seqs:
        seq.request.num_computed_tokens = seq.num_computed + seq.num_new
        if seq.samples:
            seq.request.output_token_ids.append(sampled)
    return out


def test_prefill_then_decode_allocates_exact_blocks() -> None:
    s, pool = make(8)
    a = req("a", 6)
    s.add(a)
    out = run_step(s)
    assert [(x.request.request_id, x.num_computed, x.num_new) for x in out.seqs] == [("a", 0, 6)]
    assert a.block_ids == [0, 1] and a.state is RequestState.RUNNING
    out = run_step(s)  # decode token 7 at position 6: still block 1
    assert [(x.num_computed, x.num_new) for x in out.seqs] == [(6, 1)]
    assert a.block_ids == [0, 1]
    run_step(s)  # position 7
    run_step(s)  # position 8 needs a third block
    assert a.block_ids == [0, 1, 2]
    s.finish(a)
    assert pool.num_free == 8
    pool.check_integrity()


def test_budget_chunks_long_prompt_and_decodes_go_first() -> None:
    s, _ = make(32, budget=8)
    a, b = req("a", 3), req("b", 20)
    s.add(a)
    s.add(b)
    out = run_step(s)
    assert [(x.request.request_id, x.num_new) for x in out.seqs] == [("a", 3), ("b", 5)]
    assert not out.seqs[1].samples
    out = run_step(s)
    assert [(x.request.request_id, x.num_computed, x.num_new) for x in out.seqs] == [
        ("a", 3, 1),
        ("b", 5, 7),
    ]


def test_max_prefill_chunk_limits_each_chunk() -> None:
    s, _ = make(32, budget=64, chunk=4)
    a = req("a", 10)
    s.add(a)
    chunks = [run_step(s).seqs[0].num_new for _ in range(3)]
    assert chunks == [4, 4, 2]
    assert a.output_token_ids == [7]


def test_admission_waits_for_blocks_and_running_cap() -> None:
    s, _ = make(4, max_seqs=1)
    a, b = req("a", 4), req("b", 4)
    s.add(a)
    s.add(b)
    run_step(s)
    assert s.running == [a] and list(s.waiting) == [b]  # cap of one sequence
    s.finish(a)
    run_step(s)
    assert s.running == [b] and b.block_ids == [1]  # FIFO: block 0 went back last


def test_preemption_frees_the_newest_and_recomputes_it() -> None:
    s, pool = make(3, budget=64)
    a, b = req("a", 4), req("b", 4)
    s.add(a)
    s.add(b)
    run_step(s)  # a: block 0, b: block 1 (prompts fill them), 1 block left
    assert (a.block_ids, b.block_ids) == ([0], [1])
    out = run_step(s)  # both need a new block; only one left -> b is preempted
    assert out.preempted == [b]
    assert b.block_ids == [] and b.num_computed_tokens == 0
    assert b.state is RequestState.WAITING and s.waiting[0] is b
    assert [x.request.request_id for x in out.seqs] == ["a"]
    assert a.block_ids == [0, 2]
    s.finish(a)
    out = run_step(s)  # b recomputes prompt + its generated token
    assert [(x.request.request_id, x.num_computed, x.num_new) for x in out.seqs] == [("b", 0, 5)]
    s.finish(b)
    assert pool.num_free == 3


def test_remote_admission_keeps_headroom_for_running_requests() -> None:
    s, _ = make(20)
    admitted: list[str] = []
    s.on_remote_admit = lambda r: admitted.append(r.request_id)
    a = req("a", 4)
    s.add(a)
    run_step(s)  # a runs with one block; 19 free
    big = req("big", 18 * BS)  # needs 18 blocks: only 1 would be left for a to grow into
    big.needs_remote_kv = True
    s.add(big)
    run_step(s)
    assert admitted == [] and list(s.waiting) == [big]
    small = req("small", 8 * BS)
    small.needs_remote_kv = True
    s2, _ = make(20)
    s2.on_remote_admit = lambda r: admitted.append(r.request_id)
    s2.add(small)
    s2.schedule()  # an idle instance admits even a large prompt
    assert admitted == ["small"] and small.block_ids == list(range(8))


def test_request_token_ids_spans_prompt_and_outputs() -> None:
    r = req("a", 5)
    r.output_token_ids += [50, 51, 52]
    everything = [0, 1, 2, 3, 4, 50, 51, 52]
    for start in range(8):
        for end in range(start, 9):
            assert r.token_ids(start, end) == everything[start:end]
