"""Scheduler-side logic of the connector (vLLM's EngineCore process; no network, no threads).

D: a request whose params say `do_remote_prefill` (with P's answer, or, when the router
sends both legs at once, only P's address and the transfer id) asks vLLM to reserve blocks
for the prompt tokens its own prefix cache lacks and to wait (load_async=True); once vLLM
allocated them (`after_alloc`) the next step's metadata hands a `RecvSpec` to the worker.
vLLM keeps those blocks, and the request waiting, until the worker reports the request in
finished_recving.

P: a request whose params say `do_remote_decode` and that finished normally keeps its
blocks (delay_free=True) and returns the params D needs (unused when D's leg went out with
P's, naming the router's `transfer_id`, which the SendSpec carries); the next step's
metadata hands a `SendSpec` to the worker, which owns the blocks until finished_sending.
"""

from __future__ import annotations

import logging
import math
from typing import Any

from pdserve.vllm.config import VllmConnectorConfig
from pdserve.vllm.params import (
    RemoteParams,
    remote_prefill,
    requested_mode,
    transfer_id,
    wants_remote_decode,
)
from pdserve.vllm.specs import RecvSpec, ReleaseSpec, SendSpec, WorkerCard

log = logging.getLogger(__name__)


class SchedulerSide:
    """What the connector's scheduler role keeps between vLLM's calls (engine thread only)."""

    def __init__(self, cfg: VllmConnectorConfig, engine_id: str, block_size: int) -> None:
        self.cfg = cfg
        self.engine_id = engine_id
        self.block_size = block_size
        self.worker: WorkerCard | None = None  # set once the worker registered its caches
        self._recvs: list[RecvSpec] = []
        self._sends: list[SendSpec] = []
        self._releases: list[ReleaseSpec] = []

    def num_matched(
        self, request_id: str, params: dict[str, Any] | None, num_prompt: int, num_computed: int
    ) -> tuple[int, bool]:
        """D: tokens P will provide beyond our own prefix cache, loaded asynchronously."""
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
        first = (num_prompt - num_external) // self.block_size
        last = math.ceil(num_prompt / self.block_size)
        spec = RecvSpec(
            request_id=request_id,
            mode=remote.transfer_mode,
            remote_engine_id=remote.remote_engine_id,
            remote_incarnation=remote.remote_incarnation,
            remote_request_id=remote.key,
            remote_address=(remote.remote_host, remote.remote_port),
            block_ids=list(block_ids[first:last]),
            remote_block_ids=list(remote.remote_block_ids),
            first_block=first,
            num_tokens=num_prompt,
        )
        self._recvs.append(spec)

    def request_finished(
        self,
        request_id: str,
        params: dict[str, Any] | None,
        block_ids: list[int],
        num_computed: int,
        finished_ok: bool,
    ) -> tuple[bool, dict[str, Any] | None]:
        """P: keep the blocks for D (True) and return D's params; otherwise vLLM frees.

        D: a request that ends before vLLM allocated its blocks (client gone while queued)
        still has P holding its KV: release it."""
        self._release_unused(params)
        if not wants_remote_decode(params) or not finished_ok or not block_ids:
            return False, None
        if self.worker is None:
            log.error("request %s: the worker never reported its identity", request_id)
            return False, None
        send = SendSpec(
            request_id=request_id,
            block_ids=list(block_ids),
            num_tokens=num_computed,
            transfer_id=transfer_id(params) or "",
        )
        self._sends.append(send)
        remote = RemoteParams(
            remote_engine_id=self.worker.engine_id,
            remote_incarnation=self.worker.incarnation,
            remote_request_id=send.key,
            remote_host=self.cfg.advertised,
            remote_port=self.cfg.side_port,
            remote_block_ids=list(block_ids),
            remote_num_tokens=num_computed,
            transfer_mode=requested_mode(params) or self.cfg.mode,
        )
        return True, remote.to_dict()

    def _release_unused(self, params: dict[str, Any] | None) -> None:
        try:
            remote = remote_prefill(params)
        except ValueError:
            return
        if remote is not None:
            params["do_remote_prefill"] = False  # type: ignore[index]
            address = (remote.remote_host, remote.remote_port)
            release = ReleaseSpec(remote_request_id=remote.key, remote_address=address)
            self._releases.append(release)

    def take(self) -> tuple[list[RecvSpec], list[SendSpec], list[ReleaseSpec]]:
        """This step's work for the worker (vLLM calls build_connector_meta once a step)."""
        out = self._recvs, self._sends, self._releases
        self._recvs, self._sends, self._releases = [], [], []
        return out
