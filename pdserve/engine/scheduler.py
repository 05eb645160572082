"""Continuous batching: which requests run this step, and with how many tokens.

Each step has a token budget (`max_num_batched_tokens`). Running requests are served
first, in arrival order: one token each when decoding, the next prompt chunk when
still prefilling. Waiting requests are then admitted FCFS while the budget, the
running-sequence cap and free blocks allow. When the pool runs dry the most recently
admitted running request is preempted: its blocks are freed and it is recomputed
from scratch later (prompt + tokens generated so far).

D (P/D): a request whose prompt KV comes from a prefill instance is admitted by
reserving blocks for its whole prompt (WAITING_FOR_REMOTE_KV). Those reservations are
capped at `remote_kv_block_cap` blocks in all (one request alone always fits): a leg over
the cap stays queued, and the requests behind it are admitted past it meanwhile, so KV
that may never come (a slow or hostile prefill side) cannot take the room running
requests grow into and local prompts prefill in.

Block ownership: the scheduler allocates blocks for a request (owner tag = request id)
just before the step that writes them, and frees them when the request finishes, is
aborted or is preempted. Nothing else frees a running request's blocks.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from pdserve.config import SchedulerConfig
from pdserve.engine.request import Request, RequestState
from pdserve.kv.block_pool import BlockPool


@dataclass(frozen=True)
class ScheduledSeq:
    """`request` feeds tokens [num_computed, num_computed + num_new) this step."""

    request: Request
    num_computed: int
    num_new: int

    @property
    def samples(self) -> bool:
        """True when this step reaches the end of the request's known tokens."""
        return self.num_computed + self.num_new == self.request.num_tokens


@dataclass
class SchedulerOutput:
    seqs: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new for s in self.seqs)


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class Scheduler:
    """Owns the waiting queue and the running list; the engine thread drives it."""

    def __init__(self, cfg: SchedulerConfig, pool: BlockPool, block_size: int) -> None:
        self.cfg = cfg
        self.pool = pool
        self.block_size = block_size
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.waiting_for_kv: dict[str, Request] = {}
        self.num_preemptions = 0
        # D side: called when a request whose KV comes from a prefill instance is admitted.
        self.on_remote_admit: Callable[[Request], None] = _no_remote
        # D side: blocks that requests waiting for remote KV may reserve in all (set by the
        # engine from its connector's config; None: no cap).
        self.remote_kv_block_cap: int | None = None

    def add(self, req: Request) -> None:
        req.state = RequestState.WAITING
        self.waiting.append(req)

    def has_work(self) -> bool:
        """True when a step would compute something (requests waiting for KV do not count)."""
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.cfg.max_num_batched_tokens
        budget = self._schedule_running(out, budget)
        if not out.preempted:
            self._admit_waiting(out, budget)
        return out

    def _chunk(self, req: Request, budget: int) -> int:
        n = min(req.num_tokens - req.num_computed_tokens, budget)
        if self.cfg.max_prefill_chunk:
            n = min(n, self.cfg.max_prefill_chunk)
        return n

    def _grow(self, req: Request, num_tokens: int) -> bool:
        """Make sure `req` has blocks for `num_tokens` tokens; False if the pool is dry."""
        need = blocks_needed(num_tokens, self.block_size) - len(req.block_ids)
        if need <= 0:
            return True
        if not self.pool.can_allocate(need):
            return False
        req.block_ids += self.pool.allocate(need, req.request_id)
        return True

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = self._chunk(req, budget)
            while not self._grow(req, req.num_computed_tokens + n):
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    return budget
            out.seqs.append(ScheduledSeq(req, req.num_computed_tokens, n))
            budget -= n
            i += 1
        return budget

    def _num_seqs(self) -> int:
        return len(self.running) + len(self.waiting_for_kv)

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        passed: list[Request] = []  # remote legs over the reservation cap, kept in order
        while self.waiting and budget > 0 and self._num_seqs() < self.cfg.max_num_seqs:
            req = self.waiting[0]
            if req.needs_remote_kv:
                if self._over_remote_cap(req):
                    passed.append(self.waiting.popleft())
                    continue
                if not self._admit_remote(req):
                    break
                continue
            n = self._chunk(req, budget)
            if not self._grow(req, req.num_computed_tokens + n):
                break
            self.waiting.popleft()
            req.state = RequestState.RUNNING
            self.running.append(req)
            out.seqs.append(ScheduledSeq(req, req.num_computed_tokens, n))
            budget -= n
        self.waiting.extendleft(reversed(passed))

    def _over_remote_cap(self, req: Request) -> bool:
        """Whether reserving `req`'s prompt would pass `remote_kv_block_cap`."""
        if self.remote_kv_block_cap is None or not self.waiting_for_kv:
            return False
        reserved = sum(len(r.block_ids) for r in self.waiting_for_kv.values())
        need = blocks_needed(req.num_prompt_tokens, self.block_size)
        return reserved + need > self.remote_kv_block_cap

    def _admit_remote(self, req: Request) -> bool:
        """D: reserve blocks for the whole prompt and hand the request to the connector.

        Push reserves these blocks while P may still be queueing the prompt, so a
        headroom of free blocks is kept for the running requests to grow into: without it
        a backlog on P fills D's pool and forces preemptions (local recompute) on D.
        """
        need = blocks_needed(req.num_prompt_tokens, self.block_size)
        headroom = len(self.running) + max(1, self.pool.num_blocks // 20)
        if self.pool.num_free - need < headroom and (self.running or self.waiting_for_kv):
            return False
        if not self._grow(req, req.num_prompt_tokens):
            return False
        self.waiting.popleft()
        req.state = RequestState.WAITING_FOR_REMOTE_KV
        self.waiting_for_kv[req.request_id] = req
        self.on_remote_admit(req)
        return True

    def kv_arrived(self, req: Request) -> None:
        """D: the prompt's KV is in the request's blocks; it decodes from now on."""
        del self.waiting_for_kv[req.request_id]
        req.needs_remote_kv = False
        req.num_computed_tokens = req.num_prompt_tokens
        req.state = RequestState.RUNNING
        self.running.append(req)

    def _preempt(self, req: Request) -> None:
        self.pool.free(req.block_ids, req.request_id)
        req.block_ids = []
        req.num_computed_tokens = 0
        req.state = RequestState.WAITING
        self.waiting.appendleft(req)
        self.num_preemptions += 1

    def finish(self, req: Request) -> None:
        """Remove `req` wherever it is and free its blocks (finish, abort or error)."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.waiting_for_kv.pop(req.request_id, None)
        if req.block_ids:
            self.pool.free(req.block_ids, req.request_id)
            req.block_ids = []
        req.state = RequestState.FINISHED


def _no_remote(req: Request) -> None:
    raise RuntimeError(f"{req.request_id}: remote KV requested but no connector is configured")
