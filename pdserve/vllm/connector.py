"""PdserveConnector: vLLM's KVConnectorBase_V1 on pdserve's transfer core.

vLLM builds the connector twice: with the SCHEDULER role in the engine core (block
accounting, `scheduler.SchedulerSide`) and with the WORKER role next to the model
(`worker.WorkerSide`, which starts pdserve's transfer cores when vLLM registers its KV
caches). The two talk only through vLLM: scheduler -> worker in the per-step connector
metadata (`StepSpecs`), worker -> scheduler in finished_sending / finished_recving /
failed_recving and, once at start, in the handshake metadata (the worker's identity and
side-channel ports, which P's params carry). This module is the only one that touches
vLLM's types; it turns them into plain values for the two sides.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)

from pdserve.vllm.config import VllmConnectorConfig
from pdserve.vllm.scheduler import Scheduled, SchedulerSide
from pdserve.vllm.specs import StepSpecs, WorkerCard
from pdserve.vllm.worker import ROLE_OF_KV_ROLE, WorkerSide

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request


def _log_like_vllm() -> None:
    """Send pdserve's log records where vLLM's go, at vLLM's level (vLLM configures only its
    own logger, from VLLM_LOGGING_LEVEL: DEBUG turns on pdserve's handoff trace too)."""
    ours, theirs = logging.getLogger("pdserve"), logging.getLogger("vllm")
    if not ours.handlers:
        for handler in theirs.handlers:
            ours.addHandler(handler)
        ours.setLevel(min(theirs.getEffectiveLevel(), logging.INFO))
        ours.propagate = False


@dataclasses.dataclass
class PdserveConnectorMetadata(KVConnectorMetadata):
    """One step's work for the worker (pdserve.vllm.specs)."""

    specs: StepSpecs


@dataclasses.dataclass
class PdserveHandshakeMetadata(KVConnectorHandshakeMetadata):
    card: WorkerCard


class PdserveConnector(KVConnectorBase_V1):
    """See the module docstring and docs/vllm.md."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        _log_like_vllm()
        ktc = vllm_config.kv_transfer_config
        self.cfg = VllmConnectorConfig.from_extra(ktc.kv_connector_extra_config)
        engine_id = str(ktc.engine_id)
        self._block_size = vllm_config.cache_config.block_size
        self._sched: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._sched = SchedulerSide(self.cfg, engine_id, self._block_size)
        else:
            role_name = ROLE_OF_KV_ROLE.get(str(ktc.kv_role), "both")
            self._worker = WorkerSide(
                self.cfg, engine_id, vllm_config.model_config.model, role_name
            )

    # -- worker role --------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        self._worker.register(kv_caches, self._block_size)

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        if self._worker is None or self._worker.transfers is None:
            return None
        return PdserveHandshakeMetadata(self._worker.card())

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        assert self._worker is not None
        meta = self._get_connector_metadata()
        assert isinstance(meta, PdserveConnectorMetadata)
        self._worker.step(meta.specs)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are asynchronous: a request runs only once all its KV arrived

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        """P, push: this layer's KV is final for the step: the core writes it to D for the
        prompts this step completes (pdserve.vllm.transfers)."""
        assert self._worker is not None
        meta = self._get_connector_metadata()  # bound before the forward pass
        assert isinstance(meta, PdserveConnectorMetadata)
        self._worker.save_layer(layer_name, meta.specs)

    def wait_for_save(self) -> None:
        if self._worker is not None:
            self._worker.end_step()

    def get_transfer_results(
        self, finished_req_ids: set[str] | None = None
    ) -> KVConnectorTransferResults:
        assert self._worker is not None
        r = self._worker.results(set(finished_req_ids or ()))
        return KVConnectorTransferResults(
            finished_sending=r.finished_sending,
            finished_recving=r.finished_recving,
            failed_recving=r.failed_recving,
        )

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        r = self.get_transfer_results(finished_req_ids)
        return r.finished_sending or None, r.finished_recving or None

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()

    # -- scheduler role -----------------------------------------------------------------------
    def set_xfer_handshake_metadata(
        self, metadata: dict[int, KVConnectorHandshakeMetadata]
    ) -> None:
        assert self._sched is not None
        for meta in metadata.values():
            if isinstance(meta, PdserveHandshakeMetadata):
                self._sched.worker = meta.card

    def on_new_request(self, request: Request) -> None:
        assert self._sched is not None
        self._sched.arrived(
            request.request_id, request.kv_transfer_params, request.num_prompt_tokens
        )

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        assert self._sched is not None
        return self._sched.num_matched(
            request.request_id,
            request.kv_transfer_params,
            request.num_prompt_tokens,
            num_computed_tokens,
        )

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        assert self._sched is not None
        self._sched.after_alloc(
            request.request_id,
            request.kv_transfer_params,
            blocks.get_block_ids()[0],
            request.num_prompt_tokens,
            num_external_tokens,
        )

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._sched is not None
        self._sched.scheduled(_scheduled(scheduler_output))
        return PdserveConnectorMetadata(self._sched.take())

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus

        assert self._sched is not None
        ok = request.status in (
            RequestStatus.FINISHED_LENGTH_CAPPED,
            RequestStatus.FINISHED_STOPPED,
        )
        return self._sched.request_finished(
            request.request_id,
            request.kv_transfer_params,
            list(block_ids),
            request.num_computed_tokens,
            ok,
            request.num_prompt_tokens,
        )


def _scheduled(out: SchedulerOutput) -> list[Scheduled]:
    """vLLM's step as plain values (the first KV cache group's blocks: one group here)."""
    steps = [
        Scheduled(
            request_id=r.req_id,
            new_blocks=list(r.block_ids[0]) if r.block_ids else [],
            num_computed=r.num_computed_tokens,
            num_scheduled=out.num_scheduled_tokens.get(r.req_id, 0),
            resumed=True,
        )
        for r in out.scheduled_new_reqs
    ]
    cached = out.scheduled_cached_reqs
    for i, rid in enumerate(cached.req_ids):
        new = cached.new_block_ids[i]
        steps.append(
            Scheduled(
                request_id=rid,
                new_blocks=list(new[0]) if new else None,
                num_computed=cached.num_computed_tokens[i],
                num_scheduled=out.num_scheduled_tokens.get(rid, 0),
                resumed=rid in cached.resumed_req_ids,
            )
        )
    return steps
