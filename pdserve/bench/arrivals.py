"""The arrival process: when each request is released, as offsets from the start of a run.

Gaps between arrivals are gamma distributed with shape = burstiness and mean = 1/rate
(burstiness 1 is a Poisson process; below 1 burstier, above 1 more regular; inf gives
constant gaps). A rate of inf releases everything at once. This is vLLM's `bench serve`
model, including its normalisation: the sum of the gaps is rescaled to num_requests/rate so
that a short run offers exactly the configured rate (with 32 requests the raw sum of Poisson
gaps strays by about 18%, which would blur a rate sweep); the shape of the gaps is kept.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from pdserve.options import option

LOAD_GROUP = "load"  # where `pdserve bench serve --help` lists the flags below


@dataclass(frozen=True)
class ArrivalConfig:
    """Request rate (req/s, inf = all at once) and burstiness (gamma shape, inf = regular)."""

    request_rate: float = option(
        math.inf, group=LOAD_GROUP, help="req/s (default inf: all at once)"
    )
    burstiness: float = option(1.0, group=LOAD_GROUP, help="gamma shape of the gaps; 1: Poisson")
    normalize: bool = True  # rescale the gaps so the last arrival is at n / rate

    def __post_init__(self) -> None:
        if not self.request_rate > 0:
            raise ValueError(f"request_rate must be > 0, got {self.request_rate}")
        if not self.burstiness > 0:
            raise ValueError(f"burstiness must be > 0, got {self.burstiness}")


def gamma_gaps(n: int, cfg: ArrivalConfig, rng: np.random.Generator) -> np.ndarray:
    """`n` inter-arrival gaps in seconds (not normalised)."""
    if math.isinf(cfg.request_rate):
        return np.zeros(n)
    if math.isinf(cfg.burstiness):
        return np.full(n, 1.0 / cfg.request_rate)
    scale = 1.0 / (cfg.request_rate * cfg.burstiness)
    return rng.gamma(shape=cfg.burstiness, scale=scale, size=n)


def arrival_offsets(n: int, cfg: ArrivalConfig, rng: np.random.Generator) -> np.ndarray:
    """Release times of `n` requests, seconds from the run start, non-decreasing.

    Request i is released after i + 1 gaps (the first one waits a gap too, as in vLLM).
    """
    offsets = np.cumsum(gamma_gaps(n, cfg, rng))
    if cfg.normalize and n and offsets[-1] > 0:
        offsets *= (n / cfg.request_rate) / offsets[-1]
    return offsets
