"""Which waiting requests a peer's death ends: all of its address's, but after a restart
only the old incarnation's (a leg admitted after the restart names the new one)."""

from __future__ import annotations

from pdserve.transfer.adapter import RemoteRequest
from pdserve.transfer.connector import PeerDown
from pdserve.transfer.params import KVTransferParams

ADDR = ("127.0.0.1", 40000)


def waiting(incarnation: str, port: int = 40000) -> RemoteRequest:
    params = KVTransferParams(
        do_remote_prefill=True,
        transfer_mode="pull",
        remote_engine_id="prefill-0",
        remote_incarnation=incarnation,
        remote_host="127.0.0.1",
        remote_port=port,
    )
    return RemoteRequest("r", params, [1, 2, 3], (0,), 3)


def test_a_dead_peer_ends_every_request_at_its_address() -> None:
    down = PeerDown(ADDR, "stopped answering")
    assert down.ends(waiting("old")) and down.ends(waiting("new"))
    assert not down.ends(waiting("old", port=40001))


def test_a_restarted_peer_ends_only_its_old_incarnation_s_requests() -> None:
    down = PeerDown(ADDR, "restarted (new incarnation)", restarted_as="new")
    assert down.ends(waiting("old"))
    assert not down.ends(waiting("new"))
