"""Fault injection: the faults a test builds into one instance, never set from a command line.

Tests construct a `Faults` and hand it to what they build: the configs
(`EngineConfig.faults`, `ConnectorConfig.faults`), `pdserve.server.serve.main`, or, for a
faulty subprocess, the test-only entry point `python -m tests.fault_serve --faults JSON ...`.
Each layer reads only its own fields; the default, `NO_FAULTS`, injects nothing.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Faults:
    """What to break in one instance (all off by default)."""

    # Engine: sleep this long in every step (a slow instance, for routing and load tests).
    step_delay_s: float = 0.0
    # D, push: wait this long before sending a registration (P's prompt finishes first).
    register_delay_s: float = 0.0
    # P, push: hand a finished prompt to the writer this long after prefill (D's
    # registration comes first); layer-wise streaming is off meanwhile.
    finish_delay_s: float = 0.0
    # Every Nth transfer this instance posts fails at once (0: none).
    fail_transfer_every: int = 0


NO_FAULTS = Faults()
