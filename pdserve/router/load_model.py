"""The router's load model: what a request will cost an instance, and how loaded it will be.

Inputs per instance (`LoadView`): the legs the router has in flight there (its own count,
exact between polls) and the instance's last `/load` report (`LoadReport`: queues, KV
blocks, tokens left, measured rates). Legs sent after that report was requested are
"unreported" and added on top, so a burst between two polls does not all land on the
instance that looked idle at the last poll.

The model, deliberately simple (docs/router.md, "load_aware"):
- A prefill instance works through its prompt tokens at its measured rate (prompt tokens
  per second while prefilling). A new prompt is done after `(backlog + prompt) / rate`.
- A decode instance advances each of the `n` requests it reported running by one token
  per step at its measured step rate `s`: it produces `n * s` tokens per second (at least
  `s`). The model takes that throughput as fixed, i.e. a step time that grows in
  proportion to the batch: more requests share it, they do not add to it. (Step time
  really is `a + b * n`; taking `a = 0` spreads load early instead of piling a burst onto
  one instance before its measured rate drops.) By the time this request's KV arrives
  (`ready_in_s`, the predicted prefill finish) the instance has worked off `n * s *
  ready_in_s` of the tokens it owes. The score is the time to finish what it will still
  owe then plus this request's tokens, at that throughput: proportional to the TPOT this
  request will see when the owed tokens are spread evenly; it prefers instances whose
  requests end soon, and a slow instance (low `s`) scores high. A local prefill adds
  `(backlog + prompt) / prefill rate` on that instance.
- An instance with almost no free KV blocks would queue the request: its score doubles.
- An unknown rate (never measured, or an instance without the extended report) is taken
  as the mean of the other candidates' rates; if no candidate has one, scores fall back
  to tokens (least outstanding tokens).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from pdserve.server.load_report import LoadReport

# Below this fraction of free KV blocks an instance would queue new requests.
KV_LOW_FREE_FRACTION = 0.05


@dataclass(frozen=True)
class Demand:
    """What one request asks of the instance that gets the leg being chosen."""

    prompt_tokens: int
    decode_tokens: int  # max_tokens (or the router's estimate when the client set none)
    ready_in_s: float = 0.0  # decode leg: predicted time until its KV is there
    local_prefill: bool = False  # decode leg: the decode instance prefills the prompt itself
    # The prompt's chained chunk names (pdserve.router.prefix_index), for `cache_aware`;
    # empty for the other policies.
    prefix: tuple[bytes, ...] = ()

    @property
    def decode_cost(self) -> int:
        """Tokens the leg counts on a decode instance (its prompt too when prefilled there)."""
        return self.decode_tokens + (self.prompt_tokens if self.local_prefill else 0)


class LoadView(Protocol):
    """What the load model reads of an instance (`health.Instance` provides it)."""

    @property
    def outstanding(self) -> int: ...  # legs in flight (the router's count)

    @property
    def outstanding_tokens(self) -> int: ...  # their tokens (the router's count)

    @property
    def load(self) -> LoadReport | None: ...

    @property
    def unreported_legs(self) -> int: ...  # legs sent after `load` was requested

    @property
    def unreported_prompt_tokens(self) -> int: ...

    @property
    def unreported_decode_tokens(self) -> int: ...


def mean_rate(rates: Sequence[float | None]) -> float | None:
    """The mean of the known, positive rates; None if there is none."""
    known = [r for r in rates if r is not None and r > 0]
    return sum(known) / len(known) if known else None


def prefill_backlog(c: LoadView) -> int:
    """Prompt tokens the instance has to compute before a new prompt's turn."""
    if c.load is None:
        return c.outstanding_tokens
    return c.load.prefill_tokens_left + c.unreported_prompt_tokens


def prefill_finish_s(c: LoadView, prompt_tokens: int, rate: float | None) -> float | None:
    """Predicted seconds until a new prompt is prefilled there; None without a rate."""
    if rate is None or rate <= 0:
        return None
    return (prefill_backlog(c) + prompt_tokens) / rate


def decode_owed(c: LoadView) -> int:
    """Decode tokens the instance owes: its report plus the unreported legs."""
    if c.load is None:
        return c.outstanding_tokens
    return c.load.decode_tokens_left + c.unreported_decode_tokens


def decode_throughput(c: LoadView, steps_per_s: float) -> float:
    """Tokens per second: one per step for each request it reported running (at least one)."""
    running = c.load.num_running if c.load is not None else c.outstanding - c.unreported_legs
    return steps_per_s * max(1, running)


def decode_score(
    c: LoadView, demand: Demand, steps_per_s: float | None, prefill_rate: float | None
) -> float:
    """Seconds (tokens when no step rate is known) until the instance would have finished
    everything it holds plus this request; lower is better."""
    owed = decode_owed(c)
    if steps_per_s is None or steps_per_s <= 0:
        score = float(owed + demand.decode_cost)
    else:
        throughput = decode_throughput(c, steps_per_s)
        owed_then = max(0.0, owed - throughput * demand.ready_in_s)
        score = (owed_then + demand.decode_tokens) / throughput
        if demand.local_prefill and prefill_rate:
            score += (prefill_backlog(c) + demand.prompt_tokens) / prefill_rate
    return score * 2.0 if kv_nearly_full(c.load) else score


def kv_nearly_full(load: LoadReport | None) -> bool:
    """Too few free KV blocks to admit a request without waiting."""
    if load is None or load.kv_blocks_total <= 0:
        return False
    free = load.kv_blocks_total - load.kv_blocks_used
    return free < KV_LOW_FREE_FRACTION * load.kv_blocks_total
