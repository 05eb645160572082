"""P/D in one process: pull and push over real transports equal a monolithic engine.

Scenarios: both push arrival orders (forced by injected delays), P's failure notice,
D's watchdog, the fencing rule, lease expiry and a compatibility mismatch; after each,
both block pools are full again and pass their integrity check.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable

import pytest

from pdserve.config import ModelConfig
from pdserve.engine.types import EngineRequest, FinishReason, SamplingParams
from pdserve.faults import Faults
from pdserve.model.loader import load_model
from pdserve.transfer.adapter import Quarantine
from tests.pd_harness import Pair, greedy_tokens, make_engine, unreachable_push_params

# Slow (P and D engines over real sockets (tests/pd_harness.py), waiting out heartbeats and
# leases): `make test` runs it, the unit tier (`make test-fast`) does not.
pytestmark = pytest.mark.slow


GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    return load_model(ModelConfig(cache_dir=tmp_path_factory.mktemp("models")))


@pytest.fixture(scope="module")
def reference(loaded):
    """Greedy tokens of a monolithic engine, by prompt."""
    mono = make_engine(loaded, "both", "pull")
    cache: dict[tuple[int, ...], list[int]] = {}

    def ref(ids: list[int]) -> list[int]:
        key = tuple(ids)
        if key not in cache:
            cache[key] = greedy_tokens(mono, ids, GREEDY)
        return cache[key]

    return ref


def wait_for(cond: Callable[[], bool], timeout: float = 30.0) -> None:
    """Poll `cond` (without stepping any engine) until it holds; fail after `timeout`."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met"
        time.sleep(0.005)


def prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 250) for _ in range(rng.randrange(1, 200))] for _ in range(n)]


@pytest.fixture
def pair_factory(loaded):
    made: list[Pair] = []

    def make(mode: str, p_kw=None, d_kw=None, transport="tcp") -> Pair:
        pair = Pair(
            make_engine(loaded, "prefill", mode, transport, **(p_kw or {})),
            make_engine(loaded, "decode", mode, transport, **(d_kw or {})),
            mode,
        )
        made.append(pair)
        return pair

    yield make
    for pair in made:
        pair.close()


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_pd_output_equals_monolithic(pair_factory, reference, mode) -> None:
    pair = pair_factory(mode)
    for i, ids in enumerate(prompts(8, seed=10)):
        out = pair.generate(f"r{i}", ids, GREEDY)
        assert out.finish_reason is FinishReason.LENGTH, out.error
        assert pair.tokens(f"r{i}") == reference(ids), f"prompt {i} ({len(ids)} tokens)"
    pair.settle()
    assert pair.p.connector.stats.transfers + pair.d.connector.stats.transfers >= 8


@pytest.mark.parametrize("order", ["registration_first", "prefill_first"])
def test_push_pairs_in_either_order(pair_factory, reference, order) -> None:
    first = order == "registration_first"
    delay = {"faults": Faults(finish_delay_s=0.3)} if first else {}
    d_delay = {} if first else {"faults": Faults(register_delay_s=0.3)}
    pair = pair_factory("push", p_kw=delay, d_kw=d_delay)
    ids = prompts(1, seed=11)[0]
    pair.generate("r", ids, GREEDY)
    assert pair.tokens("r") == reference(ids)
    ws = pair.p.connector.writer_stats
    if order == "registration_first":
        assert (ws.registered_first, ws.finished_first) == (1, 0)
    else:
        assert (ws.registered_first, ws.finished_first) == (0, 1)
    pair.settle()


def test_live_requests_count_only_prompts_computed_here(pair_factory) -> None:
    """`/load`'s input: a prompt whose KV comes from P has nothing left to prefill on D,
    and both sides owe what max_tokens says (LiveRequest, LLMEngine.live_requests)."""
    pair = pair_factory("push", p_kw={"faults": Faults(finish_delay_s=0.3)})
    ids = prompts(1, seed=14)[0]
    pair.submit_p("r-p", ids, "t-live")
    pair.submit_d("r", ids, GREEDY, pair.push_params("t-live"))
    (on_p,), (on_d,) = pair.p.live_requests(), pair.d.live_requests()
    assert (on_p.prompt, on_p.computed, on_p.outputs, on_p.decode_left) == (len(ids), 0, 0, 1)
    assert (on_d.prompt, on_d.computed, on_d.outputs, on_d.decode_left) == (0, 0, 0, 12)
    pair.run_until(lambda: pair.finished("r"))
    assert pair.d.live_requests() == []
    pair.settle()


def test_push_failure_notice_fails_decode_at_once(pair_factory) -> None:
    pair = pair_factory("push", p_kw={"faults": Faults(finish_delay_s=0.0)})
    ids = prompts(1, seed=12)[0]
    tid = "t-fail"
    pair.submit_p("r-p", ids, tid)
    pair.submit_d("r", ids, GREEDY, pair.push_params(tid))
    # Only D runs: its registration reaches P while P's prompt has not started.
    pair.run_until(lambda: pair.d.stats().num_waiting_for_kv == 1, only=pair.d)
    pair.p.abort_request("r-p")  # prefill aborted: P must tell D
    pair.run_until(lambda: pair.finished("r"), timeout=5.0)
    out = pair.finished("r")
    assert out.finish_reason is FinishReason.ERROR and "prefill" in out.error
    pair.settle()


def test_push_watchdog_frees_blocks_when_no_write_comes(pair_factory) -> None:
    pair = pair_factory("push", d_kw={"recv_timeout_s": 0.5})
    ids = prompts(1, seed=13)[0]
    # P never hears of this transfer: nobody will write.
    pair.submit_d("r", ids, GREEDY, pair.push_params("t-lost"))
    pair.run_until(lambda: pair.finished("r"), timeout=5.0)
    out = pair.finished("r")
    assert out.finish_reason is FinishReason.ERROR and "no KV" in out.error
    assert pair.d.connector.stats.recv_timeouts == 1
    pair.settle()


def test_push_fencing_blocks_stay_quarantined_until_p_acknowledges(pair_factory) -> None:
    # P computes the prompt at once but hands it to its writer only after 1 s; D's watchdog
    # gives up after 0.3 s. D's blocks must stay fenced until P acknowledges the abort.
    pair = pair_factory(
        "push", p_kw={"faults": Faults(finish_delay_s=1.0)}, d_kw={"recv_timeout_s": 0.3}
    )
    ids = list(range(3, 100))
    tid = "t-fence"
    pair.submit_p("r-p", ids, tid)
    pair.submit_d("r", ids, GREEDY, pair.push_params(tid))
    pair.run_until(lambda: pair.d.stats().num_waiting_for_kv == 1, only=pair.d)
    reserved = set(pair.d.requests["r"].block_ids)
    # D's registration lane sends on its own thread; D is not stepped until P has it, so the
    # watchdog cannot fire first (on a loaded machine a handshake can outlast 0.3 s, and a
    # registration cancelled before it was sent frees its blocks at once: no fence).
    wait_for(lambda: tid in pair.p.connector._registered)
    pair.run_until(lambda: pair.finished("r"), timeout=5.0, only=pair.d)
    assert pair.finished("r").finish_reason is FinishReason.ERROR
    fenced = {
        b for b in range(pair.d.pool.num_blocks) if pair.d.pool.owner_of(b) == Quarantine(tid)
    }
    assert fenced == reserved  # not back in the free queue
    # A new request on D in the meantime never receives a fenced block.
    sp = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    big = [5] * (16 * (pair.d.pool.num_free - 1))
    pair.d.add_request(EngineRequest(request_id="other", prompt_token_ids=big, params=sp))
    pair.d.step()
    assert not set(pair.d.requests["other"].block_ids) & fenced
    pair.run_until(lambda: pair.finished("other"))
    # P's writer gets the abort before the hand-off: it never posts, frees its hold, acks.
    pair.settle(timeout=10.0)
    assert pair.p.connector.stats.transfers == 0
    assert pair.d.pool.num_free == pair.d.pool.num_blocks


def test_pull_lease_expiry_frees_p_blocks(pair_factory) -> None:
    pair = pair_factory("pull", p_kw={"lease_s": 0.3})
    pair.submit_p("r-p", prompts(1, seed=14)[0])
    pair.run_until(lambda: pair.finished("r-p"))
    assert pair.p.pool.num_used > 0  # held for a decode instance that never comes
    pair.settle(timeout=5.0)
    assert pair.p.connector.stats.lease_expired == 1


def test_compat_mismatch_is_a_clear_error(pair_factory, loaded) -> None:
    pair = pair_factory("pull")
    ids = prompts(1, seed=15)[0]
    pair.p.connector.compat = type(pair.p.connector.compat)(
        **{
            **{
                f: getattr(pair.p.connector.compat, f)
                for f in pair.p.connector.compat.__struct_fields__
            },
            "block_size": 32,
        }
    )
    out = pair.generate("r", ids, GREEDY)
    assert out.finish_reason is FinishReason.ERROR
    assert "block_size" in out.error and "incompatible" in out.error
    pair.settle()


def test_push_unclaimed_registration_expires_with_a_failure_notice(pair_factory) -> None:
    pair = pair_factory("push", p_kw={"registration_ttl_s": 0.3}, d_kw={"recv_timeout_s": 30})
    ids = prompts(1, seed=16)[0]
    pair.submit_d("r", ids, GREEDY, pair.push_params("t-orphan"))  # P never gets the prompt
    pair.run_until(lambda: pair.finished("r"), timeout=5.0)
    out = pair.finished("r")
    assert out.finish_reason is FinishReason.ERROR and "never finished" in out.error
    assert pair.p.connector.stats.registrations_expired == 1
    assert pair.d.connector.stats.recv_timeouts == 0  # P's notice, not D's watchdog
    pair.settle()


def test_push_prompt_nobody_registers_for_is_freed_after_the_lease(pair_factory) -> None:
    pair = pair_factory("push", p_kw={"lease_s": 0.3})
    pair.submit_p("r-p", prompts(1, seed=17)[0], "t-unwanted")
    pair.run_until(lambda: pair.finished("r-p"))
    assert pair.p.pool.num_used > 0  # held for a decode instance that never registers
    pair.settle(timeout=5.0)
    assert pair.p.connector.stats.lease_expired == 1


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_dead_prefill_instance_fails_waiting_requests_by_heartbeat(pair_factory, mode) -> None:
    d_kw = {"recv_timeout_s": 60}
    pair = pair_factory(mode, d_kw=d_kw)
    ids = prompts(1, seed=18)[0]
    if mode == "push":
        pair.submit_d("r", ids, GREEDY, pair.push_params("t-dead"))
    else:  # P prefilled and holds the blocks; D has not read them yet
        pair.submit_p("r-p", ids)
        pair.run_until(lambda: pair.finished("r-p"), only=pair.p)
        kv = pair.finished("r-p").kv_transfer_params
        pair.p.close()  # dies before D's READ: the handshake or read cannot complete
        fields = {f: getattr(kv, f) for f in kv.__struct_fields__}
        pair.submit_d("r", ids, GREEDY, type(kv)(**{**fields, "do_remote_prefill": True}))
    if mode == "push":
        pair.run_until(lambda: pair.d.stats().num_waiting_for_kv == 1, only=pair.d)
        pair.p.close()  # P is gone while D waits for its write
    pair.run_until(lambda: pair.finished("r"), timeout=15.0, only=pair.d)
    out = pair.finished("r")
    assert out.finish_reason is FinishReason.ERROR, out
    pair.run_until(lambda: pair.d.pool.num_used == 0, timeout=10.0, only=pair.d)
    pair.d.check_integrity()
    if mode == "push":
        assert "stopped answering" in out.error and pair.d.connector.stats.peers_down == 1


def test_push_streams_layer_by_layer_when_registered_before_the_last_chunk(
    pair_factory, reference
) -> None:
    pair = pair_factory("push")
    ids = prompts(3, seed=19)[2]
    tid = "t-layers"
    pair.submit_d("r", ids, GREEDY, pair.push_params(tid))
    pair.run_until(lambda: tid in pair.p.connector._registered, only=pair.d)
    pair.submit_p("r-p", ids, tid)  # the registration is already there
    pair.run_until(lambda: pair.finished("r"))
    assert pair.tokens("r") == reference(ids)
    ws = pair.p.connector.writer_stats
    assert ws.layerwise == 1 and ws.registered_first == 1
    # one write per layer, each coalesced to one descriptor per K and V run
    assert pair.p.connector.stats.transfers == 1
    assert pair.p.connector.stats.descriptors >= 2 * pair.p.kv.num_layers
    pair.settle()


def test_push_streams_layer_by_layer_when_registration_comes_during_the_last_chunk(
    pair_factory, reference
) -> None:
    """The router sends both legs at once, so D's registration usually reaches P after P
    scheduled a one-chunk prompt. The layers computed before it wait on P's writer and go
    out when it comes; the rest stream as computed, and PushDone follows them all."""
    pair = pair_factory("push")
    ids = prompts(3, seed=23)[2]
    tid = "t-late-registration"
    conn = pair.p.connector
    streams = conn.layer_hook

    def layer_hook(reqs):
        inner = streams(reqs)

        def hook(layer: int) -> None:
            if inner is not None:
                inner(layer)
            if layer == 0:  # D registers only now, while P's step is in progress
                pair.submit_d("r", ids, GREEDY, pair.push_params(tid))
                pair.run_until(
                    lambda: tid in conn._registered or conn.writer_stats.registered_first,
                    only=pair.d,
                )

        return hook

    conn.layer_hook = layer_hook
    pair.submit_p("r-p", ids, tid)
    pair.run_until(lambda: pair.finished("r"))
    assert pair.tokens("r") == reference(ids)
    assert conn.writer_stats.layerwise == 1  # not one whole-prompt write after the step
    assert conn.stats.descriptors >= 2 * pair.p.kv.num_layers  # one write per layer
    pair.settle()


def test_push_done_goes_out_before_p_frees_the_hold(pair_factory, reference) -> None:
    """P's writer sends PushDone (what D waits for) before it reports the finished writes to
    P's engine thread: that report wakes the engine, which would take the GIL first."""
    pair = pair_factory("push")
    ids = prompts(3, seed=24)[1]
    tid = "t-order"
    conn = pair.p.connector
    order: list[str] = []
    report, send_notif = conn.report, conn.transport.send_notif

    def recording_report(item) -> None:
        order.append(type(item).__name__)
        report(item)

    def recording_send_notif(peer, payload: bytes) -> None:
        order.append("PushDone")
        send_notif(peer, payload)

    conn.report, conn.transport.send_notif = recording_report, recording_send_notif
    pair.submit_d("r", ids, GREEDY, pair.push_params(tid))
    pair.run_until(lambda: tid in conn._registered, only=pair.d)
    pair.submit_p("r-p", ids, tid)
    pair.run_until(lambda: pair.finished("r"))
    pair.settle()
    assert pair.tokens("r") == reference(ids)
    assert conn.writer_stats.layerwise == 1
    assert order.index("PushDone") < order.index("ReleaseHold")


def test_unreachable_address_does_not_delay_other_pushes(pair_factory, reference) -> None:
    """Each prefill instance has its own registration lane on D: a registration stuck in a
    handshake with an address nobody answers at does not hold up the live P's.

    The dead address's handshake would last 60 s; the live request gets 15 s, so it cannot
    have waited behind that handshake. The dead one fails by D's heartbeat, leaking nothing.
    """
    pair = pair_factory("push", d_kw={"handshake_timeout_s": 60.0, "recv_timeout_s": 60.0})
    ids = prompts(1, seed=20)[0]
    dead = unreachable_push_params("t-dead")
    pair.submit_d("r-dead", ids, GREEDY, dead)
    pair.run_until(lambda: pair.d.stats().num_waiting_for_kv == 1, only=pair.d)  # handshaking
    pair.submit_p("r-p", ids, "t-live")
    pair.submit_d("r", ids, GREEDY, pair.push_params("t-live"))
    pair.run_until(lambda: pair.finished("r"), timeout=15.0)
    assert pair.finished("r").finish_reason is FinishReason.LENGTH, pair.finished("r").error
    assert pair.tokens("r") == reference(ids)
    pair.run_until(lambda: pair.finished("r-dead"), timeout=15.0)
    out = pair.finished("r-dead")
    assert out.finish_reason is FinishReason.ERROR
    assert f"127.0.0.1:{dead.remote_port} stopped answering" in out.error, out.error
    pair.settle()


def test_push_registration_cancelled_before_it_is_sent_frees_blocks_at_once(
    pair_factory,
) -> None:
    """A registration still waiting for its handshake when D's watchdog ends the request is
    never sent, so no write can land: D's blocks go back at once, not after `quarantine_s`
    (the heartbeat, which would also release them, is made too slow to matter here)."""
    slow = {"handshake_timeout_s": 60.0, "quarantine_s": 60.0, "heartbeat_misses": 1000}
    pair = pair_factory("push", d_kw={**slow, "recv_timeout_s": 0.5})
    pair.submit_d("r", prompts(1, seed=21)[0], GREEDY, unreachable_push_params("t-gone"))
    pair.run_until(lambda: pair.finished("r"), timeout=10.0, only=pair.d)
    assert "no KV" in pair.finished("r").error
    pair.run_until(lambda: pair.d.pool.num_used == 0, timeout=10.0, only=pair.d)
    pair.d.check_integrity()
    assert not pair.d.connector.quarantine


def test_push_connectors_run_only_their_roles_threads(loaded) -> None:
    p = make_engine(loaded, "prefill", "push")
    d = make_engine(loaded, "decode", "push")
    try:
        names = {role: {t.name for t in e.connector._threads} for role, e in (("p", p), ("d", d))}
        assert names["p"] == {"pdserve-push-writer", "pdserve-push-watch"}
        assert names["d"] == {"pdserve-push-notif"}
        assert all(t.is_alive() for e in (p, d) for t in e.connector._threads)
    finally:
        p.close()
        d.close()
