"""Which kernel runs pdserve's linears fastest on this CPU, per dtype and row count (issue 8).

For every projection of the 4-layer, 256-hidden Qwen3 shape (builtin:small and the vLLM
comparison checkpoint) it times, on one thread:
- `F.linear` with the weight stored [out, in] (row-major, what PyTorch expects by default);
- `F.linear` with the weight stored [in, out] and passed as a transposed view (what
  pdserve's decoder does today: `_store_transposed`);
- oneDNN with a weight packed once ahead of time (`torch.ops.mkldnn._reorder_linear_weight`
  + `_linear_pointwise`, the path Inductor's freezing takes for bfloat16 on CPU);
- at one row, `torch.mv` on either storage (PyTorch's own GEMV paths).
Each variant's output is checked against the first one's before it is timed. Variants run
interleaved, `--repeats` times each per round, and the median per call is reported.
The weights of all seven projections of all four layers are cycled through, so that a call
finds its weights in cache no more often than a decode step does.

usage: taskset -c 1 .venv/bin/python scripts/bench/perf/linear_kernels.py [--rows 1 4 1024]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

SHAPES = {"qkv": (256, 512), "o": (256, 256), "gate_up": (256, 1536), "down": (768, 256)}
LAYERS = 4
Kernel = Callable[[torch.Tensor], torch.Tensor]


def variants(w: torch.Tensor, rows: int) -> dict[str, Kernel]:
    """w: [out, in]. Each kernel computes x @ w.T."""
    row_major = w.contiguous()
    transposed = w.t().contiguous().t()
    out = {
        "out_in": lambda x: F.linear(x, row_major),
        "in_out_view": lambda x: F.linear(x, transposed),
    }
    if rows == 1:
        out["mv_out_in"] = lambda x: torch.mv(row_major, x[0]).unsqueeze(0)
        out["mv_in_out_view"] = lambda x: torch.mv(transposed, x[0]).unsqueeze(0)
    if w.dtype == torch.bfloat16 and torch.backends.mkldnn.is_available():
        packed = torch.ops.mkldnn._reorder_linear_weight(row_major, rows)
        out["onednn_packed"] = lambda x: torch.ops.mkldnn._linear_pointwise(
            x, packed, None, "none", [], ""
        )
    return out


def time_calls(calls: list[tuple[Kernel, torch.Tensor]], repeats: int) -> float:
    t0 = time.perf_counter()
    for _ in range(repeats):
        for fn, x in calls:
            fn(x)
    return (time.perf_counter() - t0) / (repeats * len(calls)) * 1e6


def run(dtype: torch.dtype, rows: int, repeats: int, rounds: int) -> dict[str, float]:
    torch.manual_seed(0)
    per_variant: dict[str, list[tuple[Kernel, torch.Tensor]]] = {}
    for _ in range(LAYERS):
        for din, dout in SHAPES.values():
            w = (torch.randn(dout, din) / din**0.5).to(dtype)
            x = torch.randn(rows, din).to(dtype)
            ks = variants(w, rows)
            ref = next(iter(ks.values()))(x).float()
            for name, fn in ks.items():
                got = fn(x).float()
                if not torch.allclose(got, ref, rtol=2e-2, atol=2e-2):
                    raise SystemExit(f"{name} differs: {(got - ref).abs().max()}")
                per_variant.setdefault(name, []).append((fn, x))
    times: dict[str, list[float]] = {name: [] for name in per_variant}
    for _ in range(rounds):
        for name, calls in per_variant.items():
            times[name].append(time_calls(calls, repeats))
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 1024])
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=7)
    a = ap.parse_args()
    torch.set_num_threads(1)
    print("| dtype | rows | kernel | us per call (median of rounds) | vs out_in |")
    print("|---|---|---|---|---|")
    for dtype in (torch.float32, torch.bfloat16):
        for rows in a.rows:
            repeats = max(2, a.repeats // max(1, rows // 16))
            res = run(dtype, rows, repeats, a.rounds)
            base = res["out_in"]
            for name, us in res.items():
                print(f"| {str(dtype)[6:]} | {rows} | {name} | {us:.1f} | {us / base:.2f} |")


if __name__ == "__main__":
    main()
