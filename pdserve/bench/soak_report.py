"""The soak's accounting, free of I/O: failure causes, KV-block leaks, oracle comparison,
per-phase counts, the result Struct saved as JSON, the one-screen summary and the exit status.

Failure causes are grouping keys: the HTTP status and the OpenAI error type plus the start
of its message, with ids and numbers masked so that one kind of failure is one group
("HTTP 502 upstream_error: prefill instance # failed: ..."), or the client-side exception
class for a broken connection.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any, Literal

import msgspec
import numpy as np

MAX_FAILED_SAVED = 500
MESSAGE_PREFIX = 72  # characters of an error message kept in its grouping key
_ID = re.compile(r"\b(?=[0-9a-f_-]*\d)[0-9a-f][0-9a-f_-]{5,}\b", re.IGNORECASE)
_NUMBER = re.compile(r"\d+")
Phase = Literal["before", "during", "after"]
PHASES: tuple[Phase, ...] = ("before", "during", "after")


# -- failure causes -------------------------------------------------------------------------


def normalize_message(message: str, limit: int = MESSAGE_PREFIX) -> str:
    """The message with ids and numbers masked ("#"), whitespace collapsed, cut to `limit`."""
    text = _NUMBER.sub("#", _ID.sub("#", message))
    return " ".join(text.split())[:limit]


class _Error(msgspec.Struct):
    message: str = ""
    type: str | None = None


class _ErrorBody(msgspec.Struct):
    error: _Error | str | None = None
    detail: Any = None


def _error_key(raw: bytes) -> str | None:
    """ "type: message" of an OpenAI-style error body, None if it is not one."""
    try:
        body = msgspec.json.decode(raw, type=_ErrorBody)
    except msgspec.DecodeError:
        return None
    err = body.error
    if isinstance(err, str):
        return normalize_message(err)
    if err is not None:
        return f"{err.type or 'error'}: {normalize_message(err.message)}"
    if body.detail is not None:
        return f"detail: {normalize_message(str(body.detail))}"
    return None


def cause_of_http(status: int, body: bytes) -> str:
    """Grouping key of a non-200 answer."""
    key = _error_key(body)
    return f"HTTP {status} {key}" if key else f"HTTP {status} (not an OpenAI error body)"


def cause_of_stream_error(error_json: bytes) -> str:
    """Grouping key of an error event inside a 200 stream (its `error` member)."""
    key = _error_key(b'{"error":' + error_json + b"}")
    return f"stream error {key or normalize_message(error_json.decode(errors='replace'))}"


def cause_of_exception(exc: BaseException) -> str:
    """Grouping key of a client-side exception (connection reset, protocol error...)."""
    return f"transport {type(exc).__name__}"


def group_causes(causes: Iterable[str | None]) -> dict[str, int]:
    """Count per cause, most frequent first (ties by name); None entries are skipped."""
    counts = Counter(c for c in causes if c is not None)
    return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


# -- KV blocks ------------------------------------------------------------------------------


class InstanceBlocks(msgspec.Struct, kw_only=True):
    """An instance's KV pool after the drain, from its `GET /load`.

    `leaked` is the blocks still used once nothing runs, waits or is held: every block
    should be back in the free queue. The pool's own integrity check (free + used == total,
    no block in two places) is not exposed by any endpoint, so `kv_blocks_free` is derived
    as total - used and cannot reveal a free queue that double-counts a block."""

    name: str
    pid: int
    restarts: int
    kv_blocks_total: int
    kv_blocks_used: int
    kv_blocks_free: int
    num_running: int
    num_waiting: int
    num_waiting_for_kv: int
    leaked: int
    error: str | None = None  # the instance could not be read


class _Load(msgspec.Struct):
    num_running: int
    num_waiting: int
    num_waiting_for_kv: int
    kv_blocks_used: int
    kv_blocks_total: int


def blocks_from_load(name: str, pid: int, restarts: int, load_json: bytes) -> InstanceBlocks:
    """Leak accounting from one `GET /load` body (raises msgspec.DecodeError if malformed)."""
    load = msgspec.json.decode(load_json, type=_Load)
    return InstanceBlocks(
        name=name,
        pid=pid,
        restarts=restarts,
        kv_blocks_total=load.kv_blocks_total,
        kv_blocks_used=load.kv_blocks_used,
        kv_blocks_free=load.kv_blocks_total - load.kv_blocks_used,
        num_running=load.num_running,
        num_waiting=load.num_waiting,
        num_waiting_for_kv=load.num_waiting_for_kv,
        leaked=load.kv_blocks_used,
    )


def unreadable_instance(name: str, pid: int, restarts: int, error: str) -> InstanceBlocks:
    """An instance whose pool could not be read: counted as leaking (-1 = unknown)."""
    return InstanceBlocks(
        name=name,
        pid=pid,
        restarts=restarts,
        kv_blocks_total=-1,
        kv_blocks_used=-1,
        kv_blocks_free=-1,
        num_running=-1,
        num_waiting=-1,
        num_waiting_for_kv=-1,
        leaked=-1,
        error=error,
    )


def is_drained(b: InstanceBlocks) -> bool:
    """Nothing runs, waits or holds a block."""
    return (
        b.error is None
        and b.leaked == 0
        and not (b.num_running or b.num_waiting)
        and not (b.num_waiting_for_kv)
    )


# -- oracle ---------------------------------------------------------------------------------


class Mismatch(msgspec.Struct, kw_only=True):
    """A sampled request whose P/D output differs from the monolithic oracle's."""

    index: int
    prompt_len: int
    max_tokens: int
    first_difference: int  # first position where the token ids differ
    got: list[int]  # P/D's ids from that position (at most 8)
    want: list[int]  # the oracle's


def first_difference(got: Sequence[int], want: Sequence[int]) -> int | None:
    """First index where the sequences differ (a length difference counts); None if equal."""
    for i, (a, b) in enumerate(zip(got, want, strict=False)):
        if a != b:
            return i
    return None if len(got) == len(want) else min(len(got), len(want))


def oracle_sample(
    candidates: Sequence[int], fraction: float, rng: np.random.Generator
) -> list[int]:
    """ceil(fraction * n) of the candidate indices, drawn without replacement, sorted."""
    k = min(len(candidates), math.ceil(fraction * len(candidates)))
    if k <= 0:
        return []
    return sorted(int(i) for i in rng.choice(np.asarray(candidates), size=k, replace=False))


# -- phases and the result ------------------------------------------------------------------


class PhaseCounts(msgspec.Struct, kw_only=True):
    """Requests sent in one phase of the soak, by how they ended."""

    sent: int = 0
    completed: int = 0
    aborted: int = 0
    failed: int = 0


class RestartInfo(msgspec.Struct, kw_only=True):
    """The prefill restart, in seconds from the start of the traffic. `settled_s` is
    `ready_s` plus the time the router needs to notice the new incarnation (its health
    round); requests sent from then on should all succeed."""

    instance: str
    killed_s: float
    ready_s: float
    settled_s: float
    old_pid: int
    new_pid: int
    old_incarnation: str | None
    new_incarnation: str | None


class KillInfo(msgspec.Struct, kw_only=True):
    """One kill of the kill mode (`--kill-every`), in seconds from the start of the traffic.
    `skipped`: the process was not running then (still being restarted), so nothing was
    killed. `back_s` None: not back within the soak's wait (see `soak_kills`)."""

    instance: str  # "prefill-0", "decode-0", "router"
    role: str
    killed_s: float
    skipped: bool = False
    back_s: float | None = None
    old_pid: int | None = None
    new_pid: int | None = None
    old_incarnation: str | None = None  # instances only
    new_incarnation: str | None = None


def phase_of(sent_s: float, restart: RestartInfo | None) -> Phase:
    """before the kill, during the outage (kill to settled), after it settled."""
    if restart is None or sent_s < restart.killed_s:
        return "before"
    return "during" if sent_s < restart.settled_s else "after"


def count_phases(
    outcomes: Iterable[tuple[float, str]], restart: RestartInfo | None
) -> dict[str, PhaseCounts]:
    """(sent_s, status) pairs counted per phase."""
    phases = {p: PhaseCounts() for p in PHASES}
    for sent_s, status in outcomes:
        c = phases[phase_of(sent_s, restart)]
        c.sent += 1
        setattr(c, status, getattr(c, status) + 1)
    return phases


class FailedRequest(msgspec.Struct, kw_only=True):
    """One failed request, for reading the failures one by one."""

    index: int
    sent_s: float
    ended_s: float
    cause: str
    detail: str | None


class SoakResult(msgspec.Struct, kw_only=True):
    """Everything a soak found; saved as `soak-<mode>-<date>.json`."""

    date: str
    mode: str
    transport: str
    model: str
    duration_s: float  # traffic (arrivals) duration
    drain_s: float  # from the last arrival until every instance was drained (or gave up)
    request_rate: float
    rate_derived: bool
    input_len: tuple[int, int]
    output_len: tuple[int, int]
    abort_fraction: float
    max_concurrency: int
    seed: int
    sent: int
    completed: int
    aborted: int
    failed: int
    output_tokens: int
    latency_p50_s: float | None  # end-to-end, completed non-aborted requests
    latency_p99_s: float | None
    causes: dict[str, int]
    phases: dict[str, PhaseCounts]
    restart: RestartInfo | None
    instances: list[InstanceBlocks]
    blocks_leaked: int  # sum over instances; an unreadable instance counts 1
    oracle_candidates: int
    oracle_checked: int
    oracle_failed: int  # sampled requests the oracle itself could not answer
    mismatches: list[Mismatch]
    failed_requests: list[FailedRequest]  # the first MAX_FAILED_SAVED
    load_average: tuple[float, float, float]
    log_dir: str
    # Kill mode (`--kill-every`); empty or None otherwise. `restarts`: times each process
    # was started again (also the single prefill restart), `given_up`: processes the
    # supervisor gave up on.
    kill_every_s: float | None = None
    kill_roles: list[str] = []
    kills: list[KillInfo] = []
    restarts: dict[str, int] = {}
    given_up: list[str] = []

    @property
    def restarts_total(self) -> int:
        return sum(self.restarts.values())


def latency_percentiles(latencies: Sequence[float]) -> tuple[float | None, float | None]:
    """(p50, p99) in seconds, numpy's linear interpolation; (None, None) without samples."""
    if not latencies:
        return None, None
    p50, p99 = np.percentile(np.asarray(latencies), [50, 99])
    return float(p50), float(p99)


def total_leaked(instances: Iterable[InstanceBlocks]) -> int:
    """Blocks leaked over all instances; an unreadable instance counts as 1."""
    return sum(b.leaked if b.leaked >= 0 else 1 for b in instances)


def not_healed(result: SoakResult) -> list[str]:
    """Processes of the kill mode that did not come back (given up, or not back in time)."""
    late = [k.instance for k in result.kills if not k.skipped and k.back_s is None]
    return sorted({*result.given_up, *late})


def exit_status(result: SoakResult) -> int:
    """0 when no block leaked, no checked output was wrong and every killed process came
    back, else 1."""
    return 1 if result.blocks_leaked or result.mismatches or not_healed(result) else 0


def _pct(part: int, whole: int) -> str:
    return f"{100.0 * part / whole:5.1f}%" if whole else "    -"


def format_summary(r: SoakResult) -> str:
    """The one-screen summary printed at the end."""
    lines = [
        f"soak: {r.mode}/{r.transport}, {r.model}, {r.duration_s / 60:.1f} min at "
        f"{r.request_rate:.2f} req/s{' (derived)' if r.rate_derived else ''}, "
        f"inputs {r.input_len[0]}-{r.input_len[1]}, outputs {r.output_len[0]}-{r.output_len[1]}, "
        f"aborts {r.abort_fraction:.0%}, load avg {r.load_average[0]:.1f}",
        f"  sent {r.sent}: completed {r.completed} ({_pct(r.completed, r.sent)}), aborted by "
        f"client {r.aborted} ({_pct(r.aborted, r.sent)}), failed {r.failed} "
        f"({_pct(r.failed, r.sent)}); {r.output_tokens} output tokens; drain {r.drain_s:.1f} s",
    ]
    if r.latency_p50_s is not None and r.latency_p99_s is not None:
        lines.append(
            f"  latency of completed requests: p50 {r.latency_p50_s:.2f} s, "
            f"p99 {r.latency_p99_s:.2f} s"
        )
    if r.restart is not None:
        rs = r.restart
        lines.append(
            f"  restart of {rs.instance}: killed at {rs.killed_s:.1f} s (pid {rs.old_pid}), "
            f"ready at {rs.ready_s:.1f} s (pid {rs.new_pid}, new incarnation: "
            f"{rs.new_incarnation != rs.old_incarnation}); 'after' = sent from {rs.settled_s:.1f} s"
        )
    lines += _kill_lines(r)
    lines.append("  phase    sent  completed  aborted  failed")
    for name, c in r.phases.items():
        lines.append(f"  {name:<7}{c.sent:>6}{c.completed:>11}{c.aborted:>9}{c.failed:>8}")
    if r.causes:
        lines.append("  failures by cause:")
        lines += [f"    {n:>5}  {cause}" for cause, n in list(r.causes.items())[:8]]
        if len(r.causes) > 8:
            lines.append(f"    ... {len(r.causes) - 8} more causes in the JSON")
    lines.append("  KV blocks after the drain (used / total; leaked):")
    for b in r.instances:
        state = (
            f"unreadable: {b.error}"
            if b.error
            else (
                f"{b.kv_blocks_used} / {b.kv_blocks_total}; leaked {b.leaked}; running "
                f"{b.num_running}, waiting {b.num_waiting}, waiting for KV {b.num_waiting_for_kv}"
            )
        )
        lines.append(f"    {b.name:<10} pid {b.pid:<8} {state}")
    lines.append(
        f"  oracle: {r.oracle_checked} of {r.oracle_candidates} completed kept requests "
        f"checked, {len(r.mismatches)} wrong, {r.oracle_failed} unanswered by the oracle"
    )
    for m in r.mismatches[:5]:
        lines.append(
            f"    request {m.index}: first difference at token {m.first_difference} "
            f"(got {m.got}, want {m.want})"
        )
    verdict = "PASS" if exit_status(r) == 0 else "FAIL"
    unhealed = f", not back: {', '.join(not_healed(r))}" if not_healed(r) else ""
    lines.append(
        f"  {verdict}: {r.blocks_leaked} blocks leaked, {len(r.mismatches)} wrong outputs{unhealed}"
    )
    return "\n".join(lines)


def _kill_lines(r: SoakResult) -> list[str]:
    """The kill mode's lines of the summary: kills, restarts, what did not come back."""
    if r.kill_every_s is None:
        return []
    done = [k for k in r.kills if not k.skipped]
    outages = [k.back_s - k.killed_s for k in done if k.back_s is not None]
    longest = f"; longest outage {max(outages):.1f} s" if outages else ""
    restarts = ", ".join(f"{name} {n}" for name, n in r.restarts.items())
    lines = [
        f"  kills every {r.kill_every_s:g} s ({', '.join(r.kill_roles)}): {len(done)} killed, "
        f"{len(r.kills) - len(done)} skipped (being restarted), {len(outages)} back{longest}",
        f"  restarts: {r.restarts_total} ({restarts}); given up: {', '.join(r.given_up) or 'none'}",
    ]
    for k in done[:6]:
        back = f"back at {k.back_s:.1f} s (pid {k.new_pid})" if k.back_s is not None else "NOT BACK"
        lines.append(f"    {k.instance:<10} killed at {k.killed_s:.1f} s (pid {k.old_pid}), {back}")
    if len(done) > 6:
        lines.append(f"    ... {len(done) - 6} more kills in the JSON")
    return lines
