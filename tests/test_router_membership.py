"""The router's pool following a membership source, and the registry behind it (no Ray)."""

from __future__ import annotations

import asyncio

from pdserve.cluster.registry import InstanceRecord, Registry
from pdserve.router.config import RouterConfig
from pdserve.router.health import InstancePool
from pdserve.router.membership import Member, Membership, MembershipWatcher, apply

P0, D0, D1 = "http://127.0.0.1:1001", "http://127.0.0.1:2001", "http://127.0.0.1:2002"


def _pool() -> InstancePool:
    return InstancePool(RouterConfig(prefill_urls=(P0,), decode_urls=(D0,), kv_transfer="push"))


def test_joined_instances_wait_for_health_and_kept_ones_keep_their_state() -> None:
    pool = _pool()
    p0 = pool.instances[0]
    p0.admitted = True
    apply(pool, [Member(P0, "prefill"), Member(D0, "decode"), Member(D1, "decode")])
    assert pool.instances[0] is p0 and p0.admitted
    joined = pool.instances[-1]
    assert joined.url == D1 and joined.role == "decode" and not joined.admitted


def test_draining_leaves_selection_without_ending_legs_and_gone_is_ejected() -> None:
    pool = _pool()
    for inst in pool.instances:
        inst.admitted = True
    p0, d0 = pool.instances
    lines = apply(pool, [Member(P0, "prefill", draining=True)])
    assert pool.instances == ()
    assert not p0.ejected.is_set()  # its open legs run on
    assert d0.ejected.is_set() and not d0.admitted  # gone: its legs end now
    assert any("draining" in line for line in lines) and any("left" in line for line in lines)


class _Source:
    def __init__(self, membership: Membership) -> None:
        self.membership = membership
        self.acknowledged: list[int] = []

    async def current(self) -> Membership:
        return self.membership

    async def acknowledge(self, version: int) -> None:
        self.acknowledged.append(version)


def test_watcher_applies_new_versions_and_acknowledges_them() -> None:
    pool = _pool()
    source = _Source(Membership(3, (Member(P0, "prefill"), Member(D1, "decode"))))
    watcher = MembershipWatcher(pool, source, interval_s=60)
    asyncio.run(watcher.refresh())
    assert [i.url for i in pool.instances] == [P0, D1]
    assert source.acknowledged == [3]


def test_registry_counts_restarts_and_versions_changes() -> None:
    reg = Registry()
    first = reg.register(InstanceRecord("decode-0", "decode", D0, 100, "n1", "127.0.0.1"))
    assert first.restarts == 0
    again = reg.register(InstanceRecord("decode-0", "decode", D1, 200, "n1", "127.0.0.1"))
    assert again.restarts == 1
    version = reg.set_draining("decode-0")
    members = reg.membership()
    assert members.version == version and members.members == (Member(D1, "decode", True),)
    assert reg.acknowledged() == -1
    reg.acknowledge(version)
    assert reg.acknowledged() == version
    assert reg.remove("decode-0") > version and reg.records() == []
