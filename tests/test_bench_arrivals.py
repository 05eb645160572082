"""The arrival process: rates and gap distributions over many seeded samples."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pdserve.bench.arrivals import ArrivalConfig, arrival_offsets, gamma_gaps

N = 50_000


def _rng(seed: int = 1) -> np.random.Generator:
    return np.random.default_rng(seed)


def test_infinite_rate_releases_everything_at_once() -> None:
    offsets = arrival_offsets(100, ArrivalConfig(request_rate=math.inf), _rng())
    assert offsets.shape == (100,)
    assert not offsets.any()


def test_infinite_burstiness_gives_constant_gaps() -> None:
    offsets = arrival_offsets(5, ArrivalConfig(request_rate=4.0, burstiness=math.inf), _rng())
    np.testing.assert_allclose(offsets, [0.25, 0.5, 0.75, 1.0, 1.25])


def test_poisson_gaps_are_exponential() -> None:
    gaps = gamma_gaps(N, ArrivalConfig(request_rate=4.0, burstiness=1.0), _rng())
    assert gaps.mean() == pytest.approx(0.25, rel=0.02)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.03)
    # exponential CDF 1 - exp(-rate x) at its median and at its mean
    assert np.mean(gaps <= math.log(2) / 4.0) == pytest.approx(0.5, abs=0.01)
    assert np.mean(gaps <= 0.25) == pytest.approx(1 - math.exp(-1), abs=0.01)


@pytest.mark.parametrize("burstiness", [0.25, 0.5, 2.0, 4.0])
def test_gamma_gaps_mean_and_dispersion(burstiness: float) -> None:
    gaps = gamma_gaps(N, ArrivalConfig(request_rate=2.0, burstiness=burstiness), _rng())
    assert gaps.mean() == pytest.approx(0.5, rel=0.03)
    # the coefficient of variation of a gamma with shape k is 1 / sqrt(k)
    assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.05)


def test_gamma_shape_two_cdf() -> None:
    # shape 2, scale theta: CDF(x) = 1 - exp(-x/theta) (1 + x/theta); here theta = 1/(2*2)
    gaps = gamma_gaps(N, ArrivalConfig(request_rate=2.0, burstiness=2.0), _rng(7))
    theta = 0.25
    for x in (0.1, 0.25, 0.5, 1.0):
        expected = 1 - math.exp(-x / theta) * (1 + x / theta)
        assert np.mean(gaps <= x) == pytest.approx(expected, abs=0.01)


def test_normalised_offsets_offer_exactly_the_rate() -> None:
    offsets = arrival_offsets(32, ArrivalConfig(request_rate=8.0), _rng(3))
    assert offsets[-1] == pytest.approx(32 / 8.0)
    assert np.all(np.diff(offsets) >= 0) and offsets[0] > 0


def test_unnormalised_mean_rate() -> None:
    offsets = arrival_offsets(N, ArrivalConfig(request_rate=8.0, normalize=False), _rng(3))
    assert N / offsets[-1] == pytest.approx(8.0, rel=0.02)


def test_seeded_and_reproducible() -> None:
    cfg = ArrivalConfig(request_rate=3.0, burstiness=0.5)
    a, b = arrival_offsets(100, cfg, _rng(11)), arrival_offsets(100, cfg, _rng(11))
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, arrival_offsets(100, cfg, _rng(12)))


@pytest.mark.parametrize("kwargs", [{"request_rate": 0.0}, {"burstiness": 0.0}, {"burstiness": -1}])
def test_invalid_config(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        ArrivalConfig(**kwargs)
