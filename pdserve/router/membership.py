"""Instances that come and go: the router's pool follows a membership source.

A router started with fixed URLs (`pdserve router --prefill ... --decode ...`) never
changes its pool. One started with a `MembershipSource` (Ray: `pdserve.cluster.ray_router`)
asks it every `interval_s` which instances exist, and `apply` makes the pool match:

- a new URL becomes a new `Instance`, admitted by the health monitor once it answers and
  fits (as at start-up);
- a member marked draining leaves the pool at once, so no new leg is sent to it, but it
  is not ejected: legs already open on it keep their `Instance` and finish (the dispatcher
  holds them), which is what lets a drained instance be stopped without dropping requests;
- a URL no longer listed at all (its process died and came back elsewhere, or its node
  left) is ejected (its `ejected` event ends the legs still open there) and dropped.

The watcher is the only writer of `InstancePool.instances` after start-up, on the router's
event loop like every other pool write; it tells the source which version it applied
(`acknowledge`), so whoever drains an instance knows when the router stopped picking it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Protocol

import msgspec

from pdserve.router.health import Instance, InstancePool
from pdserve.router.policy import Role

log = logging.getLogger(__name__)


class Member(msgspec.Struct, frozen=True):
    """One instance as the membership source lists it."""

    url: str
    role: Role
    draining: bool = False


class Membership(msgspec.Struct, frozen=True):
    """What exists at one version of the source."""

    version: int
    members: tuple[Member, ...]


class MembershipSource(Protocol):
    """Where a dynamic router learns its instances (owned by whoever made the router)."""

    async def current(self) -> Membership:
        """The members now (may block briefly; called from the router's event loop)."""
        ...

    async def acknowledge(self, version: int) -> None:
        """The router's pool now reflects `version` (no new legs to members drained by it)."""
        ...


def apply(pool: InstancePool, members: Sequence[Member]) -> list[str]:
    """Make `pool` hold exactly the non-draining `members`; returns one log line per change.
    Kept instances keep their state (admission, legs, load); see the module doc for
    what leaving means."""
    wanted = {(m.url, m.role) for m in members if not m.draining}
    draining = {(m.url, m.role) for m in members if m.draining}
    kept: list[Instance] = []
    changes = []
    for inst in pool.instances:
        key = (inst.url, inst.role)
        if key in wanted:
            kept.append(inst)
            wanted.discard(key)
            continue
        if key in draining:
            changes.append(f"{inst.role} instance {inst.url} draining: no new legs")
        else:
            changes.append(f"{inst.role} instance {inst.url} left the cluster: ejected")
            inst.admitted = False
            inst.ejected.set()  # legs still open there end now (the dispatcher)
    for url, role in sorted(wanted, key=lambda k: (k[1] != "prefill", k[0])):
        kept.append(Instance(url, role))
        changes.append(f"{role} instance {url} joined: admitted once healthy")
    pool.instances = tuple(kept)
    return changes


class MembershipWatcher:
    """The background task that keeps `pool` in step with `source` (started by the app)."""

    def __init__(self, pool: InstancePool, source: MembershipSource, interval_s: float) -> None:
        self._pool = pool
        self._source = source
        self._interval_s = interval_s
        self._task: asyncio.Task[None] | None = None
        self.version = -1  # the last version applied

    async def refresh(self) -> None:
        """Read the source once and apply it (nothing when its version is unchanged)."""
        found = await self._source.current()
        if found.version != self.version:
            for line in apply(self._pool, found.members):
                log.info("%s", line)
            self.version = found.version
        await self._source.acknowledge(self.version)

    async def start(self) -> None:
        await self.refresh()
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self._interval_s)
            try:
                await self.refresh()
            except Exception:  # a source that fails once must not stop the watching
                log.exception("membership refresh failed; keeping the current instances")
