"""Scheduler-side logic of the connector (vLLM's EngineCore process; no network, no threads).

It decides which blocks vLLM lends the worker's transfer core, and hands that to the
worker in the next step's metadata (`StepSpecs`); the worker gives them back through
finished_sending / finished_recving (pdserve.vllm.engine_side).

D: a request whose params say `do_remote_prefill` (with P's answer, or, when the router
sends both legs at once, only P's address and the transfer id) asks vLLM to reserve blocks
for the prompt tokens its own prefix cache lacks and to wait (load_async=True); once vLLM
allocated them (`after_alloc`) a `RecvSpec` goes to the worker. vLLM keeps those blocks,
and the request waiting, until the worker reports the request in finished_recving (vLLM
also delays freeing them if the request is aborted meanwhile).

P: a request whose params say `do_remote_decode` is announced when it enters vLLM's queue
(`arrived`, from on_new_request; else when vLLM first considers it) (`PrefillSpec` in
`admitted`); the step that completes its prompt names its blocks
(`LayerSpec`, push: the worker writes each layer as vLLM saves it); when it finishes
normally it keeps its blocks (delay_free=True), returns the params D needs (unused when
D's leg went out with P's, naming the router's `transfer_id`) and a `SendSpec` lends the
blocks to the worker until finished_sending. One that ends otherwise is announced in
`aborted` (push: D is told at once) and freed by vLLM at once, unless its completing step
was named in `layerwise`: layer writes may still read its blocks, so vLLM keeps them and
the aborted spec lends them to the worker until finished_sending.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any

import msgspec

from pdserve.transfer.params import sign
from pdserve.vllm.config import VllmConnectorConfig
from pdserve.vllm.params import (
    Mode,
    RemoteParams,
    core_params,
    remote_prefill,
    requested_mode,
    transfer_id,
    wants_remote_decode,
)
from pdserve.vllm.specs import (
    LayerSpec,
    PrefillSpec,
    RecvSpec,
    ReleaseSpec,
    SendSpec,
    StepSpecs,
    WorkerCard,
)

log = logging.getLogger(__name__)


@dataclass
class _Prefill:
    """P: a prompt vLLM scheduled whose KV goes to a decode instance."""

    spec: PrefillSpec
    num_prompt: int
    blocks: list[int] = field(default_factory=list)
    streamed: bool = False  # its completing step was seen
    layerwise: bool = False  # ... and named in `layerwise`: layer writes may read its blocks


@dataclass(frozen=True)
class Scheduled:
    """One request of vLLM's step, as the scheduler output has it (plain values)."""

    request_id: str
    new_blocks: list[int] | None  # blocks added this step (all of them when `resumed`)
    num_computed: int
    num_scheduled: int
    resumed: bool = False


class SchedulerSide:
    """What the connector's scheduler role keeps between vLLM's calls (engine thread only)."""

    def __init__(self, cfg: VllmConnectorConfig, engine_id: str, block_size: int) -> None:
        self.cfg = cfg
        self.engine_id = engine_id
        self.block_size = block_size
        self.worker: WorkerCard | None = None  # set once the worker registered its caches
        token = cfg.cluster_token()
        self._key = token.encode() if token else None
        self._out = StepSpecs()
        self._prefills: dict[str, _Prefill] = {}

    def _blocks_for(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.block_size)

    # -- both roles: what vLLM schedules --------------------------------------------------
    def arrived(self, request_id: str, params: dict[str, Any] | None, num_prompt: int) -> None:
        """P: a P leg entered vLLM's queue (on_new_request): announce it to the worker now.
        vLLM considers a waiting request only once those ahead of it were scheduled, and D's
        registration, which comes at once, must not outlive `registration_grace_s` waiting
        for P to hear of its prompt while P's queue is long."""
        if wants_remote_decode(params):
            self._admit(request_id, params, num_prompt)

    def num_matched(
        self, request_id: str, params: dict[str, Any] | None, num_prompt: int, num_computed: int
    ) -> tuple[int, bool]:
        """D: tokens P will provide beyond our own prefix cache, loaded asynchronously.
        P: the first time vLLM considers a P leg, announce it to the worker (if `arrived`
        has not already)."""
        if wants_remote_decode(params):
            self._admit(request_id, params, num_prompt)
            return 0, False
        try:
            remote = remote_prefill(params)
        except ValueError as exc:  # computing the prompt here is always correct
            log.warning("request %s: %s; prefilling locally", request_id, exc)
            return 0, False
        if remote is None:
            return 0, False
        if remote.remote_num_tokens is not None and remote.remote_num_tokens < num_prompt:
            return 0, False
        count = num_prompt - num_computed
        return (count, True) if count > 0 else (0, False)

    def _admit(self, request_id: str, params: dict[str, Any] | None, num_prompt: int) -> None:
        if request_id in self._prefills:
            return
        mode = requested_mode(params) or self.cfg.mode
        spec = PrefillSpec(
            request_id=request_id, transfer_id=transfer_id(params) or request_id, mode=mode
        )
        self._prefills[request_id] = _Prefill(spec, num_prompt)
        self._out.admitted.append(spec)

    def scheduled(self, step: list[Scheduled]) -> None:
        """P: follow the blocks of P legs; name those whose prompt this step completes
        (push, layer-wise: the worker writes each layer as vLLM saves it)."""
        for s in step:
            p = self._prefills.get(s.request_id)
            if p is None:
                continue
            if s.resumed:
                p.blocks = list(s.new_blocks or ())
            elif s.new_blocks:
                p.blocks += s.new_blocks
            need = self._blocks_for(p.num_prompt)
            completes = s.num_computed + s.num_scheduled >= p.num_prompt
            if p.streamed or not completes or len(p.blocks) < need:
                continue
            p.streamed = True
            if p.spec.mode == "push" and self.cfg.push_layerwise:
                p.layerwise = True
                layer = LayerSpec(
                    request_id=s.request_id,
                    transfer_id=p.spec.transfer_id,
                    block_ids=p.blocks[:need],
                    num_tokens=p.num_prompt,
                )
                self._out.layerwise.append(layer)

    # -- D ---------------------------------------------------------------------------------
    def after_alloc(
        self,
        request_id: str,
        params: dict[str, Any] | None,
        block_ids: list[int],
        num_prompt: int,
        num_external: int,
    ) -> None:
        """D: vLLM reserved `block_ids` for the request; hand the receive to the worker."""
        try:
            remote = remote_prefill(params)
        except ValueError:  # num_matched logged it; computed locally
            return
        if remote is None:
            return
        if num_external <= 0:  # vLLM computes the prompt itself: P's hold is not needed
            self._release_unused(params)
            return
        params["do_remote_prefill"] = False  # type: ignore[index]  # not again on preemption
        spec = RecvSpec(
            request_id=request_id,
            mode=remote.transfer_mode,
            remote_engine_id=remote.remote_engine_id,
            remote_incarnation=remote.remote_incarnation,
            remote_request_id=remote.key,
            remote_address=(remote.remote_host, remote.remote_port),
            block_ids=list(block_ids[: self._blocks_for(num_prompt)]),
            remote_block_ids=list(remote.remote_block_ids),
            first_block=(num_prompt - num_external) // self.block_size,
            num_tokens=num_prompt,
            remote_num_tokens=remote.remote_num_tokens,
            expires_at=remote.expires_at,
            signature=remote.signature,
        )
        self._out.recvs.append(spec)

    # -- P (and D's release) ---------------------------------------------------------------
    def request_finished(
        self,
        request_id: str,
        params: dict[str, Any] | None,
        block_ids: list[int],
        num_computed: int,
        finished_ok: bool,
        num_prompt: int | None = None,
    ) -> tuple[bool, dict[str, Any] | None]:
        """P: keep the blocks for D (True) and return D's params; otherwise vLLM frees, but
        for an aborted push prompt whose completing step was streamed layer by layer: its
        layer writes may still be reading the blocks, so vLLM keeps them (True, no params)
        and the worker gives them back in finished_sending once none is pending.

        D: a request that ends before vLLM allocated its blocks (client gone while queued)
        still has P holding its KV: release it."""
        self._release_unused(params)
        prefill = self._prefills.pop(request_id, None)
        if not wants_remote_decode(params):
            return False, None
        mode = requested_mode(params) or self.cfg.mode
        tid = transfer_id(params) or request_id
        num_tokens = min(num_computed, num_prompt if num_prompt is not None else num_computed)
        blocks = list(block_ids[: self._blocks_for(num_tokens)])
        if not finished_ok or not blocks or self.worker is None:
            if self.worker is None:
                log.error("request %s: the worker never reported its identity", request_id)
            spec = (
                prefill.spec
                if prefill
                else PrefillSpec(request_id=request_id, transfer_id=tid, mode=mode)
            )
            if prefill and prefill.layerwise and block_ids and self.worker is not None:
                spec = msgspec.structs.replace(spec, block_ids=list(block_ids))
                self._out.aborted.append(spec)
                return True, None  # lent: back in finished_sending (PrefillSpec)
            self._out.aborted.append(spec)
            return False, None
        send = SendSpec(
            request_id=request_id,
            block_ids=blocks,
            num_tokens=num_tokens,
            transfer_id=transfer_id(params) or "",
            mode=mode,
        )
        self._out.sends.append(send)
        return True, self._params_for_d(send, mode).to_dict()

    def _params_for_d(self, send: SendSpec, mode: Mode) -> RemoteParams:
        assert self.worker is not None
        address = (self.cfg.advertised, self.worker.port(mode))
        expires_at = signature = None
        if self._key is not None and mode == "pull":
            expires_at = time.time() + self.cfg.lease_s
            signed = sign(
                core_params(
                    mode=mode,
                    key=send.key,
                    engine_id=self.worker.engine_id,
                    incarnation=self.worker.incarnation,
                    address=address,
                    block_ids=send.block_ids,
                    num_tokens=send.num_tokens,
                    expires_at=expires_at,
                ),
                self._key,
            )
            signature = signed.signature
        return RemoteParams(
            remote_engine_id=self.worker.engine_id,
            remote_incarnation=self.worker.incarnation,
            remote_request_id=send.key,
            remote_host=address[0],
            remote_port=address[1],
            remote_block_ids=list(send.block_ids),
            remote_num_tokens=send.num_tokens,
            transfer_mode=mode,
            expires_at=expires_at,
            signature=signature,
        )

    def _release_unused(self, params: dict[str, Any] | None) -> None:
        try:
            remote = remote_prefill(params)
        except ValueError:
            return
        if remote is not None:
            params["do_remote_prefill"] = False  # type: ignore[index]
            release = ReleaseSpec(
                mode=remote.transfer_mode,
                remote_request_id=remote.key,
                remote_address=(remote.remote_host, remote.remote_port),
                remote_block_ids=list(remote.remote_block_ids),
            )
            self._out.releases.append(release)

    def take(self) -> StepSpecs:
        """This step's work for the worker (vLLM calls build_connector_meta once a step)."""
        out, self._out = self._out, StepSpecs()
        return out
