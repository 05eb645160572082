"""A simulated P/D cluster: the instances, the router's choices, and the client's view.

`Cluster` builds N prefill and M decode instances (or N + M monolithic ones for
`mode="monolithic"`), the P->D links, and the connector that plays the mode's protocol
(`pdserve.sim.connectors`). The router picks instances round-robin per role (pull picks D
only when P has answered; push picks both up front). Every token D (or a monolithic
instance) emits reaches the client two HTTP hops later (instance -> router -> client).
"""

from __future__ import annotations

from collections.abc import Callable

from pdserve.sim.cluster_config import ClusterConfig
from pdserve.sim.connectors import make_connector
from pdserve.sim.costs import CostModel
from pdserve.sim.engine import EventLoop, FifoServer
from pdserve.sim.instance import Instance, Role, SimRequest


class RoundRobin:
    """The router's per-role cursor."""

    def __init__(self, items: list[Instance]) -> None:
        self.items = items
        self._next = 0

    def pick(self) -> Instance:
        item = self.items[self._next % len(self.items)]
        self._next += 1
        return item


class Cluster:
    """Owns the instances, links and connector of one simulated run."""

    def __init__(
        self, cfg: ClusterConfig, loop: EventLoop, on_done: Callable[[SimRequest], None]
    ) -> None:
        self.cfg = cfg
        self.loop = loop
        self.on_done = on_done
        self.prefill_costs = CostModel(cfg.model, cfg.hardware, cfg.software, cfg.tp_prefill)
        self.decode_costs = CostModel(cfg.model, cfg.hardware, cfg.software, cfg.tp_decode)
        self.connector = make_connector(self)  # a ClusterView: the connector sees no more
        if cfg.mode == "monolithic":
            n = cfg.num_prefill + cfg.num_decode
            self.prefill = [
                self._instance(f"mono{i}", "both", self.prefill_costs) for i in range(n)
            ]
            self.decode: list[Instance] = []
        else:
            self.prefill = [
                self._instance(f"P{i}", "prefill", self.prefill_costs)
                for i in range(cfg.num_prefill)
            ]
            self.decode = [
                self._instance(f"D{i}", "decode", self.decode_costs) for i in range(cfg.num_decode)
            ]
        self.pick_prefill = RoundRobin(self.prefill)
        self.pick_decode = RoundRobin(self.decode)
        self.links: dict[tuple[str, str], FifoServer] = {}
        self.handshake_done: dict[tuple[str, str], float] = {}

    def _instance(self, name: str, role: Role, costs: CostModel) -> Instance:
        return Instance(name, role, costs, self.loop, self.connector)

    @property
    def instances(self) -> list[Instance]:
        return self.prefill + self.decode

    def check_fits(self, prompt_len: int, output_len: int) -> None:
        """ValueError when a request could never be admitted (KV larger than an instance)."""
        for inst in self.instances:
            need = prompt_len + (output_len if inst.role != "prefill" else 0)
            if inst.blocks_for(need) > inst.total_blocks:
                raise ValueError(
                    f"a request of {prompt_len}+{output_len} tokens needs "
                    f"{inst.blocks_for(need)} KV blocks; {inst.name} has {inst.total_blocks}"
                )

    def submit(self, req: SimRequest) -> None:
        """The client sends `req` now."""
        self.connector.dispatch(req, self.loop.now)

    def link(self, p: Instance, d: Instance) -> FifoServer:
        """The P->D network path (both sides' NIC shares), FIFO."""
        return self.links.setdefault((p.name, d.name), FifoServer())

    def pair_ready(self, p: Instance, d: Instance, now: float) -> float:
        """When P and D can talk: now if warm or already handshaken, else after the first
        contact's handshake (requests arriving meanwhile wait for the same one)."""
        if self.cfg.warm:
            return now
        key = (p.name, d.name)
        if key not in self.handshake_done:
            self.handshake_done[key] = now + self.cfg.software.handshake_s
        return max(now, self.handshake_done[key])

    def wire_time(self, num_bytes: float) -> float:
        """Serialisation time of a P->D transfer: each TP rank pair moves its shard over its
        own network share, so the narrower side sets the aggregate bandwidth."""
        tp = min(self.cfg.tp_prefill, self.cfg.tp_decode)
        return num_bytes / (tp * self.cfg.hardware.net_bw_per_device)
