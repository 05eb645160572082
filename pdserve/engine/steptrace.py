"""Per-step trace of the engine loop: one DEBUG line per step on `pdserve.engine.steps`.

Off by default; `pdserve serve --log-level debug` turns it on (or enable that logger for
DEBUG in-process). Each line is `step ` + a JSON `StepRecord`: the step's batch (decodes,
prompt chunks, prompt tokens), the KV landings the engine applied since the previous step
(D side), the step's wall time and the gap since the previous step ended (inbox, connector
poll, idle, or waiting for the GIL). `parse_step_line` reads the lines back.

Ownership: the engine owns one `StepTracer` and calls it from the engine thread only. The
tracer holds no request or block, only counters of the current step. When the logger is off,
a step costs one `isEnabledFor` check (cached by `logging`).
"""

from __future__ import annotations

import logging
import time

import msgspec

from pdserve.engine.scheduler import SchedulerOutput
from pdserve.tracelog import log_record, parse_record

STEP_LOGGER = "pdserve.engine.steps"
_PREFIX = "step "


class StepRecord(msgspec.Struct, frozen=True, kw_only=True):
    """One engine step. Times in seconds (`t`: time.monotonic() at the step's start)."""

    t: float
    decodes: int  # sequences past their prompt, one token each
    prefills: int  # sequences feeding a prompt chunk or a recompute (D: recomputes only)
    prefill_tokens: int  # tokens of those chunks
    kv_landed: int  # remote prompts whose KV was applied since the previous recorded step (D)
    step_s: float  # schedule + forward + sampling + output bookkeeping
    gap_s: float  # previous step's end to this step's start (0.0 for the first step)


def batch_counts(sched: SchedulerOutput) -> tuple[int, int, int]:
    """(decodes, prefills, prefill tokens) of a scheduled step."""
    decodes = prefills = prefill_tokens = 0
    for s in sched.seqs:
        if s.num_new == 1 and s.num_computed >= s.request.num_prompt_tokens:
            decodes += 1
        else:
            prefills += 1
            prefill_tokens += s.num_new
    return decodes, prefills, prefill_tokens


class StepTracer:
    """Collects one engine step at a time and logs it if `logger` is on for DEBUG."""

    def __init__(self, logger: logging.Logger | None = None) -> None:
        self.logger = logger or logging.getLogger(STEP_LOGGER)
        self._landed = 0
        self._last_end: float | None = None

    @property
    def enabled(self) -> bool:
        return self.logger.isEnabledFor(logging.DEBUG)

    def landed(self, n: int) -> None:
        """`n` remote prompts' KV were applied (counted into the next step's record)."""
        self._landed += n

    def record(self, sched: SchedulerOutput, start: float) -> StepRecord:
        """Log the step that began at `start` (time.monotonic()) and ends now."""
        end = time.monotonic()
        decodes, prefills, prefill_tokens = batch_counts(sched)
        gap = 0.0 if self._last_end is None else start - self._last_end
        rec = StepRecord(
            t=round(start, 6),
            decodes=decodes,
            prefills=prefills,
            prefill_tokens=prefill_tokens,
            kv_landed=self._landed,
            step_s=round(end - start, 6),
            gap_s=round(gap, 6),
        )
        self._landed = 0
        self._last_end = end
        log_record(self.logger, _PREFIX, rec)
        return rec


def parse_step_line(line: str) -> StepRecord | None:
    """The record in one log line written by `StepTracer`, or None for any other line."""
    return parse_record(line, STEP_LOGGER, _PREFIX, StepRecord)
