"""D hands P's first token over between two layers of a step in progress, instead of after
the step: under load a prompt's KV usually lands while D decodes other requests, and
waiting for the step's end added up to one whole step to the handoff.

In-process pair (tests/pd_harness.py), pull and push over tcp. D is stepped by hand and its
connector is never polled between steps here, so every first token must come out of the
mid-step hook; the outputs stay equal to a monolithic engine's.
"""

from __future__ import annotations

import time
import uuid

import pytest

from pdserve.config import ModelConfig
from pdserve.engine.types import EngineRequest, RequestOutput, SamplingParams
from pdserve.model.loader import load_model
from pdserve.transfer.params import KVTransferParams
from tests.pd_harness import Pair, greedy_tokens, make_engine

pytestmark = pytest.mark.timeout(120)

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
LONG = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
PROMPT_A = [7 + i % 200 for i in range(40)]
PROMPT_B = [11 + (3 * i) % 230 for i in range(90)]
# Between D's steps once P is done: A's 400 tokens then last at least 0.8 s whatever the
# CPU's speed, far longer than B's transfer over loopback takes.
STEP_GAP_S = 0.002


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    return load_model(ModelConfig(cache_dir=tmp_path_factory.mktemp("models")))


def monolithic(loaded, ids: list[int], params: SamplingParams) -> list[int]:
    return greedy_tokens(make_engine(loaded, "both", "pull"), ids, params)


@pytest.fixture
def pair(loaded, request):
    mode = request.param
    p = make_engine(loaded, "prefill", mode)
    d = make_engine(loaded, "decode", mode)
    pair = Pair(p, d, mode)
    yield pair
    pair.close()


class Recorder:
    """D's `early_outputs`: notes each output and that a step was running when it came."""

    def __init__(self) -> None:
        self.outputs: list[RequestOutput] = []
        self.stepping = False
        self.outside_a_step = 0

    def __call__(self, outputs: list[RequestOutput]) -> None:
        self.outside_a_step += not self.stepping
        self.outputs += outputs


def step_d(pair: Pair, rec: Recorder) -> None:
    """One step of D without polling its connector first (unlike Pair.step)."""
    rec.stepping = True
    try:
        for o in pair.d.step():
            pair.outputs.setdefault(o.request_id, []).append(o)
    finally:
        rec.stepping = False


def start_b(pair: Pair, rec: Recorder) -> None:
    """Send prompt B through P to D as the router would, stepping P and D in turn."""
    if pair.mode == "pull":
        pair.submit_p("b-p", PROMPT_B)
        pair.run_until(lambda: pair.finished("b-p"), only=pair.p)
        kv = pair.finished("b-p").kv_transfer_params
        fields = {f: getattr(kv, f) for f in kv.__struct_fields__}
        pair.submit_d(
            "b", PROMPT_B, GREEDY, KVTransferParams(**{**fields, "do_remote_prefill": True})
        )
    else:
        tid = uuid.uuid4().hex
        pair.submit_p("b-p", PROMPT_B, tid)
        pair.submit_d("b", PROMPT_B, GREEDY, pair.push_params(tid))


@pytest.mark.parametrize("pair", ["pull", "push"], indirect=True)
def test_first_token_leaves_in_the_middle_of_a_step(pair: Pair, loaded) -> None:
    rec = Recorder()
    pair.d.early_outputs = rec
    pair.d.add_request(EngineRequest(request_id="a", prompt_token_ids=PROMPT_A, params=LONG))
    step_d(pair, rec)  # A prefilled on D; it decodes from now on
    start_b(pair, rec)
    deadline = time.monotonic() + 60
    while not any(o.request_id == "b" for o in rec.outputs):
        assert time.monotonic() < deadline, "B's first token never came"
        assert pair.d.has_work(), "A ended before B's KV landed: make A longer"
        if pair.p.has_work():
            pair.step(only=pair.p)
        else:  # B's KV is on the wire: A's remaining steps must not outrun it on a fast CPU
            time.sleep(STEP_GAP_S)
        step_d(pair, rec)
    first = next(o for o in rec.outputs if o.request_id == "b")
    assert rec.outside_a_step == 0
    assert first.new_token_ids == monolithic(loaded, PROMPT_B, GREEDY)[:1]
    pair.outputs.setdefault("b", []).insert(0, first)
    pair.run_until(lambda: pair.finished("b") and pair.finished("a"))
    assert pair.tokens("b") == monolithic(loaded, PROMPT_B, GREEDY)
    assert pair.tokens("a") == monolithic(loaded, PROMPT_A, LONG)
    pair.settle()


@pytest.mark.parametrize("pair", ["push"], indirect=True)
def test_events_of_requests_in_the_running_step_wait_for_the_next_poll(pair: Pair) -> None:
    start_b(pair, Recorder())
    pair.d.step()  # admits B: it now waits for its KV
    deadline = time.monotonic() + 30
    while not pair.d.connector.has_events():
        assert time.monotonic() < deadline, "B's KV never landed"
        pair.step(only=pair.p)
    assert pair.d.poll_connector(busy={"b"}) == []  # deferred, not lost
    (out,) = pair.d.poll_connector()
    assert out.request_id == "b" and len(out.new_token_ids) == 1
    pair.run_until(lambda: pair.finished("b"))
    pair.settle()
