"""`pdserve bench engine`: prefill and decode tokens/s of the engine alone (no HTTP).

Prefill: one request of `--prefill-len` tokens, timed from submission to its first
token. Decode: `--batch` requests decoding together, timed over `--decode-steps` steps
after their prompts are in the cache. Reported per model and batch size.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from tqdm import tqdm

from pdserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.types import EngineRequest, SamplingParams
from pdserve.options import add_options, option


@dataclass(frozen=True)
class EngineBenchConfig:
    """What `pdserve bench engine` measures and how it prints it (its flags)."""

    model: tuple[str, ...] = option(
        ("builtin:tiny", "builtin:small"),
        nargs="+",
        help="models to measure (default: %(default)s)",
    )
    batch: tuple[int, ...] = option(
        (1, 8, 32), nargs="+", help="decode batch sizes (default: %(default)s)"
    )
    prefill_len: int = option(
        1024, help="prompt length for the prefill figure (default: %(default)s)"
    )
    decode_ctx: int = option(
        128, help="prompt length of each decoding request (default: %(default)s)"
    )
    decode_steps: int = option(32, help="decode steps timed (default: %(default)s)")
    threads: int = option(1, help="torch threads (default: %(default)s)")
    dtype: str = option("float32", help="model dtype (default: %(default)s)")
    max_num_batched_tokens: int | None = option(
        None,
        help="step token budget, i.e. the prefill chunk (default: the prefill length, at "
        "least 2048; the server's default is 2048, so a longer prompt is chunked there)",
    )
    json: bool = option(False, help="print JSON instead of a table")

    def budget(self) -> int:
        """The step token budget: the flag's, else the prefill length (at least 2048)."""
        return self.max_num_batched_tokens or max(self.prefill_len, 2048)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `pdserve bench engine` (declared on `EngineBenchConfig`)."""
    add_options(parser, EngineBenchConfig)


def _engine(model: str, dtype: str, budget: int) -> LLMEngine:
    cfg = EngineConfig(
        model=ModelConfig(model=model, dtype=dtype),
        cache=CacheConfig(kv_cache_memory_gib=1.0),
        scheduler=SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=256),
    )
    return LLMEngine.from_config(cfg)


def _prompt(n: int, rng: random.Random) -> list[int]:
    return [rng.randrange(3, 250) for _ in range(n)]


def prefill_tps(engine: LLMEngine, n: int, rng: random.Random) -> float:
    sp = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    engine.add_request(EngineRequest(request_id="p", prompt_token_ids=_prompt(n, rng), params=sp))
    t0 = time.perf_counter()
    while engine.has_work():
        engine.step()
    return n / (time.perf_counter() - t0)


def decode_tps(engine: LLMEngine, batch: int, ctx: int, steps: int, rng: random.Random) -> float:
    sp = SamplingParams(max_tokens=steps + 2, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        er = EngineRequest(request_id=f"d{i}", prompt_token_ids=_prompt(ctx, rng), params=sp)
        engine.add_request(er)
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.requests.values()):
        engine.step()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    elapsed = time.perf_counter() - t0
    while engine.has_work():
        engine.step()
    return batch * steps / elapsed


def run(cfg: EngineBenchConfig) -> int:
    """Measure every model of `cfg`, print the table (or JSON)."""
    torch.set_num_threads(cfg.threads)
    rng = random.Random(0)
    rows = []
    for model in cfg.model:
        budget = cfg.budget()
        engine = _engine(model, cfg.dtype, budget)
        prefill_tps(engine, 64, rng)  # warm-up
        row = {
            "model": model,
            "threads": cfg.threads,
            "prefill_len": cfg.prefill_len,
            "max_num_batched_tokens": budget,
            "prefill_tok_s": round(prefill_tps(engine, cfg.prefill_len, rng), 1),
        }
        for b in tqdm(cfg.batch, desc=f"{model} decode", leave=False):
            row[f"decode_tok_s_b{b}"] = round(
                decode_tps(engine, b, cfg.decode_ctx, cfg.decode_steps, rng), 1
            )
        engine.check_integrity()
        rows.append(row)
    if cfg.json:
        print(json.dumps(rows, indent=2))
    else:
        _print_table(rows, cfg.batch)
    return 0


def _print_table(rows: list[dict], batches: Sequence[int]) -> None:
    head = ["model", "prefill tok/s"] + [f"decode tok/s b={b}" for b in batches]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in rows:
        cells = [r["model"], f"{r['prefill_tok_s']:.0f}"]
        cells += [f"{r[f'decode_tok_s_b{b}']:.0f}" for b in batches]
        print("| " + " | ".join(cells) + " |")
