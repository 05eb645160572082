"""vLLM's side of the transfer contract (pdserve.transfer.adapter): `EngineSide` over the
blocks vLLM lends the connector, and the events the core reports, as vLLM's results.

vLLM owns every KV block; its scheduler never hands a block id to anyone else while the
connector may touch it, and it learns that the connector is done with a request's blocks
only from the request id in finished_sending (P) or finished_recving (D). So:

Who owns a block, at every moment (vLLM's request status in brackets):
  P: the request (running, prefilling; with layer-wise push the core reads each layer of
     the blocks the step's `LayerSpec` named once vLLM saved it) -> lent (finished: vLLM
     delayed freeing them, `lend` from the `SendSpec`) -> `Hold(tid)` (`take_blocks`, in
     the core's `prefill_done`) -> back to vLLM: `free_blocks` puts the request id in
     finished_sending, and vLLM frees them at its next step.
     Aborted after its completing step was streamed (push, layer-wise): lent (vLLM delayed
     freeing them, `lend` from the aborted `PrefillSpec`'s `block_ids`) -> `Hold(tid)`
     (`take_blocks`, in the core's `prefill_failed`) until no layer write posted from them
     is pending -> finished_sending; any the core did not take go back at once (`sent`).
  D: lent (WAITING_FOR_REMOTE_KVS, `lend` from the `RecvSpec`) ->
     - `KVReady`: the request again (finished_recving; vLLM runs it);
     - `KVFailed` with nothing fenced: back to vLLM (finished_recving + failed_recving;
       vLLM fails the request and frees them);
     - `Quarantine(tid)` (`take_blocks`: the core's `cancel_receive` when vLLM ended the
       request while a transfer may still land, or a peer declared down while a read may
       still be claiming) -> back to vLLM when the core frees them: finished_recving +
       failed_recving (their bytes never count). A `KVFailed` for a fenced request waits
       for that moment, so vLLM never fails (and frees) a request whose blocks are fenced.
  A request id is reported exactly once (vLLM asserts the request still exists).
  The worker's glue (pdserve.vllm.transfers) calls `ended` for a lent D request that vLLM
  finished and the core did not fence: it goes back at once.

Engine thread only (vLLM's worker thread), like every TransferCore call. Imports no vLLM,
so the transfer core's scenarios run it without vLLM (tests/transfer_adapters.py).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from pdserve.transfer.adapter import (
    ConnectorOwner,
    Event,
    Hold,
    KVFailed,
    KVReady,
    Quarantine,
)

log = logging.getLogger(__name__)


@dataclass
class Results:
    """Request ids vLLM may act on (taken every step by get_finished)."""

    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    failed_recving: set[str] = field(default_factory=set)


class VllmBlocks:
    """`EngineSide` over what vLLM lent the connector (module doc)."""

    def __init__(self) -> None:
        self._lent: dict[str, list[int]] = {}  # request id -> blocks lent, not taken
        self._taken: dict[ConnectorOwner, tuple[str, list[int]]] = {}
        self._failed: dict[str, str] = {}  # D, fenced: KVFailed waiting for the blocks
        self._results = Results()

    # -- the worker's glue -------------------------------------------------------------------
    def lend(self, request_id: str, blocks: Sequence[int]) -> None:
        """vLLM lent these blocks of `request_id` (P: delayed free; D: waiting for KV)."""
        self._lent[request_id] = list(blocks)

    def is_lent(self, request_id: str) -> bool:
        return request_id in self._lent

    def on_events(self, events: Iterable[Event]) -> None:
        """D: the core's events, as vLLM's results (module doc)."""
        for ev in events:
            rid = ev.request_id
            if isinstance(ev, KVReady):
                if self._lent.pop(rid, None) is not None:
                    self._results.finished_recving.add(rid)
            elif isinstance(ev, KVFailed):
                log.warning("pdserve connector: KV of %s did not arrive: %s", rid, ev.error)
                if self._lent.pop(rid, None) is not None:
                    self._report_failed(rid)
                elif self._fenced(rid):
                    self._failed[rid] = ev.error

    def ended(self, request_id: str) -> None:
        """D: a lent request vLLM finished that the core did not fence: no transfer can
        land in its blocks, so they go back now."""
        if self._lent.pop(request_id, None) is not None:
            self._report_failed(request_id)

    def sent(self, request_id: str) -> None:
        """P: a lent request whose blocks the core did not take: back to vLLM now."""
        if self._lent.pop(request_id, None) is not None:
            self._results.finished_sending.add(request_id)

    def take_results(self) -> Results:
        out, self._results = self._results, Results()
        return out

    def num_lent(self) -> int:
        """Blocks lent and not given back (lent or taken), for tests and logs."""
        taken = sum(len(b) for _, b in self._taken.values())
        return taken + sum(len(b) for b in self._lent.values())

    def owner_of(self, block: int) -> object | None:
        """Who the connector thinks holds `block`: its request id while lent, the core's
        owner once taken, None if not lent (tests: vLLM's own bookkeeping says the rest)."""
        for owner, (_, blocks) in self._taken.items():
            if block in blocks:
                return owner
        return next((rid for rid, b in self._lent.items() if block in b), None)

    # -- EngineSide ----------------------------------------------------------------------
    def take_blocks(self, request_id: str, owner: ConnectorOwner) -> list[int]:
        blocks = self._lent.pop(request_id, None)
        if blocks is None:
            return []
        self._taken[owner] = (request_id, blocks)
        return list(blocks)

    def free_blocks(self, blocks: Sequence[int], owner: ConnectorOwner) -> None:
        taken = self._taken.pop(owner, None)
        if taken is None:
            log.error("pdserve connector: %s freed blocks it never took", owner)
            return
        rid = taken[0]
        if isinstance(owner, Hold):
            self._results.finished_sending.add(rid)
        else:
            self._failed.pop(rid, None)
            self._report_failed(rid)

    # -- helpers ---------------------------------------------------------------------------
    def _fenced(self, request_id: str) -> bool:
        return any(
            isinstance(o, Quarantine) and rid == request_id for o, (rid, _) in self._taken.items()
        )

    def _report_failed(self, request_id: str) -> None:
        self._results.finished_recving.add(request_id)
        self._results.failed_recving.add(request_id)
