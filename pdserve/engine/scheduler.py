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

Prefix caching (`prefix_caching`): a request admitted with nothing computed first takes
the longest run of cached blocks that matches its token prefix (pdserve.kv.prefix_hash),
shared read-only with whoever else holds them, and computes only the rest: it starts with
`num_computed_tokens` at the end of the hit, so positions and the attention prefix follow.
The hit stops at least one token short of the end (a step must compute something to
sample from), so every block a request writes is one it allocated alone. Once a step has
filled a block (prompt or output tokens) the block is registered in the cache
(`cache_computed`); freed cached blocks stay findable until the pool evicts them (LRU).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from pdserve.config import SchedulerConfig
from pdserve.engine.request import Request, RequestState
from pdserve.kv.block_pool import BlockPool
from pdserve.kv.prefix_hash import extend_hashes


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

    def __init__(
        self,
        cfg: SchedulerConfig,
        pool: BlockPool,
        block_size: int,
        prefix_caching: bool = False,
    ) -> None:
        self.cfg = cfg
        self.pool = pool
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        # Tokens looked up in the prefix cache at admission, and tokens found (vLLM's
        # prefix_cache_queries / prefix_cache_hits); both stay 0 without caching.
        self.prefix_queries = 0
        self.prefix_hits = 0
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

    def _chunk(self, req: Request, budget: int, start: int | None = None) -> int:
        start = req.num_computed_tokens if start is None else start
        n = min(req.num_tokens - start, budget)
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
            n = self._admit_local(req, budget)
            if n == 0:
                break
            self.waiting.popleft()
            req.state = RequestState.RUNNING
            self.running.append(req)
            out.seqs.append(ScheduledSeq(req, req.num_computed_tokens, n))
            budget -= n
        self.waiting.extendleft(reversed(passed))

    def _admit_local(self, req: Request, budget: int) -> int:
        """Give `req` its cached prefix (if any) and blocks for its first chunk; returns the
        chunk's length, or 0 (nothing taken) when the pool cannot hold it."""
        # Prompt logprobs need the logits of every prompt position: a cache hit would skip
        # computing them (vLLM makes the same exception).
        fresh_start = not req.block_ids and not req.num_computed_tokens
        wants_prompt = req.params.prompt_logprobs is not None
        lookup = self.prefix_caching and fresh_start and not wants_prompt
        hits = self._cache_hit(req) if lookup else []
        if not hits:
            n = self._chunk(req, budget)
            if not self._grow(req, req.num_computed_tokens + n):
                return 0
            self.prefix_queries += req.num_tokens if lookup else 0
            return n
        start = len(hits) * self.block_size
        n = self._chunk(req, budget, start)
        # Free cached blocks leave the free queue when taken, so they count against it too.
        taken = sum(1 for b in hits if self.pool.is_free(b))
        fresh = blocks_needed(start + n, self.block_size) - len(hits)
        if not self.pool.can_allocate(fresh + taken):
            return 0
        self.pool.share(hits, req.request_id)
        req.block_ids = list(hits)
        req.num_cached_blocks = len(hits)
        req.num_computed_tokens = start
        self._grow(req, start + n)
        self.prefix_queries += req.num_tokens
        self.prefix_hits += start
        return n

    def _cache_hit(self, req: Request, limit: int | None = None) -> list[int]:
        """The cached blocks holding `req`'s longest cached block prefix within its first
        `limit` tokens (default: short of its last token); nothing is taken yet."""
        limit = req.num_tokens - 1 if limit is None else limit
        extend_hashes(req.block_hashes, req.token_ids, limit, self.block_size)
        hits: list[int] = []
        for h in req.block_hashes[: limit // self.block_size]:
            b = self.pool.lookup(h)
            if b is None:
                break
            hits.append(b)
        return hits

    def cache_computed(self, req: Request) -> None:
        """Register the blocks `req` has filled since the last call (after a step, or when
        remote KV arrived). Their contents are final: `req` writes only past them."""
        if not self.prefix_caching:
            return
        full = req.num_computed_tokens // self.block_size
        if full <= req.num_cached_blocks:
            return
        extend_hashes(req.block_hashes, req.token_ids, full * self.block_size, self.block_size)
        for j in range(req.num_cached_blocks, full):
            self.pool.cache(req.block_ids[j], req.block_hashes[j], req.request_id)
        req.num_cached_blocks = full

    def _release(self, req: Request) -> None:
        """Free `req`'s blocks, its last first: with caching, a prompt's tail is the least
        likely to be shared, so it is the first the LRU queue evicts."""
        blocks = reversed(req.block_ids) if self.prefix_caching else req.block_ids
        self.pool.free(blocks, req.request_id)
        req.block_ids = []
        req.num_cached_blocks = 0

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
        hits = self._remote_hit(req)
        taken = sum(1 for b in hits if self.pool.is_free(b))
        need = blocks_needed(req.num_prompt_tokens, self.block_size) - len(hits) + taken
        headroom = len(self.running) + max(1, self.pool.num_blocks // 20)
        if self.pool.num_free - need < headroom and (self.running or self.waiting_for_kv):
            return False
        if not self.pool.can_allocate(need):
            return False
        if hits:
            self.pool.share(hits, req.request_id)
            req.block_ids = list(hits)
            req.num_cached_blocks = len(hits)
        self._grow(req, req.num_prompt_tokens)
        if self.prefix_caching:
            self.prefix_queries += req.num_prompt_tokens
            self.prefix_hits += len(hits) * self.block_size
        self.waiting.popleft()
        req.state = RequestState.WAITING_FOR_REMOTE_KV
        self.waiting_for_kv[req.request_id] = req
        self.on_remote_admit(req)
        return True

    def _remote_hit(self, req: Request) -> list[int]:
        """D: the cached blocks of `req`'s prompt prefix, so that only the rest is received.
        At least the prompt's last block always comes from P (with P's first token)."""
        if not self.prefix_caching or req.block_ids:
            return []
        limit = (req.num_prompt_tokens - 1) // self.block_size * self.block_size
        return self._cache_hit(req, limit)

    def kv_arrived(self, req: Request) -> None:
        """D: the prompt's KV is in the request's blocks; it decodes from now on."""
        del self.waiting_for_kv[req.request_id]
        req.needs_remote_kv = False
        req.num_computed_tokens = req.num_prompt_tokens
        req.state = RequestState.RUNNING
        self.running.append(req)
        self.cache_computed(req)

    def _preempt(self, req: Request) -> None:
        self._release(req)
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
            self._release(req)
        req.state = RequestState.FINISHED


def _no_remote(req: Request) -> None:
    raise RuntimeError(f"{req.request_id}: remote KV requested but no connector is configured")
