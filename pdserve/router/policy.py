"""Instance selection policies: which of the admitted instances of one role gets a leg.

A policy sees only `Candidate`s (URL, the legs the router has in flight there, and the
instance's last `/load` report) and returns one of them. It keeps its own small cursor
state, owned by the router's event loop, so one policy object serves one role.
Load-aware push (choosing P and D together) will add a pair policy beside these.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, TypeVar

from pdserve.router.config import PolicyName
from pdserve.transfer.params import InstanceLoad


class Candidate(Protocol):
    """What a policy may look at."""

    @property
    def url(self) -> str: ...

    @property
    def outstanding(self) -> int: ...  # legs the router has sent there and not finished

    @property
    def load(self) -> InstanceLoad | None: ...  # last `GET /load`, None if never fetched


C = TypeVar("C", bound=Candidate)


class Policy(Protocol):
    """Picks one of a non-empty list of candidates."""

    uses_load: bool  # True: the router must poll `/load` for this policy

    def pick(self, candidates: Sequence[C]) -> C: ...


class RoundRobin:
    """Each candidate in turn."""

    uses_load = False

    def __init__(self) -> None:
        self._next = 0

    def pick(self, candidates: Sequence[C]) -> C:
        chosen = candidates[self._next % len(candidates)]
        self._next += 1
        return chosen


def load_score(load: InstanceLoad | None) -> int:
    """Requests the instance reports as queued or running (0 when unknown)."""
    if load is None:
        return 0
    return load.num_running + load.num_waiting + load.num_waiting_for_kv


class LeastLoaded:
    """Fewest outstanding legs as the router counts them; ties go to the lower reported load,
    and remaining ties rotate so equal instances share the traffic."""

    uses_load = True

    def __init__(self) -> None:
        self._rotation = 0

    def pick(self, candidates: Sequence[C]) -> C:
        keys = [(c.outstanding, load_score(c.load)) for c in candidates]
        best = min(keys)
        tied = [c for c, k in zip(candidates, keys, strict=True) if k == best]
        chosen = tied[self._rotation % len(tied)]
        self._rotation += 1
        return chosen


def make_policy(name: PolicyName) -> Policy:
    """A fresh policy object (one per role)."""
    if name == "round_robin":
        return RoundRobin()
    if name == "least_loaded":
        return LeastLoaded()
    raise ValueError(f"unknown policy {name!r}")
