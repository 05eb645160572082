"""The transfer core's scenarios, once per engine adapter (tests/transfer_adapters.py).

Each scenario drives a prefill and a decode core (real side channel, tcp transport, small
KV regions) through `TransferCore` only, the test thread being each engine's thread, and
checks what the contract promises whatever the engine: the KV lands byte for byte, the
engine is told with typed events, and every block is owned by the request, by the core's
typed owner, or free, at the moments pdserve.transfer.adapter says, and all come back.
"""

from __future__ import annotations

import itertools
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
import torch

from pdserve.config import ConnectorConfig, TransportConfig
from pdserve.kv.cache import KVCache
from pdserve.ports import free_port
from pdserve.transfer import messages as m
from pdserve.transfer.adapter import (
    EngineSide,
    Event,
    Hold,
    KVFailed,
    KVReady,
    Quarantine,
    RemoteRequest,
    TransferCore,
)
from pdserve.transfer.connector import KVConnector
from pdserve.transfer.descriptors import OneRegion
from pdserve.transfer.errors import TransferCause
from pdserve.transfer.kv_transport import open_kv_transport
from pdserve.transfer.params import KVTransferParams
from pdserve.transfer.pull import PullConnector
from pdserve.transfer.push import PushConnector
from tests.transfer_adapters import ADAPTERS, EngineDouble

BLOCK_SIZE, NUM_BLOCKS, LAYERS, HEADS, HEAD_DIM = 4, 16, 2, 1, 8
PROMPT = list(range(100, 110))  # 10 tokens: 3 blocks of 4
NEED = 3
COMPAT = m.Compat(
    model="core-scenarios",
    dtype="float32",
    num_layers=LAYERS,
    num_kv_heads=HEADS,
    head_dim=HEAD_DIM,
    block_size=BLOCK_SIZE,
    layout="LKBTHD",
)


@dataclass
class Side:
    """One instance: an engine (its double) and its transfer core."""

    engine: EngineDouble
    core: KVConnector
    kv: KVCache

    def blocks_of(self, blocks: list[int]) -> torch.Tensor:
        return self.kv.tensor[:, :, blocks].clone()

    def check(self) -> None:
        self.engine.check_integrity(self.core.num_blocks_held())


def _side(double: EngineDouble, role: str, mode: str, **cfg: object) -> Side:
    kv = KVCache(torch.zeros((LAYERS, 2, NUM_BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM)), BLOCK_SIZE)
    ccfg = ConnectorConfig(role=role, mode=mode, engine_id=f"{role}-{uuid.uuid4().hex[:6]}", **cfg)
    regions = OneRegion.of(kv)
    tcfg = TransportConfig(kind="tcp", timeout_s=5.0)
    transport = open_kv_transport(tcfg, ccfg.engine_id, regions)
    cls = PushConnector if mode == "push" else PullConnector
    return Side(double, cls(ccfg, regions, double.side, COMPAT, transport), kv)


PAIRS = list(itertools.product(ADAPTERS, repeat=2))  # (P's adapter, D's adapter)


@pytest.fixture(params=PAIRS, ids=[f"p={p},d={d}" for p, d in PAIRS])
def make_pair(request) -> Iterator[Callable[..., tuple[Side, Side]]]:
    """Build (P, D) for a mode: P on the first adapter, D on the second."""
    p_adapter, d_adapter = (ADAPTERS[name] for name in request.param)
    made: list[Side] = []

    def make(mode: str, **cfg: object) -> tuple[Side, Side]:
        p = _side(p_adapter(NUM_BLOCKS), "prefill", mode, **cfg)
        made.append(p)
        d = _side(d_adapter(NUM_BLOCKS), "decode", mode, **cfg)
        made.append(d)
        return p, d

    yield make
    for side in made:
        side.core.close()


def _view(rid: str, params: KVTransferParams, blocks: list[int]) -> RemoteRequest:
    return RemoteRequest(
        request_id=rid,
        params=params,
        prompt_token_ids=PROMPT,
        block_ids=tuple(blocks),
        num_tokens=len(PROMPT),
    )


def _run_until(cond: Callable[[list[Event]], bool], *sides: Side, timeout: float = 10.0):
    """Be each side's engine thread: poll its core until `cond(events so far)`."""
    events: list[Event] = []
    deadline = time.monotonic() + timeout
    while not cond(events):
        if time.monotonic() > deadline:
            raise TimeoutError(f"scenario did not finish; events: {events}")
        for s in sides:
            new = s.core.poll()
            s.engine.on_events(new)
            events += new
        time.sleep(0.002)
    return events


def _prefill(p: Side, tid: str, mode: str) -> tuple[list[int], KVTransferParams]:
    """P computes the prompt (random KV in its blocks) and finishes it: the core holds them."""
    blocks = p.engine.admit("rp", PROMPT, NEED)
    p.kv.tensor[:, :, blocks] = torch.randn_like(p.kv.tensor[:, :, blocks])
    params = KVTransferParams(do_remote_decode=True, transfer_mode=mode, transfer_id=tid)
    p.core.prefill_admitted(_view("rp", params, []))
    out = p.core.prefill_done(_view("rp", params, blocks), first_token=p.engine.first_token)
    p.engine.finish("rp")
    assert [p.engine.owner_of(b) for b in blocks] == [Hold(tid)] * NEED
    p.check()
    return blocks, out


def _push_params(p: Side, tid: str) -> KVTransferParams:
    host, port = p.core.side_address
    return KVTransferParams(
        do_remote_prefill=True,
        transfer_mode="push",
        transfer_id=tid,
        remote_engine_id=p.core.cfg.engine_id,
        remote_host=host,
        remote_port=port,
    )


def _arrived(events: list[Event]) -> bool:
    return any(isinstance(e, KVReady | KVFailed) for e in events)


def _land_and_settle(p: Side, d: Side, p_blocks: list[int], d_blocks: list[int]) -> None:
    """D's KV arrives; P's hold and, once the request ends, D's blocks all come back."""
    events = [e for e in _run_until(_arrived, p, d) if isinstance(e, KVReady | KVFailed)]
    assert [(type(e), e.request_id) for e in events] == [(KVReady, "rd")]
    # P's (carried in the params or the notification), None from a vLLM P (D recomputes it)
    assert events[0].first_token_id == p.engine.first_token
    assert [d.engine.owner_of(b) for b in d_blocks] == ["rd"] * NEED  # the request decodes
    assert torch.equal(d.blocks_of(d_blocks), p.blocks_of(p_blocks))
    _run_until(lambda _: p.engine.num_used() == 0, p, d)
    d.engine.finish("rd")
    assert d.engine.num_used() == 0 and not d.core.has_pending() and not p.core.has_pending()
    p.check()
    d.check()


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_each_side_speaks_the_contract(make_pair, mode: str) -> None:
    for side in make_pair(mode):
        assert isinstance(side.core, TransferCore)
        assert isinstance(side.engine.side, EngineSide)


def test_pull_reads_the_prompt_and_every_block_comes_back(make_pair) -> None:
    p, d = make_pair("pull")
    p_blocks, params = _prefill(p, "t-pull", "pull")
    d_params = KVTransferParams(**{**msgspec_fields(params), "do_remote_prefill": True})
    d_blocks = d.engine.admit("rd", PROMPT, NEED)
    d.core.start_receive(_view("rd", d_params, d_blocks))
    _land_and_settle(p, d, p_blocks, d_blocks)


@pytest.mark.parametrize("first", ["registration", "prompt"])
def test_push_pairs_registration_and_prompt_in_either_order(make_pair, first: str) -> None:
    p, d = make_pair("push")
    tid = f"t-push-{first}"
    d_blocks = d.engine.admit("rd", PROMPT, NEED)
    if first == "registration":
        d.core.start_receive(_view("rd", _push_params(p, tid), d_blocks))
        _run_until(lambda _: tid in p.core._registered, p, d)
        p_blocks, _ = _prefill(p, tid, "push")
    else:
        p_blocks, _ = _prefill(p, tid, "push")
        d.core.start_receive(_view("rd", _push_params(p, tid), d_blocks))
    _land_and_settle(p, d, p_blocks, d_blocks)


def test_push_cancel_fences_the_blocks_until_prefill_acknowledges(make_pair) -> None:
    p, d = make_pair("push")
    tid = "t-cancel"
    d_blocks = d.engine.admit("rd", PROMPT, NEED)
    view = _view("rd", _push_params(p, tid), d_blocks)
    d.core.start_receive(view)
    _run_until(lambda _: tid in p.core._registered, p, d)  # P may write from now on
    d.core.cancel_receive(view)
    d.engine.finish("rd")  # the request ends; the engine frees none of its blocks
    assert [d.engine.owner_of(b) for b in d_blocks] == [Quarantine(tid)] * NEED
    d.check()
    _run_until(lambda _: d.engine.num_used() == 0, p, d)  # PushAbortAck came
    assert not d.core.has_pending()
    d.check()


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_unreachable_prefill_fails_the_request_with_a_typed_cause(make_pair, mode) -> None:
    _, d = make_pair(mode, handshake_timeout_s=0.3, handshake_tries=1)
    params = KVTransferParams(
        do_remote_prefill=True,
        transfer_mode=mode,
        transfer_id="t-nobody",
        remote_engine_id="prefill-gone",
        remote_host="127.0.0.1",
        remote_port=free_port(),
        remote_block_ids=[0, 1, 2],
        remote_num_tokens=len(PROMPT),
        first_token_id=7,
        expires_at=time.time() + 30,
    )
    d_blocks = d.engine.admit("rd", PROMPT, NEED)
    d.core.start_receive(_view("rd", params, d_blocks))
    events = _run_until(_arrived, d)
    assert [(type(e), e.request_id, e.cause) for e in events] == [
        (KVFailed, "rd", TransferCause.PEER_UNREACHABLE)
    ]
    assert events[0].error.startswith("KV transfer failed [peer_unreachable]: ")
    # Push: the failed request keeps its blocks (nothing was sent: nothing can land); the
    # engine frees them when it ends the request (pdserve: at `finish`; vLLM ends a request
    # failed_recving names at once). Pull: the peer is down, but its lane's job may still
    # be claiming: fenced until the job ends, then free.
    owners = {d.engine.owner_of(b) for b in d_blocks}
    assert owners <= {"rd", None} if mode == "push" else owners <= {Quarantine("t-nobody"), None}
    d.core.cancel_receive(_view("rd", params, d_blocks))  # already over: nothing to fence
    d.engine.finish("rd")
    _run_until(lambda _: not d.core.has_pending(), d)
    assert d.engine.num_used() == 0
    d.check()


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_router_release_hands_an_unclaimed_hold_back(make_pair, mode) -> None:
    p, _ = make_pair(mode)
    tid = f"t-release-{mode}"
    p_blocks, _ = _prefill(p, tid, mode)
    p.core.release_transfer(tid)
    _run_until(lambda _: p.engine.num_used() == 0, p)  # push: through the writer
    assert [p.engine.owner_of(b) for b in p_blocks] == [None] * NEED
    assert p.core.metrics().stats.released_by_router == 1
    p.check()


def test_pull_lease_end_hands_the_hold_back(make_pair) -> None:
    p, _ = make_pair("pull", lease_s=0.2)
    _prefill(p, "t-lease", "pull")
    _run_until(lambda _: p.engine.num_used() == 0, p)
    assert p.core.metrics().stats.lease_expired == 1
    p.check()


def msgspec_fields(params: KVTransferParams) -> dict:
    return {f: getattr(params, f) for f in params.__struct_fields__}
