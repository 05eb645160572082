"""One simulated engine instance: continuous batching in engine steps, like pdserve's and
vLLM's engine loops.

A step begins at a *boundary*: the instance applies what arrived since the last one (new
requests, KV arrivals, connector work handed to the loop), admits waiting requests FCFS
while KV blocks and the running cap allow, runs the engine-loop connector work queued for
this step (pull's descriptor posting in vLLM: every running request waits for it), then one
forward pass whose duration comes from the roofline (`CostModel`). Anything that arrives
during a step waits for the next boundary; an idle instance wakes at the arrival.

Block ownership (counted, not named): a request's blocks are taken at admission for its
prompt and output and returned when it finishes; on a prefill instance they pass to the
connector at prefill end (the hold) and return through `release`. Requests on a decode
instance in P/D wait in `waiting_for_kv` with their blocks reserved until `kv_arrived`.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal, Protocol

from pdserve.sim.costs import CostModel, SeqWork
from pdserve.sim.engine import EventLoop

Role = Literal["both", "prefill", "decode"]


@dataclass(eq=False)
class SimRequest:
    """One client request and what the client saw. Times are simulated seconds."""

    index: int
    prompt_len: int
    output_len: int
    arrival: float
    send: float = math.nan
    prefill_done: float | None = None  # P's prefill-done time (P/D only)
    token_times: list[float] = field(default_factory=list)  # at the client

    @property
    def done(self) -> bool:
        return len(self.token_times) >= self.output_len


@dataclass(eq=False)
class Seq:
    """A request's state on one instance.

    It computes `to_compute` tokens after `cached_base` already cached (a prompt; for
    vLLM's decode side the last prompt token), then emits output tokens; `emits` is how
    many tokens this instance streams (0 on a prefill instance).
    """

    req: SimRequest
    to_compute: int
    cached_base: int
    emits: int
    blocks: int
    remote: bool = False  # KV comes from a prefill instance
    computed: int = 0
    emitted: int = 0

    @property
    def prefilling(self) -> bool:
        return self.computed < self.to_compute

    def work(self, num_new: int) -> SeqWork:
        if self.prefilling:
            cached = self.cached_base + self.computed
            return SeqWork(num_new, cached, self.computed + num_new == self.to_compute)
        return SeqWork(1, self.req.prompt_len + self.emitted - 1, True)


class Listener(Protocol):
    """What the cluster (router and connector) hears from an instance. Called inside the
    instance's boundary or step end, with the simulated time of the event."""

    def on_remote_admit(self, inst: Instance, seq: Seq, now: float) -> None: ...

    def on_forward(
        self, inst: Instance, seq: Seq, num_new: int, start: float, duration: float
    ) -> None: ...

    def on_prefill_done(self, inst: Instance, seq: Seq, now: float) -> None: ...

    def on_token(self, inst: Instance, seq: Seq, now: float) -> None: ...


@dataclass
class StepRecord:
    """Counters of one instance, for reports and tests."""

    steps: int = 0
    busy_s: float = 0.0
    stall_s: float = 0.0  # engine-loop connector work
    forward_s: float = 0.0


class Instance:
    """A simulated engine: owns its queues and block count; the event loop drives it."""

    def __init__(
        self, name: str, role: Role, costs: CostModel, loop: EventLoop, listener: Listener
    ) -> None:
        self.name = name
        self.role = role
        self.costs = costs
        self.loop = loop
        self.listener = listener
        sw = costs.software
        self.block_size = sw.block_size
        self.total_blocks = costs.kv_capacity_tokens() // sw.block_size
        self.free_blocks = self.total_blocks
        self.waiting: deque[Seq] = deque()
        self.running: list[Seq] = []
        self.waiting_for_kv: list[Seq] = []
        self._inbox: list[tuple[Callable[..., None], tuple]] = []
        self._loop_work: list[tuple[float, Callable[[float], None]]] = []
        self._busy = False
        self._wake_pending = False
        self.stats = StepRecord()

    # --- inputs ---------------------------------------------------------------------

    def deliver(self, fn: Callable[..., None], *args: object) -> None:
        """Apply `fn(*args)` at the next step boundary (now, if the instance is idle)."""
        self._inbox.append((fn, args))
        if not self._busy and not self._wake_pending:
            self._wake_pending = True
            self.loop.at(self.loop.now, self._boundary)

    def add(self, seq: Seq) -> None:
        """Queue a request for admission (call inside a delivered action)."""
        self.waiting.append(seq)

    def add_loop_work(self, duration: float, done: Callable[[float], None]) -> None:
        """Connector work that runs in the engine loop before this step's forward pass;
        `done(t)` is called with its completion time (call inside a boundary)."""
        self._loop_work.append((duration, done))

    def kv_arrived(self, seq: Seq) -> None:
        """D: the request's KV is in place; it runs from this boundary on."""
        self.waiting_for_kv.remove(seq)
        self.running.append(seq)
        if not seq.prefilling:  # the first token came with the KV (pdserve)
            self._emit(seq, self.loop.now)

    def release(self, blocks: int) -> None:
        """Blocks the connector held (P's hold) go back to the pool."""
        self.free_blocks += blocks
        if self.waiting and not self._busy and not self._wake_pending:
            self.deliver(_noop)

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    # --- the loop -------------------------------------------------------------------

    def _boundary(self) -> None:
        self._wake_pending = False
        now = self.loop.now
        inbox, self._inbox = self._inbox, []
        for fn, args in inbox:
            fn(*args)
        batch = self._schedule(now)
        stall = self._run_loop_work(now)
        seqs = [(seq, seq.work(n)) for seq, n in batch]
        duration = self.costs.step_time([w for _, w in seqs])
        if not batch and stall == 0.0:
            self._busy = False
            return
        self._busy = True
        start = now + stall
        for seq, n in batch:
            if seq.prefilling:
                self.listener.on_forward(self, seq, n, start, duration)
        self.stats.steps += 1
        self.stats.stall_s += stall
        self.stats.forward_s += duration
        self.stats.busy_s += stall + duration
        self.loop.at(start + duration, self._step_end, batch)

    def _run_loop_work(self, now: float) -> float:
        elapsed = 0.0
        while self._loop_work:  # work may queue more work (handed on in the same step)
            duration, done = self._loop_work.pop(0)
            elapsed += duration
            done(now + elapsed)
        return elapsed

    def _schedule(self, now: float) -> list[tuple[Seq, int]]:
        """Running requests first (a decode token or the next prompt chunk each), then
        waiting ones FCFS while blocks, the running cap and the token budget allow."""
        budget = self.costs.software.max_num_batched_tokens
        batch: list[tuple[Seq, int]] = []
        for seq in self.running:
            n = min(seq.to_compute - seq.computed, budget) if seq.prefilling else 1
            if 0 < n <= budget:
                batch.append((seq, n))
                budget -= n
        while self.waiting:
            seq = self.waiting[0]
            if not seq.remote and budget <= 0:
                break
            if not self._admit(seq, now):
                break
            self.waiting.popleft()
            if not seq.remote and seq.to_compute > 0:
                n = min(seq.to_compute, budget)
                batch.append((seq, n))
                budget -= n
        return batch

    def _admit(self, seq: Seq, now: float) -> bool:
        """Take the request's blocks; a remote one waits for its KV, a local one runs."""
        if seq.blocks > self.free_blocks:
            return False
        if seq.remote:
            if not self._remote_fits(seq):
                return False
            self.free_blocks -= seq.blocks
            self.waiting_for_kv.append(seq)
            self.listener.on_remote_admit(self, seq, now)
            return True
        if len(self.running) >= self.costs.software.max_num_seqs:
            return False
        self.free_blocks -= seq.blocks
        self.running.append(seq)
        return True

    def _remote_fits(self, seq: Seq) -> bool:
        """pdserve's D admission: requests waiting for KV count against `max_num_seqs`,
        and a remote prompt is admitted only while it leaves a headroom of free blocks
        (one per running request plus `remote_headroom_fraction` of the pool) for the
        running requests to grow into."""
        sw = self.costs.software
        if len(self.running) + len(self.waiting_for_kv) >= sw.max_num_seqs:
            return False
        if sw.remote_headroom_fraction <= 0 or not (self.running or self.waiting_for_kv):
            return True
        headroom = len(self.running) + max(1, int(self.total_blocks * sw.remote_headroom_fraction))
        return self.free_blocks - seq.blocks >= headroom

    def _step_end(self, batch: list[tuple[Seq, int]]) -> None:
        now = self.loop.now
        for seq, n in batch:
            was_prefilling = seq.prefilling
            if was_prefilling:
                seq.computed += n
                if seq.prefilling:
                    continue
            if self.role == "prefill":
                self.running.remove(seq)
                self.listener.on_prefill_done(self, seq, now)
            else:
                self._emit(seq, now)
        self._busy = False
        self._wake_pending = True
        self.loop.at(now, self._boundary)

    def _emit(self, seq: Seq, now: float) -> None:
        seq.emitted += 1
        self.listener.on_token(self, seq, now)
        if seq.emitted >= seq.emits:
            self.running.remove(seq)
            self.free_blocks += seq.blocks


def _noop() -> None:
    return None
