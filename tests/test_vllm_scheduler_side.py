"""pdserve.vllm's scheduler side without vLLM: params in, specs out, block arithmetic."""

from __future__ import annotations

import pytest

from pdserve.transfer.params import InvalidKVTransferParams, check_pull_params
from pdserve.vllm.config import TOKEN_ENV, VllmConnectorConfig
from pdserve.vllm.scheduler import Scheduled, SchedulerSide
from pdserve.vllm.specs import (
    LayerSpec,
    PrefillSpec,
    RecvSpec,
    ReleaseSpec,
    SendSpec,
    StepSpecs,
    WorkerCard,
)
from pdserve.vllm.transfers import _recv_view

BS = 16


def side() -> SchedulerSide:
    s = SchedulerSide(VllmConnectorConfig.from_extra({"side_port": 7000}), "eng", BS)
    s.worker = WorkerCard(engine_id="eng", incarnation="inc1", push_port=7000, pull_port=7001)
    return s


def p_params(s: SchedulerSide, blocks: list[int], n: int, mode: str | None = None) -> dict:
    req = {"do_remote_decode": True} | ({"transfer_mode": mode} if mode else {})
    delay, params = s.request_finished("p1", req, blocks, n, finished_ok=True)
    assert delay and params is not None
    return params


def test_prefill_keeps_blocks_and_returns_params_for_decode() -> None:
    s = side()
    params = p_params(s, [5, 6, 7], 40, mode="pull")
    assert params["remote_block_ids"] == [5, 6, 7]
    assert params["remote_incarnation"] == "inc1"
    assert params["remote_port"] == 7001  # the pull core's side channel
    assert params["transfer_mode"] == "pull"
    out = s.take()
    assert out.sends == [SendSpec(request_id="p1", block_ids=[5, 6, 7], num_tokens=40, mode="pull")]
    assert out.recvs == [] and out.releases == []
    assert not s.take()


def test_prefill_lends_only_the_blocks_holding_the_prompt() -> None:
    s = side()
    req = {"do_remote_decode": True, "transfer_mode": "push"}
    delay, params = s.request_finished("p1", req, [5, 6, 7, 8], 33, True, num_prompt=32)
    assert delay and params is not None
    assert params["remote_block_ids"] == [5, 6] and params["remote_num_tokens"] == 32
    assert params["remote_port"] == 7000  # the push core's
    assert s.take().sends[0].block_ids == [5, 6]


def test_aborted_prefill_frees_at_once_and_tells_the_worker() -> None:
    s = side()
    assert s.num_matched("p1", {"do_remote_decode": True, "transfer_id": "t1"}, 4, 0) == (0, False)
    assert s.num_matched("p1", {"do_remote_decode": True, "transfer_id": "t1"}, 4, 0) == (0, False)
    spec = PrefillSpec(request_id="p1", transfer_id="t1", mode="push")
    assert s.take() == StepSpecs(admitted=[spec])  # once, however often vLLM asks
    req = {"do_remote_decode": True, "transfer_id": "t1"}
    assert s.request_finished("p1", req, [1], 4, False) == (False, None)
    assert s.take() == StepSpecs(aborted=[spec])


def test_aborted_push_prefill_streamed_layer_by_layer_keeps_its_blocks() -> None:
    """Its layer writes may still read the blocks: vLLM must not free them at once."""
    s = side()
    req = {"do_remote_decode": True, "transfer_id": "t1"}
    s.num_matched("p1", req, 8, 0)
    s.scheduled([Scheduled("p1", [5, 6], num_computed=0, num_scheduled=8, resumed=True)])
    assert s.take().layerwise  # the completing step: the worker writes each layer
    assert s.request_finished("p1", req, [5, 6], 8, False) == (True, None)
    spec = PrefillSpec(request_id="p1", transfer_id="t1", mode="push", block_ids=[5, 6])
    assert s.take() == StepSpecs(aborted=[spec])  # lent until finished_sending


def test_the_step_that_completes_a_push_prompt_is_streamed_layer_by_layer() -> None:
    s = side()
    s.num_matched("p1", {"do_remote_decode": True, "transfer_id": "t1"}, 40, 0)
    s.take()
    s.scheduled([Scheduled("p1", [5, 6], num_computed=0, num_scheduled=32, resumed=True)])
    assert not s.take()  # a first chunk: the prompt is not complete after this step
    s.scheduled([Scheduled("p1", [7], num_computed=32, num_scheduled=8)])
    layer = LayerSpec(request_id="p1", transfer_id="t1", block_ids=[5, 6, 7], num_tokens=40)
    assert s.take() == StepSpecs(layerwise=[layer])
    s.scheduled([Scheduled("p1", None, num_computed=40, num_scheduled=1)])
    assert not s.take()  # named once


def test_pull_params_are_signed_with_a_cluster_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(TOKEN_ENV, "sesame")
    s = side()
    params = p_params(s, [5, 6, 7], 40, mode="pull")
    s.take()
    s.num_matched("d1", params, 40, 0)
    s.after_alloc("d1", params, [10, 11, 12], 40, 40)
    (spec,) = s.take().recvs
    check_pull_params(_recv_view(spec).params, b"sesame")  # D's core accepts them
    forged = msgspec_replace(spec, remote_block_ids=[1, 2, 3])
    with pytest.raises(InvalidKVTransferParams):
        check_pull_params(_recv_view(forged).params, b"sesame")


@pytest.mark.parametrize("local_hit", [0, 16, 32])
def test_decode_receives_the_blocks_its_prefix_cache_lacks(local_hit: int) -> None:
    s = side()
    params = p_params(s, [5, 6, 7], 40)
    s.take()
    assert s.num_matched("d1", params, 40, local_hit) == (40 - local_hit, True)
    s.after_alloc("d1", params, [10, 11, 12, 13], 40, 40 - local_hit)
    (spec,) = s.take().recvs
    assert isinstance(spec, RecvSpec)
    assert spec.first_block == local_hit // BS  # D's own hits, not lent
    assert spec.block_ids == [10, 11, 12]  # the lookahead block 13 is not P's
    assert spec.remote_block_ids == [5, 6, 7]
    assert params["do_remote_prefill"] is False  # not loaded twice (preemption)


def test_decode_that_loads_nothing_releases_p() -> None:
    s = side()
    params = p_params(s, [5], 1)
    s.take()
    s.after_alloc("d1", params, [3], 1, 0)  # vLLM recomputes a one-token prompt
    out = s.take()
    assert out.recvs == []
    address = ("127.0.0.1", 7000)
    release = ReleaseSpec(
        mode="push", remote_request_id="p1", remote_address=address, remote_block_ids=[5]
    )
    assert out.releases == [release]


def test_decode_aborted_while_queued_releases_p() -> None:
    s = side()
    params = p_params(s, [5], 10)
    s.take()
    assert s.request_finished("d1", params, [], 0, False) == (False, None)
    assert len(s.take().releases) == 1


def test_malformed_params_compute_locally() -> None:
    s = side()
    bad = {"do_remote_prefill": True, "remote_block_ids": "x"}
    assert s.num_matched("d1", bad, 10, 0) == (0, False)
    s.after_alloc("d1", bad, [1], 10, 0)
    assert not s.take()


def test_unknown_extra_config_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown extra config"):
        VllmConnectorConfig.from_extra({"mdoe": "push"})
    with pytest.raises(ValueError, match="mode"):
        VllmConnectorConfig.from_extra({"mode": "teleport"})


def test_legs_at_once_pair_by_transfer_id() -> None:
    # The router sends both legs at once: D knows only P's address and the transfer id.
    s = side()
    d_params = {
        "do_remote_prefill": True,
        "transfer_mode": "push",
        "transfer_id": "t1",
        "remote_engine_id": "eng",
        "remote_host": "127.0.0.1",
        "remote_port": 7000,
    }
    assert s.num_matched("d1", d_params, 40, 16) == (24, True)
    s.after_alloc("d1", d_params, [10, 11, 12], 40, 24)
    (spec,) = s.take().recvs
    assert spec.remote_request_id == "t1" and spec.remote_incarnation == ""
    assert spec.first_block == 1 and spec.block_ids == [10, 11, 12]
    p_leg = {"do_remote_decode": True, "transfer_mode": "push", "transfer_id": "t1"}
    delay, params = s.request_finished("p1", p_leg, [5, 6, 7], 40, finished_ok=True)
    assert delay and params is not None and params["remote_request_id"] == "t1"
    (send,) = s.take().sends
    assert send.request_id == "p1" and send.key == "t1"


@pytest.mark.parametrize(
    "bad",
    [
        {"transfer_mode": "push"},  # neither a request id nor a transfer id
        {"transfer_mode": "pull", "transfer_id": "t1"},  # pull needs P's answer
    ],
)
def test_decode_params_without_what_the_mode_needs_compute_locally(bad: dict) -> None:
    s = side()
    params = {"do_remote_prefill": True, "remote_engine_id": "e", "remote_host": "h"}
    params |= {"remote_port": 1, **bad}
    assert s.num_matched("d1", params, 40, 0) == (0, False)


def msgspec_replace(spec: RecvSpec, **kw: object) -> RecvSpec:
    import msgspec

    return msgspec.structs.replace(spec, **kw)


def test_prefill_leg_is_announced_when_it_enters_the_queue() -> None:
    """vLLM considers a waiting request only once those ahead of it are scheduled: P tells
    its worker of a P leg on arrival (on_new_request), so D's registration, which reaches P
    at once, is not failed as unknown while the prompt waits in a long queue."""
    s = side()
    params = {"do_remote_decode": True, "transfer_id": "t9", "transfer_mode": "push"}
    s.arrived("p9", params, 4096)
    spec = PrefillSpec(request_id="p9", transfer_id="t9", mode="push")
    assert s.take() == StepSpecs(admitted=[spec])
    assert s.num_matched("p9", params, 4096, 0) == (0, False)  # considered later: not again
    assert s.take() == StepSpecs()
    s.arrived("d1", {"do_remote_prefill": True}, 10)  # not a P leg: nothing to announce
    assert s.take() == StepSpecs()
