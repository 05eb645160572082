"""Tracing, for every layer: trace records as log lines, and the handoff trace.

Records: `PREFIX` + a msgspec struct's JSON, one per line on DEBUG through `logging`, so the
lines carry whatever the handler adds in front (time, level, logger name); reading them back
finds the prefix after the logger's name and decodes the rest. The engine's step trace
(`pdserve.engine.steptrace`) and the handoff trace below are written this way.

Handoff trace: one DEBUG line per hop of a P/D request's first token, on `pdserve.handoff`.
The push handoff crosses two processes and several threads (P's engine and writer, the
transport's sender and receiver, D's notification poller and engine, the HTTP layers of D
and the router). Each of them calls `hop(key, name)` where the first token passes, and the
lines of all processes, joined by key (transfer id or request id) and sorted by their unix
times, give the per-hop breakdown (scripts/bench/perf/handoff_hops.py). Off by default:
`--log-level debug` turns it on (or set that logger to DEBUG in-process); when off a hop costs
one cached `isEnabledFor` check. Each line also carries the calling thread's CPU time (`cpu`)
and, on Linux, its time spent runnable but waiting for a core (`runq`): between two hops of
one thread, wall time minus both is time it was blocked.

Ownership: nothing is kept; each record is one log line.
"""

from __future__ import annotations

import logging
import time
from typing import TypeVar

import msgspec

T = TypeVar("T", bound=msgspec.Struct)


def log_record(logger: logging.Logger, prefix: str, record: msgspec.Struct) -> None:
    """Log `record` on DEBUG as `prefix` + its JSON (callers check `isEnabledFor` first)."""
    logger.debug("%s%s", prefix, msgspec.json.encode(record).decode())


# vLLM's log format names the file and line that logged, not the logger: a record from
# inside vLLM's processes (pdserve's KV connector) reads `... DEBUG ... [tracelog.py:35] hop {`.
_VLLM_FORMAT_MARK = "[tracelog.py:"


def parse_record(line: str, logger_name: str, prefix: str, kind: type[T]) -> T | None:
    """The `kind` record in a line that `log_record` wrote on `logger_name` with `prefix`
    (or, in vLLM's log format, from this module), or None for any other line."""
    i = line.find(prefix + "{")
    if i < 0 or (logger_name not in line[:i] and _VLLM_FORMAT_MARK not in line[:i]):
        return None
    return msgspec.json.decode(line[i + len(prefix) :].strip(), type=kind)


# -- the handoff trace ----------------------------------------------------------------------
HOP_LOGGER = "pdserve.handoff"
_PREFIX = "hop "
_log = logging.getLogger(HOP_LOGGER)  # looked up once: hops sit on the engine and transport paths


class Hop(msgspec.Struct, frozen=True, kw_only=True):
    """One hop: `key` (transfer or request id), `name` (where), `t` (unix seconds)."""

    key: str
    name: str
    t: float
    extra: dict[str, str | int | float] = msgspec.field(default_factory=dict)


def enabled() -> bool:
    """Whether hops are logged (callers skip building costly extras otherwise)."""
    return _log.isEnabledFor(logging.DEBUG)


def hop(key: str, name: str, t: float | None = None, **extra: str | int | float) -> None:
    """Log that the first token of `key` passed `name` at `t` (default: now)."""
    if _log.isEnabledFor(logging.DEBUG):
        extra["cpu"] = round(time.thread_time(), 6)  # this thread's CPU time so far
        runq = _run_queue_s()
        if runq is not None:
            extra["runq"] = runq
        rec = Hop(key=key, name=name, t=time.time() if t is None else t, extra=extra)
        log_record(_log, _PREFIX, rec)


def _run_queue_s() -> float | None:
    """Seconds this thread has waited runnable for a CPU so far (Linux schedstat), or None:
    with `cpu`, tells a hop that computed from one that waited for the core."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, ValueError, IndexError):
        return None


def parse_hop_line(line: str) -> Hop | None:
    """The hop in one log line written by `hop`, or None for any other line."""
    return parse_record(line, HOP_LOGGER, _PREFIX, Hop)
