"""Instance selection policies: which of the admitted instances of one role gets a leg.

A policy sees only `Candidate`s (URL, the legs and tokens the router has in flight there,
the instance's last `/load` report and what was sent since) and the request's `Demand`,
and returns one candidate. It keeps its own small cursor state, owned by the router's
event loop, so one policy object serves one role.

- `round_robin`: the candidates in turn.
- `least_loaded`: fewest legs in flight; ties to the lower reported queue; then rotate.
- `least_tokens`: fewest tokens in flight (prompt tokens on P; max_tokens, plus the prompt
  when prefilled locally, on D); ties as above.
- `load_aware`: the lowest predicted cost from the instances' own reports
  (`pdserve.router.load_model`): on P the predicted prefill finish; on D the predicted
  drain time at the moment the KV arrives (`Demand.ready_in_s`).
- `cache_aware`: the least predicted work counting the prompt's cached prefix: tokens in
  flight there plus the prompt tokens the instance probably does not hold yet (from what
  this policy sent it, `pdserve.router.prefix_index`); on D those weigh less (they are
  received, not computed, unless D prefills locally). Ties as in `least_loaded`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal, Protocol, TypeVar

from pdserve.router.config import PolicyName
from pdserve.router.load_model import (
    Demand,
    LoadView,
    decode_score,
    mean_rate,
    prefill_backlog,
    prefill_finish_s,
)
from pdserve.router.prefix_index import CHUNK_TOKENS, DEFAULT_CAPACITY, PrefixIndex
from pdserve.transfer.params import InstanceLoad

Role = Literal["prefill", "decode"]


class Candidate(LoadView, Protocol):
    """What a policy may look at."""

    @property
    def url(self) -> str: ...


C = TypeVar("C", bound=Candidate)


class Policy(Protocol):
    """Picks one of a non-empty list of candidates."""

    uses_load: bool  # True: the router must poll `/load` for this policy

    def pick(self, candidates: Sequence[C], demand: Demand) -> C: ...


class RoundRobin:
    """Each candidate in turn."""

    uses_load = False

    def __init__(self) -> None:
        self._next = 0

    def pick(self, candidates: Sequence[C], demand: Demand) -> C:
        chosen = candidates[self._next % len(candidates)]
        self._next += 1
        return chosen


def load_score(load: InstanceLoad | None) -> int:
    """Requests the instance reports as queued or running (0 when unknown)."""
    if load is None:
        return 0
    return load.num_running + load.num_waiting + load.num_waiting_for_kv


class _Lowest:
    """The candidate with the lowest key; exact ties rotate so equal instances share."""

    uses_load = True

    def __init__(self) -> None:
        self._rotation = 0

    def _lowest(self, candidates: Sequence[C], key: Callable[[C], tuple[float, ...]]) -> C:
        keys = [key(c) for c in candidates]
        best = min(keys)
        tied = [c for c, k in zip(candidates, keys, strict=True) if k == best]
        chosen = tied[self._rotation % len(tied)]
        self._rotation += 1
        return chosen


class LeastLoaded(_Lowest):
    """Fewest outstanding legs as the router counts them; ties go to the lower reported
    load, and remaining ties rotate so equal instances share the traffic."""

    def pick(self, candidates: Sequence[C], demand: Demand) -> C:
        return self._lowest(candidates, lambda c: (c.outstanding, load_score(c.load)))


class LeastTokens(_Lowest):
    """Fewest outstanding tokens as the router counts them (see `Demand`); ties as in
    `LeastLoaded`."""

    def pick(self, candidates: Sequence[C], demand: Demand) -> C:
        return self._lowest(
            candidates, lambda c: (c.outstanding_tokens, c.outstanding, load_score(c.load))
        )


class LoadAware(_Lowest):
    """The lowest predicted cost from the instances' reports (`load_model`); ties go to
    fewer outstanding tokens, then rotate."""

    def __init__(self, role: Role) -> None:
        super().__init__()
        self.role = role

    def pick(self, candidates: Sequence[C], demand: Demand) -> C:
        if self.role == "prefill":
            rate = prefill_rate_for(candidates)
            return self._lowest(
                candidates,
                lambda c: (_prefill_key(c, demand, rate(c)), c.outstanding_tokens),
            )
        steps = mean_rate([_steps(c) for c in candidates])
        prefill = mean_rate([_prefill_rate(c) for c in candidates])
        return self._lowest(
            candidates,
            lambda c: (
                decode_score(c, demand, _steps(c) or steps, _prefill_rate(c) or prefill),
                c.outstanding_tokens,
            ),
        )


# On D a prompt token not cached there is received (push/pull) rather than computed: far
# cheaper than a token of prefill, so it weighs this much of a token of load (not measured;
# the cache-aware bench compares the outcome with round robin and least-loaded).
DECODE_MISS_WEIGHT = 0.25


class CacheAware(_Lowest):
    """Least predicted work with the cached prefix counted off (see the module docstring).

    The cost of a candidate is its outstanding tokens (the router's count) plus the
    prompt tokens past the prefix it is predicted to hold; the chosen one is then recorded
    as holding this prompt. Load keeps a hot prefix from piling onto one instance: a hit
    wins only while the instance's extra load is smaller than the tokens it saves.
    """

    def __init__(self, role: Role, capacity: int = DEFAULT_CAPACITY) -> None:
        super().__init__()
        self.role = role
        self.index = PrefixIndex(capacity)

    def pick(self, candidates: Sequence[C], demand: Demand) -> C:
        chain = demand.prefix
        local = self.role == "prefill" or demand.local_prefill
        weight = 1.0 if local else DECODE_MISS_WEIGHT

        def key(c: C) -> tuple[float, ...]:
            hit = min(demand.prompt_tokens, self.index.match(c.url, chain) * CHUNK_TOKENS)
            miss = weight * (demand.prompt_tokens - hit)
            return (c.outstanding_tokens + miss, c.outstanding, load_score(c.load))

        chosen = self._lowest(candidates, key)
        self.index.record(chosen.url, chain)
        return chosen


def prefill_rate_for(candidates: Sequence[Candidate]) -> Callable[[Candidate], float | None]:
    """Each candidate's prefill rate, the mean of the known ones where it has none."""
    fallback = mean_rate([_prefill_rate(c) for c in candidates])
    return lambda c: _prefill_rate(c) or fallback


def _prefill_key(c: Candidate, demand: Demand, rate: float | None) -> float:
    finish = prefill_finish_s(c, demand.prompt_tokens, rate)
    return float(prefill_backlog(c)) if finish is None else finish


def _steps(c: Candidate) -> float | None:
    return c.load.decode_steps_per_s if c.load is not None else None


def _prefill_rate(c: Candidate) -> float | None:
    return c.load.prefill_tokens_per_s if c.load is not None else None


def make_policy(name: PolicyName, role: Role = "decode") -> Policy:
    """A fresh policy object for one role."""
    if name == "round_robin":
        return RoundRobin()
    if name == "least_loaded":
        return LeastLoaded()
    if name == "least_tokens":
        return LeastTokens()
    if name == "load_aware":
        return LoadAware(role)
    if name == "cache_aware":
        return CacheAware(role)
    raise ValueError(f"unknown policy {name!r}")
