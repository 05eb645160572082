"""What a connector may see of its cluster (`ClusterView`), so connectors need no `Cluster`.

`pdserve.sim.cluster.Cluster` builds its connector and satisfies this structurally; the
connectors import only this, which keeps the two modules free of an import cycle. The cluster
owns everything named here; a connector reads it and schedules events, and never keeps an
instance or a link beyond the request it is moving.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from pdserve.sim.cluster_config import ClusterConfig
from pdserve.sim.costs import CostModel
from pdserve.sim.engine import EventLoop, FifoServer
from pdserve.sim.instance import Instance, SimRequest


class Picker(Protocol):
    """The router's choice of the next instance of one role."""

    def pick(self) -> Instance: ...


class ClusterView(Protocol):
    """The cluster as its connector sees it."""

    cfg: ClusterConfig
    loop: EventLoop
    on_done: Callable[[SimRequest], None]
    prefill_costs: CostModel
    decode_costs: CostModel
    pick_prefill: Picker
    pick_decode: Picker

    def link(self, p: Instance, d: Instance) -> FifoServer:
        """The P->D network path."""
        ...

    def pair_ready(self, p: Instance, d: Instance, now: float) -> float:
        """When P and D can talk (after the first contact's handshake unless warm)."""
        ...

    def wire_time(self, num_bytes: float) -> float:
        """Serialisation time of a P->D transfer of `num_bytes`."""
        ...
