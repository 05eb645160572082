"""LLMEngine: one step of continuous batching at a time, in the engine thread.

    step():  schedule -> run the model -> append sampled tokens -> emit outputs

Ownership: the engine owns the block pool, the KV cache and the scheduler. A request's
blocks are freed exactly once: by `Scheduler.finish`, when it finishes, is aborted or
fails, unless the transfer core took them first (P: a finished prompt's, under `Hold`;
D: those a transfer may still hit, under `Quarantine`), through the engine's side of the
transfer contract (pdserve.engine.transfer_adapter; pdserve.transfer.adapter has who
owns what, when); the core then frees them. The engine talks to the core only through
`TransferCore`. `check_integrity()` verifies the pool (tests call it after every scenario).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection

import torch

from pdserve.config import EngineConfig
from pdserve.engine.detokenizer import IncrementalDetokenizer
from pdserve.engine.handle import EngineInfo
from pdserve.engine.logprobs import attach_logprobs
from pdserve.engine.params_check import sampling_problem
from pdserve.engine.request import Request, RequestState
from pdserve.engine.runner import ModelRunner
from pdserve.engine.scheduler import Scheduler, SchedulerOutput, blocks_needed
from pdserve.engine.steptrace import StepTracer
from pdserve.engine.transfer_adapter import EngineBlocks, remote_view
from pdserve.engine.types import (
    EngineRequest,
    EngineStats,
    FinishReason,
    LiveRequest,
    RequestOutput,
)
from pdserve.kv.block_pool import BlockPool
from pdserve.kv.cache import KVCache, num_blocks_for_budget
from pdserve.model.loader import LoadedModel, load_model
from pdserve.token_logprob import TokenLogprob
from pdserve.tracelog import hop
from pdserve.transfer.adapter import (
    EngineSide,
    Event,
    KVReady,
    TransferCore,
    remote_address_of,
    transfer_id_for,
)
from pdserve.transfer.errors import TransferCause, transfer_error
from pdserve.transfer.params import (
    InstanceInfo,
    InstanceLimits,
    InvalidKVTransferParams,
    KVTransferParams,
    check_for_instance,
    check_remote_blocks,
)

# Builds the transfer core once the KV cache exists; it reaches the engine only through
# the `EngineSide` it is given (pdserve.transfer.factory.build_factory makes one).
ConnectorFactory = Callable[[KVCache, EngineSide, LoadedModel], TransferCore]

log = logging.getLogger(__name__)


class LLMEngine:
    """A paged-KV engine over one loaded model. Not thread-safe: one thread drives it."""

    def __init__(
        self,
        loaded: LoadedModel,
        cfg: EngineConfig,
        connector_factory: ConnectorFactory | None = None,
    ) -> None:
        self.cfg = cfg
        self.loaded = loaded
        self.tokenizer = loaded.tokenizer
        self.model_name = loaded.name
        spec = loaded.spec
        self.max_model_len = cfg.model.max_model_len or spec.max_position_embeddings
        device = torch.device(cfg.model.device)
        bs = cfg.cache.block_size
        num_blocks = cfg.cache.num_blocks or num_blocks_for_budget(
            spec, int(cfg.cache.kv_cache_memory_gib * 2**30), bs, loaded.dtype
        )
        self.kv = KVCache.allocate(spec, num_blocks, bs, loaded.dtype, device)
        self.pool = BlockPool(num_blocks)
        self.scheduler = Scheduler(cfg.scheduler, self.pool, bs, cfg.cache.enable_prefix_caching)
        self.runner = ModelRunner(loaded.model, self.kv, device, self.tokenizer.eos_token_ids)
        self.requests: dict[str, Request] = {}
        self.trace = StepTracer()  # DEBUG lines on pdserve.engine.steps (steptrace.py)
        self.connector: TransferCore | None = None
        # Set by whoever drives the loop (AsyncEngine): outputs made between two layers of a
        # step are handed over through it at once instead of with the step's outputs.
        self.early_outputs: Callable[[list[RequestOutput]], None] | None = None
        self._deferred: list[Event] = []  # connector events for requests in a running step
        if connector_factory is not None:
            blocks = EngineBlocks(self.pool, self.requests)
            self.connector = connector = connector_factory(self.kv, blocks, loaded)
            self.scheduler.on_remote_admit = lambda r: connector.start_receive(remote_view(r))
            frac = self.connector.cfg.max_waiting_kv_fraction
            self.scheduler.remote_kv_block_cap = int(frac * num_blocks)
        log.info("engine: %s, %d KV blocks of %d tokens", self.model_name, num_blocks, bs)

    @classmethod
    def from_config(
        cls, cfg: EngineConfig, connector_factory: ConnectorFactory | None = None
    ) -> LLMEngine:
        """Load the model named in `cfg` and build an engine (and connector) around it."""
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        return cls(load_model(cfg.model), cfg, connector_factory)

    # -- requests --------------------------------------------------------------------------
    def add_request(self, er: EngineRequest) -> list[RequestOutput]:
        """Queue a request; returns an immediate error output if it can never run."""
        problem = self._validate(er)
        if problem:
            return [_error_output(er.request_id, problem, len(er.prompt_token_ids))]
        detok = IncrementalDetokenizer(self.tokenizer, er.params.stop)
        req = Request(er, detok)
        self.requests[req.request_id] = req
        if self.connector is not None and req.is_remote_decode:
            self.connector.prefill_admitted(remote_view(req))
        self.scheduler.add(req)
        return []

    def _validate(self, er: EngineRequest) -> str | None:
        """Why `er` can never run here, or None. The HTTP layer checks the same first (to
        answer 400); this is the authority, and the only check for in-process callers."""
        if er.request_id in self.requests:
            return f"request id {er.request_id!r} is already in use"
        total = len(er.prompt_token_ids) + er.params.max_tokens
        if not er.prompt_token_ids:
            return "the prompt is empty"
        if total > self.max_model_len:
            return (
                f"prompt + max_tokens = {total} exceeds the max model length {self.max_model_len}"
            )
        if blocks_needed(total, self.kv.block_size) > self.pool.num_blocks:
            return f"prompt + max_tokens = {total} tokens do not fit in the KV cache"
        bad = sampling_problem(er.params, self.loaded.spec.vocab_size)
        if bad:
            return bad
        p = er.kv_transfer
        if p is None or not (p.do_remote_prefill or p.do_remote_decode):
            return None
        try:
            check_for_instance(p, self.instance_limits(), len(er.prompt_token_ids))
            self._check_transfer_free(p.transfer_id or er.request_id)
            peer_blocks = None
            if p.do_remote_prefill and p.remote_engine_id and p.remote_incarnation:
                peer_blocks = self.connector.remote_num_blocks(
                    p.remote_engine_id, p.remote_incarnation
                )
            if peer_blocks is not None and p.transfer_mode == "pull":
                check_remote_blocks(p, peer_blocks)
        except InvalidKVTransferParams as exc:
            return str(exc)
        busy = self._over_cap(er, blocks_needed(len(er.prompt_token_ids), self.kv.block_size))
        if busy is None:
            return None
        self.connector.count_refused_leg()
        return transfer_error(TransferCause.OVERLOADED, busy)

    def _over_cap(self, er: EngineRequest, need: int) -> str | None:
        """Why this P/D leg must be refused for now (its side's caps), or None.

        D: legs queued or waiting for KV from one prefill instance, at most
        `max_waiting_per_peer`. P: blocks held for transfers no decode instance has claimed
        or registered for, at most `max_unclaimed_hold_fraction` of the pool (a prompt
        alone always fits). Both bound what strangers' legs can tie up; the router's
        release and the lease free P's holds, D's legs end by arrival, failure or watchdog.
        """
        c, p = self.connector, er.kv_transfer
        assert c is not None and p is not None
        if p.do_remote_prefill:
            peer = (p.remote_host, p.remote_port)
            waiting = sum(
                1
                for r in self.requests.values()
                if r.needs_remote_kv and remote_address_of(r.kv_transfer) == peer
            )
            if waiting >= c.cfg.max_waiting_per_peer:
                return (
                    f"{waiting} requests already wait for KV from the prefill instance at "
                    f"{p.remote_host}:{p.remote_port} (the most: --kv-max-waiting-per-peer)"
                )
            return None
        cap = int(c.cfg.max_unclaimed_hold_fraction * self.pool.num_blocks)
        held = c.unclaimed_blocks()
        if held and held + need > cap:
            return (
                f"{held} KV blocks are held for transfers no decode instance has claimed yet; "
                f"{need} more would pass the cap of {cap} (--kv-max-unclaimed-fraction)"
            )
        return None

    def instance_limits(self) -> InstanceLimits:
        """This engine's side of a P/D pair, for checking `kv_transfer_params`."""
        c = self.connector
        return InstanceLimits(
            role=c.cfg.role if c else "both",
            mode=c.cfg.mode if c else None,
            block_size=self.kv.block_size,
            vocab_size=self.tokenizer.vocab_size,
        )

    def _check_transfer_free(self, tid: str) -> None:
        """A transfer id names one transfer until its blocks are back: a second request
        with it would overwrite the first one's hold, receive slot or quarantine."""
        c = self.connector
        assert c is not None
        busy = c.transfer_in_use(tid) or any(
            r.kv_transfer is not None and _transfer_id(r) == tid for r in self.requests.values()
        )
        if busy:
            raise InvalidKVTransferParams(
                f"kv_transfer_params.transfer_id {tid!r} is in use by a transfer in flight"
            )

    def abort_request(self, request_id: str) -> list[RequestOutput]:
        """Abort a request wherever it is; frees its blocks. Unknown ids are ignored."""
        req = self.requests.get(request_id)
        if req is None:
            return []
        return [self._finish(req, FinishReason.ABORT)]

    def release_transfer(self, transfer_id: str) -> None:
        """P: the router will send no decode leg for `transfer_id`; the connector frees
        what nobody uses (pdserve.transfer.connector). A no-op without a connector."""
        if self.connector is not None:
            self.connector.release_transfer(transfer_id)

    def has_work(self) -> bool:
        """True when `step()` would compute (connector events are polled separately)."""
        return self.scheduler.has_work()

    def poll_connector(self, busy: Collection[str] = ()) -> list[RequestOutput]:
        """Apply the connector's events: KV arrived (emit P's first token), KV failed.

        Events for the requests in `busy` (those of a step in progress) wait for the next
        call: a request must not end while the model computes on its blocks.
        """
        if self.connector is None:
            return []
        outputs = []
        events, self._deferred = self._deferred + self.connector.poll(), []
        for ev in events:
            if ev.request_id in busy:
                self._deferred.append(ev)
                continue
            req = self.requests.get(ev.request_id)
            if req is None:
                continue
            if isinstance(ev, KVReady) and ev.first_token_id is None:
                # Only a P of another engine sends none (vLLM's D recomputes that token);
                # this engine emits P's token and has no step for it: a clear error.
                why = "the prefill instance sent no first token (another engine's P?)"
                outputs.append(self._fail(req, transfer_error(TransferCause.TRANSFER_FAILED, why)))
            elif isinstance(ev, KVReady):
                self.trace.landed(1)
                hop(_transfer_id(req), "d.engine_kv", busy=len(busy))
                self.scheduler.kv_arrived(req)
                lp = ev.first_token_logprobs if req.logprobs is not None else None
                outputs.append(self._append_token(req, ev.first_token_id, lp))
                hop(_transfer_id(req), "d.engine_out", rid=req.request_id)
            else:
                outputs.append(self._fail(req, ev.error))
        return outputs

    # -- the loop body ---------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one batch; returns the outputs produced by it."""
        start = time.monotonic()
        sched = self.scheduler.schedule()
        if not sched.seqs:
            return []
        if self.cfg.faults.step_delay_s:  # fault injection (tests): a slow instance
            time.sleep(self.cfg.faults.step_delay_s)
        try:
            sampled = self.runner.execute(sched.seqs, self._layer_hook(sched))
        except Exception as exc:  # one bad batch must not kill the instance
            log.exception("engine step failed; failing its %d requests", len(sched.seqs))
            return [self._fail(s.request, f"engine step failed: {exc}") for s in sched.seqs]
        outputs = self._update(sched, sampled)
        if self.trace.enabled:
            self.trace.record(sched, start)
        return outputs

    def _layer_hook(self, sched: SchedulerOutput) -> Callable[[int], None] | None:
        """P (layer-wise push): stream each layer of prompts finishing in this step.
        D: between layers, hand over the first token of KV that has just landed."""
        if self.connector is None:
            return None
        if self.connector.cfg.role == "decode" and self.early_outputs is not None:
            return self._mid_step_poll(frozenset(s.request.request_id for s in sched.seqs))
        last = [
            remote_view(s.request, num_tokens=s.request.num_prompt_tokens)
            for s in sched.seqs
            if s.samples and s.request.is_remote_decode
        ]
        return self.connector.layer_hook(last) if last else None

    def _mid_step_poll(self, busy: frozenset[str]) -> Callable[[int], None]:
        """A layer hook for D. A prompt whose KV lands during a step would otherwise wait
        for the step's end before its first token (P's) leaves: up to a whole decode step
        of the handoff under load. Its request is not in this step (it was waiting for
        KV), so taking its event now changes nothing the step computes on."""
        connector, deliver = self.connector, self.early_outputs
        assert connector is not None and deliver is not None

        def hook(layer: int) -> None:
            if connector.has_events():
                outputs = self.poll_connector(busy)
                if outputs:
                    deliver(outputs)

        return hook

    def _fail(self, req: Request, message: str) -> RequestOutput:
        out = self._finish(req, FinishReason.ERROR)
        out.error = message
        return out

    def _update(self, sched: SchedulerOutput, sampled: dict[str, int]) -> list[RequestOutput]:
        outputs = []
        for s in sched.seqs:
            req = s.request
            req.num_computed_tokens = s.num_computed + s.num_new
            self.scheduler.cache_computed(req)
            got = sampled.get(req.request_id)
            if got is not None:
                outputs.append(self._append_token(req, got.token, got.logprob))
        return outputs

    def _append_token(
        self, req: Request, token: int, logprob: TokenLogprob | None = None
    ) -> RequestOutput:
        req.output_token_ids.append(token)
        if req.logprobs is not None:
            req.logprobs.append(logprob)
        stopped = self._stops(req, token)
        reason = FinishReason.STOP if stopped else self._length_reason(req)
        if reason is not None:
            return self._finish(req, reason, [token])
        return self._output(req, [token], final=False)

    def _stops(self, req: Request, token: int) -> bool:
        p = req.params
        if token in p.stop_token_ids:
            return True
        if not p.ignore_eos and token in self.tokenizer.eos_token_ids:
            return True
        # Before `min_tokens` a stop string does not stop (EOS and stop ids are masked).
        return req.detok.append(token, check_stop=len(req.output_token_ids) > p.min_tokens)

    def _length_reason(self, req: Request) -> FinishReason | None:
        if req.is_remote_decode or len(req.output_token_ids) >= req.params.max_tokens:
            return FinishReason.LENGTH
        if req.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def _finish(
        self, req: Request, reason: FinishReason, new: list[int] | None = None
    ) -> RequestOutput:
        params = self._hand_over(req, reason)
        self.scheduler.finish(req)
        req.finish_reason = reason
        del self.requests[req.request_id]
        out = self._output(req, new or [], final=True)
        out.kv_transfer_params = params
        return out

    def _hand_over(self, req: Request, reason: FinishReason) -> KVTransferParams | None:
        """P/D: tell the transfer core the request ends, before its blocks are freed: the
        core takes those it still needs (P: the prompt's, D: those a transfer may hit)."""
        c = self.connector
        if c is None:
            return None
        if req.state is RequestState.WAITING_FOR_REMOTE_KV:
            c.cancel_receive(remote_view(req))
        elif req.is_remote_decode and reason in (FinishReason.STOP, FinishReason.LENGTH):
            return c.prefill_done(remote_view(req), req.output_token_ids[-1])
        elif req.is_remote_decode:
            c.prefill_failed(remote_view(req), f"prefill ended: {reason.value}")
        return None

    def _output(self, req: Request, new: list[int], final: bool) -> RequestOutput:
        out = RequestOutput(
            request_id=req.request_id,
            new_token_ids=new,
            new_text=req.detok.take(final),
            finished=final,
            finish_reason=req.finish_reason,
            num_prompt_tokens=req.num_prompt_tokens,
            num_output_tokens=len(req.output_token_ids),
        )
        if req.logprobs is not None or req.prompt_logprobs is not None:
            attach_logprobs(req, out)
        return out

    # -- introspection ---------------------------------------------------------------------
    def info(self) -> EngineInfo:
        """What the front end needs to know about this engine (fixed once it is built)."""
        c = self.connector
        instance = InstanceInfo(
            engine_id=c.cfg.engine_id if c else "monolithic",
            incarnation=c.cfg.incarnation if c else "",
            role=c.cfg.role if c else "both",
            transfer_mode=c.cfg.mode if c else None,
            transport=c.transport_kind if c else None,
            side_channel_host=c.side_address[0] if c else None,
            side_channel_port=c.side_address[1] if c else None,
            model=self.model_name,
        )
        return EngineInfo(
            model_name=self.model_name,
            model_path=str(self.loaded.path),
            max_model_len=self.max_model_len,
            block_size=self.kv.block_size,
            limits=self.instance_limits(),
            instance=instance,
        )

    def live_requests(self) -> list[LiveRequest]:
        """Progress of the live requests (any thread: one atomic copy of the dict, then racy
        but harmless reads of ints and list lengths the engine thread writes)."""
        return [_live(r) for r in list(self.requests.values())]

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_waiting_for_kv=len(self.scheduler.waiting_for_kv),
            kv_blocks_used=self.pool.num_used,
            kv_blocks_total=self.pool.num_blocks,
            num_preemptions=self.scheduler.num_preemptions,
            prefix_cache_queries=self.scheduler.prefix_queries,
            prefix_cache_hits=self.scheduler.prefix_hits,
        )

    def check_integrity(self) -> None:
        """Pool consistent, and every hold on a block is a live request's or the connector's
        (a cached block shared by several counts once per holder)."""
        self.pool.check_integrity()
        owned = sum(len(r.block_ids) for r in self.requests.values())
        if self.connector is not None:
            owned += self.connector.num_blocks_held()
        if owned != self.pool.num_refs:
            raise AssertionError(f"{self.pool.num_refs} block holds, owners account for {owned}")

    def close(self) -> None:
        if self.connector is not None:
            self.connector.close()


def _transfer_id(r: Request) -> str:
    return transfer_id_for(r.kv_transfer, r.request_id)


def _live(r: Request) -> LiveRequest:
    remote = bool(r.kv_transfer and r.kv_transfer.do_remote_prefill)
    prompt = 0 if remote else len(r.prompt_token_ids)
    outputs = len(r.output_token_ids)
    return LiveRequest(
        request_id=r.request_id,
        outputs=outputs,
        computed=min(r.num_computed_tokens, prompt),
        prompt=prompt,
        decode_left=max(0, r.params.max_tokens - outputs),
    )


def _error_output(request_id: str, message: str, num_prompt: int) -> RequestOutput:
    return RequestOutput(
        request_id=request_id,
        new_token_ids=[],
        new_text="",
        finished=True,
        finish_reason=FinishReason.ERROR,
        error=message,
        num_prompt_tokens=num_prompt,
    )
