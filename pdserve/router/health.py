"""The router's view of its instances: admission by health checks, identity, load.

`InstancePool` holds one `Instance` per configured URL. Every field of an `Instance` is
written only on the router's event loop (by `HealthMonitor`'s tasks and by the dispatcher's
acquire/release), so no locks are needed.

Health: `/health` every `health_interval_s`; an instance is admitted (may be picked) after
one success and ejected after `health_failures_to_eject` failures in a row. An instance
never seen healthy is not admitted. Identity: `GET /kv/info` is read before every
admission and checked (`pdserve.router.admission`): an instance whose role, transfer mode,
model or transport does not fit is refused (not admitted; logged once per change, listed
on the router's /health) and checked again every round, so fixing it needs no router
restart. One whose /kv/info cannot be read is admitted at a later round; one that answers
404 is admitted unchecked, and so is every instance of a router for vLLM instances
(`RouterConfig.engine`), which never asks: vLLM has /health but no /kv/info or /load (a
push P's coordinates then come from the configuration, `Instance.peer`). For prefill
instances in push mode /kv/info is re-read every round, so a restarted P (new
incarnation) is noticed within a round instead of being sent stale side-channel
coordinates (and refused if it no longer fits). Load:
`GET /load` every `load_interval_s` while the policy uses it. With a cluster token both
reads carry a fresh proof of it (`X-PDServe-Cluster-Auth`, pdserve.transfer.cluster_auth),
which instances with a token require; `/health` needs none.

Counted per instance (read by the metrics at scrape time): ejections, and restarts the
router noticed: a new incarnation in /kv/info (at a re-admission or a push P's refresh);
for an instance without /kv/info, which cannot tell, every re-admission after an ejection.

Legs: `InstancePool.acquire` opens a `Leg` on the chosen instance and `release` closes it,
exactly once (the dispatcher's ownership rules). An instance's outstanding legs and tokens
are its open legs; those opened after its last `/load` was requested (less
`LEG_SETTLE_S`) are "unreported" and the load model adds them to the report.

Ejection signal: each admission gives the instance a fresh `ejected` event, which the
monitor sets when it ejects the instance. A leg keeps the event of the admission it was
opened under (`Leg.ejected`), so the dispatcher can end a leg stuck on an instance that
stopped answering at once instead of at `request_timeout_s`; a later re-admission does not
revive it.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import msgspec

from pdserve.router.admission import Refusal, refusal
from pdserve.router.config import RouterConfig
from pdserve.router.load_model import Demand, mean_rate, prefill_finish_s
from pdserve.router.policy import Policy, Role, make_policy
from pdserve.router.upstream import Answer, Upstream, UpstreamError, UpstreamProtocolError
from pdserve.router.vllm_legs import PrefillPeer
from pdserve.server.load_report import LoadReport
from pdserve.transfer.cluster_auth import route_headers
from pdserve.transfer.params import InstanceInfo

log = logging.getLogger(__name__)

# How long a new leg may take to show up in an instance's load report.
LEG_SETTLE_S = 0.1

# Why the dispatcher ends a leg whose instance the monitor ejected (client-facing text).
EJECTED_REASON = "ejected: not answering health checks"
# The router's state while no prefill instance is usable (logs and the /health body).
NO_PREFILL_DEGRADED = "no prefill instance: prefilling on decode instances"


@dataclass(frozen=True, eq=False)
class Leg:
    """One leg of a request on one instance, from `acquire` to `release`."""

    id: int
    prompt_tokens: int  # tokens it counts as prompt work (P, or D prefilling locally)
    decode_tokens: int  # tokens it counts as decode work (D)
    opened: float  # time.monotonic()
    # Set when the instance is ejected (the event of the admission the leg was opened under).
    ejected: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + self.decode_tokens


@dataclass(eq=False)
class Instance:
    """One prefill or decode instance. Owned and mutated by the router's event loop only."""

    url: str
    role: Role
    admitted: bool = False
    failures: int = 0  # consecutive failed health checks
    legs: dict[int, Leg] = field(default_factory=dict)  # open legs (the router's own count)
    load: LoadReport | None = None
    load_requested: float = 0.0  # time.monotonic() the poll that gave `load` was sent
    info: InstanceInfo | None = None
    info_unsupported: bool = False  # /kv/info answered 404, or a vLLM instance
    peer: PrefillPeer | None = None  # a vLLM prefill instance's connector (configured)
    refused: Refusal | None = None  # healthy, but does not fit the cluster (admission.py)
    incarnation_seen: str | None = None  # the last one /kv/info gave (kept across ejections)
    ejections: int = 0
    restarts: int = 0  # noticed by the router (module doc)
    # Fresh at each admission, set at ejection (see the module docstring).
    ejected: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def outstanding(self) -> int:
        """Legs sent and not yet finished."""
        return len(self.legs)

    @property
    def outstanding_tokens(self) -> int:
        return sum(leg.tokens for leg in self.legs.values())

    def _unreported(self) -> list[Leg]:
        # A leg opened just before the poll may not be in the instance's lists yet (its
        # request is still on the wire or in the engine's inbox until the next step):
        # counting it twice for one poll is safer than forgetting it.
        since = self.load_requested - LEG_SETTLE_S
        return [leg for leg in self.legs.values() if leg.opened >= since]

    @property
    def unreported_legs(self) -> int:
        return len(self._unreported())

    @property
    def unreported_prompt_tokens(self) -> int:
        return sum(leg.prompt_tokens for leg in self._unreported())

    @property
    def unreported_decode_tokens(self) -> int:
        return sum(leg.decode_tokens for leg in self._unreported())

    @property
    def can_receive_push(self) -> bool:
        """A push D leg needs this P's engine id and side channel (its /kv/info, or for a
        vLLM instance its configured `peer`)."""
        if self.peer is not None:
            return True
        i = self.info
        return i is not None and i.side_channel_host is not None and i.side_channel_port is not None


class InstancePool:
    """The configured instances and one selection policy per role. `instances` is replaced
    whole (never mutated in place) when a membership source changes it
    (`pdserve.router.membership`)."""

    def __init__(self, config: RouterConfig) -> None:
        peers = config.prefill_peers or (None,) * len(config.prefill_urls)
        prefill = [
            Instance(u, "prefill", peer=peer)
            for u, peer in zip(config.prefill_urls, peers, strict=True)
        ]
        decode = [Instance(u, "decode") for u in config.decode_urls]
        self.instances: tuple[Instance, ...] = (*prefill, *decode)
        self._policies: dict[Role, Policy] = {
            "prefill": make_policy(config.policy, "prefill"),
            "decode": make_policy(config.policy, "decode"),
        }
        self.uses_load = self._policies["prefill"].uses_load
        self._leg_ids = itertools.count()

    def by_role(self, role: Role) -> list[Instance]:
        """Every configured instance of `role`, admitted or not."""
        return [i for i in self.instances if i.role == role]

    def admitted(self, role: Role) -> list[Instance]:
        """The instances of `role` that may be picked now."""
        return [i for i in self.instances if i.role == role and i.admitted]

    def prefill_usable(self, push: bool) -> bool:
        """Whether an admitted prefill instance can take a P leg (push: one whose side
        channel is known)."""
        return any(i.can_receive_push or not push for i in self.admitted("prefill"))

    def refusals(self, role: Role) -> list[tuple[Instance, Refusal]]:
        """The healthy instances of `role` refused for not fitting the cluster."""
        return [(i, i.refused) for i in self.by_role(role) if i.refused is not None]

    def reference_info(self, other_than: Instance) -> InstanceInfo | None:
        """The identity the cluster's admitted instances share (the first one's), which a
        new instance's model and transport must match; None while none is admitted."""
        return next(
            (i.info for i in self.instances if i.admitted and i.info and i is not other_than),
            None,
        )

    def acquire(
        self,
        role: Role,
        demand: Demand,
        *,
        need_push_info: bool = False,
        prefer: Instance | None = None,
    ) -> tuple[Instance, Leg] | None:
        """Pick an admitted instance (`prefer` when it is one it could pick, else the
        policy's choice) and open a leg on it; the caller must `release` it."""
        candidates = self.admitted(role)
        if need_push_info:
            candidates = [i for i in candidates if i.can_receive_push]
        if not candidates:
            return None
        if any(c is prefer for c in candidates):
            chosen = prefer
        else:
            chosen = self._policies[role].pick(candidates, demand)
        prefills = role == "prefill" or demand.local_prefill
        prompt = demand.prompt_tokens if prefills else 0
        decode = demand.decode_tokens if role == "decode" else 0
        leg = Leg(next(self._leg_ids), prompt, decode, time.monotonic(), chosen.ejected)
        chosen.legs[leg.id] = leg
        return chosen, leg

    def predict_prefill_s(self, p: Instance) -> float:
        """Predicted seconds until prefill instance `p` has worked off its backlog (which
        includes a leg just opened there), at its measured rate or the mean of the other
        prefill instances'; 0 when no rate is known (no prediction)."""
        rate = mean_rate([p.load.prefill_tokens_per_s if p.load else None])
        if rate is None:
            rate = mean_rate(
                [i.load.prefill_tokens_per_s for i in self.admitted("prefill") if i.load]
            )
        return prefill_finish_s(p, 0, rate) or 0.0

    @staticmethod
    def release(instance: Instance, leg: Leg) -> None:
        """A leg opened by `acquire` has ended (a second release is a no-op)."""
        instance.legs.pop(leg.id, None)


class HealthMonitor:
    """Background tasks keeping `InstancePool` current; started and stopped by the app."""

    def __init__(self, pool: InstancePool, upstream: Upstream, config: RouterConfig) -> None:
        self._pool = pool
        self._upstream = upstream
        self._config = config
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        """One health round now (so instances already up are admitted at once), then loops."""
        await self.check_all()
        self._tasks.append(
            asyncio.create_task(self._every(self._config.health_interval_s, self.check_all))
        )
        if self._pool.uses_load:
            self._tasks.append(
                asyncio.create_task(self._every(self._config.load_interval_s, self.poll_loads))
            )

    async def stop(self) -> None:
        """Cancel the background loops and wait for them."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()

    async def check_all(self) -> None:
        """One health round over every instance: probes and /kv/info reads concurrently,
        then admissions in the configured order (prefill URLs, then decode URLs), so the
        instance that sets the cluster's model and transport does not depend on timing."""
        instances = self._pool.instances  # a membership change may replace it meanwhile
        seen = await asyncio.gather(*(self._observe(i) for i in instances))
        for inst, candidate in zip(instances, seen, strict=True):
            if candidate is not None:
                self._admit(inst, candidate)

    async def poll_loads(self) -> None:
        """Refresh `load` of every admitted instance; a failed poll clears it."""
        await asyncio.gather(*(self._poll_load(i) for i in self._pool.instances if i.admitted))

    @staticmethod
    async def _every(interval: float, round_: Callable[[], Awaitable[None]]) -> None:
        while True:
            started = time.monotonic()
            try:
                await round_()
            except Exception:  # a bug in one round must not stop health checking for good
                log.exception("router background round failed")
            await asyncio.sleep(max(0.0, interval - (time.monotonic() - started)))

    async def _check(self, inst: Instance) -> None:
        """One instance's health round (`check_all` does every instance's)."""
        candidate = await self._observe(inst)
        if candidate is not None:
            self._admit(inst, candidate)

    async def _observe(self, inst: Instance) -> _Candidate | None:
        """Probe `inst` and apply what that says about an admitted one (ejection, a push
        P's refreshed /kv/info); for a healthy one not admitted, its /kv/info to decide on
        (None: nothing to decide this round)."""
        if not await self._probe(inst):
            inst.failures += 1
            inst.refused = None  # down now; whether it fits is checked when it is back
            if inst.admitted and inst.failures >= self._config.health_failures_to_eject:
                log.warning(
                    "%s instance %s failed %d health checks: ejected",
                    inst.role,
                    inst.url,
                    inst.failures,
                )
                inst.ejections += 1
                self._unadmit(inst)
            return None
        inst.failures = 0
        if not inst.admitted:
            return await self._read_info(inst)
        if self._wants_info(inst):
            read = await self._read_info(inst)
            if read is not None and read.info is not None:
                self._take_info(inst, read.info)
        return None

    def _admit(self, inst: Instance, candidate: _Candidate) -> None:
        """Admit a healthy instance whose /kv/info fits (or that has none)."""
        if candidate.info is not None and not self._take_info(inst, candidate.info):
            return
        if candidate.info is None and inst.ejections:
            inst.restarts += 1  # without /kv/info it cannot tell: every come-back may be one
        log.info("%s instance %s is healthy: admitted", inst.role, inst.url)
        inst.ejected = asyncio.Event()
        inst.admitted = True

    @staticmethod
    def _unadmit(inst: Instance) -> None:
        inst.admitted = False
        inst.ejected.set()  # ends the legs still open on it (the dispatcher)
        inst.info, inst.info_unsupported, inst.load = None, False, None

    async def _probe(self, inst: Instance) -> bool:
        try:
            r = await self._upstream.get(
                f"{inst.url}/health", timeout_s=self._config.health_timeout_s
            )
        except UpstreamError:
            return False
        return r.status == 200

    def _wants_info(self, inst: Instance) -> bool:
        if inst.info_unsupported:
            return False
        push_prefill = self._config.kv_transfer == "push" and inst.role == "prefill"
        return inst.info is None or push_prefill

    async def _read_info(self, inst: Instance) -> _Candidate | None:
        """`inst`'s /kv/info (info None: it has none, a 404, or it is a vLLM instance), or
        None if unreadable."""
        if self._config.engine == "vllm":
            inst.info_unsupported = True
            return _Candidate(None)
        try:
            r = await self._for_routers(inst, "/kv/info")
            if r.status == 404:
                if not inst.info_unsupported:
                    log.info("%s instance %s has no /kv/info", inst.role, inst.url)
                inst.info_unsupported, inst.refused = True, None
                return _Candidate(None)
            return _Candidate(msgspec.json.decode(_success(r).content, type=InstanceInfo))
        except (UpstreamError, msgspec.DecodeError) as exc:
            log.warning("cannot read /kv/info of %s: %s", inst.url, exc)
            return None

    def _take_info(self, inst: Instance, info: InstanceInfo) -> bool:
        """Check `info` (`pdserve.router.admission`) and keep it if it fits; a misfit is
        refused, and ejected if it was admitted. False if refused."""
        found = refusal(inst.role, info, self._config.kv_transfer, self._pool.reference_info(inst))
        self._note_refusal(inst, found)
        if found is not None:
            if inst.admitted:
                self._unadmit(inst)
            return False
        _log_identity_change(inst, info)
        if inst.incarnation_seen not in (None, info.incarnation):
            inst.restarts += 1
        inst.info, inst.incarnation_seen = info, info.incarnation
        return True

    @staticmethod
    def _note_refusal(inst: Instance, found: Refusal | None) -> None:
        """Record `inst`'s refusal, logging only changes (it is checked every round)."""
        if found == inst.refused:
            return
        if found is not None:
            log.warning("%s instance %s refused: %s", inst.role, inst.url, found.detail)
        else:
            log.info("%s instance %s now fits the cluster", inst.role, inst.url)
        inst.refused = found

    async def _for_routers(self, inst: Instance, path: str) -> Answer:
        """GET a route for routers of `inst`, with a proof of the cluster token if any."""
        headers = route_headers(self._config.cluster_token, path)
        return await self._upstream.get(
            f"{inst.url}{path}", timeout_s=self._config.health_timeout_s, headers=headers
        )

    async def _poll_load(self, inst: Instance) -> None:
        requested = time.monotonic()
        try:
            r = await self._for_routers(inst, "/load")
            inst.load = msgspec.json.decode(_success(r).content, type=LoadReport)
            inst.load_requested = requested
        except (UpstreamError, msgspec.DecodeError):
            inst.load, inst.load_requested = None, 0.0


@dataclass(frozen=True)
class _Candidate:
    """A healthy instance's /kv/info, read for the admission decision (None: it has none)."""

    info: InstanceInfo | None


def _success(answer: Answer) -> Answer:
    """`answer` if its status is 2xx, else an `UpstreamError` naming the status (and for a
    refused proof, what to fix)."""
    if answer.status in (401, 403):
        raise UpstreamProtocolError(
            f"HTTP {answer.status}: the instance has a cluster token and the router's proof "
            "of it is missing or wrong (--cluster-token or $PDSERVE_CLUSTER_TOKEN)"
        )
    if not answer.is_success:
        raise UpstreamProtocolError(f"HTTP {answer.status}")
    return answer


def _log_identity_change(inst: Instance, info: InstanceInfo) -> None:
    old = inst.incarnation_seen
    if old is not None and old != info.incarnation:
        log.warning(
            "%s instance %s restarted (incarnation %s -> %s): side channel %s:%s",
            inst.role,
            inst.url,
            old,
            info.incarnation,
            info.side_channel_host,
            info.side_channel_port,
        )
