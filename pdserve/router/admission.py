"""The router's check of what it fronts: an instance's `/kv/info` against its place.

Run by the health monitor before it admits an instance (at start-up and at every
re-admission) and whenever it re-reads an admitted one's `/kv/info`. An instance that does
not fit is refused, not admitted: its configuration mistake must not reach clients as a
4xx on some requests (a pull router in front of push instances used to answer 200 on
/health and 400 `invalid_request_error` to every long prompt).

What must fit, in this order (the first mismatch is reported):
- role: a URL given as `--prefill` must report role `prefill`, one given as `--decode` role
  `decode`. A `both` instance is accepted in either place only with the router's transfer
  mode; pdserve's `both` is monolithic (no connector, transfer mode null), so it is always
  refused as a P/D instance: it would refuse every leg that carries `kv_transfer_params`.
- transfer mode: the instance's must be the router's `--kv-transfer`.
- model and transport: the same as the admitted instances', since P and D exchange KV of
  one model over one transport. The first instance admitted sets them; in a health round
  admissions are decided in the configured order (prefill URLs, then decode URLs), so at
  start-up that is the first healthy instance given.

An instance without `/kv/info` (404: e.g. a vLLM instance) is not checked.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from pdserve.router.config import TransferMode
from pdserve.router.policy import Role
from pdserve.transfer.params import InstanceInfo


class Mismatch(enum.Enum):
    """What about an instance does not fit the cluster."""

    ROLE = "role"
    TRANSFER_MODE = "transfer_mode"
    MODEL = "model"
    TRANSPORT = "transport"


@dataclass(frozen=True)
class Refusal:
    """Why an instance is not admitted (`detail` is for operators: logs and /health)."""

    mismatch: Mismatch
    detail: str


def refusal(
    role: Role, info: InstanceInfo, mode: TransferMode, reference: InstanceInfo | None
) -> Refusal | None:
    """Why an instance configured as `role` and reporting `info` may not serve behind a
    router of `mode`, whose admitted instances report `reference` (None: none yet)."""
    if info.role not in (role, "both"):
        return Refusal(Mismatch.ROLE, f"configured as {role}, but it reports role {info.role}")
    if info.transfer_mode != mode:
        what = info.transfer_mode or "none (a monolithic instance)"
        return Refusal(
            Mismatch.TRANSFER_MODE,
            f"its transfer mode is {what}, the router's --kv-transfer is {mode}",
        )
    if reference is None:
        return None
    if info.model != reference.model:
        return Refusal(
            Mismatch.MODEL, f"it serves model {info.model}, the cluster serves {reference.model}"
        )
    if info.transport != reference.transport:
        return Refusal(
            Mismatch.TRANSPORT,
            f"its KV transport is {info.transport}, the cluster's is {reference.transport}",
        )
    return None
