"""Pull mode: P keeps the prompt's blocks under a lease; D claims them, READs them, tells P.

P (engine thread): `prefill_done` moves the blocks to `Hold(tid)` with a lease of
  `lease_s` and returns their ids to the router (signed with the cluster token, if any,
  with the lease's end as `expires_at`). D's PullDone or the lease's end frees them.
P (engine thread): the router's release (`release_transfer`) frees a hold no reader has
  claimed; a claimed one belongs to its reader's PullDone. A release that comes while the
  prompt is still computing is remembered, and the hold freed as soon as it is made.
P (side-channel receiver): a PullClaim is granted only if P still holds exactly the named
  blocks for that transfer and nobody else claimed them; the hold then belongs to the
  claimant (its lease starts again) and only the claimant's PullDone frees it early (an
  unclaimed hold: a PullDone naming its exact blocks, from a D that failed before claiming).
D (engine thread): `start_receive` verifies the params (`check_params`: P's signature,
  when this instance has a cluster token) and hands the job to the lane of its prefill
  instance; a rejected job fails at once, before any message or READ.
D (lanes, pdserve.transfer.lanes): one thread per prefill instance (side-channel
  address), created on demand and gone after `LANE_IDLE_S` without work, runs that
  instance's jobs in order: handshake on first contact, claim, READ of every layer's
  blocks with coalesced descriptors (bounded by the transport's own timeout), PullDone,
  report. A dead or slow prefill instance delays only its own lane; no READ ever runs on
  the engine thread.
  A request that ends while its READ is in flight has its blocks quarantined; the lane
  releases them once the READ is over, whatever its outcome, so no READ ever lands in
  blocks that another request owns. The same holds when the request fails because its
  prefill instance was declared down (`_abandon`): every job reports ReleaseQuarantine
  when it ends, after its outcome. A job whose request is gone does not handshake (and
  stops a handshake in progress).
"""

from __future__ import annotations

import logging
import time
from typing import overload

import msgspec

from pdserve.logsafe import shown
from pdserve.tracelog import hop
from pdserve.transfer import messages as m
from pdserve.transfer.adapter import RemoteRequest, remote_address_of
from pdserve.transfer.connector import (
    Arrived,
    Failed,
    KVConnector,
    Peer,
    ReleaseHold,
    ReleaseQuarantine,
    TransferError,
)
from pdserve.transfer.errors import TransferCause
from pdserve.transfer.lanes import Lanes
from pdserve.transfer.params import (
    InvalidKVTransferParams,
    KVTransferParams,
    check_pull_params,
    lease_ended,
    sign,
)
from pdserve.transfer.side_channel import Address, new_nonce

log = logging.getLogger(__name__)

MAX_LANES = 64  # prefill instances D reads from at once; more fail at once (hostile params)
LANE_IDLE_S = 30.0  # a lane's thread ends after this long without a job


class _ReadJob(msgspec.Struct):
    tid: str
    blocks: list[int]  # D's blocks (owned by the request, or quarantined if it ended)
    params: KVTransferParams
    skip: int = 0  # prefix caching: the prompt's first blocks D holds already (not read)

    @property
    def remote_blocks(self) -> list[int]:
        """P's blocks this job reads: those past the ones D holds."""
        return list(self.params.remote_block_ids or ())[self.skip :]

    @property
    def address(self) -> Address:
        return (self.params.remote_host, self.params.remote_port)


class PullConnector(KVConnector):
    """Pull: the decode side reads; the prefill side holds blocks under a lease."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        token = self.cfg.cluster_token
        self._key = token.encode() if token else None
        self._lanes: Lanes[_ReadJob] = Lanes(self._run, "pdserve-pull", MAX_LANES, LANE_IDLE_S)
        # P: transfers the router released while their prompt was still computing (engine
        # thread; an entry lives at most as long as its prompt).
        self._release_when_done: set[str] = set()
        # P: claims that came while their prompt was still alive here (under `holds_lock`;
        # answered when its hold is made or the prompt fails). Only an engine that returns
        # params before `prefill_done` sees these (vLLM: its worker hears of a finished
        # prompt one step after the router got P's params).
        self._early_claims: dict[str, m.PullClaim] = {}

    # -- P -------------------------------------------------------------------------------
    def _prefill_done(self, req: RemoteRequest, first_token: int | None) -> KVTransferParams:
        h = self.hold(req, first_token, time.time(), lease=True)
        hop(h.transfer_id, "p.prefill_done", h.done_time)
        host, port = self.side.address
        params = KVTransferParams(
            transfer_mode="pull",
            transfer_id=h.transfer_id,
            remote_engine_id=self.cfg.engine_id,
            remote_incarnation=self.cfg.incarnation,
            remote_host=host,
            remote_port=port,
            remote_block_ids=list(h.blocks),
            remote_num_tokens=h.num_tokens,
            first_token_id=first_token,
            first_token_logprobs=req.last_logprob,
            prefill_done_time=h.done_time,
            expires_at=time.time() + self.cfg.lease_s,
        )
        if h.transfer_id in self._release_when_done:  # the router gave up on it meanwhile
            self._release_when_done.discard(h.transfer_id)
            self.release_unclaimed(h.transfer_id)
        with self.holds_lock:
            early = self._early_claims.pop(h.transfer_id, None)
        if early is not None:
            self.side.send(tuple(early.reply_to), self._claim_hold(early))
        return sign(params, self._key) if self._key else params

    def _prefill_failed(self, req: RemoteRequest, reason: str) -> None:
        self._release_when_done.discard(req.transfer_id)
        with self.holds_lock:
            self.prompts_alive.discard(req.transfer_id)  # no claim parks after this
            early = self._early_claims.pop(req.transfer_id, None)
        if early is not None:
            self.side.send(tuple(early.reply_to), self._claim_hold(early))  # refused

    def release_transfer(self, tid: str) -> None:
        """P: free the hold of `tid` unless a reader claimed it (its PullDone frees it)."""
        freed = self.release_unclaimed(tid)
        if not freed and tid not in self.holds and tid in self.prompts_alive:
            self._release_when_done.add(tid)  # still computing: free the hold once it is made

    def on_message(self, msg: m.Message) -> None:
        if isinstance(msg, m.PullClaim):
            reply = self._claim_hold(msg, park=True)
            if reply is not None:
                self.side.send(tuple(msg.reply_to), reply)
        elif isinstance(msg, m.PullDone):
            with self.holds_lock:
                h = self.holds.get(msg.transfer_id)
                claimed_by = None if h is None else h.claimant
                mine = h is not None and (
                    claimed_by == (msg.engine_id, msg.incarnation)
                    or (claimed_by is None and h.blocks == msg.block_ids)
                )
            if mine:
                self.report(ReleaseHold(msg.transfer_id, "read done" if msg.ok else "read failed"))

    @overload
    def _claim_hold(self, msg: m.PullClaim) -> m.PullClaimReply: ...

    @overload
    def _claim_hold(self, msg: m.PullClaim, park: bool) -> m.PullClaimReply | None: ...

    def _claim_hold(self, msg: m.PullClaim, park: bool = False) -> m.PullClaimReply | None:
        """Grant `msg` the hold it names, or say why not; with `park` (receiver thread),
        None: the prompt is still alive here, and the claim is answered once its hold is
        made or it fails (`_early_claims`)."""
        claimant = (msg.engine_id, msg.incarnation)
        with self.holds_lock:
            h = self.holds.get(msg.transfer_id)
            now = time.monotonic()
            if h is None and park and msg.transfer_id in self.prompts_alive:
                self._early_claims[msg.transfer_id] = msg
                return None
            if h is None or h.deadline < now:
                error = f"transfer {msg.transfer_id} is not held here (lease ended, or unknown)"
                return m.PullClaimReply(nonce=msg.nonce, error=error, lease_expired=True)
            if h.blocks != msg.block_ids:
                error = f"blocks {msg.block_ids} do not belong to transfer {msg.transfer_id}"
                return m.PullClaimReply(nonce=msg.nonce, error=error)
            if h.claimant not in (None, claimant):
                error = f"transfer {msg.transfer_id} is already being read by another instance"
                return m.PullClaimReply(nonce=msg.nonce, error=error)
            h.claimant = claimant
            h.deadline = now + self.cfg.lease_s
        return m.PullClaimReply(nonce=msg.nonce)

    # -- D -------------------------------------------------------------------------------
    def check_params(self, params: KVTransferParams) -> None:
        """With a cluster token: P's signature over every field D uses (a 400 when the
        HTTP gate calls this). The lease's end is checked at admission (`start_receive`)."""
        check_pull_params(params, self._key)

    def start_receive(self, req: RemoteRequest) -> None:
        super().start_receive(req)
        skip = req.num_cached_blocks
        job = _ReadJob(req.transfer_id, list(req.block_ids[skip:]), req.params, skip)
        hop(job.tid, "d.start_receive")
        try:
            self.check_params(job.params)
        except InvalidKVTransferParams as exc:
            self._fail_now(job.tid, str(exc), TransferCause.PARAMS_REJECTED)
            return
        ended = lease_ended(job.params)
        if ended:
            self._fail_now(job.tid, ended, TransferCause.LEASE_EXPIRED)
            return
        if not self._lanes.submit(job.address, job):
            what = f"already reading from {len(self._lanes)} prefill instances (the most)"
            self._fail_now(job.tid, what, TransferCause.OVERLOADED)

    def decode_waiting(self, tid: str) -> bool:
        return tid in self._early_claims

    def decline_transfer(self, params: KVTransferParams) -> None:
        """D: this leg will not read its KV after all: P frees the hold now (an unclaimed
        hold whose exact blocks the PullDone names), not at its lease's end."""
        address = remote_address_of(params)
        if address is None or not params.transfer_id or self.given_up(address):
            return
        done = m.PullDone(
            transfer_id=params.transfer_id,
            ok=False,
            engine_id=self.cfg.engine_id,
            incarnation=self.cfg.incarnation,
            block_ids=list(params.remote_block_ids or ()),
        )
        self.side.send(address, done)

    def _fail_now(self, tid: str, error: str, cause: TransferCause) -> None:
        """A job that never reached a lane: nothing was sent, nothing can land."""
        self._warn[cause].warning("pull %s refused: %s", shown(tid), shown(error, 400))
        self.report(Failed(tid, error, cause))
        self.report(ReleaseQuarantine(tid))

    def _abandon(self, tid: str, req: RemoteRequest) -> None:
        """D: the request fails (its peer is gone), but its job may still be queued or
        claiming: fence the blocks until the job ends (it reports ReleaseQuarantine)."""
        self._fence(tid, req.request_id, None)

    def _on_peer_gone(self, address: Address) -> None:
        self._lanes.drop(address)

    def _run(self, job: _ReadJob) -> None:
        """Claim, read and report one job (its lane's thread); never raises."""
        ok = False
        try:
            p = job.params
            if len(job.remote_blocks) != len(job.blocks) or not job.blocks:
                raise TransferError(
                    f"prefill instance holds {len(p.remote_block_ids or ())} blocks for "
                    f"{p.remote_num_tokens} tokens, decode allocated {len(job.blocks)} "
                    f"past the {job.skip} it holds"
                )
            hop(job.tid, "d.lane_start")

            def wanted() -> bool:  # a membership read of an engine-thread dict
                return job.tid in self.receiving

            if not wanted():
                raise TransferError("the request ended before its read started")
            peer = self.peer(p.remote_engine_id, job.address, p.remote_incarnation, wanted)
            self._claim(peer, job)
            hop(job.tid, "d.claimed")
            arrived = self._read(peer, job)
            hop(job.tid, "d.read_done")
            self.report(arrived)
            ok = True
        except Exception as exc:  # every failure becomes a clear per-request error
            cause = exc.cause if isinstance(exc, TransferError) else TransferCause.TRANSFER_FAILED
            self._warn[cause].warning("pull %s failed: %s", shown(job.tid), exc)
            where = f"{job.address[0]}:{job.address[1]}"
            self.report(Failed(job.tid, f"pull from {where}: {exc}", cause))
        finally:
            # P may free its hold now, whatever happened (no handshake needed for this).
            done = m.PullDone(
                transfer_id=job.tid,
                ok=ok,
                engine_id=self.cfg.engine_id,
                incarnation=self.cfg.incarnation,
                block_ids=list(job.params.remote_block_ids or ()),
            )
            try:
                if not self.given_up(job.address):  # else it would dial it again
                    self.side.send(job.address, done)
            except Exception:  # a bad address must not kill the lane
                log.exception("pull %s: could not send PullDone", shown(job.tid))
            self.report(ReleaseQuarantine(job.tid))

    def _claim(self, peer: Peer, job: _ReadJob) -> None:
        """Ask P to keep exactly these blocks for us; TransferError if it will not."""
        claim = m.PullClaim(
            nonce=new_nonce(),
            transfer_id=job.tid,
            block_ids=list(job.params.remote_block_ids or ()),
            engine_id=self.cfg.engine_id,
            incarnation=self.cfg.incarnation,
            reply_to=self.side.address,
        )
        timeout = self.cfg.handshake_timeout_s
        try:
            reply = self.side.request(peer.address, claim, timeout)
        except TimeoutError:
            raise TransferError(
                f"{shown(peer.engine_id)} did not answer the claim of transfer "
                f"{shown(job.tid)} within {timeout:.0f} s",
                TransferCause.PEER_UNREACHABLE,
            ) from None
        assert isinstance(reply, m.PullClaimReply)
        if reply.error:
            cause = (
                TransferCause.LEASE_EXPIRED
                if reply.lease_expired
                else TransferCause.PARAMS_REJECTED
            )
            raise TransferError(
                f"{shown(peer.engine_id)} refused the read: {shown(reply.error, 400)}", cause
            )

    def _read(self, peer: Peer, job: _ReadJob) -> Arrived:
        p = job.params
        local, remote = self.descriptors(peer, job.blocks, job.remote_blocks)
        self.run_transfer("read", peer, local, remote, None)
        return Arrived(
            job.tid, p.first_token_id, p.prefill_done_time or 0.0, p.first_token_logprobs
        )

    def close(self) -> None:
        self._lanes.close()
        super().close()
