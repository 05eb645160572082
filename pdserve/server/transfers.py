"""Admission of P/D legs: `kv_transfer_params` checked against this instance before submission.

First, with a cluster token, who sent the leg: only a caller that proves the token (the
router's `X-PDServe-Leg-Signature` over every field of the params and a timestamp,
`pdserve.transfer.cluster_auth`) may make this instance hold blocks for a transfer or dial
a peer. A missing signature is a 401, a wrong, expired or replayed one a 403, right after
the params are parsed and before any check against this instance (or tokenizing the
prompt): a stranger learns nothing about the instance, and nothing is allocated.

Everything a leg can get wrong is a 400 here, before the engine sees it: the wrong role or
mode, a prompt that does not match what P computed, a first token outside the vocabulary,
block ids P does not have (once P is known from a handshake), and a `transfer_id` that
another transfer still uses. The engine repeats these checks (`LLMEngine._validate`) as the
authority; this gate exists so that the client gets a 400 with the reason instead of a
failed generation.

Ownership: a leg's transfer id is claimed here, on the event loop, from admission until its
HTTP response has ended (`TransferClaim.release`, called by the app on every path). The
engine's own records (P's holds, D's receive slots and quarantine) cover the id from the
moment they exist, which is before a finished response ends. When the client goes away
instead, the claim ends as the abort is queued; the engine applies that abort before any
later request, and its own check (`LLMEngine._validate`) refuses a reuse that still
collides, so the only cost of that window is an engine-side refusal instead of a 400.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pdserve.engine.handle import EngineHandle
from pdserve.engine.types import EngineRequest
from pdserve.server.errors import bad_request
from pdserve.server.proofs import leg_refusal
from pdserve.transfer.cluster_auth import Proof, SeenSignatures, check_leg
from pdserve.transfer.params import (
    InvalidKVTransferParams,
    KVTransferParams,
    check_for_instance,
    check_remote_blocks,
    parse_kv_transfer_params,
)


@dataclass
class TransferClaim:
    """One leg's hold on its transfer id; `release` is idempotent."""

    gate: TransferGate
    transfer_id: str
    request_id: str
    released: bool = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.gate.release(self)


@dataclass
class TransferGate:
    """Checks and claims the transfer ids of one app's P/D legs (event loop only)."""

    engine: EngineHandle
    token: str | None = None  # the cluster token: legs must be signed with it
    claims: dict[str, str] = field(default_factory=dict)  # transfer id -> request id
    seen: SeenSignatures = field(default_factory=SeenSignatures)

    def leg_params(
        self, raw: dict[str, Any] | None, signature: str | None
    ) -> KVTransferParams | None:
        """A request body's `kv_transfer_params`, parsed (a 400 if malformed) and, for a
        leg, its sender's proof checked (`signature`: the leg signature header; 401/403).
        The first step of every request, before its prompt is even tokenized: a stranger's
        leg costs a parse and a MAC."""
        if raw is None:
            return None
        try:
            params = parse_kv_transfer_params(raw)
        except InvalidKVTransferParams as exc:
            raise bad_request(str(exc), param="kv_transfer_params") from exc
        if params.do_remote_decode or params.do_remote_prefill:
            self._check_sender(params, signature)
        return params

    def admit(self, er: EngineRequest) -> TransferClaim | None:
        """Raise a 400 if `er`'s leg (params from `leg_params`) cannot run here; else claim
        its transfer id."""
        p = er.kv_transfer
        if p is None or not (p.do_remote_decode or p.do_remote_prefill):
            return None
        tid = p.transfer_id or er.request_id
        try:
            check_for_instance(p, self.engine.info.limits, len(er.prompt_token_ids))
            self._check_remote_blocks(er)
        except InvalidKVTransferParams as exc:
            raise bad_request(str(exc), param="kv_transfer_params") from exc
        self._check_signature(p)
        if tid in self.claims or self._engine_uses(tid):
            raise bad_request(
                f"kv_transfer_params.transfer_id {tid!r} is in use by a transfer in flight; "
                "every transfer needs its own id",
                param="kv_transfer_params",
                code="transfer_id_in_use",
            )
        self.claims[tid] = er.request_id
        return TransferClaim(self, tid, er.request_id)

    def _check_sender(self, params: KVTransferParams, signature: str | None) -> None:
        """With a cluster token: the router's fresh signature over exactly `params`, used
        once."""
        proof = check_leg(self.token, params, signature)
        if proof is Proof.OK and self.token is not None:
            assert signature is not None
            if not self.seen.first_use(signature):
                proof = Proof.REPLAYED
        if proof is not Proof.OK:
            raise leg_refusal(proof)

    def release(self, claim: TransferClaim) -> None:
        if self.claims.get(claim.transfer_id) == claim.request_id:
            del self.claims[claim.transfer_id]

    def _check_signature(self, p: KVTransferParams) -> None:
        """Pull with a cluster token: P's signature, refused before any stream starts."""
        if not p.do_remote_prefill:
            return
        try:
            self.engine.check_params(p)
        except InvalidKVTransferParams as exc:
            raise bad_request(
                f"KV transfer failed (params rejected): {exc}",
                param="kv_transfer_params",
                code="kv_params_rejected",
            ) from exc

    def _check_remote_blocks(self, er: EngineRequest) -> None:
        """Pull: P's block ids against P's cache size, when a handshake told us that."""
        p = er.kv_transfer
        if p is None or not p.do_remote_prefill or p.transfer_mode != "pull":
            return
        if p.remote_engine_id and p.remote_incarnation:
            num_blocks = self.engine.peer_num_blocks(p.remote_engine_id, p.remote_incarnation)
            if num_blocks is not None:
                check_remote_blocks(p, num_blocks)

    def _engine_uses(self, tid: str) -> bool:
        """Whether the connector still has blocks under `tid` (possibly stale: the engine
        re-checks on its own thread, so a stale answer can only cost a later, engine-side
        refusal)."""
        return self.engine.transfer_in_use(tid)
