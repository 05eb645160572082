"""The worker's glue between vLLM's step and pdserve's transfer cores (engine thread only).

Each step vLLM binds the scheduler's `StepSpecs`, runs the forward pass, which saves each
attention layer (`save_layer`, from save_kv_layer), hands the specs to the worker (`step`,
from start_load_kv: vLLM 0.32 calls it after the forward pass when the step has only
asynchronous loads, before it otherwise) and asks what finished (`results`, from
get_finished, with the ids of the requests vLLM finished). The layer hook of a step is
made from its specs by whichever of `save_layer` and `step` comes first.
This turns that into `TransferCore` calls on the core of each request's mode (one
`PushConnector` and one `PullConnector` per worker: vLLM's legs pick their mode per
request), and the cores' events and freed blocks into vLLM's finished_sending /
finished_recving / failed_recving through `VllmBlocks` (pdserve.vllm.engine_side, which
says who owns each block when).

vLLM's D computes the prompt's last token again itself, so P passes no first token to
`prefill_done` and D ignores `KVReady.first_token_id` (None).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence

from pdserve.transfer.adapter import KVFailed, RemoteRequest, TransferCore
from pdserve.transfer.params import KVTransferParams
from pdserve.vllm.engine_side import Results, VllmBlocks
from pdserve.vllm.params import Mode, core_params
from pdserve.vllm.specs import LayerSpec, PrefillSpec, RecvSpec, ReleaseSpec, SendSpec, StepSpecs

ABORTED = "the prefill request was aborted or failed in vLLM"
_ASK = {"push": "registration", "pull": "claim"}
log = logging.getLogger(__name__)


class VllmTransfers:
    """See the module docstring."""

    def __init__(
        self, cores: Mapping[Mode, TransferCore], blocks: VllmBlocks, layers: Sequence[str]
    ) -> None:
        self.cores = cores
        self.blocks = blocks
        self._layer_index = {name: i for i, name in enumerate(layers)}
        self._recving: dict[str, tuple[Mode, RemoteRequest]] = {}  # D: lent, no event yet
        self._hook: Callable[[int], None] | None = None
        self._hook_specs: StepSpecs | None = None  # the step `_hook` belongs to

    # -- vLLM's step --------------------------------------------------------------------------
    def step(self, specs: StepSpecs) -> None:
        """The scheduler's specs for this step (start_load_kv, before the forward pass)."""
        for rel in specs.releases:
            self.cores[rel.mode].decline_transfer(_declined(rel))
        for pre in specs.admitted:
            self.cores[pre.mode].prefill_admitted(_prefill_view(pre))
        for pre in specs.aborted:
            self._abort(pre)
        for send in specs.sends:
            self._send(send)
        for recv in specs.recvs:
            self._recv(recv)
        self._hook_for(specs)  # vLLM called this before the forward pass (sync loads)

    def _hook_for(self, specs: StepSpecs) -> Callable[[int], None] | None:
        """The layer hook of the step `specs` belongs to, made once per step."""
        if self._hook_specs is not specs:
            self._hook_specs = specs
            self._hook = self._layer_hook(specs.layerwise)
        return self._hook

    def _send(self, send: SendSpec) -> None:
        """P: the core takes the lent blocks (`Hold`) in `prefill_done`."""
        self._log_early(send.mode, send.key)
        self.blocks.lend(send.request_id, send.block_ids)
        try:
            self.cores[send.mode].prefill_done(_send_view(send), None)
        finally:
            self.blocks.sent(send.request_id)  # only if the core did not take them

    def _abort(self, pre: PrefillSpec) -> None:
        """P: the prompt will never finish. Blocks lent with it (vLLM delayed their free:
        layer writes may read them) the core takes (`Hold`) until no posted write is
        pending; any it does not take go back to vLLM at once."""
        if pre.block_ids:
            self.blocks.lend(pre.request_id, pre.block_ids)
        try:
            self.cores[pre.mode].prefill_failed(_prefill_view(pre), ABORTED)
        finally:
            self.blocks.sent(pre.request_id)  # only if lent and the core did not take them

    def _recv(self, recv: RecvSpec) -> None:
        """D: the core fills the lent blocks (past D's own prefix-cache hits)."""
        view = _recv_view(recv)
        self.blocks.lend(recv.request_id, recv.block_ids[recv.first_block :])
        self._recving[recv.request_id] = (recv.mode, view)
        self.cores[recv.mode].start_receive(view)

    def _layer_hook(self, specs: list[LayerSpec]) -> Callable[[int], None] | None:
        core = self.cores.get("push")
        if not specs or core is None:
            return None
        for spec in specs:
            self._log_early("push", spec.transfer_id)
        # D computes the last token again: it needs no token from P, so it is told the KV is
        # complete right after the last layer's write, not after the step that hands the
        # worker the request's SendSpec (under load, the next prompt's whole forward pass).
        return core.layer_hook([_layer_view(s) for s in specs], done_after_last_layer=True)

    def _log_early(self, mode: Mode, tid: str) -> None:
        if self.cores[mode].decode_waiting(tid):
            log.info(
                "pdserve connector: %s for %s arrived before its prefill ended", _ASK[mode], tid
            )

    def save_layer(self, layer_name: str, specs: StepSpecs) -> None:
        """P: vLLM saved this layer's KV for the step of `specs` (save_kv_layer): it is
        final, and the core may write it for the prompts the step completes."""
        hook = self._hook_for(specs)
        index = self._layer_index.get(layer_name)
        if hook is not None and index is not None:
            hook(index)

    def end_step(self) -> None:
        """The forward pass ended (wait_for_save): no more layers of this step."""
        self._hook = None

    def results(self, finished: set[str]) -> Results:
        """What vLLM may act on now (get_finished). `finished`: the requests vLLM finished
        this step; a D request among them still waiting for KV is cancelled."""
        for rid in finished & self._recving.keys():
            mode, view = self._recving.pop(rid)
            self.cores[mode].cancel_receive(view)  # fences the blocks if a write may land
            self.blocks.ended(rid)  # else they go back now
        for core in self.cores.values():
            events = core.poll()
            for ev in events:
                waiting = self._recving.pop(ev.request_id, None)
                if isinstance(ev, KVFailed) and waiting is not None:
                    # The request ends: a transfer may still land (the watchdog's KVFailed
                    # leaves the receive armed), so the core fences its blocks first, and
                    # `on_events` then waits for the quarantine to end before vLLM frees.
                    core.cancel_receive(waiting[1])
            self.blocks.on_events(events)
        return self.blocks.take_results()

    def close(self) -> None:
        for core in self.cores.values():
            core.close()


def _prefill_params(mode: Mode, tid: str) -> KVTransferParams:
    return KVTransferParams(do_remote_decode=True, transfer_mode=mode, transfer_id=tid)


def _prefill_view(pre: PrefillSpec) -> RemoteRequest:
    params = _prefill_params(pre.mode, pre.transfer_id)
    return RemoteRequest(pre.request_id, params, (), tuple(pre.block_ids), 0)


def _send_view(send: SendSpec) -> RemoteRequest:
    params = _prefill_params(send.mode, send.key)
    return RemoteRequest(send.request_id, params, (), tuple(send.block_ids), send.num_tokens)


def _layer_view(spec: LayerSpec) -> RemoteRequest:
    params = _prefill_params("push", spec.transfer_id)
    return RemoteRequest(spec.request_id, params, (), tuple(spec.block_ids), spec.num_tokens)


def _recv_view(recv: RecvSpec) -> RemoteRequest:
    params = core_params(
        mode=recv.mode,
        key=recv.remote_request_id,
        engine_id=recv.remote_engine_id,
        incarnation=recv.remote_incarnation,
        address=recv.remote_address,
        block_ids=recv.remote_block_ids,
        num_tokens=recv.remote_num_tokens,
        expires_at=recv.expires_at,
        signature=recv.signature,
    )
    return RemoteRequest(
        request_id=recv.request_id,
        params=params,
        prompt_token_ids=(),
        block_ids=tuple(recv.block_ids),
        num_tokens=recv.num_tokens,
        num_cached_blocks=recv.first_block,
    )


def _declined(rel: ReleaseSpec) -> KVTransferParams:
    return core_params(
        mode=rel.mode,
        key=rel.remote_request_id,
        engine_id="",
        incarnation="",
        address=rel.remote_address,
        block_ids=rel.remote_block_ids,
        num_tokens=None,
    )
