"""The HTTP status of each KV transfer failure cause (pdserve.server.serving)."""

from __future__ import annotations

import pytest

from pdserve.server.serving import kv_transfer_error
from pdserve.transfer.errors import TransferCause


@pytest.mark.parametrize("cause", list(TransferCause))
def test_each_cause_has_its_status(cause: TransferCause) -> None:
    err = kv_transfer_error(cause, "detail")
    expected = {TransferCause.PARAMS_REJECTED: 400, TransferCause.OVERLOADED: 503}
    assert err.status == expected.get(cause, 502)
    body = err.body()["error"]
    assert body["code"] == f"kv_{cause.value}" and "detail" in body["message"]
