"""The planner on a Ray cluster: every `interval_s`, observe the last window, decide, and
add or drain instances through `RayCluster` (one change at most per decision).

The same `decide` as in the simulator; what differs is only where the observation comes
from (`pdserve.planner.observe`) and how a layout change is made: an added instance is
admitted by the router once healthy; a removed one is the newest of its role, drained
first (`RayCluster.remove_instance`), so no request is dropped. A change of role ("move one
decode instance to prefill") adds the new instance before draining the old one.

Each decision is logged (`pdserve.planner`: action, new layout, reason with the measured
values) and counted in `PlannerMetrics`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge

from pdserve import http_client
from pdserve.cluster.ray_cluster import RayCluster, Role
from pdserve.planner.config import PlannerConfig
from pdserve.planner.observe import Buckets, histogram_buckets, observation
from pdserve.planner.policy import Action, Decision, Observation, PlannerState, decide

log = logging.getLogger("pdserve.planner")


@dataclass
class PlannerMetrics:
    """The planner's Prometheus metrics (its own registry; `pdserve up` may serve it)."""

    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        r = self.registry
        self.decisions = Counter(
            "pdserve_planner_decisions", "Planner decisions, by action.", ["action"], registry=r
        )
        self.instances = Gauge(
            "pdserve_planner_instances", "Instances the planner asked for.", ["role"], registry=r
        )
        self.observed = Gauge(
            "pdserve_planner_observed",
            "The last window's measurements the planner decided on (seconds, or requests "
            "for queues, or a fraction for KV use).",
            ["measure"],
            registry=r,
        )

    def record(self, obs: Observation, decision: Decision) -> None:
        self.decisions.labels(decision.action.value).inc()
        self.instances.labels("prefill").set(decision.num_prefill)
        self.instances.labels("decode").set(decision.num_decode)
        for name, value in (
            ("ttft_seconds", obs.ttft_s),
            ("tpot_seconds", obs.tpot_s),
            ("handoff_seconds", obs.handoff_s),
            ("prefill_queue", obs.prefill_queue),
            ("decode_queue", obs.decode_queue),
            ("decode_kv_use", obs.decode_kv_use),
        ):
            if value is not None:
                self.observed.labels(name).set(value)


class RayPlannerLoop:
    """Owned by the `pdserve up --ray` driver thread (or a test), which calls `step`."""

    def __init__(self, cluster: RayCluster, cfg: PlannerConfig) -> None:
        self.cluster = cluster
        self.cfg = cfg
        self.metrics = PlannerMetrics()
        self._state = PlannerState()
        self._last: Buckets = self._scrape()
        self.decisions: list[Decision] = []

    def observe(self) -> Observation:
        """The window since the last call."""
        now = self._scrape()
        loads = {
            role: [self.cluster.load(n) for n in self.cluster.names(role)]
            for role in ("prefill", "decode")
        }
        obs = observation(self.cfg.percentile, self._last, now, loads["prefill"], loads["decode"])
        self._last = now
        return obs

    def step(self) -> Decision:
        """Observe, decide, apply; returns the decision (logged and counted)."""
        obs = self.observe()
        decision, self._state = decide(self.cfg, obs, self._state)
        log.info(
            "planner: %s -> %dP%dD: %s",
            decision.action.value,
            decision.num_prefill,
            decision.num_decode,
            decision.reason,
        )
        self.metrics.record(obs, decision)
        self.decisions.append(decision)
        self._apply(decision.action)
        return decision

    def _apply(self, action: Action) -> None:
        adds: dict[Action, list[Role]] = {
            Action.ADD_PREFILL: ["prefill"],
            Action.ADD_DECODE: ["decode"],
            Action.DECODE_TO_PREFILL: ["prefill"],
            Action.PREFILL_TO_DECODE: ["decode"],
        }
        removes: dict[Action, list[Role]] = {
            Action.REMOVE_PREFILL: ["prefill"],
            Action.REMOVE_DECODE: ["decode"],
            Action.DECODE_TO_PREFILL: ["decode"],
            Action.PREFILL_TO_DECODE: ["prefill"],
        }
        for role in adds.get(action, []):
            record = self.cluster.add_instance(role)
            log.info("planner: started %s at %s", record.name, record.url)
        for role in removes.get(action, []):
            name = self.cluster.names(role)[-1]
            self.cluster.remove_instance(name)
            log.info("planner: drained and stopped %s", name)

    def _scrape(self) -> Buckets:
        try:
            r = http_client.get(f"{self.cluster.router_url}/metrics", timeout_s=5.0)
            r.raise_for_status()
        except http_client.HttpError as exc:
            log.warning("planner: cannot read the router's metrics: %s", exc)
            return {}
        return histogram_buckets(r.text)
