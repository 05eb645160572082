"""`kv_transfer_params.first_token_logprobs` (P's logprobs of the first token, sent to D
with it) is checked like every other field: it must describe `first_token_id`, hold at most
20 top entries, and hold no impossible value."""

from __future__ import annotations

import math

import msgspec
import pytest

from pdserve.token_logprob import TokenLogprob
from pdserve.transfer.params import InvalidKVTransferParams, parse_kv_transfer_params

LEG = {
    "do_remote_prefill": True,
    "transfer_mode": "pull",
    "transfer_id": "t",
    "remote_engine_id": "p",
    "remote_host": "127.0.0.1",
    "remote_port": 5000,
    "remote_block_ids": [0],
    "remote_num_tokens": 5,
    "first_token_id": 7,
}


def leg(lp: object) -> dict:
    return {**LEG, "first_token_logprobs": lp}


def test_a_genuine_entry_round_trips_through_json() -> None:
    lp = TokenLogprob(7, -0.25, 2, [3, 7], [-0.1, -0.25])
    wire = msgspec.json.decode(msgspec.json.encode(leg(lp)))
    assert parse_kv_transfer_params(wire).first_token_logprobs == lp


@pytest.mark.parametrize(
    "lp",
    [
        [8, -0.25, 1, [], []],  # another token
        [7, 0.5, 1, [], []],  # a positive logprob
        [7, math.nan, 1, [], []],
        [7, -0.25, 0, [], []],  # rank 0
        [7, -0.25, 1, [1, 2], [-0.1]],  # lists of different lengths
        [7, -0.25, 1, [-1], [-0.1]],
        [7, -0.25, 1, [1], [0.1]],
        [7, -0.25, 1, list(range(21)), [-1.0] * 21],
        [7, -0.25, 1],  # too short
        {"token_id": 7},
    ],
)
def test_bad_entries_are_refused(lp: object) -> None:
    with pytest.raises(InvalidKVTransferParams, match="first_token_logprobs"):
        parse_kv_transfer_params(leg(lp))
