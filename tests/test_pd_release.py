"""The router's release of P's hold (`release_transfer`), connector by connector, in one
process (tests/pd_harness.py): what it frees, when, and what it must leave alone.

Every pair runs with a long lease, so blocks freed within a test were freed by the release,
never by the lease (`lease_expired` stays 0).
"""

from __future__ import annotations

import time

import pytest

from pdserve.config import ModelConfig
from pdserve.engine.types import FinishReason, SamplingParams
from pdserve.model.loader import load_model
from pdserve.transfer import messages as m
from pdserve.transfer.push import RELEASED_REASON, _WriterState
from pdserve.transfer.release import ReleaseAuth, check_release, release_signature
from tests.pd_harness import Pair, make_engine

pytestmark = pytest.mark.timeout(120)

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
LONG_LEASE = {"lease_s": 300.0, "registration_ttl_s": 300.0}
IDS = list(range(3, 120))  # 8 blocks of 16 tokens


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    return load_model(ModelConfig(cache_dir=tmp_path_factory.mktemp("models")))


@pytest.fixture
def pair_factory(loaded):
    made: list[Pair] = []

    def make(mode: str, p_kw=None, d_kw=None) -> Pair:
        pair = Pair(
            make_engine(loaded, "prefill", mode, **{**LONG_LEASE, **(p_kw or {})}),
            make_engine(loaded, "decode", mode, **(d_kw or {})),
            mode,
        )
        made.append(pair)
        return pair

    yield make
    for pair in made:
        pair.close()


def held(pair: Pair) -> int:
    return pair.p.connector.num_blocks_held()


def prefill(pair: Pair, rid: str, tid: str) -> None:
    pair.submit_p(rid, IDS, tid)
    pair.run_until(lambda: pair.finished(rid), only=pair.p)
    assert pair.finished(rid).kv_transfer_params is not None


def test_pull_release_frees_an_unclaimed_hold_and_only_that_one(pair_factory) -> None:
    pair = pair_factory("pull")
    prefill(pair, "a-p", "t-a")
    prefill(pair, "b-p", "t-b")
    one = held(pair) // 2
    pair.p.release_transfer("t-a")
    assert held(pair) == one and "t-a" not in pair.p.connector.holds
    assert "t-b" in pair.p.connector.holds  # another transfer's hold is untouched
    pair.p.release_transfer("t-a")  # idempotent
    pair.p.release_transfer("t-unknown")
    assert pair.p.connector.stats.released_by_router == 1
    pair.p.release_transfer("t-b")
    assert held(pair) == 0 and pair.p.pool.num_used == 0
    assert pair.p.connector.stats.lease_expired == 0
    pair.p.check_integrity()


def test_pull_release_leaves_a_claimed_hold_to_its_reader(pair_factory) -> None:
    pair = pair_factory("pull")
    prefill(pair, "r-p", "t-claimed")
    h = pair.p.connector.holds["t-claimed"]
    claim = m.PullClaim(
        nonce="n1",
        transfer_id="t-claimed",
        block_ids=list(h.blocks),
        engine_id="decode-x",
        incarnation="i1",
        reply_to=("127.0.0.1", 1),
    )
    assert pair.p.connector._claim_hold(claim).error is None  # a reader claimed it
    pair.p.release_transfer("t-claimed")
    assert "t-claimed" in pair.p.connector.holds and held(pair) == len(h.blocks)
    assert pair.p.connector.stats.released_by_router == 0
    # The claimant's PullDone frees it, as ever.
    done = m.PullDone(
        transfer_id="t-claimed", ok=True, engine_id="decode-x", incarnation="i1", block_ids=[]
    )
    pair.p.connector.on_message(done)
    pair.settle(timeout=5.0)


def test_pull_release_while_computing_frees_the_hold_when_it_is_made(pair_factory) -> None:
    pair = pair_factory("pull")
    pair.submit_p("r-p", IDS, "t-early")
    pair.p.release_transfer("t-early")  # the prompt has not run yet
    pair.run_until(lambda: pair.finished("r-p"), only=pair.p)
    assert held(pair) == 0 and pair.p.pool.num_used == 0
    assert pair.p.connector.stats.released_by_router == 1
    pair.p.check_integrity()


def test_pull_release_of_an_aborted_prompt_forgets_it(pair_factory) -> None:
    pair = pair_factory("pull")
    pair.submit_p("r-p", IDS, "t-aborted")
    pair.p.release_transfer("t-aborted")
    pair.p.abort_request("r-p")
    assert not pair.p.connector._release_when_done
    pair.settle()


def test_push_release_frees_a_finished_prompt_nobody_registered_for(pair_factory) -> None:
    pair = pair_factory("push")
    prefill(pair, "r-p", "t-unposted")
    assert held(pair) > 0
    t0 = time.monotonic()
    pair.p.release_transfer("t-unposted")
    pair.run_until(lambda: held(pair) == 0, timeout=1.0, only=pair.p)
    assert time.monotonic() - t0 < 1.0
    assert pair.p.connector.stats.released_by_router == 1
    assert pair.p.connector.stats.lease_expired == 0
    pair.settle()


def test_push_release_drops_a_registration_and_tells_decode(pair_factory) -> None:
    """D registered, P's prompt has not run: D fails at once with the reason, and P's hold
    is freed as soon as the prompt finishes."""
    pair = pair_factory("push", d_kw={"recv_timeout_s": 300.0})
    pair.submit_p("r-p", IDS, "t-reg")
    pair.submit_d("r", IDS, GREEDY, pair.push_params("t-reg"))
    pair.run_until(lambda: "t-reg" in pair.p.connector._registered, only=pair.d)
    pair.p.release_transfer("t-reg")
    pair.run_until(lambda: pair.finished("r"), timeout=5.0, only=pair.d)
    out = pair.finished("r")
    assert out.finish_reason is FinishReason.ERROR and RELEASED_REASON in out.error
    pair.run_until(lambda: pair.finished("r-p"), only=pair.p)
    pair.run_until(lambda: held(pair) == 0, timeout=2.0, only=pair.p)
    assert pair.p.connector.stats.released_by_router == 1
    assert pair.p.connector.stats.transfers == 0  # nothing was ever written
    pair.settle()


def test_push_registration_after_the_release_is_refused(pair_factory) -> None:
    pair = pair_factory("push", d_kw={"recv_timeout_s": 300.0})
    prefill(pair, "r-p", "t-late")
    pair.p.release_transfer("t-late")
    pair.run_until(lambda: held(pair) == 0, timeout=2.0, only=pair.p)
    pair.submit_d("r", IDS, GREEDY, pair.push_params("t-late"))  # D comes too late
    pair.run_until(lambda: pair.finished("r"), timeout=5.0)
    assert RELEASED_REASON in pair.finished("r").error
    pair.settle()


def test_push_release_leaves_a_write_in_flight(pair_factory) -> None:
    """The writer's state machine: a transfer whose write is posted or streaming is left to
    complete (or to D's abort); nothing is freed, nothing marked."""
    pair = pair_factory("push")
    conn = pair.p.connector
    w = _WriterState()
    w.inflight["t-w"] = object()  # type: ignore[assignment]
    w.streams["t-s"] = object()  # type: ignore[assignment]
    for tid in ("t-w", "t-s"):
        conn._writer_release(w, tid)
    assert set(w.inflight) == {"t-w"} and set(w.streams) == {"t-s"}
    assert not w.released and conn.stats.released_by_router == 0
    assert not conn.has_events()  # no ReleaseHold reported


def test_push_release_on_decode_queues_nothing(pair_factory) -> None:
    pair = pair_factory("push")
    pair.d.release_transfer("t-x")  # a decode instance has no writer to drain its inbox
    assert pair.d.connector._inbox.empty()


def test_release_signature_is_checked_only_with_a_token() -> None:
    sig = release_signature("tok", "t1")
    assert check_release("tok", "t1", sig) is ReleaseAuth.OK
    assert check_release("tok", "t1", None) is ReleaseAuth.MISSING
    assert check_release("tok", "t2", sig) is ReleaseAuth.WRONG  # bound to its transfer
    assert check_release("other", "t1", sig) is ReleaseAuth.WRONG
    assert check_release(None, "t1", None) is ReleaseAuth.OK
