"""When to start a dead child again, and when to give up on it: a pure policy, fed times.

`RestartBudget` is one child's: each failure (the child died, or a restart of it never
became healthy) is recorded at a time the caller gives (a monotonic clock in
`pdserve.supervisor`, fake times in tests) and answered with a `Restart` after an
exponential backoff (`backoff_s`, doubling per failure within the window, capped at
`backoff_max_s`) or, once more than `max_restarts` failures fall within the last
`window_s`, with `GiveUp`. Failures older than the window are forgotten, so a child that
crashes now and then, hours apart, is restarted every time and promptly.

The budget owns its failure times and nothing else; it starts, kills and sleeps nothing.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from pdserve.options import option

SUPERVISION_GROUP = "supervision"  # where `pdserve up --help` lists the flags below


@dataclass(frozen=True)
class RestartPolicy:
    """How a supervisor treats a child that died (`pdserve up --max-restarts ...`)."""

    max_restarts: int = option(  # restarts allowed within `window_s`; one more gives up
        5,
        group=SUPERVISION_GROUP,
        metavar="N",
        help="restarts of one process allowed within the window (0: never restart; "
        "default: %(default)s)",
    )
    window_s: float = option(
        300.0,
        flag="--restart-window",
        group=SUPERVISION_GROUP,
        metavar="S",
        help="seconds over which a process's failures are counted (default: %(default)s)",
    )
    backoff_s: float = option(  # the delay before the first restart within the window
        0.5,
        flag="--restart-backoff",
        group=SUPERVISION_GROUP,
        metavar="S",
        help="delay before the first restart within the window (default: %(default)s)",
    )
    backoff_max_s: float = option(  # the doubling stops here
        30.0,
        flag="--restart-backoff-max",
        group=SUPERVISION_GROUP,
        metavar="S",
        help="the doubling delay stops here (default: %(default)s)",
    )

    def __post_init__(self) -> None:
        if self.max_restarts < 0:
            raise ValueError("max_restarts must be >= 0")
        if not self.window_s > 0:
            raise ValueError("window_s must be > 0")
        if not 0 <= self.backoff_s <= self.backoff_max_s:
            raise ValueError("need 0 <= backoff_s <= backoff_max_s")


@dataclass(frozen=True)
class Restart:
    """Start the child again after `delay_s`; it is restart `attempt` of
    `policy.max_restarts` allowed within the window."""

    delay_s: float
    attempt: int


@dataclass(frozen=True)
class GiveUp:
    """Leave the child dead: `failures` failures fell within the window."""

    failures: int


Verdict = Restart | GiveUp


class RestartBudget:
    """One child's recent failures and the verdict on each new one (see module docstring)."""

    def __init__(self, policy: RestartPolicy) -> None:
        self.policy = policy
        self._failures: deque[float] = deque()

    def failed(self, now: float) -> Verdict:
        """Record a failure at `now` (seconds, any monotonic origin) and say what to do."""
        self._failures.append(now)
        while self._failures and self._failures[0] <= now - self.policy.window_s:
            self._failures.popleft()
        count = len(self._failures)
        if count > self.policy.max_restarts:
            return GiveUp(failures=count)
        delay = min(self.policy.backoff_max_s, self.policy.backoff_s * 2 ** (count - 1))
        return Restart(delay_s=delay, attempt=count)

    def recent(self, now: float) -> int:
        """Failures within the window ending at `now`."""
        return sum(t > now - self.policy.window_s for t in self._failures)
