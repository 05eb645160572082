"""The load report of an instance (`GET /load`): queue, KV blocks, work left and work rates.

`LoadReport` extends the wire struct `InstanceLoad` with what a load-aware router needs to
predict an instance's load a little ahead (docs/router.md, "load_aware"):
- `decode_tokens_left`: output tokens the instance still owes its live requests
  (max_tokens minus tokens generated, summed; stop strings or EOS may end them sooner);
- `prefill_tokens_left`: prompt tokens it still has to compute itself (KV arriving from a
  prefill instance is not counted);
- `decode_steps_per_s`: how many decode steps it has been doing per second lately (each
  running request gains one token per step), None until measured;
- `prefill_tokens_per_s`: prompt tokens computed per second while it had prompts to
  compute, None until measured.

`LoadMeter` computes them from the engine's live requests (`EngineHandle.live_requests`,
progress counts only) at each report: no engine hook, no lock. Rates
are measured between two consecutive reports (the router polls every fraction of a
second): steps = the largest output growth of a request present in both, prefill tokens =
the growth of `num_computed_tokens` of local prompts (a prompt gone since the last report
counts as finished). An idle interval leaves the last rate unchanged. Smoothed with an
exponential moving average, because one interval holds only a few steps.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import msgspec

from pdserve.engine.types import EngineStats, LiveRequest
from pdserve.transfer.params import InstanceLoad

# Weight of the newest interval in the moving averages: about the last 3 reports count.
SMOOTHING = 0.4


class LoadReport(InstanceLoad, kw_only=True):
    """`GET /load`; the fields beyond `InstanceLoad` default so that older reports decode."""

    decode_tokens_left: int = 0
    prefill_tokens_left: int = 0
    decode_steps_per_s: float | None = None
    prefill_tokens_per_s: float | None = None


@dataclass
class LoadMeter:
    """Builds load reports for one engine; owned by the instance's event loop (one per app)."""

    _last: dict[str, LiveRequest] = field(default_factory=dict)
    _last_time: float | None = None
    decode_steps_per_s: float | None = None
    prefill_tokens_per_s: float | None = None

    def report(self, stats: EngineStats, requests: Sequence[LiveRequest], now: float) -> LoadReport:
        """The report for this moment; `requests` are the engine's live requests."""
        progress = {r.request_id: r for r in requests}
        decode_left = sum(r.decode_left for r in requests)
        prefill_left = sum(max(0, p.prompt - p.computed) for p in progress.values())
        self._measure(progress, prefill_left, now)
        return LoadReport(
            num_running=stats.num_running,
            num_waiting=stats.num_waiting,
            num_waiting_for_kv=stats.num_waiting_for_kv,
            kv_blocks_used=stats.kv_blocks_used,
            kv_blocks_total=stats.kv_blocks_total,
            decode_tokens_left=decode_left,
            prefill_tokens_left=prefill_left,
            decode_steps_per_s=_rounded(self.decode_steps_per_s),
            prefill_tokens_per_s=_rounded(self.prefill_tokens_per_s),
        )

    def _measure(self, progress: dict[str, LiveRequest], prefill_left: int, now: float) -> None:
        last, last_time = self._last, self._last_time
        self._last, self._last_time = progress, now
        if last_time is None or now <= last_time:
            return
        dt = now - last_time
        steps = max(
            (p.outputs - last[rid].outputs for rid, p in progress.items() if rid in last),
            default=0,
        )
        if steps > 0:
            self.decode_steps_per_s = _ewma(self.decode_steps_per_s, steps / dt)
        was_pending = any(p.prompt > p.computed for p in last.values())
        if was_pending and prefill_left > 0:  # prefilling the whole interval: a clean rate
            done = _prefill_done_between(last, progress)
            if done > 0:
                self.prefill_tokens_per_s = _ewma(self.prefill_tokens_per_s, done / dt)


def _prefill_done_between(last: dict[str, LiveRequest], now: dict[str, LiveRequest]) -> int:
    """Prompt tokens computed between two reports (a prompt gone since counts as done)."""
    done = 0
    for rid, p in now.items():
        done += p.computed - (last[rid].computed if rid in last else 0)
    for rid, p in last.items():
        if rid not in now:
            done += p.prompt - p.computed
    return max(0, done)


def _ewma(old: float | None, new: float) -> float:
    return new if old is None else SMOOTHING * new + (1.0 - SMOOTHING) * old


def _rounded(x: float | None) -> float | None:
    return None if x is None else round(x, 3)


class TokenCount(msgspec.Struct, kw_only=True):
    """`POST /tokenize`: the prompt of a completion or chat body as this instance would
    tokenize it, and its length (routers read only `count`, to decide local prefill)."""

    count: int
    max_model_len: int = 0
    tokens: list[int] = msgspec.field(default_factory=list)
