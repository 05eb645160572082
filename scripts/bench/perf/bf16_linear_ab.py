"""bf16 decode and prefill with other weight layouts and kernels, vs pdserve's linears (issue 8).

scripts/bench/perf/linear_kernels.py found, per call on one thread:
- oneDNN's ahead-of-time packed bf16 weights 27-32% faster than today's `F.linear` on a
  transposed ([in, out] storage) view at 1-4 rows, slower at 1024 rows;
- `torch.mv` on a row-major [out, in] bf16 weight ~34% faster than today's layout at one row
  (PyTorch's bf16 GEMV fast path); on today's layout `torch.mv` is slower.
This measures what each is worth on whole engine steps, without changing pdserve: it
replaces `pdserve.model.decoder._linear` (and, for the [out, in] variants, re-stores every
linear's weight row-major) per engine.

Variants, one engine each, interleaved per round (round 0 warms up and is not counted):
  float32       as shipped
  bfloat16      as shipped ([in, out] storage, F.linear)
  bf16-packed   + a oneDNN-packed copy of each weight for calls of <= 16 rows
  bf16-outin    weights re-stored [out, in], F.linear
  bf16-outin-mv [out, in], and torch.mv for one-row calls
Each engine holds BATCH requests of a 1024-token prompt; a round times STEPS decode steps,
then one step that also prefills a new 1024-token prompt (reported as "prefill step").
usage: taskset -c 1 .venv/bin/python scripts/bench/perf/bf16_linear_ab.py MODEL
       [--batch 1] [--steps 40] [--rounds 5]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from decode_step import engine_with_batch
from torch import nn

import pdserve.model.decoder as decoder
from pdserve.engine.engine import LLMEngine
from pdserve.engine.types import EngineRequest, SamplingParams

PACKED_MAX_ROWS = 16
Linear = Callable[[nn.Linear, torch.Tensor], torch.Tensor]


def shipped(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return F.linear(x, layer.weight, layer.bias)


def packed_linear(model: nn.Module) -> Linear:
    packed = {
        id(m): torch.ops.mkldnn._reorder_linear_weight(m.weight.detach().contiguous(), 1)
        for m in model.modules()
        if isinstance(m, nn.Linear)
    }

    def linear(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > PACKED_MAX_ROWS:
            return F.linear(x, layer.weight, layer.bias)
        return torch.ops.mkldnn._linear_pointwise(x, packed[id(layer)], layer.bias, "none", [], "")

    return linear


def restore_row_major(model: nn.Module) -> None:
    for m in model.modules():
        if isinstance(m, nn.Linear):
            m.weight = nn.Parameter(m.weight.detach().contiguous(), requires_grad=False)


def mv_linear(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    if x.shape[0] != 1:
        return F.linear(x, layer.weight, layer.bias)
    y = torch.mv(layer.weight, x[0]).unsqueeze(0)
    return y if layer.bias is None else y + layer.bias


def build(model: str, batch: int, steps: int) -> dict[str, tuple[LLMEngine, Linear]]:
    out: dict[str, tuple[LLMEngine, Linear]] = {}
    out["float32"] = (engine_with_batch(model, batch, steps, "float32"), shipped)
    out["bfloat16"] = (engine_with_batch(model, batch, steps, "bfloat16"), shipped)
    e = engine_with_batch(model, batch, steps, "bfloat16")
    out["bf16-packed"] = (e, packed_linear(e.runner.model))
    for name, fn in (("bf16-outin", shipped), ("bf16-outin-mv", mv_linear)):
        e = engine_with_batch(model, batch, steps, "bfloat16")
        restore_row_major(e.runner.model)
        out[name] = (e, fn)
    return out


def decode_ms(engine: LLMEngine, steps: int) -> float:
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    return (time.perf_counter() - t0) / steps * 1e3


def prefill_ms(engine: LLMEngine, rng: random.Random, tag: str) -> float:
    """One step carrying a new 1024-token prompt; the request then finishes (max_tokens=1)."""
    ids = [rng.randrange(3, 250) for _ in range(1024)]
    sp = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    engine.add_request(EngineRequest(request_id=tag, prompt_token_ids=ids, params=sp))
    t0 = time.perf_counter()
    engine.step()
    return (time.perf_counter() - t0) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    torch.set_num_threads(1)
    engines = build(a.model, a.batch, a.steps * (a.rounds + 1) * 2 + 16)
    dec: dict[str, list[float]] = {k: [] for k in engines}
    pre: dict[str, list[float]] = {k: [] for k in engines}
    for r in range(a.rounds + 1):
        for name, (engine, linear) in engines.items():
            decoder._linear = linear
            d = decode_ms(engine, a.steps)
            p = prefill_ms(engine, random.Random(r), f"p{r}")
            engine.step()  # the prefilled request leaves
            if r:
                dec[name].append(d)
                pre[name].append(p)
    d0, p0 = statistics.median(dec["bfloat16"]), statistics.median(pre["bfloat16"])
    print("| batch | variant | decode step (ms) | vs bf16 | prefill step (ms) | vs bf16 |")
    print("|---|---|---|---|---|---|")
    for name in engines:
        d, p = statistics.median(dec[name]), statistics.median(pre[name])
        print(f"| {a.batch} | {name} | {d:.3f} | {d / d0:.2f} | {p:.1f} | {p / p0:.2f} |")


if __name__ == "__main__":
    main()
