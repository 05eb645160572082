"""No KV block of one request is read or overwritten by a transfer for another.

Many pull and push requests run at once through a prefill/decode pair (the in-process
harness: real engines and connectors over tcp, stepped by hand) with small block pools, so
blocks are reused all the time, while aborts hit both sides at every stage: P before its
prompt is done, D while queued, at the hand-off (push: just after P's WRITE is posted;
pull: the step D's READ starts), and while decoding; some prefilled prompts are never
claimed at all (P's lease frees them). A wrapper around each transport delays every
transfer, and the WRITEs of hand-off aborts by far, so that aborts land while transfers
are in flight and late transfers arrive when their blocks, unless fenced, would already
belong to another request. (Checked against the code it guards: without D's quarantine,
or with P acknowledging an abort before its WRITE is done, this test fails.)

Two oracles:
- on every step, each decode request whose KV arrived holds, for every position it has
  computed, the monolithic engine's KV of the same tokens (a transfer that read another
  request's blocks, or a late one that wrote into this request's, shows up at once);
- every request that completes returns the monolithic engine's greedy tokens.
At the end both block pools are full again and pass their integrity check.
"""

from __future__ import annotations

import itertools
import random
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from pdserve.config import ModelConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.request import RequestState
from pdserve.engine.types import EngineRequest, FinishReason, RequestOutput, SamplingParams
from pdserve.model.loader import LoadedModel, load_model
from pdserve.transfer import messages as m
from pdserve.transfer.params import KVTransferParams
from tests.pd_harness import Pair, _fields, make_engine

# Slow (P and D engines over real sockets (tests/pd_harness.py), many concurrent transfers): `make
# test` runs it, the unit tier (`make test-fast`) does not.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
NUM_REQUESTS = 40
# Small pools: 40 prompts of up to 150 tokens need far more blocks than either side has, so
# blocks freed by one request (or its abort) are soon another request's.
NUM_BLOCKS = 48
# What happens to each request (chances): its P leg aborted at a random step, its D leg
# aborted at a random step, its D leg aborted at the hand-off, or its prompt never claimed.
FATES = {"abort_p": 0.1, "abort_d": 0.15, "abort_handoff": 0.15, "unclaimed": 0.1}
# A scenario ends well within this on a loaded 2-core machine; it only bounds a hang.
SCENARIO_TIMEOUT_S = 150.0
IDLE_SLEEP_S = 0.002  # a round with nothing to step waits for a timer or a transfer


@dataclass
class Reference:
    tokens: list[int]
    kv: torch.Tensor  # [layers, 2, positions, kv heads, head dim]: prompt and decoded tokens


def kv_of(eng: LLMEngine, blocks: list[int], n: int) -> torch.Tensor:
    """A copy of the KV of the first `n` positions held in `blocks` of `eng`'s cache."""
    t = eng.kv.tensor[:, :, blocks]
    layers, two, nb, bs, heads, dim = t.shape
    return t.reshape(layers, two, nb * bs, heads, dim)[:, :, :n].clone()


@pytest.fixture(scope="module")
def loaded(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    torch.set_num_threads(1)
    return load_model(ModelConfig(cache_dir=tmp_path_factory.mktemp("models")))


@pytest.fixture(scope="module")
def mono(loaded: LoadedModel) -> LLMEngine:
    return make_engine(loaded, "both", "pull")


def reference(mono: LLMEngine, ids: list[int]) -> Reference:
    """Greedy tokens, and the KV of every position a decode of them computes, from a
    monolithic engine running `ids` alone."""
    rid = uuid.uuid4().hex
    longer = SamplingParams(max_tokens=GREEDY.max_tokens + 1, temperature=0.0, ignore_eos=True)
    mono.add_request(EngineRequest(request_id=rid, prompt_token_ids=ids, params=longer))
    tokens: list[int] = []
    while len(tokens) < GREEDY.max_tokens:
        tokens += [t for o in mono.step() for t in o.new_token_ids]
    req = mono.requests[rid]
    kv = kv_of(mono, req.block_ids, req.num_computed_tokens)
    mono.abort_request(rid)
    return Reference(tokens[: GREEDY.max_tokens], kv)


@dataclass
class Run:
    """One scenario's bookkeeping; the pair is stepped by `Run.step`."""

    pair: Pair
    prompts: dict[str, list[int]]
    refs: dict[str, Reference]
    arrived: set[str] = field(default_factory=set)  # D requests whose KV came
    outputs: dict[str, list[RequestOutput]] = field(default_factory=dict)
    checks: int = 0
    aborted: dict[str, int] = field(default_factory=dict)  # by fate, aborts that hit
    handoff_seen: dict[str, float] = field(default_factory=dict)  # push: see at_handoff

    def record(self, outs: list[RequestOutput]) -> None:
        for o in outs:
            self.outputs.setdefault(o.request_id, []).append(o)

    def finished(self, rid: str) -> RequestOutput | None:
        outs = self.outputs.get(rid, [])
        return outs[-1] if outs and outs[-1].finished else None

    def step(self) -> bool:
        """One round of both engines; False if neither had anything to do."""
        busy = False
        for eng in (self.pair.p, self.pair.d):
            outs = eng.poll_connector()
            self.record(outs)
            if eng is self.pair.d:
                self.arrived |= {o.request_id for o in outs if o.new_token_ids}
            if eng.has_work():
                self.record(eng.step())
                busy = True
            busy = busy or bool(outs)
        self.check_kv()
        return busy

    def check_kv(self) -> None:
        """Every D request whose KV arrived holds its own tokens' KV at every computed
        position (a preempted one recomputes from scratch; it is checked again once its
        prompt is back)."""
        d = self.pair.d
        for rid in self.arrived:
            req = d.requests.get(rid)
            n = req.num_computed_tokens if req is not None else 0
            if n < len(self.prompts[rid]):
                continue
            ref = self.refs[rid].kv[:, :, :n]
            got = kv_of(d, req.block_ids, n)
            assert torch.allclose(got, ref, atol=1e-4, rtol=1e-3), (
                f"{rid}: the KV in its blocks is not its own (max diff "
                f"{(got - ref).abs().max().item():.3g})"
            )
            self.checks += 1

    def abort(self, fate: str, eng: LLMEngine, rid: str) -> None:
        if rid in eng.requests:
            self.record(eng.abort_request(rid))
            self.aborted[fate] = self.aborted.get(fate, 0) + 1


class SlowLink:
    """Wraps a connector's transport so that each READ or WRITE is posted only after a
    delay: transfers stay in flight for many engine steps, so aborts land while they are in
    flight (the case fencing exists for). Mostly short delays, sometimes long ones, and the
    WRITEs of the transfers in `late` (those whose decode request is aborted at the
    hand-off) land long after, when their blocks would long be someone else's were they not
    fenced. Everything else goes to the real transport."""

    def __init__(self, inner: Any, seed: int, late: set[str], max_delay_s: float = 0.02) -> None:
        self.inner = inner
        self.rng = random.Random(seed)
        self.late = late
        self.max_delay_s = max_delay_s

    def write(self, peer: Any, local: Any, remote: Any, notif: bytes | None) -> _Delayed:
        tid = getattr(m.decode(notif), "transfer_id", None) if notif else None
        delay = self.rng.uniform(0.15, 0.3) if tid in self.late else self._delay()
        return _Delayed("write", (peer, local, remote, notif), time.monotonic() + delay)

    def read(self, *args: Any) -> _Delayed:
        return _Delayed("read", args, time.monotonic() + self._delay())

    def _delay(self) -> float:
        if self.rng.random() < 0.25:
            return self.rng.uniform(3, 8) * self.max_delay_s
        return self.rng.uniform(0, self.max_delay_s)

    def poll(self, handle: Any) -> tuple[bool, str | None]:
        if not isinstance(handle, _Delayed):
            return self.inner.poll(handle)
        if handle.posted is None:
            if time.monotonic() < handle.due:
                return False, None
            handle.posted = getattr(self.inner, handle.kind)(*handle.args)
        return self.inner.poll(handle.posted)

    def wait(self, handle: Any, timeout_s: float) -> tuple[bool, str | None]:
        time.sleep(min(timeout_s, 0.001))  # the delay is ours: poll it
        return self.poll(handle)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


@dataclass
class _Delayed:
    kind: str
    args: tuple[Any, ...]
    due: float
    posted: Any = None


def run_scenario(loaded: LoadedModel, mono: LLMEngine, mode: str, seed: int) -> Run:
    rng = random.Random(seed)
    pair = Pair(
        make_engine(loaded, "prefill", mode, num_blocks=NUM_BLOCKS, lease_s=1.0),
        make_engine(loaded, "decode", mode, num_blocks=NUM_BLOCKS, recv_timeout_s=5.0),
        mode,
    )
    prompts = {
        f"r{i}": [rng.randrange(3, 250) for _ in range(rng.randrange(1, 150))]
        for i in range(NUM_REQUESTS)
    }
    tids = {rid: uuid.uuid4().hex for rid in prompts}
    fate = fates(list(prompts), rng)
    late = {tids[rid] for rid, f in fate.items() if f == "abort_handoff"}
    for eng in (pair.p, pair.d):
        assert eng.connector is not None
        eng.connector.transport = SlowLink(eng.connector.transport, seed, late)
    run = Run(pair, prompts, {rid: reference(mono, ids) for rid, ids in prompts.items()})
    try:
        drive(run, mode, rng, tids, fate)
        pair.settle(timeout=20.0)
    finally:
        pair.close()
    return run


def fates(rids: list[str], rng: random.Random) -> dict[str, str]:
    out = {}
    for rid in rids:
        x = rng.random()
        for fate, chance in FATES.items():
            if x < chance:
                out[rid] = fate
                break
            x -= chance
    return out


def drive(
    run: Run, mode: str, rng: random.Random, tids: dict[str, str], fate: dict[str, str]
) -> None:
    """Submit everything, abort as each request's fate says, until every request ended."""
    pair = run.pair
    at_step = {rid: rng.randrange(60) for rid in fate}
    for rid, ids in run.prompts.items():
        kv = KVTransferParams(do_remote_decode=True, transfer_mode=mode, transfer_id=tids[rid])
        sp = SamplingParams(max_tokens=1, temperature=0.0)
        pair.p.add_request(
            EngineRequest(request_id=f"{rid}-p", prompt_token_ids=ids, params=sp, kv_transfer=kv)
        )
        if mode == "push" and fate.get(rid) != "unclaimed":
            run.record(pair.d.add_request(d_request(rid, ids, pair.push_params(tids[rid]))))
    live = {rid for rid in run.prompts if fate.get(rid) != "unclaimed"}
    pending_d = set(live) if mode == "pull" else set()
    # Bounded in time, not in steps: what ends the last requests is often a timer (P's
    # lease, D's receive watchdog, a delayed transfer), and a fast machine runs any number
    # of idle steps before it fires. Idle rounds sleep briefly, so they cost no CPU either.
    deadline = time.monotonic() + SCENARIO_TIMEOUT_S
    for step in itertools.count():
        if time.monotonic() > deadline:
            raise AssertionError(f"the scenario did not end in {SCENARIO_TIMEOUT_S:g} s")
        if not run.step():
            time.sleep(IDLE_SLEEP_S)
        for rid, f in fate.items():
            if f == "abort_p" and at_step[rid] == step:
                run.abort(f, pair.p, f"{rid}-p")
            due = at_step[rid] == step if f == "abort_d" else at_handoff(run, mode, rid)
            if f in ("abort_d", "abort_handoff") and due:
                run.abort(f, pair.d, rid)
        for rid in sorted(pending_d):  # pull: D's leg goes once P answered
            p_out = run.finished(f"{rid}-p")
            if p_out is None:
                continue
            pending_d.discard(rid)
            if p_out.finish_reason is FinishReason.LENGTH:
                params = KVTransferParams(
                    **{**_fields(p_out.kv_transfer_params), "do_remote_prefill": True}
                )
                run.record(pair.d.add_request(d_request(rid, run.prompts[rid], params)))
            else:
                live.discard(rid)  # P was aborted: no D leg
        if not pending_d and all(run.finished(rid) for rid in live):
            return


def at_handoff(run: Run, mode: str, rid: str) -> bool:
    """Pull: D's READ has started. Push: D registered and P's prompt is done, a few
    milliseconds ago (P's writer has paired them and posted the WRITE)."""
    req = run.pair.d.requests.get(rid)
    ready = req is not None and req.state is RequestState.WAITING_FOR_REMOTE_KV
    if mode == "pull" or not ready:
        return ready
    if run.finished(f"{rid}-p") is None:
        return False
    since = run.handoff_seen.setdefault(rid, time.monotonic())
    return time.monotonic() - since > 0.005


def d_request(rid: str, ids: list[int], kv: KVTransferParams) -> EngineRequest:
    return EngineRequest(request_id=rid, prompt_token_ids=ids, params=GREEDY, kv_transfer=kv)


@pytest.mark.parametrize("seed", [1, 2])
@pytest.mark.parametrize("mode", ["pull", "push"])
def test_concurrent_transfers_with_aborts_never_mix_kv(
    loaded: LoadedModel, mono: LLMEngine, mode: str, seed: int
) -> None:
    run = run_scenario(loaded, mono, mode, seed)
    completed = 0
    for rid in run.prompts:
        out = run.finished(rid)
        if out is not None and out.finish_reason is FinishReason.LENGTH:
            completed += 1
            tokens = [t for o in run.outputs[rid] for t in o.new_token_ids]
            assert tokens == run.refs[rid].tokens, rid
    # The scenario did what it says: many completions, aborts on both sides and at the
    # hand-off, and the KV checked on many steps.
    assert completed >= NUM_REQUESTS // 3, completed
    assert sum(run.aborted.values()) >= 6 and run.aborted.get("abort_handoff", 0) >= 2, run.aborted
    assert run.checks >= NUM_REQUESTS, run.checks
