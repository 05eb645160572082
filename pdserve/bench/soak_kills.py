"""The soak's kill mode: SIGKILL a random process of a supervised cluster every N seconds.

Every `every_s` seconds of the traffic (at every_s, 2 every_s, ... before its end), a role
is drawn from the chosen ones (seeded), then one process of that role, and the process is
killed by PID through the cluster's `Supervisor` (`pdserve.supervisor`), which restarts it
on its ports as `pdserve up` does. A process not running at that moment (still being
restarted after an earlier kill) is not killed: the kill is recorded as skipped. Each kill
is followed until the supervisor reports the process back (a new PID; for an instance, the
incarnation its `/kv/info` then gives), or until `back_timeout_s`.

`plan_kills` and `choose_victim` are pure; `run_kills` owns the kill tasks it creates and
awaits them all before returning.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Sequence
from typing import Literal

import aiohttp
import numpy as np

from pdserve.bench.client import open_session
from pdserve.bench.soak_report import KillInfo
from pdserve.restarts import RestartPolicy
from pdserve.supervisor import Supervisor
from pdserve.transfer.cluster_auth import route_headers

KillRole = Literal["prefill", "decode", "router"]
KILL_ROLES: tuple[KillRole, ...] = ("prefill", "decode", "router")
RESTARTS_MARGIN = 5  # a restart that keeps failing still gives up, whatever the kills


def plan_kills(every_s: float, duration_s: float) -> list[float]:
    """The kill times, seconds into the traffic: every_s, 2 every_s, ... before duration_s."""
    count = math.ceil(duration_s / every_s) - 1  # the multiples strictly below duration_s
    return [k * every_s for k in range(1, count + 1)]


def soak_restart_policy(every_s: float, duration_s: float) -> RestartPolicy:
    """A restart budget the planned kills alone cannot exhaust (each could hit the same
    process), so that only restarts that fail by themselves make the supervisor give up."""
    return RestartPolicy(max_restarts=len(plan_kills(every_s, duration_s)) + RESTARTS_MARGIN)


def choose_victim(
    roles: Sequence[KillRole], names_by_role: dict[str, list[str]], rng: np.random.Generator
) -> tuple[KillRole, str]:
    """A role drawn uniformly from `roles`, then one of its processes uniformly."""
    role = roles[int(rng.integers(len(roles)))]
    names = names_by_role[role]
    return role, names[int(rng.integers(len(names)))]


async def run_kills(
    sup: Supervisor,
    roles: Sequence[KillRole],
    times: Sequence[float],
    t0: float,
    rng: np.random.Generator,
    back_timeout_s: float,
) -> list[KillInfo]:
    """Kill at each of `times` (seconds after `t0`, a time.monotonic()); every kill's
    record, in kill order, once each killed process is back (or was waited for
    `back_timeout_s`)."""
    names_by_role: dict[str, list[str]] = {}
    for p in sup.cluster.processes:
        names_by_role.setdefault(p.role, []).append(p.name)
    kills: list[asyncio.Task[KillInfo]] = []
    async with open_session(5.0) as http:
        for at in times:
            await asyncio.sleep(max(0.0, at - (time.monotonic() - t0)))
            role, name = choose_victim(roles, names_by_role, rng)
            kill = _kill_and_follow(sup, http, name, role, t0, back_timeout_s)
            kills.append(asyncio.create_task(kill))
        return list(await asyncio.gather(*kills))


async def _kill_and_follow(
    sup: Supervisor,
    http: aiohttp.ClientSession,
    name: str,
    role: KillRole,
    t0: float,
    timeout_s: float,
) -> KillInfo:
    """SIGKILL `name` through the supervisor and wait until it is back."""
    url = sup.cluster.process(name).url  # the same before and after a restart
    token = sup.cluster.cluster_token
    old_incarnation = None if role == "router" else await read_incarnation(http, url, token)
    old_pid = await asyncio.to_thread(sup.kill, name)
    killed_s = time.monotonic() - t0
    if old_pid is None:  # not running: being restarted after an earlier kill
        return KillInfo(instance=name, role=role, killed_s=killed_s, skipped=True)
    deadline = time.monotonic() + timeout_s
    new_pid = None
    while new_pid is None and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
        pid = await asyncio.to_thread(sup.running_pid, name)
        new_pid = pid if pid != old_pid else None
    back = new_pid is not None
    back_s = time.monotonic() - t0 if back else None
    new_incarnation = None
    if back and role != "router":
        new_incarnation = await read_incarnation(http, url, token)
    return KillInfo(
        instance=name,
        role=role,
        killed_s=killed_s,
        back_s=back_s,
        old_pid=old_pid,
        new_pid=new_pid,
        old_incarnation=old_incarnation,
        new_incarnation=new_incarnation,
    )


async def read_incarnation(http: aiohttp.ClientSession, url: str, token: str) -> str | None:
    """The incarnation the instance at `url` gives in its /kv/info (None: no such answer)."""
    headers = route_headers(token, "/kv/info")  # a route for routers: needs the proof
    try:
        async with http.get(f"{url}/kv/info", headers=headers) as resp:
            return str(json.loads(await resp.read())["incarnation"])
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError, TypeError):
        return None
