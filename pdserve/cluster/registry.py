"""Who serves where: the registry the instances of a Ray cluster report to.

One `Registry` per cluster, run as a named Ray actor (`pdserve.cluster.ray_actors`); this
module is plain Python so that it can be tested without Ray. Owners:

- an instance actor calls `register` each time its process starts (the first time and after
  every restart by Ray), with the URL it now serves on, its PID and node; a name seen
  before with another PID counts as a restart (a new incarnation);
- the cluster (the `pdserve up --ray` driver) calls `set_draining` and `remove` when it
  scales down or finds an actor dead for good;
- the router reads `membership` and `acknowledge`s each version it applied, so the driver
  knows when a draining instance gets no more legs (`acknowledged`).
"""

from __future__ import annotations

import msgspec

from pdserve.router.membership import Member, Membership
from pdserve.router.policy import Role


class InstanceRecord(msgspec.Struct, frozen=True):
    """One instance's current process, as it registered."""

    name: str  # "prefill-0", "decode-1": stable across restarts
    role: Role
    url: str
    pid: int
    node_id: str
    node_ip: str
    restarts: int = 0
    draining: bool = False


class Registry:
    """The members of one cluster and a version that changes with them."""

    def __init__(self) -> None:
        self._records: dict[str, InstanceRecord] = {}
        self._version = 0
        self._acknowledged = -1

    def register(self, record: InstanceRecord) -> InstanceRecord:
        """Record `record`'s process; returns it with its restart count."""
        old = self._records.get(record.name)
        restarts = 0 if old is None else old.restarts + (old.pid != record.pid)
        stored = msgspec.structs.replace(
            record, restarts=restarts, draining=old.draining if old else False
        )
        self._records[record.name] = stored
        self._version += 1
        return stored

    def set_draining(self, name: str) -> int:
        """Stop new legs to `name` (the router drops it at the returned version)."""
        self._records[name] = msgspec.structs.replace(self._records[name], draining=True)
        self._version += 1
        return self._version

    def remove(self, name: str) -> int:
        """Forget `name` (stopped, or dead for good); returns the new version."""
        self._records.pop(name, None)
        self._version += 1
        return self._version

    def records(self) -> list[InstanceRecord]:
        return list(self._records.values())

    def membership(self) -> Membership:
        members = tuple(Member(r.url, r.role, r.draining) for r in self._records.values())
        return Membership(self._version, members)

    def acknowledge(self, version: int) -> None:
        self._acknowledged = max(self._acknowledged, version)

    def acknowledged(self) -> int:
        """The newest version the router has applied (-1: none yet)."""
        return self._acknowledged
