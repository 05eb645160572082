"""Pull mode: P keeps the prompt's blocks under a lease; D READs them, then tells P.

P (engine thread): `prefill_done` moves the blocks to "hold:<tid>" with a lease of
  `lease_s` and returns their ids to the router. D's PullDone (side channel) or the
  lease's end frees them.
D: `start_receive` queues a job for the reader thread, which handshakes on first
  contact, READs every layer's blocks with coalesced descriptors, waits for the
  transport to finish (bounded by the transport's own timeout), sends PullDone to P
  and reports the outcome. A request that ends while its READ is in flight has its
  blocks quarantined; the reader releases them once the READ is over, whatever its
  outcome, so no READ ever lands in blocks that another request owns.
"""

from __future__ import annotations

import logging
import queue
import threading
import time

from pdserve.engine.request import Request
from pdserve.transfer import messages as m
from pdserve.transfer.connector import (
    Arrived,
    Failed,
    KVConnector,
    ReleaseHold,
    ReleaseQuarantine,
    TransferError,
    transfer_id_of,
)
from pdserve.transfer.params import KVTransferParams

log = logging.getLogger(__name__)


class _ReadJob:
    __slots__ = ("blocks", "params", "tid")

    def __init__(self, tid: str, blocks: list[int], params: KVTransferParams) -> None:
        self.tid, self.blocks, self.params = tid, blocks, params


class PullConnector(KVConnector):
    """Pull: the decode side reads; the prefill side holds blocks under a lease."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._jobs: queue.SimpleQueue[_ReadJob | None] = queue.SimpleQueue()
        self._reader = threading.Thread(target=self._read_loop, name="pdserve-pull", daemon=True)
        self._reader.start()

    # -- P -------------------------------------------------------------------------------
    def prefill_done(self, req: Request, first_token: int) -> KVTransferParams:
        h = self.hold(req, first_token, time.time(), lease=True)
        host, port = self.side.address
        return KVTransferParams(
            transfer_mode="pull",
            transfer_id=h.transfer_id,
            remote_engine_id=self.cfg.engine_id,
            remote_incarnation=self.cfg.incarnation,
            remote_host=host,
            remote_port=port,
            remote_block_ids=list(h.blocks),
            remote_num_tokens=h.num_tokens,
            first_token_id=first_token,
            prefill_done_time=h.done_time,
        )

    def on_message(self, msg: m.Message) -> None:
        if isinstance(msg, m.PullDone):
            self.report(ReleaseHold(msg.transfer_id, "read done" if msg.ok else "read failed"))

    # -- D -------------------------------------------------------------------------------
    def start_receive(self, req: Request) -> None:
        super().start_receive(req)
        assert req.kv_transfer is not None
        self._jobs.put(_ReadJob(transfer_id_of(req), list(req.block_ids), req.kv_transfer))

    def _read_loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            ok = False
            try:
                self.report(self._read(job))
                ok = True
            except Exception as exc:  # every failure becomes a clear per-request error
                log.warning("pull %s failed: %s", job.tid, exc)
                self.report(Failed(job.tid, f"KV pull failed: {exc}"))
            finally:
                # P may free its hold now, whatever happened (no handshake needed for this).
                to = (job.params.remote_host, job.params.remote_port)
                try:
                    self.side.send(to, m.PullDone(transfer_id=job.tid, ok=ok))
                except Exception:  # a bad address must not kill the reader thread
                    log.exception("pull %s: could not send PullDone to %s", job.tid, to)
                self.report(ReleaseQuarantine(job.tid))

    def _read(self, job: _ReadJob) -> Arrived:
        p = job.params
        if len(p.remote_block_ids or ()) != len(job.blocks):
            raise TransferError(
                f"prefill instance holds {len(p.remote_block_ids or ())} blocks for "
                f"{p.remote_num_tokens} tokens, decode allocated {len(job.blocks)}"
            )
        peer = self.peer(p.remote_engine_id, (p.remote_host, p.remote_port), p.remote_incarnation)
        local, remote = self.descriptors(peer, job.blocks, p.remote_block_ids)
        self.run_transfer("read", peer, local, remote, None)
        return Arrived(job.tid, p.first_token_id, p.prefill_done_time or 0.0)

    def close(self) -> None:
        self._jobs.put(None)
        self._reader.join(2.0)
        super().close()
