"""pdserve.vllm's worker side without vLLM: two workers (pdserve's transfer cores through
the vLLM adapter) over real tcp transports and fake per-layer caches shaped like vLLM's
CPU cache ([num_blocks, kv_heads, block_size, 2 * head_dim]).

The tests drive each worker as vLLM's worker thread does: the scheduler's `StepSpecs` at
the start of a step, `save_layer` per layer, `results(finished ids)` at its end; and they
read what vLLM would get back (finished_sending / finished_recving / failed_recving), each
id at most once.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from pdserve.ports import free_port
from pdserve.vllm.config import VllmConnectorConfig
from pdserve.vllm.engine_side import Results
from pdserve.vllm.specs import (
    LayerSpec,
    PrefillSpec,
    RecvSpec,
    ReleaseSpec,
    SendSpec,
    StepSpecs,
)
from pdserve.vllm.worker import WorkerSide

# Slow (two vLLM-side workers over real tcp transports, waiting out grace periods): `make test`
# runs it, the unit tier (`make test-fast`) does not.
pytestmark = pytest.mark.slow


NUM_BLOCKS, LAYERS, BLOCK_SIZE = 16, 2, 4


def caches(random: bool) -> dict[str, torch.Tensor]:
    out = {}
    for i in range(LAYERS):
        t = torch.zeros(NUM_BLOCKS, 2, BLOCK_SIZE, 16)
        if random:
            t.copy_(torch.randn_like(t))
        out[f"model.layers.{i}.attn"] = t
    return out


class Worker:
    """One vLLM worker: its caches, its WorkerSide, and what vLLM got back so far."""

    def __init__(self, name: str, kv: dict[str, torch.Tensor], **cfg: object) -> None:
        # 0: the side channel binds a free port itself (the card names it). A port picked
        # beforehand can be taken by another process's connection before the bind.
        conf = VllmConnectorConfig.from_extra({"side_port": 0, **cfg})
        self.kv = kv
        self.side = WorkerSide(conf, name, "x", "both")
        self.card = self.side.register(kv, BLOCK_SIZE)
        self.got = Results()

    def address(self, mode: str) -> tuple[str, int]:
        return ("127.0.0.1", self.card.port(mode))

    def step(self, finished: set[str] | None = None, **specs: list) -> None:
        self.side.step(StepSpecs(**specs))
        self.collect(finished or set())

    def collect(self, finished: set[str] | None = None) -> None:
        r = self.side.results(finished or set())
        for name in ("finished_sending", "finished_recving", "failed_recving"):
            mine, new = getattr(self.got, name), getattr(r, name)
            assert not (mine & new), f"{name}: {mine & new} reported twice"
            mine |= new

    def wait(self, want: str, rid: str, timeout_s: float = 20.0) -> Results:
        deadline = time.monotonic() + timeout_s
        while rid not in getattr(self.got, want):
            assert time.monotonic() < deadline, f"{rid} not in {want}: {self.got}"
            self.collect()
            time.sleep(0.02)
        return self.got

    def close(self) -> None:
        self.side.close()


@pytest.fixture
def pair() -> Iterator[tuple[Worker, Worker]]:
    conf = {"heartbeat_s": 0.2, "heartbeat_misses": 5}
    p, d = Worker("P", caches(True), **conf), Worker("D", caches(False), **conf)
    yield p, d
    p.close()
    d.close()


def recv(p: Worker, mode: str, dst: list[int], src: list[int], first: int = 0, **kw) -> RecvSpec:
    fields = dict(
        request_id="d-req",
        mode=mode,
        remote_engine_id="P",
        remote_incarnation=p.card.incarnation,
        remote_request_id="p-req",
        remote_address=p.address(mode),
        block_ids=dst,
        remote_block_ids=src if mode == "pull" else [],
        first_block=first,
        num_tokens=len(dst) * BLOCK_SIZE,
        remote_num_tokens=len(src) * BLOCK_SIZE if mode == "pull" else None,
    )
    return RecvSpec(**(fields | kw))


def send(mode: str, src: list[int], rid: str = "p-req", tid: str = "") -> SendSpec:
    return SendSpec(
        request_id=rid, block_ids=src, num_tokens=len(src) * BLOCK_SIZE, transfer_id=tid, mode=mode
    )


def same_blocks(p: Worker, d: Worker, src: list[int], dst: list[int]) -> bool:
    return all(
        torch.equal(d.kv[n][t], p.kv[n][s]) for n in p.kv for s, t in zip(src, dst, strict=True)
    )


@pytest.mark.parametrize("mode", ["push", "pull"])
@pytest.mark.parametrize("p_first", [True, False])
def test_blocks_arrive_and_both_sides_give_them_back(pair, mode: str, p_first: bool) -> None:
    p, d = pair
    src, dst = [3, 4, 9, 10], [0, 1, 7, 12]
    p.step(admitted=[PrefillSpec(request_id="p-req", transfer_id="p-req", mode=mode)])
    if p_first:
        p.step(sends=[send(mode, src)])
    d.step(recvs=[recv(p, mode, dst, src, first=1)])  # block 0: D's own prefix-cache hit
    if not p_first:
        # Push: the registration waits on P for its prompt. Pull: D's claim overtook P's
        # next step (vLLM hands the worker a finished prompt one step after its params
        # left): it waits for the hold while the prompt is alive.
        time.sleep(0.3)
        p.step(sends=[send(mode, src)])
    assert d.wait("finished_recving", "d-req").failed_recving == set()
    p.wait("finished_sending", "p-req")
    assert same_blocks(p, d, src[1:], dst[1:])
    assert all(not d.kv[n][dst[0]].any() for n in d.kv)  # D's own block: untouched


def test_legs_at_once_pair_by_transfer_id_without_p_incarnation(pair) -> None:
    p, d = pair
    src, dst = [3, 4], [5, 6]
    spec = recv(p, "push", dst, src, remote_incarnation="", remote_request_id="t1")
    d.step(recvs=[spec])
    p.step(admitted=[PrefillSpec(request_id="p-req", transfer_id="t1", mode="push")])
    time.sleep(0.2)
    p.step(sends=[send("push", src, tid="t1")])
    assert d.wait("finished_recving", "d-req").failed_recving == set()
    p.wait("finished_sending", "p-req")
    assert same_blocks(p, d, src, dst)


def test_layerwise_push_writes_each_layer_as_vllm_saves_it(pair) -> None:
    p, d = pair
    src, dst = [3, 4], [5, 6]
    core = p.side._cores["push"]
    d.step(recvs=[recv(p, "push", dst, src, remote_incarnation="", remote_request_id="t1")])
    deadline = time.monotonic() + 10
    while "t1" not in core._registered:  # D's registration reached P before P's step
        assert time.monotonic() < deadline
        time.sleep(0.01)
    layer = LayerSpec(request_id="p-req", transfer_id="t1", block_ids=src, num_tokens=8)
    specs = StepSpecs(layerwise=[layer])
    # vLLM 0.32 with only asynchronous loads: the forward pass saves each layer first,
    # then start_load_kv hands the worker the same step's specs.
    for name in sorted(p.kv):
        p.side.save_layer(name, specs)
    p.side.step(specs)
    p.side.end_step()
    p.step(sends=[send("push", src, tid="t1")])  # the next step: the request finished
    assert d.wait("finished_recving", "d-req").failed_recving == set()
    p.wait("finished_sending", "p-req")
    assert same_blocks(p, d, src, dst)
    assert core.writer_stats.layerwise == 1  # one stream, not one whole-request write


def _stream_all_layers(p: Worker, d: Worker, src: list[int], dst: list[int]) -> None:
    """D registers; then P runs the step that completes the prompt, saving every layer."""
    core = p.side._cores["push"]
    d.step(recvs=[recv(p, "push", dst, src, remote_incarnation="", remote_request_id="t1")])
    deadline = time.monotonic() + 10
    while "t1" not in core._registered:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    p.step(admitted=[PrefillSpec(request_id="p-req", transfer_id="t1", mode="push")])
    specs = StepSpecs(
        layerwise=[LayerSpec(request_id="p-req", transfer_id="t1", block_ids=src, num_tokens=8)]
    )
    for name in sorted(p.kv):
        p.side.save_layer(name, specs)
    p.side.step(specs)
    p.side.end_step()


def test_layerwise_push_tells_d_after_the_last_layer_not_after_the_send(pair) -> None:
    """vLLM's D computes the prompt's last token again, so P tells it the KV is complete as
    soon as the last layer's write is done: D's request is ready before P's worker gets the
    request's SendSpec (a step or two later, under load after the next prompt's forward
    pass). The SendSpec then only gives the blocks back."""
    p, d = pair
    src, dst = [3, 4], [5, 6]
    core = p.side._cores["push"]
    _stream_all_layers(p, d, src, dst)
    assert d.wait("finished_recving", "d-req", timeout_s=10).failed_recving == set()
    assert same_blocks(p, d, src, dst)
    p.collect()
    assert "p-req" not in p.got.finished_sending  # still the request's: no SendSpec yet
    p.step(sends=[send("push", src, tid="t1")])
    p.wait("finished_sending", "p-req", timeout_s=5)
    assert not core.holds
    assert core.writer_stats.layerwise == 1 and core.stats.failures == 0


def test_prefill_aborted_after_d_was_told_gives_blocks_back_at_once(pair) -> None:
    """The stream ended with PushDone after the last layer, then vLLM aborted P's request
    (it lends the blocks: layer writes might have read them): nothing reads them any more,
    so they go back at once, and D keeps the KV it got."""
    p, d = pair
    src, dst = [3, 4], [5, 6]
    core = p.side._cores["push"]
    _stream_all_layers(p, d, src, dst)
    assert d.wait("finished_recving", "d-req", timeout_s=10).failed_recving == set()
    aborted = PrefillSpec(request_id="p-req", transfer_id="t1", mode="push", block_ids=src)
    p.step(finished={"p-req"}, aborted=[aborted])
    p.wait("finished_sending", "p-req", timeout_s=5)
    assert not core.holds
    assert same_blocks(p, d, src, dst)


def _stall_writes(core) -> threading.Event:
    """Keep every write `core` posts pending until the returned event is set (the writer
    polls it as pending; the completion watcher waits for the event before the transport)."""
    gate = threading.Event()
    kvt = core.transport
    poll, wait = kvt.poll, kvt.transport.wait

    def gated_poll(handle):
        return poll(handle) if gate.is_set() else (False, None)

    def gated_wait(handle, timeout_s=None):
        gate.wait()
        return wait(handle, timeout_s)

    kvt.poll = gated_poll
    kvt.transport.wait = gated_wait
    return gate


def test_aborted_layerwise_prefill_keeps_its_blocks_until_its_writes_end(pair) -> None:
    """vLLM aborted P's request after its layers were posted: the blocks those writes read
    go back to vLLM (finished_sending) only once no write is pending, and D fails."""
    p, d = pair
    core = p.side._cores["push"]
    d.step(recvs=[recv(p, "push", [5, 6], [3, 4], remote_incarnation="", remote_request_id="t1")])
    deadline = time.monotonic() + 10
    while "t1" not in core._registered:  # D's registration is here: layers are posted
        assert time.monotonic() < deadline
        time.sleep(0.01)
    gate = _stall_writes(core)
    p.step(admitted=[PrefillSpec(request_id="p-req", transfer_id="t1", mode="push")])
    layer = LayerSpec(request_id="p-req", transfer_id="t1", block_ids=[3, 4], num_tokens=8)
    specs = StepSpecs(layerwise=[layer])
    for name in sorted(p.kv):
        p.side.save_layer(name, specs)
    p.side.step(specs)
    p.side.end_step()
    aborted = PrefillSpec(request_id="p-req", transfer_id="t1", mode="push", block_ids=[3, 4])
    p.step(finished={"p-req"}, aborted=[aborted])  # vLLM delayed freeing them
    time.sleep(0.5)
    p.collect()
    assert "p-req" not in p.got.finished_sending  # the layer writes still read them
    assert "t1" in core.holds
    gate.set()
    p.wait("finished_sending", "p-req", timeout_s=5)
    assert not core.holds
    assert d.wait("finished_recving", "d-req", timeout_s=5).failed_recving == {"d-req"}


def test_aborted_layerwise_prefill_with_nothing_posted_gives_blocks_back_at_once(pair) -> None:
    p, _ = pair  # no registration came: the layers waited on P, none was written
    p.step(admitted=[PrefillSpec(request_id="p-req", transfer_id="t1", mode="push")])
    layer = LayerSpec(request_id="p-req", transfer_id="t1", block_ids=[3, 4], num_tokens=8)
    specs = StepSpecs(layerwise=[layer])
    for name in sorted(p.kv):
        p.side.save_layer(name, specs)
    p.side.step(specs)
    p.side.end_step()
    aborted = PrefillSpec(request_id="p-req", transfer_id="t1", mode="push", block_ids=[3, 4])
    p.step(finished={"p-req"}, aborted=[aborted])
    p.wait("finished_sending", "p-req", timeout_s=2)
    assert not p.side._cores["push"].holds


def test_release_frees_prefill_blocks_d_will_not_load(pair) -> None:
    p, d = pair
    for mode in ("push", "pull"):
        rid = f"p-{mode}"
        p.step(sends=[send(mode, [2], rid=rid)])
        release = ReleaseSpec(
            mode=mode, remote_request_id=rid, remote_address=p.address(mode), remote_block_ids=[2]
        )
        d.step(releases=[release])
        p.wait("finished_sending", rid, timeout_s=5)


def test_lease_frees_blocks_nobody_came_for() -> None:
    p = Worker("P", caches(True), lease_s=0.3)
    try:
        p.step(sends=[send("pull", [1, 2])])
        p.wait("finished_sending", "p-req", timeout_s=5)
    finally:
        p.close()


def test_killed_prefill_fails_the_receive_and_d_gets_its_blocks_back(pair) -> None:
    p, d = pair
    d.step(recvs=[recv(p, "push", [1], [2])])  # P never finishes this request
    time.sleep(0.3)
    p.close()  # P gone: D's heartbeat declares it down
    assert d.wait("finished_recving", "d-req").failed_recving == {"d-req"}


def test_aborted_prefill_fails_the_waiting_decode_at_once(pair) -> None:
    p, d = pair
    d.step(recvs=[recv(p, "push", [1], [2], remote_request_id="t1")])
    p.step(admitted=[PrefillSpec(request_id="p-req", transfer_id="t1", mode="push")])
    time.sleep(0.2)
    p.step(aborted=[PrefillSpec(request_id="p-req", transfer_id="t1", mode="push")])
    got = d.wait("finished_recving", "d-req", timeout_s=5)  # not the 30 s grace
    assert got.failed_recving == {"d-req"}


def test_unknown_transfer_fails_the_receive_after_the_grace() -> None:
    p = Worker("P", caches(True), registration_grace_s=0.5)
    d = Worker("D", caches(False))
    try:
        d.step(recvs=[recv(p, "push", [1], [2], remote_request_id="t-lost")])
        assert d.wait("finished_recving", "d-req").failed_recving == {"d-req"}
    finally:
        p.close()
        d.close()


def test_late_transfer_fails_the_receive_at_the_watchdog() -> None:
    p = Worker("P", caches(True))
    d = Worker("D", caches(False), recv_timeout_s=0.5)
    try:
        d.step(recvs=[recv(p, "push", [1], [2], remote_request_id="t-late")])
        assert d.wait("finished_recving", "d-req").failed_recving == {"d-req"}
    finally:
        p.close()
        d.close()


def test_client_gone_while_waiting_returns_blocks_only_after_p_acks(pair) -> None:
    p, d = pair
    core = p.side._cores["push"]
    d.step(recvs=[recv(p, "push", [1], [2])])
    deadline = time.monotonic() + 10
    while "p-req" not in core._registered:  # P may write from now on
        assert time.monotonic() < deadline
        time.sleep(0.01)
    d.step(finished={"d-req"})  # vLLM aborted the request: its blocks are fenced
    assert d.side._cores["push"].quarantine  # not given back before P's PushAbortAck
    assert d.wait("finished_recving", "d-req").failed_recving == {"d-req"}
    assert not d.side._cores["push"].quarantine
    p.step(sends=[send("push", [2])])  # P's prompt ends after D gave up: freed at once
    p.wait("finished_sending", "p-req", timeout_s=5)


def test_client_gone_before_anything_was_sent_returns_blocks_at_once(pair) -> None:
    p, d = pair
    d.step(recvs=[recv(p, "pull", [1], [2])], finished={"d-req"})  # aborted in the same step
    assert d.wait("finished_recving", "d-req", timeout_s=5).failed_recving == {"d-req"}


def test_restarted_prefill_is_found_again_without_an_incarnation() -> None:
    port = free_port()
    p = Worker("P", caches(True), side_port=port)
    d = Worker("D", caches(False))
    p2 = None
    try:

        def transfer(prefill: Worker, rid: str) -> Results:
            spec = recv(prefill, "push", [1], [2], request_id=rid, remote_incarnation="")
            d.step(recvs=[msgspec_replace(spec, remote_request_id=f"t-{rid}")])
            prefill.step(sends=[send("push", [2], rid=rid, tid=f"t-{rid}")])
            return d.wait("finished_recving", rid)

        assert transfer(p, "r1").failed_recving == set()
        p.close()
        p2 = Worker("P", caches(True), side_port=port)  # same engine id and address
        transfer(p2, "r2")  # fails (P2 does not know D) or succeeds (the heartbeat saw it)
        assert "r3" not in transfer(p2, "r3").failed_recving
    finally:
        for w in (p2, d):
            if w is not None:
                w.close()


def msgspec_replace(spec: RecvSpec, **kw: object) -> RecvSpec:
    import msgspec

    return msgspec.structs.replace(spec, **kw)


def _thread_cpu_s(native_id: int) -> float:
    """utime + stime of one of this process's threads (Linux /proc), in seconds."""
    fields = Path(f"/proc/self/task/{native_id}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="needs Linux /proc")
def test_idle_workers_do_not_busy_poll(pair) -> None:
    """Every connector thread blocks (queue, socket, transfer, a timed wait): an idle pair
    of workers that just moved a prompt each way uses next to no CPU. One thread of them
    spinning takes what the OS gives it: over 0.15 s of these 2 s even on this loaded
    host with four spinning (the push writer's inbox wait patched to 0)."""
    p, d = pair
    for mode in ("push", "pull"):
        p.step(sends=[send(mode, [3], rid=f"p-{mode}")])
        spec = recv(p, mode, [5], [3], request_id=f"d-{mode}", remote_request_id=f"p-{mode}")
        d.step(recvs=[spec])
        d.wait("finished_recving", f"d-{mode}")
        p.wait("finished_sending", f"p-{mode}")
    mine = [t for t in threading.enumerate() if t is not threading.main_thread()]
    assert len(mine) >= 8  # both workers' cores: receivers, heartbeats, writer, lanes...
    before = {t.native_id: _thread_cpu_s(t.native_id) for t in mine if t.native_id}
    time.sleep(2.0)
    used = {
        f"{t.name}#{t.native_id}": _thread_cpu_s(t.native_id) - before[t.native_id]
        for t in mine
        if t.native_id in before and t.is_alive()
    }
    assert sum(used.values()) < 0.1, used  # all threads together: < 5% of a core
