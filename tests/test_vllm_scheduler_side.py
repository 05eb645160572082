"""pdserve.vllm's scheduler side without vLLM: params in, specs out, block arithmetic."""

from __future__ import annotations

import pytest

from pdserve.vllm.config import VllmConnectorConfig
from pdserve.vllm.scheduler import SchedulerSide
from pdserve.vllm.specs import RecvSpec, ReleaseSpec, SendSpec, WorkerCard

BS = 16


def side() -> SchedulerSide:
    s = SchedulerSide(VllmConnectorConfig.from_extra({"side_port": 7000}), "eng", BS)
    s.worker = WorkerCard(engine_id="eng", incarnation="inc1")
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
    assert params["remote_port"] == 7000
    assert params["transfer_mode"] == "pull"
    recvs, sends, releases = s.take()
    assert sends == [SendSpec(request_id="p1", block_ids=[5, 6, 7], num_tokens=40)]
    assert recvs == [] and releases == []
    assert s.take() == ([], [], [])


def test_aborted_prefill_frees_at_once() -> None:
    s = side()
    assert s.request_finished("p1", {"do_remote_decode": True}, [1], 4, False) == (False, None)
    assert s.take() == ([], [], [])


@pytest.mark.parametrize("local_hit", [0, 16, 32])
def test_decode_receives_the_blocks_its_prefix_cache_lacks(local_hit: int) -> None:
    s = side()
    params = p_params(s, [5, 6, 7], 40)
    s.take()
    assert s.num_matched("d1", params, 40, local_hit) == (40 - local_hit, True)
    s.after_alloc("d1", params, [10, 11, 12, 13], 40, 40 - local_hit)
    (spec,), _, _ = s.take()
    assert isinstance(spec, RecvSpec)
    first = local_hit // BS
    assert spec.first_block == first
    assert spec.block_ids == [10, 11, 12][first:]  # the lookahead block 13 is not P's
    assert spec.remote_block_ids == [5, 6, 7]
    assert params["do_remote_prefill"] is False  # not loaded twice (preemption)


def test_decode_that_loads_nothing_releases_p() -> None:
    s = side()
    params = p_params(s, [5], 1)
    s.take()
    s.after_alloc("d1", params, [3], 1, 0)  # vLLM recomputes a one-token prompt
    recvs, _, releases = s.take()
    assert recvs == []
    assert releases == [ReleaseSpec(remote_request_id="p1", remote_address=("127.0.0.1", 7000))]


def test_decode_aborted_while_queued_releases_p() -> None:
    s = side()
    params = p_params(s, [5], 10)
    s.take()
    assert s.request_finished("d1", params, [], 0, False) == (False, None)
    assert len(s.take()[2]) == 1


def test_malformed_params_compute_locally() -> None:
    s = side()
    bad = {"do_remote_prefill": True, "remote_block_ids": "x"}
    assert s.num_matched("d1", bad, 10, 0) == (0, False)
    s.after_alloc("d1", bad, [1], 10, 0)
    assert s.take() == ([], [], [])


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
    (spec,), _, _ = s.take()
    assert spec.remote_request_id == "t1" and spec.remote_incarnation == ""
    assert spec.first_block == 1 and spec.block_ids == [11, 12]
    p_leg = {"do_remote_decode": True, "transfer_mode": "push", "transfer_id": "t1"}
    delay, params = s.request_finished("p1", p_leg, [5, 6, 7], 40, finished_ok=True)
    assert delay and params is not None and params["remote_request_id"] == "t1"
    _, (send,), _ = s.take()
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
