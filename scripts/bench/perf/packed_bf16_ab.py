"""Decode step in bfloat16 with oneDNN-packed weights vs pdserve's current linears (issue 8).

scripts/bench/perf/linear_kernels.py found oneDNN's ahead-of-time packed bf16 weights
25-30% faster than `F.linear` on a transposed view at 1-4 rows, and slower at 1024 rows.
This measures what that is worth on a whole decode step, without changing pdserve: it
replaces `pdserve.model.decoder._linear` with one that, for calls of at most 16 rows on a
packed engine, uses a packed copy of the weight (built once per linear; the layer's own
weight stays, for prefill).

Three engines, interleaved per round: float32, bfloat16 (as shipped), bfloat16 with packed
decode weights. Each holds BATCH requests of a 1024-token prompt; a round times STEPS
decode steps of each. Round 0 is a warm-up and is not counted.
usage: taskset -c 1 .venv/bin/python scripts/bench/perf/packed_bf16_ab.py MODEL
       [--batch 1] [--steps 40] [--rounds 7]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from decode_step import engine_with_batch
from torch import nn

import pdserve.model.decoder as decoder
from pdserve.engine.engine import LLMEngine

PACKED_MAX_ROWS = 16


def packed_weights(model: nn.Module) -> dict[int, torch.Tensor]:
    """id(linear) -> its bf16 weight packed by oneDNN for few-row products."""
    out = {}
    for m in model.modules():
        if isinstance(m, nn.Linear) and m.weight.dtype == torch.bfloat16:
            w = m.weight.detach().contiguous()
            out[id(m)] = torch.ops.mkldnn._reorder_linear_weight(w, 1)
    return out


def install(packed: dict[int, torch.Tensor]) -> None:
    """decoder._linear uses `packed` where it has the layer and the call has few rows."""

    def linear(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        w = packed.get(id(layer))
        if w is None or x.shape[0] > PACKED_MAX_ROWS:
            return F.linear(x, layer.weight, layer.bias)
        return torch.ops.mkldnn._linear_pointwise(x, w, layer.bias, "none", [], "")

    decoder._linear = linear


def check(engine: LLMEngine, packed: dict[int, torch.Tensor]) -> None:
    """Packed and unpacked give the same product, up to bf16 rounding, on every linear."""
    worst = 0.0
    install(packed)
    for m in engine.runner.model.modules():
        if id(m) in packed:
            x = torch.randn(1, m.in_features).to(torch.bfloat16)
            got, want = decoder._linear(m, x).float(), F.linear(x, m.weight, m.bias).float()
            worst = max(worst, ((got - want).abs().max() / want.abs().max()).item())
    print(f"packed vs F.linear, one row: max |diff| / max |value| = {worst:.2e}")
    if worst > 2e-2:
        raise SystemExit("packed products differ beyond bf16 rounding")


def step_ms(engine: LLMEngine, steps: int) -> float:
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    return (time.perf_counter() - t0) / steps * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=7)
    a = ap.parse_args()
    torch.set_num_threads(1)
    total = a.steps * (a.rounds + 1) + 16
    engines = {d: engine_with_batch(a.model, a.batch, total, d) for d in ("float32", "bfloat16")}
    engines["bf16-packed"] = engine_with_batch(a.model, a.batch, total, "bfloat16")
    packs = {"bf16-packed": packed_weights(engines["bf16-packed"].runner.model)}
    check(engines["bf16-packed"], packs["bf16-packed"])
    times: dict[str, list[float]] = {k: [] for k in engines}
    for r in range(a.rounds + 1):
        for name, engine in engines.items():
            install(packs.get(name, {}))
            ms = step_ms(engine, a.steps)
            if r:
                times[name].append(ms)
    base = statistics.median(times["bfloat16"])
    for name, t in times.items():
        med = statistics.median(t)
        print(f"batch {a.batch} {name}: {med:.3f} ms/step (median of {len(t)}), {med / base:.2f}x")


if __name__ == "__main__":
    main()
