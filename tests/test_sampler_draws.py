"""The seeded sampler's draws: a decode instance skips the draw P used for the first token,
so its tokens are the ones a single instance draws next (seeded P/D equals monolithic)."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.sampler import sample, skip_draws
from pdserve.engine.types import SamplingParams

VOCAB = 300


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.8), SamplingParams(top_p=0.5)])
def test_skipping_one_draw_gives_the_second_token(params: SamplingParams) -> None:
    torch.manual_seed(0)
    first_logits = torch.randn(1, VOCAB) * 4  # P's row: any distribution
    rows = [torch.randn(1, VOCAB) for _ in range(5)]
    one = torch.Generator().manual_seed(7)
    sample(first_logits, [params], [one])
    want = [sample(r, [params], [one])[0] for r in rows]
    d = torch.Generator().manual_seed(7)
    skip_draws(d, VOCAB, 1)
    assert [sample(r, [params], [d])[0] for r in rows] == want
    fresh = torch.Generator().manual_seed(7)  # without the skip: other tokens
    assert [sample(r, [params], [fresh])[0] for r in rows] != want
