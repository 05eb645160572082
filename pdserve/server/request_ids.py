"""`X-Request-Id`: the client's id for a request, checked the same way by instances and router.

A client may name its request (the id then appears in both legs' logs and in the response
header); an id it did not send is made up. The id travels in HTTP headers to other
processes, so only what every HTTP stack carries unchanged is accepted.
"""

from __future__ import annotations

import re
import secrets

from starlette.datastructures import Headers

from pdserve.server.errors import bad_request

REQUEST_ID_HEADER = "X-Request-Id"
_REQUEST_ID_RE = re.compile(r"[\x21-\x7e]{1,128}")  # printable ASCII, no spaces


def request_id_of(headers: Headers) -> str:
    """The client's X-Request-Id if it sent one (a 400 if it is not usable), else a new one."""
    given = headers.get(REQUEST_ID_HEADER)
    if given is None:
        return secrets.token_hex(16)
    if not _REQUEST_ID_RE.fullmatch(given):
        raise bad_request(
            f"{REQUEST_ID_HEADER} must be 1-128 printable ASCII characters without spaces.",
            param=REQUEST_ID_HEADER,
        )
    return given
