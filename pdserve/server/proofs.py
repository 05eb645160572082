"""HTTP answers to proofs of the cluster token (`pdserve.transfer.cluster_auth`).

A missing proof is a 401, a wrong, expired or replayed one a 403, each an OpenAI-style
error whose `code` names the case, so an operator sees at once whether the caller lacks the
token, has another one, or has a clock far off. Shared by an instance's app (its legs and
its routes for routers) and the router's app (`/router/instances`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from http import HTTPStatus

from fastapi import Depends, Request

from pdserve.server.errors import APIError
from pdserve.transfer.cluster_auth import (
    CLUSTER_AUTH_HEADER,
    LEG_SIGNATURE_HEADER,
    MAX_AGE_S,
    Proof,
    check_route,
)

_WHY = {
    Proof.WRONG: "does not match this instance's cluster token for this request",
    Proof.EXPIRED: f"is older (or newer) than {MAX_AGE_S} s: check the clocks of the hosts",
    Proof.REPLAYED: "was already used: every leg needs a fresh signature",
}


def refusal(proof: Proof, header: str, what: str, code: str) -> APIError:
    """The error for a failed `proof` of `header`, guarding `what` (e.g. "a P/D leg");
    codes: missing_<code>, invalid_<code>, expired_<code>, replayed_<code>."""
    if proof is Proof.MISSING:
        return APIError(
            HTTPStatus.UNAUTHORIZED,
            f"this instance has a cluster token: {what} needs {header} (the router sends it)",
            code=f"missing_{code}",
        )
    prefix = "invalid" if proof is Proof.WRONG else proof.value
    return APIError(
        HTTPStatus.FORBIDDEN,
        f"{header} {_WHY[proof]}",
        type="permission_error",
        code=f"{prefix}_{code}",
    )


def leg_refusal(proof: Proof) -> APIError:
    """A P/D leg whose `X-PDServe-Leg-Signature` failed."""
    return refusal(proof, LEG_SIGNATURE_HEADER, "a P/D leg (kv_transfer_params)", "leg_signature")


def route_guard(token: str | None) -> list[Depends]:
    """The dependency of a route for routers (`/kv/info`, `/load`, `/router/instances`):
    with a token, the caller must prove it for the route's path; none without a token."""
    if token is None:
        return []

    async def check(request: Request) -> None:
        path = request.url.path
        proof = check_route(token, path, request.headers.get(CLUSTER_AUTH_HEADER))
        if proof is not Proof.OK:
            raise refusal(proof, CLUSTER_AUTH_HEADER, f"GET {path}", "cluster_auth")

    guard: Callable[[Request], Awaitable[None]] = check
    return [Depends(guard)]
